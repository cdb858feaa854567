"""zkern.GatheredParameters: stage-3 parameters whole on every rank for the length of a `with` block.

    with zkern.GatheredParameters(model.head.weight, modifier_rank=0):
        if engine.rank == 0:
            model.head.weight.normal_(std=0.02)     # rank 0's change reaches every rank's shard and fp32 master

DeepSpeed's context manager, with its semantics: `params` is one parameter or an iterable of them, the same on
every rank (entering is a collective); inside, they are whole on every rank; with `modifier_rank`, that rank's
values are broadcast on exit and written into every rank's shard of the working copy and of the fp32 master
weights, so the next forward and the next optimizer step start from them (the optimizer's moments are kept);
without it, changes are discarded. Contexts nest. Parameters of a stage 0-2 engine, or of no engine, are left
alone (a no-op). Parameters built under zkern.init_sharded and not yet given to an engine are gathered the same
way. `fwd_module`, as in DeepSpeed, declares that module as a reader of the parameters
(zkern.register_external_parameter).
"""

from __future__ import annotations

import torch

from zkern.core.owners import owner_of
from zkern.stage3.sharded_init import is_sharded, sharder_of
from zkern.stage3.units import register_external_parameter


class GatheredParameters:
    def __init__(self, params, modifier_rank: int | None = None, fwd_module: torch.nn.Module | None = None,
                 enabled: bool = True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = list(params) if params is not None else []
        if not all(isinstance(p, torch.Tensor) for p in self.params):
            bad = next(type(p).__name__ for p in self.params if not isinstance(p, torch.Tensor))
            raise TypeError(f"GatheredParameters takes parameters (a tensor or an iterable of them), got a {bad}")
        if modifier_rank is not None and (not isinstance(modifier_rank, int) or modifier_rank < 0):
            raise ValueError(f"GatheredParameters: modifier_rank must be a rank number or None, got {modifier_rank!r}")
        self.modifier_rank, self.fwd_module, self.enabled = modifier_rank, fwd_module, enabled
        self._held: list[tuple[object, list]] = []
        self._built: list[tuple[torch.nn.Parameter, object]] = []  # init_sharded parameters and their sharder

    def __enter__(self):
        if not self.enabled:
            return self
        unique = list({id(p): p for p in self.params}.values())
        by_runtime: dict[int, tuple[object, list]] = {}
        for p in unique:
            runtime = owner_of(p)
            if runtime is not None:
                by_runtime.setdefault(id(runtime), (runtime, []))[1].append(p)
            elif is_sharded(p):
                self._built.append((p, sharder_of(p)))
        try:
            for runtime, params in by_runtime.values():
                self._held.append((runtime, runtime.pin(params, self.modifier_rank)))
            for p, sharder in self._built:
                sharder.materialize(p)
        except BaseException:
            self._release(write=False)
            raise
        if self.fwd_module is not None:
            for p in unique:
                register_external_parameter(self.fwd_module, p)
                runtime = owner_of(p)
                if runtime is not None:
                    runtime.add_external_reader(self.fwd_module, p)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.enabled:
            self._release(write=exc_type is None and self.modifier_rank is not None)

    def _release(self, write: bool) -> None:
        held, built = self._held, self._built
        self._held, self._built = [], []
        for runtime, units in held:
            runtime.unpin(units, self.modifier_rank if write else None)
        for p, sharder in built:
            if not is_sharded(p):  # whole now (materialize ran)
                sharder.shard(p, src=self.modifier_rank if write else None)
