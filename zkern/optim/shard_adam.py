"""Optimizers over a rank's shard: zkern's fused Adam, or any torch optimizer, stepping shard pieces.

    python -m pytest tests/test_optimizer.py -q

A rank's shard is cut into pieces, one per parameter part it owns (partition.Piece). The pieces are what a
torch optimizer sees as its params: fp32 tensors (views into the master shard in mixed precision, into the
flat parameter buffer in fp32), whole-shaped where a piece is a whole parameter, 1-D otherwise. This gives
torch's exact semantics per parameter, including a parameter that got no gradient this step (its piece gets
grad None and is skipped, its step count unchanged), and lets LR schedulers drive param_groups as usual.

ShardAdam keeps exp_avg/exp_avg_sq as two flat shard-sized buffers and steps each bucket chunk in ONE fused
ops.adam_step_ call when all its pieces are active with equal step counts (the common case), else per run of
such pieces. Loss-scale unscaling, clipping and the 1/world average arrive folded into one grad_scale.

The moments are fp32, or bf16 (bf16.bf16_optimizer_states: 4 bytes per element instead of 8), and the master
they step may be bf16 (bf16_master_weights_and_grads); bf16 values are stored rounded to nearest even, or
stochastically (bf16_stochastic_rounding) with random bits hashed from (this rank, group, step, element), so a
run is reproducible and the bits do not depend on how a chunk is split into calls.
"""

from __future__ import annotations

import torch

from zkern import ops
from zkern.core.buffers import aligned_zeros
from zkern.core.partition import ALIGN
from zkern.core.shard_groups import Chunk, ShardGroup
from zkern.optim.piece_states import PieceStates
from zkern.reference import call_seed


