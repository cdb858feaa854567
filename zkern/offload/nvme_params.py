"""ZeRO-Infinity's parameters on NVMe: stage 3's working-dtype parameter shard in a file, read ahead of use.

    python -m pytest tests/offload/test_nvme_engine.py -q

With offload_param.device "nvme" the stage-3 runtime's param_shard is a meta stand-in (shape and dtype, no
data; see nvme.py for why) and its values live in params.bin, laid out like the shard and padded to whole 4 KiB
blocks. A gather takes a unit's chunk from a host cache of at most `max_in_cpu` elements (DeepSpeed's key: least
recently used chunks leave first), from a read the gatherer started ahead of use, or from the disk. Read-ahead
follows the order the prefetcher records: while one unit computes, the chunks of the next ones are read, at most
`buffer_count` of them and `buffer_size` elements in flight (DeepSpeed's keys for the swap buffers). Writes (the
optimizer's updated chunks, a checkpoint load, a GatheredParameters write) go to the file and to any cached or
in-flight copy, so a read never returns values older than the last write.
"""

from __future__ import annotations

import bisect
import os
import shutil
import weakref
from collections import OrderedDict

import torch

from zkern import ops

ALIGN = 4096  # bytes: O_DIRECT's alignment


def _cover(lo: int, hi: int, itemsize: int) -> tuple[int, int]:
    """Byte range of whole 4 KiB blocks holding elements [lo, hi)."""
    return lo * itemsize // ALIGN * ALIGN, -(-hi * itemsize // ALIGN) * ALIGN


class NvmeParams:
    """The parameter shard file, its unit-chunk cache and its reads in flight."""

    def __init__(self, directory: str, pool, numel: int, dtype: torch.dtype, units: dict[int, tuple[int, int]], *,
                 max_in_cpu: int, buffer_count: int, buffer_size: int):
        """units: unit index -> (first shard element, chunk elements) of every unit whose chunk rests here."""
        self.dtype, self.itemsize = dtype, torch.empty(0, dtype=dtype).element_size()
        self.units = units
        self._by_start = sorted((start, ui) for ui, (start, _) in units.items())  # units in shard order
        self.max_in_cpu, self.buffer_count, self.buffer_size = max_in_cpu, buffer_count, buffer_size
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"zkern NVMe: cannot create the parameter directory {directory}: {e.strerror}",
                          directory) from None
        self.directory = directory
        self._cleanup = weakref.finalize(self, shutil.rmtree, directory, True)  # a run's scratch file
        nbytes = max(ALIGN, -(-numel * self.itemsize // ALIGN) * ALIGN)
        self.file = ops.nvme_file(os.path.join(directory, "params.bin"), nbytes, pool)  # reserved whole now
        self.stand_in = torch.empty(numel, dtype=dtype, device="meta")
        self.cache: OrderedDict[int, torch.Tensor] = OrderedDict()  # unit -> its chunk (host), least recent first
        self.cached = 0  # elements in the cache
        self.pending: dict[int, tuple] = {}  # unit -> (work, buffer, first element in it) of a read in flight
        self.in_flight = 0  # elements of the reads in flight
        self.reads = 0  # chunk reads from the disk (read-ahead or on demand), for tests and reports
        self.ahead_hits = 0  # gathers served by a read started ahead of them

    def close(self) -> None:
        """Close and remove the file (the engine's destroy, or interpreter exit)."""
        self.file.close()
        self._cleanup()

    @property
    def nbytes(self) -> int:
        return self.file.nbytes

    def owns(self, t: torch.Tensor) -> bool:
        return t.is_meta and (t._base if t._base is not None else t) is self.stand_in

    def cache_bytes(self) -> int:
        return self.cached * self.itemsize

    def cached_tensors(self) -> list[torch.Tensor]:
        """The host copies of unit chunks (cached, or being read ahead): derived from the file, never saved."""
        return [*self.cache.values(), *(buf for _, buf, _ in self.pending.values())]

    # -- element ranges ---------------------------------------------------------------------------------------
    def _start(self, lo: int, hi: int) -> tuple:
        a, b = _cover(lo, hi, self.itemsize)
        buf = ops.aligned_empty(b - a, torch.uint8)
        return self.file.read(buf, a, async_op=True), buf, (lo * self.itemsize - a) // self.itemsize

    def _values(self, buf: torch.Tensor, skip: int, n: int) -> torch.Tensor:
        return buf.view(self.dtype)[skip:skip + n]

    def read(self, t: torch.Tensor) -> torch.Tensor:
        """The values at stand-in slice t (fresh host tensor shaped like t)."""
        lo = t.storage_offset()
        work, buf, skip = self._start(lo, lo + t.numel())
        work.wait()
        return self._values(buf, skip, t.numel()).clone().view(t.shape)

    def write(self, t: torch.Tensor, values: torch.Tensor) -> None:
        """Stand-in slice t <- values; cached and in-flight copies of the units it touches follow."""
        lo, n = t.storage_offset(), t.numel()
        values = values.reshape(-1)
        work, buf, skip = self._start(lo, lo + n)  # the blocks' other elements are kept
        work.wait()
        self._values(buf, skip, n).copy_(values)
        self.file.write(buf, _cover(lo, lo + n, self.itemsize)[0])
        first = max(0, bisect.bisect_right(self._by_start, (lo, float("inf"))) - 1)
        for start, ui in self._by_start[first:]:
            if start >= lo + n:
                break
            size = self.units[ui][1]
            x, y = max(lo, start), min(lo + n, start + size)
            if x >= y:
                continue
            if ui in self.pending:  # a read started before this write: take its result, then overwrite it
                self.unit(ui)
            if ui in self.cache:
                self.cache[ui][x - start:y - start].copy_(values[x - lo:y - lo])

    # -- unit chunks (the gatherer) -----------------------------------------------------------------------------
    def read_ahead(self, ui: int) -> bool:
        """Start reading unit ui's chunk unless it is cached or on its way; False when the read-ahead budget
        (buffer_count reads, buffer_size elements in flight) is spent."""
        if ui in self.cache or ui in self.pending or ui not in self.units:
            return True
        start, size = self.units[ui]
        if len(self.pending) >= self.buffer_count or (self.pending and self.in_flight + size > self.buffer_size):
            return False
        self.pending[ui] = self._start(start, start + size)
        self.in_flight += size
        self.reads += 1
        return True

    def unit(self, ui: int) -> torch.Tensor:
        """Unit ui's chunk on the host: cached, read ahead, or read now."""
        if ui in self.cache:
            self.cache.move_to_end(ui)
            return self.cache[ui]
        start, size = self.units[ui]
        if ui in self.pending:
            self.ahead_hits += 1
        else:
            self.pending[ui] = self._start(start, start + size)
            self.in_flight += size
            self.reads += 1
        work, buf, skip = self.pending.pop(ui)
        self.in_flight -= size
        work.wait()
        chunk = self._values(buf, skip, size)
        if size <= self.max_in_cpu:
            while self.cache and self.cached + size > self.max_in_cpu:
                _, old = self.cache.popitem(last=False)
                self.cached -= old.numel()
            self.cache[ui] = chunk
            self.cached += size
        return chunk
