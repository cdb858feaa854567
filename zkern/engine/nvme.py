"""ZeRO-Infinity's optimizer step from NVMe: the fp32 master and both Adam moments of this rank's shard live in
three files and stream through a few host tile buffers while the CPU Adam steps.

    python -m pytest tests/test_nvme.py -q

Layout: each shard chunk (optimizer.Chunk) owns one region in each of master.bin, exp_avg.bin, exp_avg_sq.bin,
starting at an ALIGN-aligned byte offset and padded to whole ALIGN blocks, so every tile transfer qualifies for
O_DIRECT. A step walks the tiles (`tile` elements, DeepSpeed's sub_group_size) of every chunk in order with
`buffer_count` >= 3 buffer sets: tile t+buffer_count-1 is read while tile t steps and tile t-1 is written, so
the disk and the CPU work at once. The arithmetic is ShardAdam's, call for call: the same runs of active pieces
(optimizer._runs), the same step counts, ops.adam_step_ on sub-ranges (the fused kernel is element-wise and
handles a range's tail with its vector code, so any split of a range gives the same bits).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from zkern import ops
from zkern.engine.optimizer import ShardGroup, _runs

STATES = ("master", "exp_avg", "exp_avg_sq")
ALIGN_ELEMENTS = 1024  # fp32 elements in 4096 bytes: O_DIRECT's alignment


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Tile:
    group: int
    chunk: int
    start: int  # first element, within the chunk
    end: int
    offset: int  # byte offset of the tile in each state file


class NvmeAdam:
    """ShardAdam's step with master and moments on disk (one directory per rank and run)."""

    def __init__(self, groups: list[ShardGroup], options: list[dict], directory: str, *, pool, tile: int,
                 buffer_count: int = 4):
        """groups: the shard groups (each chunk's param holds the initial master values, written to disk here;
        grad and out as ShardAdam reads and writes them). options: per group lr, betas, eps, weight_decay,
        adamw. tile: elements per transfer (rounded up to whole 4 KiB blocks)."""
        if buffer_count < 3:
            raise ValueError(f"offload_optimizer.buffer_count must be >= 3 for the NVMe pipeline (a tile read "
                             f"ahead, one stepping, one written behind), got {buffer_count}")
        if tile < 1:
            raise ValueError(f"sub_group_size must be >= 1 element, got {tile}")
        self.groups, self.options = groups, options
        self.directory = os.fspath(directory)
        self.tile = _round_up(tile, ALIGN_ELEMENTS)
        self.steps = [[0] * len(g.pieces) for g in groups]
        self.offsets: list[list[int]] = []  # per group, per chunk: byte offset of its region
        self.tiles: list[Tile] = []
        offset = 0
        for gi, g in enumerate(groups):
            starts = []
            for ci, c in enumerate(g.chunks):
                starts.append(offset)
                n = c.param.numel()
                for a in range(0, n, self.tile):
                    self.tiles.append(Tile(gi, ci, a, min(a + self.tile, n), offset + 4 * a))
                offset += 4 * _round_up(n, ALIGN_ELEMENTS)
            self.offsets.append(starts)
        self.nbytes = offset
        try:
            os.makedirs(self.directory, exist_ok=True)
        except OSError as e:
            raise OSError(e.errno, f"zkern NVMe: cannot create the optimizer directory {self.directory}: "
                                   f"{e.strerror}", self.directory) from None
        self.files = {name: ops.nvme_file(os.path.join(self.directory, f"{name}.bin"), self.nbytes, pool)
                      for name in STATES}  # reserved whole now: a full disk fails here, not inside a step
        self.buffers = [{name: ops.aligned_empty(self.tile, torch.float32) for name in STATES}
                        for _ in range(buffer_count)]
        for gi, g in enumerate(groups):  # the initial masters (moments start as the files' zeros)
            for ci, c in enumerate(g.chunks):
                self.write_state("master", gi, ci, c.param.detach().reshape(-1))
        self.io_wait_s = 0.0  # seconds the last step waited for the disk
        self.compute_s = 0.0  # seconds the last step spent in the Adam kernel

    @property
    def io_path(self) -> str:
        return self.files["master"].io_path

    def state_bytes(self) -> dict[str, int]:
        """Bytes on disk and in host tile buffers."""
        return {"nvme": len(STATES) * self.nbytes,
                "buffers": sum(t.numel() * t.element_size() for b in self.buffers for t in b.values())}

    # -- whole states (checkpoints, full_state_dict, tests) -----------------------------------------------------
    def read_state(self, name: str, group: int, chunk: int) -> torch.Tensor:
        """One chunk of a state, read whole into a fresh host tensor."""
        n = self.groups[group].chunks[chunk].param.numel()
        out = ops.aligned_empty(_round_up(n, ALIGN_ELEMENTS), torch.float32)
        self.files[name].read(out, self.offsets[group][chunk])
        return out[:n].clone()

    def write_state(self, name: str, group: int, chunk: int, values: torch.Tensor) -> None:
        n = values.numel()
        staged = ops.aligned_empty(_round_up(n, ALIGN_ELEMENTS), torch.float32)
        staged[n:].zero_()
        staged[:n].copy_(values)
        self.files[name].write(staged, self.offsets[group][chunk])

    # -- the step -----------------------------------------------------------------------------------------------
    def _transfer(self, t: Tile, buffers: dict, write: bool) -> list:
        """Start reading (or writing) tile t of every state file into (from) one buffer set, whole 4 KiB blocks."""
        size = _round_up(t.end - t.start, ALIGN_ELEMENTS)
        return [(self.files[name].write if write else self.files[name].read)(buffers[name][:size], t.offset,
                                                                               async_op=True) for name in STATES]

    def _wait(self, works: list) -> None:
        start = time.perf_counter()
        try:
            for w in works:
                w.wait()
        finally:
            self.io_wait_s += time.perf_counter() - start

    @torch.no_grad()
    def step(self, *, grad_scale: float = 1.0, active: list[list[bool]] | None = None) -> None:
        """One Adam step over every chunk (ShardAdam.step's semantics), tile by tile through the files."""
        for f in self.files.values():  # before any tile changes: a step is applied whole or not at all
            f.check()
        self.io_wait_s = self.compute_s = 0.0
        ons = [active[gi] if active is not None else [True] * len(g.pieces) for gi, g in enumerate(self.groups)]
        runs = {(gi, ci): _runs(chunk, ons[gi], self.steps[gi])
                for gi, g in enumerate(self.groups) for ci, chunk in enumerate(g.chunks)}
        count = len(self.buffers)
        reads: dict[int, list] = {}
        writes: dict[int, list] = {}
        try:
            for t in range(min(count - 1, len(self.tiles))):
                reads[t] = self._transfer(self.tiles[t], self.buffers[t % count], write=False)
            for t, tile in enumerate(self.tiles):
                buffers = self.buffers[t % count]
                self._wait(reads.pop(t))
                self._step_tile(tile, buffers, runs[(tile.group, tile.chunk)], grad_scale)
                writes[t] = self._transfer(tile, buffers, write=True)
                ahead = t + count - 1
                if ahead < len(self.tiles):
                    if t - 1 in writes:  # the buffers tile `ahead` reads into were last written from by tile t-1
                        self._wait(writes.pop(t - 1))
                    reads[ahead] = self._transfer(self.tiles[ahead], self.buffers[ahead % count], write=False)
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
        for gi, on in enumerate(ons):
            for i, is_on in enumerate(on):
                if is_on:
                    self.steps[gi][i] += 1

    def _step_tile(self, tile: Tile, buffers: dict, runs: list, grad_scale: float) -> None:
        start = time.perf_counter()
        chunk = self.groups[tile.group].chunks[tile.chunk]
        o = self.options[tile.group]
        hyper = dict(lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], weight_decay=o["weight_decay"],
                     adamw=o["adamw"], grad_scale=grad_scale)
        for lo, hi, step in runs:
            a, b = max(lo, tile.start), min(hi, tile.end)
            if a >= b:
                continue
            x, y = a - tile.start, b - tile.start
            ops.adam_step_(buffers["master"][x:y], chunk.grad[a:b], buffers["exp_avg"][x:y],
                           buffers["exp_avg_sq"][x:y], step=step + 1,
                           param_out=None if chunk.out is None else chunk.out[a:b], **hyper)
        self.compute_s += time.perf_counter() - start