class ShardAdam(PieceStates, torch.optim.Optimizer):
    """Adam/AdamW over flat shard chunks, with torch.optim.AdamW's per-parameter semantics."""

    def __init__(self, groups: list[ShardGroup], options: list[dict], *, state_dtype: torch.dtype = torch.float32,
                 rounding_seed: int | None = None):
        """state_dtype: the moments' dtype (fp32 or bf16). rounding_seed: bf16 state rounds stochastically with
        bits derived from it (give each rank its own), else (None) to nearest even."""
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise TypeError(f"ShardAdam keeps its moments in float32 or bfloat16, got {state_dtype}")
        param_groups = [{"params": g.pieces, **o} for g, o in zip(groups, options)]
        super().__init__(param_groups, {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                                        "adamw": True})
        self.shard_groups = groups
        self.state_dtype, self.rounding_seed = state_dtype, rounding_seed
        # Per-piece step counts as Python ints: reading a device tensor here would sync the host every step.
        self.steps = [[0] * len(g.pieces) for g in groups]
        self._allocate_moments(groups)
        self.saves: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # keep_saves(): per group

    def keep_saves(self) -> None:
        """Allocate per group a master and two moments laid out like the moments, which a step(save=True) fills with
        the values before it (offload/speculative.py's rollback). 12 host bytes an element with fp32 state, 6 with
        bf16 master and moments."""
        if any(len(b) > 1 for b in self._buffers):
            raise ValueError("ShardAdam.keep_saves: the speculative step's saves need each group's moments in one "
                             "place (partial offload refuses it)")
        self.saves = [(torch.zeros(m.numel(), dtype=g.chunks[0].param.dtype if g.chunks else torch.float32),
                       torch.zeros_like(m), torch.zeros_like(v))
                      for g, m, v in zip(self.shard_groups, self.exp_avg, self.exp_avg_sq)]

    def restore(self, gi: int, ci: int) -> None:
        """Chunk ci of group gi back to its values before the step(save=True, advance=False) that stepped it (every
        piece active, as that step took them; the step counts have not moved since)."""
        chunk, s = self.shard_groups[gi].chunks[ci], self._start[gi][ci]
        master, exp_avg, exp_avg_sq = self.saves[gi]
        for lo, hi, _ in _runs(chunk, [True] * len(self.shard_groups[gi].pieces), self.steps[gi]):
            chunk.param[lo:hi].copy_(master[s + lo:s + hi])
            self.exp_avg[gi][s + lo:s + hi].copy_(exp_avg[s + lo:s + hi])
            self.exp_avg_sq[gi][s + lo:s + hi].copy_(exp_avg_sq[s + lo:s + hi])

    def _allocate_moments(self, groups: list[ShardGroup]) -> None:
        # Each group's moments cover its own chunks only, back to back: at stage 3 every group's chunks lie in
        # one shard shared with the other groups and the frozen parameters, and a shard-sized buffer per group
        # would cost 8 bytes per element of the whole shard for every group. Chunks on other devices (partial
        # offload: some on the device, the rest on the host) get buffers on their own device, each back to back.
        self._start = []  # per group, per chunk: its first moment element in its device's buffers
        self._buffers: list[dict[torch.device, tuple[torch.Tensor, torch.Tensor]]] = []  # per group, per device
        self._chunk_buffers: list[list[tuple[torch.Tensor, torch.Tensor]]] = []  # per group, per chunk
        for g in groups:
            by_device: dict[torch.device, list[int]] = {}
            for ci, chunk in enumerate(g.chunks):
                by_device.setdefault(chunk.param.device, []).append(ci)
            starts, buffers = [0] * len(g.chunks), {}
            for device, indices in (by_device or {torch.device("cpu"): []}).items():
                sub = _compact_starts([g.chunks[i] for i in indices])
                size = sub[-1] + g.chunks[indices[-1]].param.numel() if indices else 0
                buffers[device] = (aligned_zeros(size, self.state_dtype, device),
                                   aligned_zeros(size, self.state_dtype, device))
                for ci, start in zip(indices, sub):
                    starts[ci] = start
            self._start.append(starts)
            self._buffers.append(buffers)
            self._chunk_buffers.append([buffers[chunk.param.device] for chunk in g.chunks])
        # the group's buffers on its first chunk's device (its only ones but under partial offload)
        self.exp_avg = [b[_device(g)][0] for b, g in zip(self._buffers, groups)]
        self.exp_avg_sq = [b[_device(g)][1] for b, g in zip(self._buffers, groups)]
        # Per-piece state as views into the flat buffers, shaped like the piece (as torch's AdamW keeps it).
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for gi, g in enumerate(groups):
            for ci, chunk in enumerate(g.chunks):
                exp_avg, exp_avg_sq = self._chunk_buffers[gi][ci]
                for index, start, numel in chunk.pieces:
                    lo, piece = self._start[gi][ci] + start, g.pieces[index]
                    views = (exp_avg[lo:lo + numel].view(piece.shape), exp_avg_sq[lo:lo + numel].view(piece.shape))
                    self._views[id(piece)] = views
                    self.state[piece] = {"exp_avg": views[0], "exp_avg_sq": views[1]}

    def piece_state(self, group: int, index: int) -> dict:
        """The state of piece `index` of group `group`: exp_avg and exp_avg_sq (live views) and its step count."""
        exp_avg, exp_avg_sq = self._views[id(self.shard_groups[group].pieces[index])]
        return {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "step": self.steps[group][index]}

    def set_piece_state(self, group: int, index: int, state: dict) -> None:
        """Set a piece's state from {exp_avg, exp_avg_sq, step} (any shape with the piece's numel), or reset it
        (an empty state: the piece never stepped)."""
        exp_avg, exp_avg_sq = self._views[id(self.shard_groups[group].pieces[index])]
        if state:
            if state["exp_avg"].numel() != exp_avg.numel():
                raise ValueError(f"optimizer state for piece {index} of group {group} has "
                                 f"{state['exp_avg'].numel()} elements, this engine's shard piece "
                                 f"{exp_avg.numel()}: the state comes from another layout (world size, stage or "
                                 f"bucket size)")
            exp_avg.reshape(-1).copy_(state["exp_avg"].reshape(-1))
            exp_avg_sq.reshape(-1).copy_(state["exp_avg_sq"].reshape(-1))
            self.steps[group][index] = int(state["step"])
        else:
            exp_avg.zero_()
            exp_avg_sq.zero_()
            self.steps[group][index] = 0

    def reset_state(self) -> None:
        """Every piece as if it never stepped: zero moments, step counts 0."""
        for gi, g in enumerate(self.shard_groups):
            if self.exp_avg:  # the flat buffers at once (NvmeAdam keeps them on disk: piece by piece there)
                for exp_avg, exp_avg_sq in self._buffers[gi].values():
                    exp_avg.zero_()
                    exp_avg_sq.zero_()
                self.steps[gi] = [0] * len(g.pieces)
            else:
                for i in range(len(g.pieces)):
                    self.set_piece_state(gi, i, {})

    def rounding(self, group: int, step: int, offset: int) -> dict:
        """ops.adam_step_'s stochastic-rounding arguments for a call at element `offset` of the master's storage
        (nothing when the state rounds to nearest)."""
        if self.rounding_seed is None:
            return {}
        return {"sr_seed": call_seed(self.rounding_seed, group, step), "sr_offset": offset}

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self._buffers for pair in b.values() for t in pair)

    def state_dict(self) -> dict:
        """torch's format: per piece 'step', 'exp_avg', 'exp_avg_sq' (this rank's shard pieces)."""
        for gi, g in enumerate(self.shard_groups):
            for i, piece in enumerate(g.pieces):
                self.state[piece]["step"] = torch.tensor(float(self.steps[gi][i]))
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into zkern's flat buffers. torch's loader replaces the state tensors, which would leave the fused
        step reading the old buffers; here the loaded values are copied into them and the views kept."""
        super().load_state_dict(state_dict)
        for gi, g in enumerate(self.shard_groups):
            for i, piece in enumerate(g.pieces):
                loaded = self.state[piece]
                exp_avg, exp_avg_sq = self._views[id(piece)]
                if loaded:
                    if loaded["exp_avg"].shape != exp_avg.shape:
                        raise ValueError(f"optimizer state for piece {i} of group {gi} has shape "
                                         f"{tuple(loaded['exp_avg'].shape)}, this engine's shard piece "
                                         f"{tuple(exp_avg.shape)}: the state comes from another layout (world "
                                         f"size, stage or bucket size)")
                    exp_avg.copy_(loaded["exp_avg"])
                    exp_avg_sq.copy_(loaded["exp_avg_sq"])
                    self.steps[gi][i] = int(loaded["step"])
                else:
                    exp_avg.zero_()
                    exp_avg_sq.zero_()
                    self.steps[gi][i] = 0
                self.state[piece] = {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0, active: list[list[bool]] | None = None,
             before_chunk=None, after_chunk=None, options: list[dict] | None = None,
             order: list[tuple[int, int]] | None = None, save: bool = False, advance: bool = True,
             threads: int | None = None):
        """One step; active[g][i] says whether piece i of group g got a gradient (default: all did).

        before_chunk(g, c) / after_chunk(g, c): called around chunk c of group g (the offload pipeline waits
        for that chunk's gradient and sends its parameters back there). options: each group's hyper-parameters
        as param_groups held them when the step was decided (a step run in the background must not see the LR
        schedule move them after); default param_groups now. order: the (group, chunk) pairs in the order to step
        them, each chunk at most once (default: every chunk, group by group); each chunk's arithmetic is its own, so
        the order changes only when each is done. save: the stepped elements' values before the step go to the
        saves (keep_saves). advance=False leaves the step counts where they are: a speculative step's chunks, whose
        counts move with the step that keeps them. threads: the CPU Adam's (an Adam beside the training thread
        takes a share of them; default all)."""
        if closure is not None:
            raise ValueError("ShardAdam.step does not take a closure; zkern runs forward/backward itself")
        groups = options or self.param_groups
        on = [active[gi] if active is not None else [True] * len(g.pieces) for gi, g in enumerate(self.shard_groups)]
        hyper = [dict(lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], weight_decay=o["weight_decay"],
                      adamw=o["adamw"], grad_scale=grad_scale) for o in groups]
        if order is None:
            order = [(gi, ci) for gi, g in enumerate(self.shard_groups) for ci in range(len(g.chunks))]
        for gi, ci in order:
            chunk = self.shard_groups[gi].chunks[ci]
            if before_chunk is not None:
                before_chunk(gi, ci)
            for lo, hi, step in _runs(chunk, on[gi], self.steps[gi]):
                s = self._start[gi][ci]
                out = None if chunk.out is None else chunk.out[lo:hi]
                # the working copy may rest elsewhere (stage 3's offload_param without offload_optimizer: on the
                # host): written on the master's device, then copied over
                away = out is not None and out.device != chunk.param.device
                saved = tuple(t[s + lo:s + hi] for t in self.saves[gi]) if save else None
                exp_avg, exp_avg_sq = self._chunk_buffers[gi][ci]
                ops.adam_step_(chunk.param[lo:hi], chunk.grad[lo:hi], exp_avg[s + lo:s + hi],
                               exp_avg_sq[s + lo:s + hi], step=step + 1,
                               param_out=None if away else out, **hyper[gi],
                               **self.rounding(gi, step + 1, chunk.param.storage_offset() + lo), save=saved,
                               threads=threads)
                if away:
                    out.copy_(chunk.param[lo:hi])  # the same rounding the fused copy-out does
            if after_chunk is not None:
                after_chunk(gi, ci)
        self.advance(on if advance else [])
        return None

    def advance(self, active: list[list[bool]]) -> None:
        """The step counts of the active pieces move on by one: a step's end, once every chunk has read them."""
        for steps, flags in zip(self.steps, active):
            for i, is_on in enumerate(flags):
                if is_on:
                    steps[i] += 1
        return None


