"""The planted bugs of stage 3 (planted.py's catalogue names them): its gathers (where a chunk is read, what it is
cast from), its reductions, its persistent units after a step, the views of a unit a module hands out. Each takes
planted.py's patch set and patches module attributes through it.
"""

from __future__ import annotations

import torch


def shard_offset(p) -> None:
    """Stage 3 gathers a unit from its shard one element off."""
    from zkern.stage3.sources import UnitSources

    def make(original):
        def own_chunk(self, u, buffer):
            own = original(self, u, buffer)
            return torch.roll(own, 1) if own.numel() > 1 else own
        return own_chunk
    p.wrap(UnitSources, "own_chunk", make)


def gather_source_cached(p) -> None:
    """Stage 3 gathers each unit's chunk as its first gather read it (its cast from the master kept), never the
    stepped values."""
    from zkern.stage3.sources import UnitSources

    kept: dict[tuple[int, int], torch.Tensor] = {}

    def make(original):
        def own_chunk(self, u, buffer):
            own = original(self, u, buffer)
            first = kept.setdefault((id(self), u.index), own.detach().clone())
            slot = buffer[self.comm.rank * u.bucket.chunk:(self.comm.rank + 1) * u.bucket.chunk]
            return slot.copy_(first)
        return own_chunk
    p.wrap(UnitSources, "own_chunk", make)


def first_unit_grads_dropped(p) -> None:
    """Stage 3: the gradients of the first unit's parameters never reach its reduce buffer."""
    from zkern.stage3.reduce import GradReducer

    def make(original):
        def scatter_into(self, g, u, param, grad, add):
            if u.index == min(x.index for x in self.units if x.trainable):
                grad = torch.zeros_like(grad)
            return original(self, g, u, param, grad, add)
        return scatter_into
    p.wrap(GradReducer, "_scatter_into", make)


def stale_after_step(p) -> None:
    """Stage 3: the persistent units are not gathered again after the step (their copies go stale)."""
    from zkern.stage3.gatherer import Gatherer

    def after_step(self):
        self.version += 1
        for u in self.units:
            if u.persistent:
                u.version = self.version  # claims fresh, keeps the old values
    p.set(Gatherer, "after_step", after_step)


def views_freed(p) -> None:
    """Stage 3 frees a unit's storage at rest even where a view of it left a module's call (escapes.py undone)."""
    from zkern.stage3 import hooks

    p.set(hooks, "alias_parameters", lambda output, units: output)
    p.set(hooks, "mark_escaped", lambda output, module, units: [])
