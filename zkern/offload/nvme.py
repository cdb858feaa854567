"""ZeRO-Infinity's optimizer on NVMe: the fp32 master and both Adam moments of this rank's shard live in files and
stream through a few host tile buffers while the CPU Adam steps.

    python -m pytest tests/offload/test_nvme.py tests/offload/test_nvme_engine.py -q

NvmeShard holds the files. A region is one fp32 master buffer of a stage runtime (stage 3 has one; stages 1-2 one
per parameter group); each region has three files, master-<i>.bin, exp_avg-<i>.bin and exp_avg_sq-<i>.bin, laid
out like the region element for element and padded to whole 4 KiB blocks, so every tile transfer qualifies for
O_DIRECT. The runtime holds a *meta* tensor for each region in place of the resident master: its slices (the
optimizer's pieces, each chunk's param) carry shapes and storage offsets but no data, so they say which elements
a transfer covers, and a value read by code that does not know about the files fails loudly instead of reading
stale memory. Values move only through NvmeShard.read/write (checkpoints, full_state_dict, GatheredParameters)
and NvmeAdam.step.

NvmeAdam is ShardAdam with its states there. A step walks the tiles (`sub_group_size` elements, DeepSpeed's key)
of each region that hold elements to step, with `buffer_count` >= 3 buffer sets: tile t+buffer_count-1 is read
while tile t steps and tile t-1 is written, so the disk and the CPU work at once. The arithmetic is ShardAdam's:
the same runs of active pieces (optimizer._runs), the same step counts, ops.adam_step_ on sub-ranges (the fused
kernel is element-wise and handles a range's tail with its vector code, so any split of a range gives the same
bits). Files are checked before the first tile changes (a truncated or replaced file refuses the step whole); an
I/O error in the middle of a step (EIO from the device) leaves the tiles before it applied and raises: the run
must stop there and resume from a checkpoint.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
import weakref
from dataclasses import dataclass

import torch

from zkern import ops
from zkern.core.shard_groups import ShardGroup
from zkern.optim.piece_states import load_piece_states
from zkern.optim.shard_adam import ShardAdam, _runs

log = logging.getLogger("zkern")

STATES = ("master", "exp_avg", "exp_avg_sq")
# Muon's momentum takes the first moment's file: a Muon piece has no Adam moments (nvme_muon.py)
FILE_OF = {"momentum_buffer": "exp_avg"}
ALIGN_BYTES = 4096  # O_DIRECT's alignment: every transfer starts and ends on it, in every file


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _round_down(n: int, to: int) -> int:
    return n // to * to


@dataclass(frozen=True)
class Tile:
    region: int
    start: int  # first element, within the region (NvmeShard.align-aligned)
    end: int  # one past the last element to transfer (a whole number of 4 KiB blocks past start)


class NvmeShard:
    """The files of one rank's optimizer states, and the host buffers they stream through."""

    def __init__(self, directory: str, pool, *, sub_group_size: int, buffer_count: int = 4, remove: bool = False,
                 master_dtype: torch.dtype = torch.float32, state_dtype: torch.dtype = torch.float32):
        """directory: this rank's own (made here). sub_group_size: elements per tile transfer (capped at the largest
        region, rounded up to whole 4 KiB blocks). remove: delete the directory when this object goes (a run's
        scratch files; the engine's). master_dtype / state_dtype: the files' element types (fp32 or bf16)."""
        self.dtypes = {"master": master_dtype, "exp_avg": state_dtype, "exp_avg_sq": state_dtype}
        # Elements per aligned block: a whole number of 4 KiB blocks in each file (1024 with fp32 files alone,
        # 2048 once one is bf16), so an element range moves between every file on the same bounds.
        self.align = ALIGN_BYTES // min(d.itemsize for d in self.dtypes.values())
        if buffer_count < 3:
            raise ValueError(f"offload_optimizer.buffer_count must be >= 3 for the NVMe pipeline (a tile read "
                             f"ahead, one stepping, one written behind), got {buffer_count}")
        if sub_group_size < 1:
            raise ValueError(f"sub_group_size must be >= 1 element, got {sub_group_size}")
        self.directory, self.pool = os.fspath(directory), pool
        self.sub_group_size, self.buffer_count = sub_group_size, buffer_count
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"zkern NVMe: cannot create the optimizer directory {self.directory}: "
                                   f"{e.strerror}", self.directory) from None
        # A run's scratch files go with this object, or at interpreter exit if it lives that long.
        self._cleanup = weakref.finalize(self, shutil.rmtree, self.directory, True) if remove else None
        self.regions: list[torch.Tensor] = []  # meta stand-ins, one per region
        self.files: list[dict] = []  # per region: state name -> NvmeFile
        self._buffers: list[dict[str, torch.Tensor]] | None = None
        self.tile = 0  # elements per tile, fixed when the buffers are made

    def add_region(self, numel: int) -> torch.Tensor:
        """Files for a new region of numel elements (reserved whole now: a full disk fails here, naming the
        file, never inside a step), zero-filled; returns its meta stand-in (in the master's dtype)."""
        index, padded = len(self.regions), _round_up(max(numel, 1), self.align)
        self.files.append({name: ops.nvme_file(os.path.join(self.directory, f"{name}-{index}.bin"),
                                               padded * self.dtypes[name].itemsize, self.pool) for name in STATES})
        stand_in = torch.empty(numel, dtype=self.dtypes["master"], device="meta")
        self.regions.append(stand_in)
        return stand_in

    @property
    def io_path(self) -> str:
        return self.files[0]["master"].io_path if self.files else "none"

    def nbytes(self, states: tuple[str, ...] = STATES) -> int:
        """Bytes on disk of the given states' files (padding included)."""
        return sum(files[name].nbytes for files in self.files for name in states)

    def buffer_bytes(self) -> int:
        return 0 if self._buffers is None else sum(t.numel() * t.element_size() for b in self._buffers
                                                   for t in b.values())

    def buffers(self) -> list[dict[str, torch.Tensor]]:
        """The tile buffer sets, made at the first use once every region exists."""
        if self._buffers is None:
            largest = max((r.numel() for r in self.regions), default=1)
            self.tile = _round_up(min(self.sub_group_size, max(largest, 1)), self.align)
            self._buffers = [{name: ops.aligned_empty(self.tile, self.dtypes[name]) for name in STATES}
                             for _ in range(self.buffer_count)]
        return self._buffers

    def check(self) -> None:
        """Raise OSError naming a file that is not as zkern made it (truncated, deleted, replaced)."""
        for files in self.files:
            for f in files.values():
                f.check()

    def locate(self, t: torch.Tensor) -> tuple[int, int]:
        """(region, first element) of a contiguous slice of a region's stand-in."""
        base = t._base if t._base is not None else t
        for index, region in enumerate(self.regions):
            if base is region:
                if not t.is_contiguous():
                    raise ValueError("zkern NVMe: a transfer needs a contiguous slice of a region")
                return index, t.storage_offset()
        raise ValueError("zkern NVMe: the tensor is not a slice of this shard's regions (its values are on disk "
                         "only through the region stand-ins the runtime holds)")

    # -- element ranges (checkpoints, full_state_dict, GatheredParameters) --------------------------------------
    def _bounce(self, state: str, lo: int, hi: int) -> tuple[torch.Tensor, int]:
        """A buffer for element-range transfers, and the elements per transfer: the tile buffers once they exist;
        while the runtime is still being built (the regions, hence the tile size, are not all known yet) a
        temporary one."""
        if self._buffers is not None:
            return self._buffers[0][state], self.tile
        tile = _round_up(min(self.sub_group_size, hi - lo + self.align), self.align)
        return ops.aligned_empty(tile, self.dtypes[state]), tile

    def _spans(self, lo: int, hi: int, tile: int):
        """Aligned transfers covering elements [lo, hi): (block start, block end), at most `tile` elements each."""
        a, end = _round_down(lo, self.align), _round_up(hi, self.align)
        while a < end:
            yield a, min(a + tile, end)
            a += tile

    def read(self, state: str, t: torch.Tensor) -> torch.Tensor:
        """The values of state ("master", "exp_avg", "exp_avg_sq") at the elements slice t covers: a fresh
        host tensor shaped like t, in t's dtype (a bf16 state read through an fp32 master's slice is widened,
        exactly). Muon's "momentum_buffer" is read from the exp_avg file (FILE_OF)."""
        state = FILE_OF.get(state, state)
        region, lo = self.locate(t)
        hi = lo + t.numel()
        out = torch.empty(t.numel(), dtype=t.dtype)
        buf, tile = self._bounce(state, lo, hi)
        f, size = self.files[region][state], self.dtypes[state].itemsize
        for a, b in self._spans(lo, hi, tile):
            f.read(buf[:b - a], size * a)
            x, y = max(a, lo), min(b, hi)
            out[x - lo:y - lo].copy_(buf[x - a:y - a])
        return out.view(t.shape)

    def write(self, state: str, t: torch.Tensor, values: torch.Tensor) -> None:
        """state's elements at slice t <- values (numel of t; blocks only partly covered are read first)."""
        state = FILE_OF.get(state, state)
        region, lo = self.locate(t)
        hi = lo + t.numel()
        values = values.reshape(-1)
        if values.numel() != t.numel():
            raise ValueError(f"zkern NVMe: writing {values.numel()} values into {t.numel()} elements")
        buf, tile = self._bounce(state, lo, hi)
        f, size = self.files[region][state], self.dtypes[state].itemsize
        for a, b in self._spans(lo, hi, tile):
            x, y = max(a, lo), min(b, hi)
            if x > a or y < b:
                f.read(buf[:b - a], size * a)
            buf[x - a:y - a].copy_(values[x - lo:y - lo])  # rounded to nearest where the file is bf16
            f.write(buf[:b - a], size * a)

    def close(self) -> None:
        """Close the files (and remove the directory when this shard owns it)."""
        for files in self.files:
            for f in files.values():
                f.close()
        if self._cleanup is not None:
            self._cleanup()


