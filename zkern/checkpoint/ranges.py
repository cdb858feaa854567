"""Torch tensors in and out of checkpoint files: byte views without copies, and a reader that fills ranges of
tensors from the entries that hold them, verifying every entry it reads.

    python -m pytest tests/test_checkpoint_files.py -q
"""

from __future__ import annotations

import ctypes
import hashlib
import os
from collections import defaultdict

import torch

from zkern.checkpoint.manifest import entry_key
from zkern.checkpoint.tensorfile import TensorInfo, read_header
from zkern.errors import CheckpointError

TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}
DTYPE_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in DTYPE_NAMES:
        raise CheckpointError(f"a tensor of dtype {dtype} cannot be stored in a checkpoint (known: "
                              f"{sorted(str(d) for d in DTYPE_NAMES)})")
    return DTYPE_NAMES[dtype]


def byte_view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy (the tensor must outlive the view)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("byte_view needs a contiguous host tensor")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class RangeReader:
    """Collect requests "fill dest with elements [start, start + dest.numel()) of (kind, name)", then run() reads
    each entry that overlaps a request once, checks it against the manifest (file size, header, sha256) and copies
    the overlaps (casting to dest's dtype). Nothing outside the requested dests is written, so a failed read leaves
    the caller's state untouched when dests are staging buffers (a dest that is a whole entry is read into, and
    holds the file's bytes when its checksum fails)."""

    def __init__(self, tag_dir: str, manifest: dict):
        self.tag_dir, self.manifest = tag_dir, manifest
        self.entries: dict[tuple[str, str], list[dict]] = defaultdict(list)
        for e in manifest["tensors"]:
            self.entries[(e["kind"], e["name"])].append(e)
        present: dict[str, bool] = {}  # a range stored twice (node-local storage) is read from the file here
        for lst in self.entries.values():
            for e in lst:
                if e["file"] not in present:
                    present[e["file"]] = os.path.isfile(os.path.join(tag_dir, e["file"]))
            lst.sort(key=lambda e: (e["start"], not present[e["file"]]))
        self.kinds_of: dict[str, set[str]] = defaultdict(set)  # tensor name -> the kinds stored for it
        for kind, name in self.entries:
            self.kinds_of[name].add(kind)
        self._work: dict[int, list[tuple[int, int, torch.Tensor]]] = defaultdict(list)  # id(entry) -> overlaps
        self._by_id: dict[int, dict] = {}
        self._headers: dict[str, dict[str, TensorInfo]] = {}

    def has(self, kind: str, name: str) -> bool:
        return (kind, name) in self.entries

    def request(self, kind: str, name: str, start: int, dest: torch.Tensor) -> None:
        end = start + dest.numel()
        covered = start
        for e in self.entries.get((kind, name), ()):
            lo, hi = max(start, e["start"]), min(end, e["start"] + e["numel"])
            if lo >= hi or hi <= covered:  # outside the request, or a second copy of what is covered
                continue
            if lo > covered:
                break
            self._work[id(e)].append((lo - e["start"], lo - start, dest[lo - start:hi - start]))
            self._by_id[id(e)] = e
            covered = max(covered, hi)
        if covered < end:
            raise CheckpointError(f"{self.tag_dir}: holds no {kind} values for elements [{covered}, {end}) of "
                                  f"{name!r}: the checkpoint is incomplete (a rank's entries are missing from its "
                                  f"manifest)")

    def _header(self, file: str) -> dict[str, TensorInfo]:
        if file not in self._headers:
            path = os.path.join(self.tag_dir, file)
            expected = self.manifest["files"][file]["bytes"]
            try:
                size = os.path.getsize(path)
            except FileNotFoundError:
                raise CheckpointError(f"{path}: missing; the manifest lists it ({expected} bytes)") from None
            if size != expected:
                raise CheckpointError(f"{path}: {size} bytes, the manifest says {expected}: the file is "
                                      f"{'truncated' if size < expected else 'longer than written'}")
            self._headers[file] = read_header(path)[0]
        return self._headers[file]

    def check_files(self) -> None:
        """Every file some request reads: present, of the manifest's size, with a sound header."""
        for e in self._by_id.values():
            self._header(e["file"])

    def run(self) -> int:
        """Read and verify every needed entry, fill the requests; returns the bytes read."""
        total = 0
        for eid, overlaps in self._work.items():
            e = self._by_id[eid]
            whole = overlaps[0][2] if len(overlaps) == 1 and self._fits_whole(e, *overlaps[0]) else None
            data = self.read_entry(e, into=whole)  # a dest that is the whole entry is read into directly
            total += data.numel() * data.element_size()
            if whole is None:
                for src, _, dest in overlaps:
                    dest.copy_(data[src:src + dest.numel()])
            del data
        return total

    @staticmethod
    def _fits_whole(e: dict, src: int, _: int, dest: torch.Tensor) -> bool:
        return src == 0 and dest.numel() == e["numel"] and dest.dtype == TORCH_DTYPES[e["dtype"]] \
            and dest.device.type == "cpu" and dest.is_contiguous()

    def read_entry(self, e: dict, into: torch.Tensor | None = None) -> torch.Tensor:
        """One entry whole, as a 1-D host tensor of its dtype (into: that tensor, contiguous, of the entry's dtype
        and size), its sha256 checked."""
        key = entry_key(e["kind"], e["name"], e["start"])
        path = os.path.join(self.tag_dir, e["file"])
        info = self._header(e["file"]).get(key)
        if info is None:
            raise CheckpointError(f"{path}: has no tensor {key!r}, which the manifest places there")
        if info.dtype != e["dtype"] or info.numel != e["numel"]:
            raise CheckpointError(f"{path}: tensor {key!r} is {info.dtype} x {info.numel} in the file, "
                                  f"{e['dtype']} x {e['numel']} in the manifest")
        out = torch.empty(e["numel"], dtype=TORCH_DTYPES[e["dtype"]]) if into is None else into
        view = byte_view(out)
        with open(path, "rb", buffering=0) as f:  # one read: the disk serves it in large requests
            got = _pread(f.fileno(), view, info.begin) if len(view) else 0
        if got != info.end - info.begin:
            raise CheckpointError(f"{path}: tensor {key!r}: read {got} of {info.end - info.begin} bytes (truncated)")
        digest = hashlib.sha256(view).hexdigest()
        if digest != e["sha256"]:
            raise CheckpointError(f"{path}: tensor {key!r} ({e['dtype']}, {e['numel']} elements at bytes "
                                  f"{info.begin}-{info.end}): sha256 {digest} differs from the manifest's "
                                  f"{e['sha256']}: the file was altered or damaged")
        return out


def _pread(fd: int, into: memoryview, offset: int) -> int:
    """Fill `into` from the file at offset (fewer bytes only at the end of the file); returns the bytes read."""
    got = 0
    while got < len(into):
        n = os.preadv(fd, [into[got:]], offset + got)
        if not n:
            break
        got += n
    return got
