// zkern/cpu/csrc/aio.h: a pool of I/O threads over pread/pwrite (ZeRO-Infinity's NVMe traffic). No libaio, no
// io_uring: plain POSIX calls, so nothing beyond the C++ standard library is needed to build it. A request is cut
// into blocks of block_size bytes; the pool's threads take blocks from one queue, so a large request is read or
// written by every thread at once, and requests submitted back to back overlap.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace zk_aio {

// What a finished request reports: err 0 on success, else the errno of the first failed block (or -1 for an
// unexpected end of file), with the byte offset where it failed.
struct Outcome {
  int err = 0;
  int64_t offset = 0;
};

class Pool {
 public:
  // threads >= 1; block_size > 0 bytes per pread/pwrite call; queue_depth >= 1 blocks queued at once (submit
  // waits for room beyond that).
  Pool(int threads, int64_t block_size, int queue_depth);
  ~Pool();
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  // Queue a read (write=false) of nbytes at file offset into ptr, or a write from ptr. Returns a ticket.
  int64_t submit(bool write, int fd, uintptr_t ptr, int64_t nbytes, int64_t offset);
  // Whether the ticket's blocks are all done (never blocks).
  bool done(int64_t ticket);
  // Block until the ticket is done, forget it, and return its outcome.
  Outcome wait(int64_t ticket);
  int threads() const { return static_cast<int>(workers_.size()); }
  int64_t block_size() const { return block_size_; }

 private:
  struct Block {
    int64_t ticket;
    bool write;
    int fd;
    char* ptr;
    int64_t nbytes;
    int64_t offset;
  };
  struct Request {
    int64_t left = 0;  // blocks not finished yet
    Outcome outcome;
  };
  void run();
  static Outcome transfer(const Block& b);

  int64_t block_size_;
  size_t queue_depth_;
  std::mutex mu_;
  std::condition_variable work_ready_;  // a block was queued, or the pool stops
  std::condition_variable room_;        // the queue has room again
  std::condition_variable finished_;    // a request finished
  std::deque<Block> queue_;
  std::unordered_map<int64_t, Request> requests_;
  int64_t next_ticket_ = 1;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace zk_aio
