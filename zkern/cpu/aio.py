"""NVMe I/O for ZeRO-Infinity: files of fp32 state read and written through the extension's thread pool.

    python -m pytest tests/test_aio.py -q

IoPool is zkern.cpu._adam_ext.AioPool (csrc/aio.cpp): `thread_count` threads take blocks of `block_size` bytes
from one queue of at most `queue_depth` blocks and pread/pwrite them; submit and wait release the GIL, so reads
and writes run while the CPU Adam steps. NvmeFile is one preallocated file: its whole size is reserved when it
is created (posix_fallocate), so a full disk is an error then, naming the path, and never halfway through a
step. Requests whose buffer, size and offset are all aligned to ALIGN bytes go through an O_DIRECT descriptor
where the file system takes one (the page cache is bypassed: what is read is what the disk holds); others, and
file systems that refuse O_DIRECT (tmpfs), use a buffered descriptor. `aligned_empty` makes buffers that qualify.
"""

from __future__ import annotations

import errno as errno_names
import logging
import os

import torch

from zkern.cpu._ext import BUILD_HINT, EXT, LOAD_ERROR

log = logging.getLogger("zkern")

ALIGN = 4096  # bytes: O_DIRECT's alignment for buffers, sizes and offsets on every common device
_said_buffered: set[str] = set()


def _need_ext() -> None:
    if EXT is None:
        raise RuntimeError(f"zkern's NVMe I/O needs the C++ extension: {LOAD_ERROR}; {BUILD_HINT}")


class IoPool:
    """The I/O threads (DeepSpeed's aio section: block_size, queue_depth, thread_count)."""

    def __init__(self, thread_count: int = 1, block_size: int = 1 << 20, queue_depth: int = 8):
        _need_ext()
        for name, value in (("thread_count", thread_count), ("block_size", block_size),
                            ("queue_depth", queue_depth)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"aio.{name} must be a whole number >= 1, got {value!r}")
        self.pool = EXT.AioPool(thread_count, block_size, queue_depth)
        self.thread_count, self.block_size, self.queue_depth = thread_count, block_size, queue_depth


class IoWork:
    """One submitted read or write; wait() raises OSError naming the file if it failed."""

    def __init__(self, pool: IoPool, ticket: int, path: str, what: str, keep: torch.Tensor):
        self.pool, self.ticket, self.path, self.what = pool, ticket, path, what
        self._keep = keep  # the buffer must outlive the transfer
        self._done = False

    def done(self) -> bool:
        return self._done or self.pool.pool.done(self.ticket)

    def wait(self) -> None:
        if self._done:
            return
        self._done = True
        err, offset = self.pool.pool.wait(self.ticket)
        self._keep = None
        if err == -1:
            raise OSError(errno_names.EIO, f"zkern NVMe: {self.what} of {self.path} reached the end of the file at "
                                           f"byte {offset}: the file is shorter than it was made (truncated?)",
                          self.path)
        if err:
            raise OSError(err, f"zkern NVMe: {self.what} of {self.path} failed at byte {offset}: "
                               f"{os.strerror(err)}", self.path)


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor whose first byte is ALIGN-aligned (an O_DIRECT-ready buffer)."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    raw = torch.empty(numel * itemsize + ALIGN, dtype=torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + numel * itemsize].view(dtype)