def _pool_and_directory(cfg, path: str, what: str, rank: int):
    """The aio section's I/O pool, and a directory of this rank and run's own under path."""
    aio = cfg.aio
    pool = ops.nvme_pool(thread_count=aio.thread_count, block_size=aio.block_size, queue_depth=aio.queue_depth)
    return pool, os.path.join(path, f"zkern-{what}-rank{rank}-{os.getpid()}-{secrets.token_hex(4)}")


def shard_from_config(cfg, rank: int, *, master_dtype: torch.dtype = torch.float32,
                      state_dtype: torch.dtype = torch.float32) -> NvmeShard:
    """The engine's NvmeShard under offload_optimizer.nvme_path (removed when the engine goes), its files in the
    master's and the moments' dtypes (RuntimeSpec's)."""
    zero, aio = cfg.zero_optimization, cfg.aio
    pool, directory = _pool_and_directory(cfg, zero.offload_optimizer_nvme_path, "optimizer", rank)
    if rank == 0 and (aio.single_submit, aio.overlap_events) != (False, True):
        log.info("zkern NVMe: aio.single_submit and aio.overlap_events choose libaio submission modes; zkern's reader "
                 "is a thread pool over pread/pwrite, where they change nothing")
    return NvmeShard(directory, pool, sub_group_size=zero.sub_group_size,
                     buffer_count=zero.offload_optimizer_buffer_count, remove=True, master_dtype=master_dtype,
                     state_dtype=state_dtype)


