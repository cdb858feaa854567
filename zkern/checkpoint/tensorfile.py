"""The safetensors file format, written and read a tensor (or a byte range) at a time, with no torch and no pickle.

    python -c "from zkern.checkpoint.tensorfile import read_header; print(read_header('rank00000.safetensors'))"

A file is an 8-byte little-endian header length, a JSON header {name: {"dtype", "shape", "data_offsets": [begin,
end]}, "__metadata__": {str: str}} padded with spaces to a multiple of 8, then the tensors' bytes back to back
(offsets count from the end of the header). zkern writes it itself rather than through the safetensors package so
that a file can be written as a stream (the header first, then one tensor at a time, hashed on the way: nothing
is held whole) and read by byte range (a loader reads only the elements of its own shard). Files written here
load with safetensors.torch.load_file and Hugging Face's from_pretrained.

Reading trusts nothing: the header length is bounded by the file's size, every dtype is a known one, and every
tensor's byte range matches its shape and lies inside the file, before anything is allocated from it.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass

from zkern.errors import CheckpointError
from zkern.safe_io import parse_json

# safetensors dtype name -> bytes per element
DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
MAX_HEADER = 256 << 20  # a header larger than this is not a checkpoint zkern wrote
COPY_BLOCK = 1 << 20  # bytes moved per read when streaming: a reader's whole working memory, and hashed while cached
WRITE_SLICE = 1 << 20  # bytes per write call: each is hashed just before, while it is in the cache
WRITEBACK_EVERY = 8 << 20  # bytes after which the kernel is told to start writing back (see StreamWriter)


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    end: int  # absolute file offset one past the last byte

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def header_bytes(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, list[int]]:
    """The header for tensors [(name, dtype, shape)] stored in that order, and each one's byte size."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    sizes, offset = [], 0
    for name, dtype, shape in tensors:
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(f"tensor {name!r}: dtype {dtype} cannot be stored (known: {sorted(DTYPE_SIZES)})")
        n = DTYPE_SIZES[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        sizes.append(n)
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw, sizes


class StreamWriter:
    """Write one safetensors file as a stream: the header at once, then each tensor's bytes in order.

    With hashed=True each tensor's sha256 is taken on the way (self.hashes), so a checksum costs no second read; the
    header's own sha256 is self.header_sha256, so header and tensors together cover every byte of the file. Bytes go
    out in WRITE_SLICE pieces, each hashed just before it is written (it is still in the cache), and every
    WRITEBACK_EVERY bytes the kernel is told to start writing back what came before (posix_fadvise DONTNEED starts
    the write-back of dirty pages and does not wait), so the disk works while the rest is hashed and the final fsync
    waits for the tail only. The caller closes it (close(fsync=True) makes the data durable before the file is
    renamed into place)."""

    def __init__(self, path: str, tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str],
                 hashed: bool = True):
        self.path = path
        head, self.sizes = header_bytes(tensors, metadata)
        self.names = [t[0] for t in tensors]
        self.hashed = hashed
        self.file = open(path, "wb", buffering=0)  # noqa: SIM115 - closed by close()
        self.header_sha256 = hashlib.sha256(head).hexdigest()
        self.nbytes = 0
        self._written_back = 0  # bytes the kernel was told to write back
        self._put(memoryview(head))
        self.hashes: dict[str, str] = {}
        self._index = 0
        self._tensor_hash = None
        self._left = 0

    def begin(self, name: str) -> None:
        if self._left or self._index >= len(self.names) or self.names[self._index] != name:
            raise CheckpointError(f"{self.path}: tensor {name!r} written out of the header's order")
        self._tensor_hash = hashlib.sha256() if self.hashed else None
        self._left = self.sizes[self._index]
        if self._left == 0:
            self._finish()

    def write(self, data) -> None:
        """Bytes of the current tensor (any buffer: bytes, memoryview); several calls may make up one tensor."""
        view = memoryview(data).cast("B")
        if not view:  # nothing to add (a zero-element tensor was finished by begin)
            return
        if len(view) > self._left:
            raise CheckpointError(f"{self.path}: {len(view)} bytes written to tensor {self.names[self._index]!r}, "
                                  f"{self._left} left in it")
        for at in range(0, len(view), WRITE_SLICE):
            piece = view[at:at + WRITE_SLICE]
            if self._tensor_hash is not None:
                self._tensor_hash.update(piece)
            self._put(piece)
        self._left -= len(view)
        if self._left == 0:
            self._finish()

    def _put(self, piece: memoryview) -> None:
        while piece:
            n = self.file.write(piece)
            piece = piece[n:]
            self.nbytes += n
        if self.nbytes - self._written_back >= WRITEBACK_EVERY and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.file.fileno(), self._written_back, self.nbytes - self._written_back,
                             os.POSIX_FADV_DONTNEED)
            self._written_back = self.nbytes

    def _finish(self) -> None:
        if self._tensor_hash is not None:
            self.hashes[self.names[self._index]] = self._tensor_hash.hexdigest()
        self._index += 1

    def close(self, fsync: bool = True) -> None:
        """Finish the file (fsync: durable on return)."""
        if self._index != len(self.names):
            self.file.close()
            raise CheckpointError(f"{self.path}: closed after {self._index} of {len(self.names)} tensors")
        if fsync:
            os.fsync(self.file.fileno())
        self.file.close()

    def abort(self) -> None:
        self.file.close()


def read_header(path: str) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """{name: TensorInfo}, metadata of a safetensors file, every field checked against the file's size."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO under the name must not block the reader
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open ({e.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: not a regular file (a FIFO, device or socket under its name); refusing it")
    try:
        size = os.fstat(fd).st_size
        with os.fdopen(fd, "rb") as f:
            first = f.read(8)
            if len(first) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short to be a safetensors file (truncated?)")
            (length,) = struct.unpack("<Q", first)
            if length > min(MAX_HEADER, size - 8):
                raise CheckpointError(f"{path}: its header claims {length} bytes but the file has {size}: not a "
                                      f"safetensors file, or truncated")
            raw = f.read(length)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    header = parse_json(raw, path, "safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: the header's __metadata__ is not a JSON object")
    start = 8 + length
    out = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        if dtype not in DTYPE_SIZES or not all(isinstance(s, int) and s >= 0 for s in shape) \
                or not isinstance(begin, int) or not isinstance(end, int):
            raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype!r} / shape {list(shape)}: not valid")
        t = TensorInfo(dtype, shape, start + begin, start + end)
        if end - begin != t.numel * DTYPE_SIZES[dtype] or begin < 0 or t.end > size:
            raise CheckpointError(f"{path}: tensor {name!r} ({dtype}, shape {list(shape)}) claims bytes "
                                  f"[{begin}, {end}) of a {size - start}-byte data section: the file is truncated "
                                  f"or its header damaged")
        out[name] = t
    return out, metadata


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(COPY_BLOCK):
            h.update(block)
    return h.hexdigest()
