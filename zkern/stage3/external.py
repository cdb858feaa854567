"""Stage 3's external reads: in the recording passes a torch function mode watches for parameters at rest, and a
module that reads another unit's parameter (a tied head reading the embedding) gathers that unit from then on.

    python -m pytest tests/stage3/test_stage3.py -q -k "tied or external"
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from zkern.stage3.lifecycle import DataState

if TYPE_CHECKING:
    from zkern.stage3.hooks import Stage3Hooks

log = logging.getLogger("zkern")

# Attribute reads an at-rest parameter answers correctly (its empty stand-in has the right dtype and device).
_METADATA = frozenset({"dtype", "device", "requires_grad", "is_leaf", "layout", "is_cuda", "grad_fn"})


class WatchAtRest(TorchFunctionMode):
    """Recording passes only: a torch call that reads a parameter at rest gathers its unit for the running
    module (and remembers that the module needs it)."""

    def __init__(self, hooks: Stage3Hooks):
        super().__init__()
        self.hooks = hooks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.hooks.in_hook:  # the runtime's own work (gathering sets p.data) is not the model reading
            return func(*args, **kwargs)
        if getattr(getattr(func, "__self__", None), "__name__", None) in _METADATA:
            return func(*args, **kwargs)
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.nn.Parameter):
                adopt_if_at_rest(self.hooks, leaf)
        return func(*args, **kwargs)


def adopt_if_at_rest(h: Stage3Hooks, p: torch.nn.Parameter) -> None:
    """A torch call read p: when p is at rest, its unit is gathered for the running module and, from now on,
    gathered by that module's hooks too (h: the Stage3Hooks)."""
    u = h.unit_of.get(id(p))
    if u is None or u.persistent or (u.data is DataState.GATHERED and not u.prefetched):
        return
    frame = h.frames[-1] if h.frames else None
    module = frame.module if frame is not None else h.root
    wanted = h.needs.setdefault(module, [])
    if u.index not in wanted:
        wanted.append(u.index)
        h.hook_module(module)
        h.needs_changed = True
        if h.comm.rank == 0:
            log.info("zkern stage 3: %s reads '%s' of unit '%s' outside that unit's modules; it gathers that "
                     "unit from now on", type(module).__name__, h._param_name(p), u.name)
    u.touched = True
    h.in_hook = True
    try:
        h._acquire(u, frame=frame, requester=module)
    finally:
        h.in_hook = False