class NvmeFile:
    """A file of `nbytes` bytes at `path`, created (and its space reserved) or opened as it is."""

    def __init__(self, path: str, nbytes: int, pool: IoPool, *, create: bool = True, direct: bool = True):
        self.path, self.nbytes, self.pool = os.fspath(path), nbytes, pool
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        try:
            self.fd = os.open(self.path, flags, 0o600)
        except OSError as e:
            raise OSError(e.errno, f"zkern NVMe: cannot {'create' if create else 'open'} {self.path}: "
                                   f"{e.strerror}", self.path) from None
        self.direct_fd = -1
        try:
            if create and nbytes:
                try:
                    os.posix_fallocate(self.fd, 0, nbytes)
                except OSError as e:
                    if e.errno not in (errno_names.EOPNOTSUPP, errno_names.EINVAL):
                        raise
                    os.ftruncate(self.fd, nbytes)  # the file system cannot reserve: a sparse file
            size = os.fstat(self.fd).st_size
            if size != nbytes:
                raise OSError(errno_names.EINVAL, f"zkern NVMe: {self.path} holds {size} bytes, expected {nbytes}",
                              self.path)
            if direct:
                self.direct_fd = _open_direct(self.path, pool)
        except OSError as e:
            self.close()
            if e.filename:
                raise
            raise OSError(e.errno, f"zkern NVMe: cannot reserve {nbytes} bytes for {self.path}: {e.strerror}",
                          self.path) from None
        if self.direct_fd < 0 and direct:
            where = os.path.dirname(os.path.abspath(self.path))
            if where not in _said_buffered:
                _said_buffered.add(where)
                log.info("zkern NVMe: %s does not take O_DIRECT; its files use buffered I/O (through the page "
                         "cache; said once per directory)", where)

    def check(self) -> None:
        """Raise OSError naming the file unless it still holds its bytes (truncated, or deleted and replaced)."""
        try:
            size = os.stat(self.path).st_size
            same = os.path.samestat(os.stat(self.path), os.fstat(self.fd))
        except OSError as e:
            raise OSError(e.errno, f"zkern NVMe: {self.path} is gone: {e.strerror}", self.path) from None
        if not same or size != self.nbytes:
            raise OSError(errno_names.EIO, f"zkern NVMe: {self.path} changed under zkern (it holds {size} bytes of "
                                           f"{self.nbytes}, {'the same' if same else 'another'} file)", self.path)

    @property
    def io_path(self) -> str:
        return "O_DIRECT" if self.direct_fd >= 0 else "buffered"

    def _submit(self, write: bool, t: torch.Tensor, offset: int) -> IoWork:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"zkern NVMe: {self.path}: I/O needs a contiguous host tensor, got {t.device} "
                             f"{'contiguous' if t.is_contiguous() else 'strided'}")
        nbytes = t.numel() * t.element_size()
        if offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(f"zkern NVMe: {self.path}: bytes [{offset}, {offset + nbytes}) lie outside the file's "
                             f"{self.nbytes}")
        aligned = t.data_ptr() % ALIGN == 0 and nbytes % ALIGN == 0 and offset % ALIGN == 0
        fd = self.direct_fd if aligned and self.direct_fd >= 0 else self.fd
        ticket = self.pool.pool.submit(write, fd, t.data_ptr(), nbytes, offset)
        return IoWork(self.pool, ticket, self.path, "write" if write else "read", t)

    def read(self, into: torch.Tensor, offset: int = 0, *, async_op: bool = False) -> IoWork:
        """into <- the file's bytes from `offset` (as many as into holds)."""
        work = self._submit(False, into, offset)
        if not async_op:
            work.wait()
        return work

    def write(self, data: torch.Tensor, offset: int = 0, *, async_op: bool = False) -> IoWork:
        """The file's bytes from `offset` <- data's."""
        work = self._submit(True, data, offset)
        if not async_op:
            work.wait()
        return work

    def close(self) -> None:
        for name in ("direct_fd", "fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def __del__(self):
        self.close()


def _open_direct(path: str, pool: IoPool) -> int:
    """An O_DIRECT descriptor of path, or -1 where the file system refuses one (at open, or at a probe read)."""
    if not hasattr(os, "O_DIRECT"):
        return -1
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    except OSError as e:
        if e.errno in (errno_names.EINVAL, errno_names.EOPNOTSUPP):
            return -1
        raise
    if os.fstat(fd).st_size >= ALIGN:
        probe = aligned_empty(ALIGN, torch.uint8)
        err, _ = pool.pool.wait(pool.pool.submit(False, fd, probe.data_ptr(), ALIGN, 0))
        if err:
            os.close(fd)
            if err in (errno_names.EINVAL, errno_names.EOPNOTSUPP):
                return -1
            raise OSError(err, os.strerror(err), path)
    return fd