def params_from_config(cfg, rank: int, numel: int, dtype: torch.dtype, units: dict[int, tuple[int, int]]):
    """Stage 3's parameter file (offload_param.device "nvme") under offload_param.nvme_path."""
    from zkern.offload.nvme_params import NvmeParams

    zero = cfg.zero_optimization
    pool, directory = _pool_and_directory(cfg, zero.offload_param_nvme_path, "params", rank)
    return NvmeParams(directory, pool, numel, dtype, units, max_in_cpu=zero.offload_param_max_in_cpu,
                      buffer_count=zero.offload_param_buffer_count, buffer_size=zero.offload_param_buffer_size)


class NvmeAdam(ShardAdam):
    """ShardAdam whose fp32 master and moments live in an NvmeShard: each chunk's param is a slice of a region's
    meta stand-in; grad and out are real tensors (the host staging buffers of offload.HostStep)."""

    def __init__(self, groups: list[ShardGroup], options: list[dict], shard: NvmeShard, *,
                 rounding_seed: int | None = None):
        self.shard = shard
        super().__init__(groups, options, state_dtype=shard.dtypes["exp_avg"], rounding_seed=rounding_seed)
        self._spans = sorted((shard.locate(c.param) + (c.param.numel(), gi, ci))
                             for gi, g in enumerate(groups) for ci, c in enumerate(g.chunks))
        self._first = {(gi, ci): start for _, start, _, gi, ci in self._spans}  # chunk -> its first region element
        self.io_wait_s = 0.0  # seconds the last step waited for the disk
        self.compute_s = 0.0  # seconds the last step spent in the Adam kernel

    def _allocate_moments(self, groups: list[ShardGroup]) -> None:
        self.exp_avg, self.exp_avg_sq, self._views = [], [], {}  # on disk, beside the master

    def state_bytes(self) -> int:
        """Host bytes of the optimizer's states: none (they are on disk; the tile buffers are counted apart)."""
        return 0

    # -- per-piece states (checkpoints) -----------------------------------------------------------------------
    def piece_state(self, group: int, index: int) -> dict:
        """exp_avg and exp_avg_sq as the piece's meta slice (a checkpoint reads their values through
        self.shard by kind), and the step count."""
        piece = self.shard_groups[group].pieces[index]
        return {"exp_avg": piece, "exp_avg_sq": piece, "step": self.steps[group][index]}

    def set_piece_state(self, group: int, index: int, state: dict) -> None:
        piece = self.shard_groups[group].pieces[index]
        for name in ("exp_avg", "exp_avg_sq"):
            value = state.get(name) if state else None
            if value is not None and value.numel() != piece.numel():
                raise ValueError(f"optimizer state {name} for piece {index} of group {group} has "
                                 f"{value.numel()} elements, this engine's shard piece {piece.numel()}: the state "
                                 f"comes from another layout (world size, stage or bucket size)")
            self.shard.write(name, piece, value if value is not None else torch.zeros(piece.numel()))
        self.steps[group][index] = int(state["step"]) if state else 0

    def state_dict(self) -> dict:
        """torch's format, the states read from disk into host memory (the whole shard's: prefer
        engine.save_checkpoint, which streams them)."""
        for gi, g in enumerate(self.shard_groups):
            for i, piece in enumerate(g.pieces):
                self.state[piece] = {"step": torch.tensor(float(self.steps[gi][i])),
                                     **{name: self.shard.read(name, piece) for name in ("exp_avg", "exp_avg_sq")}}
        try:
            return torch.optim.Optimizer.state_dict(self)
        finally:
            self.state.clear()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's format (as state_dict returns it), written to disk."""
        load_piece_states(self, state_dict)

    # -- the step -----------------------------------------------------------------------------------------------
    def _tiles(self, runs: dict) -> list[tuple[Tile, list]]:
        """The tiles holding elements to step, in region order, each with its (group, chunk, lo, hi, step) work in
        chunk coordinates."""
        tile = self.shard.tile
        by_tile: dict[tuple[int, int], list] = {}
        for region, start, _, gi, ci in self._spans:
            for lo, hi, step in runs[(gi, ci)]:
                a = _round_down(start + lo, tile)
                while a < start + hi:
                    x, y = max(lo, a - start), min(hi, a + tile - start)
                    by_tile.setdefault((region, a), []).append((gi, ci, x, y, step))
                    a += tile
        out = []
        for region, a in sorted(by_tile):
            size = self.shard.regions[region].numel()
            end = min(a + tile, _round_up(size, self.shard.align))
            out.append((Tile(region, a, end), by_tile[(region, a)]))
        return out

    def _transfer(self, t: Tile, buffers: dict, write: bool) -> list:
        """Start reading (or writing) tile t of every state file into (from) one buffer set."""
        files = self.shard.files[t.region]
        n = t.end - t.start
        return [(files[name].write if write else files[name].read)(buffers[name][:n],
                                                                   self.shard.dtypes[name].itemsize * t.start,
                                                                   async_op=True)
                for name in STATES]

    def _wait(self, works: list) -> None:
        start = time.perf_counter()
        try:
            for w in works:
                w.wait()
        finally:
            self.io_wait_s += time.perf_counter() - start

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0, active: list[list[bool]] | None = None,
             before_chunk=None, after_chunk=None):
        """One step (ShardAdam.step's semantics), tile by tile through the files. before_chunk(g, c) runs before
        the first tile that touches chunk c of group g, after_chunk(g, c) once its last element has stepped."""
        if closure is not None:
            raise ValueError("NvmeAdam.step does not take a closure; zkern runs forward/backward itself")
        self.shard.check()  # before any tile changes: a replaced or truncated file refuses the step whole
        buffer_sets = self.shard.buffers()
        self.io_wait_s = self.compute_s = 0.0
        ons = [active[gi] if active is not None else [True] * len(g.pieces) for gi, g in enumerate(self.shard_groups)]
        runs = {(gi, ci): _runs(chunk, ons[gi], self.steps[gi])
                for gi, g in enumerate(self.shard_groups) for ci, chunk in enumerate(g.chunks)}
        tiles = self._tiles(runs)
        hooks = _ChunkHooks(self._spans, before_chunk, after_chunk)
        count = len(buffer_sets)
        reads: dict[int, list] = {}
        writes: dict[int, list] = {}
        try:
            for t in range(min(count - 1, len(tiles))):
                reads[t] = self._transfer(tiles[t][0], buffer_sets[t % count], write=False)
            for t, (tile, work) in enumerate(tiles):
                buffers = buffer_sets[t % count]
                hooks.begin_before(tile.region, tile.end)
                self._wait(reads.pop(t))
                self._step_tile(tile, buffers, work, grad_scale)
                writes[t] = self._transfer(tile, buffers, write=True)
                hooks.end_before(tile.region, tile.end)
                ahead = t + count - 1
                if ahead < len(tiles):
                    if t - 1 in writes:  # the buffers tile `ahead` reads into were last written from by tile t-1
                        self._wait(writes.pop(t - 1))
                    reads[ahead] = self._transfer(tiles[ahead][0], buffer_sets[ahead % count], write=False)
            for t in sorted(writes):
                self._wait(writes.pop(t))
        except BaseException:
            for works in (*reads.values(), *writes.values()):  # no transfer may outlive its buffers' use
                for w in works:
                    try:
                        w.wait()
                    except OSError:
                        pass
            raise
        hooks.finish()
        for gi, on in enumerate(ons):
            for i, is_on in enumerate(on):
                if is_on:
                    self.steps[gi][i] += 1
        return None

    def _step_tile(self, tile: Tile, buffers: dict, work: list, grad_scale: float) -> None:
        start = time.perf_counter()
        for gi, ci, lo, hi, step in work:
            chunk = self.shard_groups[gi].chunks[ci]
            o = self.param_groups[gi]
            first = self._first[(gi, ci)]
            x, y = first + lo - tile.start, first + hi - tile.start
            ops.adam_step_(buffers["master"][x:y], chunk.grad[lo:hi], buffers["exp_avg"][x:y],
                           buffers["exp_avg_sq"][x:y], step=step + 1,
                           param_out=None if chunk.out is None else chunk.out[lo:hi], lr=o["lr"],
                           betas=tuple(o["betas"]), eps=o["eps"], weight_decay=o["weight_decay"], adamw=o["adamw"],
                           grad_scale=grad_scale, **self.rounding(gi, step + 1, first + lo))
        self.compute_s += time.perf_counter() - start


class _ChunkHooks:
    """Calls before_chunk / after_chunk in region order as the tiles advance: a chunk begins before the first
    tile that reaches it and ends once a tile has passed its end; chunks no tile reached (nothing to step) begin
    and end at the finish."""

    def __init__(self, spans: list, before, after):
        self.spans = spans  # (region, start, numel, group, chunk), sorted
        self.before, self.after = before, after
        self.begun = 0  # spans[:begun] have begun
        self.ended = 0  # spans[:ended] have ended

    def begin_before(self, region: int, end: int) -> None:
        while self.begun < len(self.spans) and self.spans[self.begun][:2] < (region, end):
            _, _, _, gi, ci = self.spans[self.begun]
            if self.before is not None:
                self.before(gi, ci)
            self.begun += 1

    def end_before(self, region: int, end: int) -> None:
        while self.ended < self.begun:
            r, start, numel, gi, ci = self.spans[self.ended]
            if (r, start + numel) > (region, end):
                break
            if self.after is not None:
                self.after(gi, ci)
            self.ended += 1

    def finish(self) -> None:
        self.begin_before(1 << 62, 0)
        self.end_before(1 << 62, 0)