def _compact_starts(chunks: list[Chunk]) -> list[int]:
    """Each chunk's first element in the group's moment buffers: back to back, except that a chunk's moments start
    at the same offset modulo ALIGN as its master does in the shard (a stage-3 group's chunk may start inside a
    unit), so the master, gradient, copy and moments of one step call share their phase of 16 bytes and a GPU
    kernel moves all of them with 128-bit accesses after one short head. Stage 1-2 chunks are whole aligned
    chunks: there the moments mirror the shard exactly."""
    starts, total = [], 0
    for chunk in chunks:
        total += (chunk.param.storage_offset() - total) % ALIGN
        starts.append(total)
        total += chunk.param.numel()
    return starts


def _runs(chunk: Chunk, active: list[bool], steps: list[int]) -> list[tuple[int, int, int]]:
    """(start, end, step) ranges of the chunk to step in one call each.

    All pieces active with one step count: the whole chunk, padding included (zero gradient, zero parameter:
    Adam leaves it zero), in one call. Otherwise maximal runs of adjacent active pieces with equal step counts.
    """
    if not chunk.pieces:
        return []
    first_step = steps[chunk.pieces[0][0]]
    if all(active[i] and steps[i] == first_step for i, _, _ in chunk.pieces):
        return [(0, chunk.param.numel(), first_step)]
    runs: list[list[int]] = []
    for index, start, numel in chunk.pieces:
        if not active[index]:
            continue
        if runs and runs[-1][1] == start and runs[-1][2] == steps[index]:
            runs[-1][1] = start + numel
        else:
            runs.append([start, start + numel, steps[index]])
    return [tuple(r) for r in runs]


