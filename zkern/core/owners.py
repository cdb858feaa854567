"""Which engine runtime partitions a parameter: a weak reference on the parameter, set once the runtime owns it.

zkern.GatheredParameters (stage3/gathered.py) asks it to reach the right runtime from a bare parameter; stages 1-2
register too, so that a write under modifier_rank reaches their fp32 masters.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch


def register_owner(params: Iterable[torch.nn.Parameter], runtime) -> None:
    """Mark params as partitioned by `runtime` (a weak reference: the engine owns the runtime, not the model)."""
    ref = weakref.ref(runtime)
    for p in params:
        p._zkern_runtime = ref


def owner_of(p: torch.Tensor):
    """The live runtime that partitions p, or None."""
    ref = getattr(p, "_zkern_runtime", None)
    return None if ref is None else ref()

