// zkern/cpu/csrc/aio.cpp: the I/O thread pool of aio.h.
#include "aio.h"

#include <unistd.h>

#include <cerrno>
#include <stdexcept>

namespace zk_aio {

Pool::Pool(int threads, int64_t block_size, int queue_depth)
    : block_size_(block_size), queue_depth_(static_cast<size_t>(queue_depth)) {
  if (threads < 1) throw std::invalid_argument("aio: thread_count must be >= 1");
  if (block_size < 1) throw std::invalid_argument("aio: block_size must be >= 1 byte");
  if (queue_depth < 1) throw std::invalid_argument("aio: queue_depth must be >= 1");
  workers_.reserve(threads);
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this] { run(); });
}

Pool::~Pool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_ready_.notify_all();
  room_.notify_all();
  for (auto& t : workers_) t.join();  // the queued blocks are finished first: their buffers are the caller's
}

int64_t Pool::submit(bool write, int fd, uintptr_t ptr, int64_t nbytes, int64_t offset) {
  if (nbytes < 0 || offset < 0) throw std::invalid_argument("aio: negative size or offset");
  std::unique_lock<std::mutex> lock(mu_);
  int64_t ticket = next_ticket_++;
  Request& request = requests_[ticket];
  int64_t blocks = nbytes == 0 ? 0 : (nbytes + block_size_ - 1) / block_size_;
  request.left = blocks;
  char* base = reinterpret_cast<char*>(ptr);
  for (int64_t i = 0; i < blocks; ++i) {
    room_.wait(lock, [this] { return queue_.size() < queue_depth_ || stopping_; });
    if (stopping_) throw std::runtime_error("aio: the pool is shutting down");
    int64_t start = i * block_size_;
    int64_t n = nbytes - start < block_size_ ? nbytes - start : block_size_;
    queue_.push_back(Block{ticket, write, fd, base + start, n, offset + start});
    work_ready_.notify_one();
  }
  return ticket;
}

bool Pool::done(int64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = requests_.find(ticket);
  if (it == requests_.end()) throw std::invalid_argument("aio: unknown ticket (already waited for?)");
  return it->second.left == 0;
}

Outcome Pool::wait(int64_t ticket) {
  std::unique_lock<std::mutex> lock(mu_);
  auto it = requests_.find(ticket);
  if (it == requests_.end()) throw std::invalid_argument("aio: unknown ticket (already waited for?)");
  Request& request = it->second;  // references into the map outlive a rehash (iterators do not)
  finished_.wait(lock, [&] { return request.left == 0; });
  Outcome outcome = request.outcome;
  requests_.erase(it);
  return outcome;
}

Outcome Pool::transfer(const Block& b) {
  int64_t moved = 0;
  while (moved < b.nbytes) {
    ssize_t r = b.write ? ::pwrite(b.fd, b.ptr + moved, static_cast<size_t>(b.nbytes - moved), b.offset + moved)
                        : ::pread(b.fd, b.ptr + moved, static_cast<size_t>(b.nbytes - moved), b.offset + moved);
    if (r < 0) {
      if (errno == EINTR) continue;
      return Outcome{errno, b.offset + moved};
    }
    if (r == 0) return Outcome{b.write ? EIO : -1, b.offset + moved};  // a read past the end of the file
    moved += r;
  }
  return Outcome{};
}

void Pool::run() {
  for (;;) {
    Block block;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_ready_.wait(lock, [this] { return !queue_.empty() || stopping_; });
      if (queue_.empty()) return;  // stopping, and nothing left to do
      block = queue_.front();
      queue_.pop_front();
    }
    room_.notify_one();
    Outcome outcome = transfer(block);
    {
      std::lock_guard<std::mutex> lock(mu_);
      Request& request = requests_[block.ticket];
      if (outcome.err != 0 && request.outcome.err == 0) request.outcome = outcome;
      if (--request.left == 0) finished_.notify_all();
    }
  }
}

}  // namespace zk_aio
