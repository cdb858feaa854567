"""Muon with its states on NVMe (offload_optimizer.device "nvme"): ShardMuon whose fp32 master and AdamW moments
live in an NvmeShard's files, as NvmeAdam's do.

    python -m pytest tests/offload/test_nvme_muon.py -q

A Muon piece has no Adam moments, so its momentum takes the first moment's file (exp_avg-<i>.bin, the same elements;
the second moment's file stays zero there). With zero_optimization.save_muon_momentum_buffer_in_memory (DeepSpeed's
key, default false) the momentum stays in host memory instead, and only the master goes to and from the disk for a
Muon piece.

The step is ShardMuon's, matrix by matrix (its module docstring): a Muon matrix's pieces are read (momentum, then
the master), stepped, and written back before the next matrix, so the host holds one matrix's values (one assembly
bucket's for the matrices that span ranks) at a time, never the shard. An AdamW piece reads and writes its master and
both moments. Each piece's new master goes into the chunk's staging out as it is written, so nothing reads the
master file again to send the parameters up. Reads and writes go through NvmeShard.read / write, whole pieces at a
time (no tile pipeline: a matrix must be whole before any of it steps). The files are checked before anything is
read, so a replaced or truncated file refuses the step whole.
"""

from __future__ import annotations

import torch

from zkern.core.shard_groups import ShardGroup
from zkern.offload.nvme import NvmeShard
from zkern.optim.muon import ShardMuon
from zkern.optim.piece_states import PieceStates, load_piece_states

MOMENTUM = "momentum_buffer"


class NvmeMuon(PieceStates, ShardMuon):
    """ShardMuon over pieces that are slices of an NvmeShard's meta stand-ins (module docstring)."""

    def __init__(self, groups: list[dict], shard: NvmeShard, *, momentum_in_memory: bool,
                 device: torch.device | None = None):
        super().__init__(groups, device=device)
        self.shard, self.momentum_in_memory = shard, momentum_in_memory

    def _on_disk(self, name: str) -> bool:
        """Whether state `name` lives in the files (NvmeShard.FILE_OF puts the momentum in the exp_avg file) rather
        than in host memory."""
        return not (name == MOMENTUM and self.momentum_in_memory)

    def _load(self, p: torch.Tensor, name: str) -> torch.Tensor:
        if not self._on_disk(name):
            state = self.state[p]
            if name not in state:
                state[name] = torch.zeros(p.shape, dtype=torch.float32)
            return state[name]
        return self.shard.read(name, p)

    def _store(self, gi: int, k: int, p: torch.Tensor, name: str, values: torch.Tensor) -> None:
        if not self._on_disk(name):
            return
        self.shard.write(name, p, values)
        if name == "master" and self._bound is not None and (gi, k) in self._bound[1]:
            self._bound[1][(gi, k)].copy_(values.reshape(-1))

    @torch.no_grad()
    def step_shard(self, groups: list[ShardGroup], *, grad_scale: float, active: list[list[bool]]) -> None:
        self.shard.check()  # before any piece changes: a replaced or truncated file refuses the step whole
        super().step_shard(groups, grad_scale=grad_scale, active=active)

    def step(self, closure=None):
        if self._bound is None:
            raise ValueError("NvmeMuon steps through step_shard: its pieces are stand-ins of values in files, and "
                             "carry no .grad")
        return super().step(closure)

    def _refresh_outs(self, groups: list[ShardGroup]) -> None:
        """Nothing: each stepped piece's new values went into its out as they were written (_store)."""

    # -- per-piece states (checkpoints, the state registry) ---------------------------------------------------
    def _names(self, group: int) -> tuple[str, ...]:
        return (MOMENTUM,) if self.param_groups[group].get("use_muon") else ("exp_avg", "exp_avg_sq")

    def piece_state(self, group: int, index: int) -> dict:
        """A Muon piece's momentum, an AdamW piece's moments and step count: tensors in memory, or the piece's meta
        slice where the values are in a file (a reader takes them through the store by name)."""
        p = self.param_groups[group]["params"][index]
        state = dict(self.state.get(p, {}))
        if self.param_groups[group].get("use_muon"):
            if self._on_disk(MOMENTUM):
                state[MOMENTUM] = p
        elif "step" in state:
            state.update(exp_avg=p, exp_avg_sq=p)
        return state

    def set_piece_state(self, group: int, index: int, state: dict) -> None:
        """A piece's state from piece_state's names (values of any shape with the piece's numel), or reset (an empty
        state: the piece never stepped)."""
        p = self.param_groups[group]["params"][index]
        kept = {}
        for name in self._names(group):
            value = state.get(name) if state else None
            if value is not None and value.numel() != p.numel():
                raise ValueError(f"optimizer state {name} for piece {index} of group {group} has {value.numel()} "
                                 f"elements, this engine's shard piece {p.numel()}: the state comes from another "
                                 f"layout (world size, stage or bucket size)")
            if self._on_disk(name):
                self.shard.write(name, p, value if value is not None else torch.zeros(p.numel()))
            elif value is not None:
                kept[name] = value.detach().reshape(p.shape).to(torch.float32, copy=True)
        if state and "step" in state and not self.param_groups[group].get("use_muon"):
            kept["step"] = torch.tensor(float(state["step"]))
        if kept:
            self.state[p] = kept
        else:
            self.state.pop(p, None)

    def reset_state(self) -> None:
        for gi, g in enumerate(self.param_groups):
            for k in range(len(g["params"])):
                self.set_piece_state(gi, k, {})

    def state_bytes(self) -> int:
        """Host bytes of the states kept in memory (the momentum, with save_muon_momentum_buffer_in_memory)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor) and t.dim() > 0)

    def state_dict(self) -> dict:
        """torch's format, the states read from disk into host memory (the whole shard's: prefer
        engine.save_checkpoint, which streams them)."""
        kept = {p: dict(s) for p, s in self.state.items()}
        try:
            for gi, g in enumerate(self.param_groups):
                for k, p in enumerate(g["params"]):
                    # piece_state names a value in a file by the piece itself
                    state = {name: self.shard.read(name, p) if v is p else v
                             for name, v in self.piece_state(gi, k).items()}
                    if state:
                        self.state[p] = state
            return torch.optim.Optimizer.state_dict(self)
        finally:
            self.state.clear()
            self.state.update(kept)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's format (as state_dict returns it), written to disk."""
        load_piece_states(self, state_dict)
