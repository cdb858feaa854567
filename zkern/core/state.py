"""The engine's training state in one registry: every stateful piece says what kind of state it is, how it returns
to a fresh engine's value, what it looks like (for tests and the differential fuzzer), and which tensors it owns.

    python -m pytest tests/core/test_state.py -q

A load, whatever its flags and whenever it comes (mid-accumulation included), first resets every component the
checkpoint will not restore, then writes what it restores: the engine ends exactly as a fresh engine loaded from
the same checkpoint. The kinds, and the load that restores each:

  weights       masters, working copies, frozen and int8-resting parameters, buffers   every load
  optimizer     moments and step counts, param-group hyper-parameters, LoCo's errors    load_optimizer_states
  lr_scheduler  the scheduler's counters                                               load_lr_scheduler_states
  training      loss scaler, step counters, data-loader epoch, per-rank generators      unless load_module_only
  transient     gradients accumulated since the last step, the micro-step count        never: always reset
  derived       copies made from the weights (hpZ's secondary slices, the offload staging copy,
                gathered stage-3 units): brought up to date by the load, never saved
  scratch       working memory with no value between steps (bucket buffers, tile buffers)         nothing to keep

The registry also names every tensor each component owns, so a test can walk the engine's objects and fail on a
tensor no component claims: new state cannot arrive without saying how it is saved, restored and reset.

A component that is not a range of the model's tensors (counters, loss scaler, LR scheduler, data-loader epoch,
generators) has a saved form: plain JSON data the checkpoint writes under its name (`save`), checks on every rank
before a load changes anything (`check`) and gives back (`restore`). Registering one is all it takes for checkpoints
to save, verify and restore it (zkern/checkpoint/ walks the registry and knows no component by name).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

KINDS = ("weights", "optimizer", "lr_scheduler", "training", "transient", "derived", "scratch")


def _nothing() -> list:
    return []


@dataclass
class Component:
    """One stateful piece. reset(): back to a fresh engine's value (None for kinds a load never resets). snapshot():
    its value as plain data and host tensors, comparable with ==/torch.equal (None where it is derived or scratch).
    tensors(): the tensors it owns (views and stand-ins included)."""

    name: str
    kind: str
    reset: Callable[[], None] | None = None
    snapshot: Callable[[], Any] | None = None
    tensors: Callable[[], Iterable[torch.Tensor]] = field(default=_nothing)
    save: Callable[[], Any] | None = None  # its saved form in a checkpoint: plain JSON data
    check: Callable[[Any], None] | None = None  # raises ValueError/TypeError on a saved form restore cannot take
    restore: Callable[[Any], None] | None = None  # takes a checked saved form back
    per_rank: bool = False  # every rank saves its own form (generators); else rank 0's stands for all

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"state component {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if self.kind in ("optimizer", "lr_scheduler", "training", "transient") and self.reset is None:
            raise ValueError(f"state component {self.name!r} of kind {self.kind!r} needs a reset: a load may have to "
                             f"return it to a fresh engine's value")
        if (self.save is None) != (self.restore is None) or (self.check is not None and self.save is None):
            raise ValueError(f"state component {self.name!r}: a saved form needs save, restore (and optionally "
                             f"check) together")


class StateRegistry:
    """The engine's components, in registration order (resets run in that order)."""

    def __init__(self):
        self.components: list[Component] = []

    def add(self, component: Component) -> Component:
        if any(c.name == component.name for c in self.components):
            raise ValueError(f"state component {component.name!r} registered twice")
        self.components.append(component)
        return component

    def __iter__(self):
        return iter(self.components)

    def of_kind(self, *kinds: str) -> list[Component]:
        return [c for c in self.components if c.kind in kinds]

    def reset(self, *kinds: str) -> None:
        """Every component of these kinds back to a fresh engine's value."""
        for c in self.of_kind(*kinds):
            if c.reset is not None:
                c.reset()

    def saved_forms(self, *, per_rank: bool) -> dict[str, Any]:
        """name -> saved form of every component a checkpoint writes as plain data (each rank's own, or the shared)."""
        return {c.name: c.save() for c in self.components if c.save is not None and c.per_rank == per_rank}

    def snapshot(self, *kinds: str) -> dict[str, Any]:
        """name -> snapshot of every component of these kinds (all kinds with a snapshot when none are given)."""
        chosen = self.of_kind(*kinds) if kinds else self.components
        return {c.name: c.snapshot() for c in chosen if c.snapshot is not None}


def kinds_a_load_resets(*, load_module_only: bool, load_optimizer_states: bool,
                        load_lr_scheduler_states: bool) -> tuple[str, ...]:
    """The kinds a load with these flags does not restore, and so resets (see the table above)."""
    kinds = ["transient"]
    if load_module_only or not load_optimizer_states:
        kinds.append("optimizer")
    if load_module_only or not load_lr_scheduler_states:
        kinds.append("lr_scheduler")
    if load_module_only:
        kinds.append("training")
    return tuple(kinds)


# -- helpers the components share ---------------------------------------------------------------------------------
def host_copy(value: Any) -> Any:
    """A snapshot's value with every tensor copied to the host (dicts, lists and tuples walked)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: host_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(host_copy(v) for v in value)
    return copy.deepcopy(value)


def hyper_parameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each param group's options (everything but its params), deep-copied."""
    return [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]


def restore_hyper_parameters(optimizer: torch.optim.Optimizer, saved: list[dict]) -> None:
    for group, values in zip(optimizer.param_groups, saved):
        for key in [k for k in group if k != "params" and k not in values]:
            del group[key]
        group.update(copy.deepcopy(values))


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() and t.dtype != torch.bool else t


def equal(a: Any, b: Any) -> bool:
    """Snapshots equal: same structure, tensors of the same dtype, shape and bits (so NaN equals the same NaN),
    plain values ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(_bits(a), _bits(b)))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    return a == b


def differences(a: dict, b: dict, where: str = "") -> list[str]:
    """Paths at which two snapshots differ (for error messages)."""
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return [] if equal(a, b) else [where or "<root>"]
    out = [f"{where}.{k}".lstrip(".") for k in sorted(set(a) ^ set(b), key=str)]
    for k in a.keys() & b.keys():
        out += differences(a[k], b[k], f"{where}.{k}".lstrip("."))
    return out