def _device(g: ShardGroup) -> torch.device:
    return g.chunks[0].param.device if g.chunks else torch.device("cpu")


def step_torch_optimizer(optimizer: torch.optim.Optimizer, groups: list[ShardGroup], *, grad_scale: float,
                         active: list[list[bool]]) -> None:
    """Step a torch optimizer whose params are the pieces: give active pieces fp32 gradients, step, refresh.

    The general path (any element-wise torch optimizer); a chunk's gradient is upcast and scaled into one
    temporary fp32 buffer when it is not already fp32 with scale 1. An optimizer that steps shard groups itself
    (Muon's step_shard: each piece upcast as it is used, states maybe in files) is handed them instead.
    """
    step_shard = getattr(optimizer, "step_shard", None)
    if step_shard is not None:
        step_shard(groups, grad_scale=grad_scale, active=active)
        return
    for gi, g in enumerate(groups):
        for chunk in g.chunks:
            grad = chunk.grad
            if grad.dtype != torch.float32 or grad_scale != 1.0:
                grad = grad.float() * grad_scale
            for index, start, numel in chunk.pieces:
                piece = g.pieces[index]
                piece.grad = grad[start:start + numel].view(piece.shape) if active[gi][index] else None
    optimizer.step()
    for g in groups:
        for piece in g.pieces:
            piece.grad = None
        for chunk in g.chunks:
            if chunk.out is not None:
                chunk.out.copy_(chunk.param)
