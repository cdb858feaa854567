"""Stage 3's external reads: in the recording passes a torch function mode watches for parameters at rest, and a
module that reads another unit's parameter (a tied head reading the embedding) gathers that unit from then on.

    python -m pytest tests/stage3/test_stage3.py -q -k "tied or external"

The watch sees the module map and the pass in progress (modules.py); it calls back into the hooks (hooks.py) to
hook the reading module and to acquire the unit for the running frame.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from zkern.stage3.lifecycle import DataState, Unit
from zkern.stage3.modules import Frame, ModuleMap, Pass

log = logging.getLogger("zkern")

# Attribute reads an at-rest parameter answers correctly (its empty stand-in has the right dtype and device).
_METADATA = frozenset({"dtype", "device", "requires_grad", "is_leaf", "layout", "is_cuda", "grad_fn"})


class WatchAtRest(TorchFunctionMode):
    """Recording passes only: a torch call that reads a parameter at rest gathers its unit for the running
    module (and remembers that the module needs it)."""

    def __init__(self, modules: ModuleMap, state: Pass, rank: int, *,
                 hook_module: Callable[[torch.nn.Module], None],
                 acquire: Callable[[Unit, Frame | None, torch.nn.Module], None]):
        super().__init__()
        self.modules, self.state, self.rank = modules, state, rank
        self.hook_module, self.acquire = hook_module, acquire

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.state.in_hook:  # the runtime's own work (gathering sets p.data) is not the model reading
            return func(*args, **kwargs)
        if getattr(getattr(func, "__self__", None), "__name__", None) in _METADATA:
            return func(*args, **kwargs)
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.nn.Parameter):
                self.adopt_if_at_rest(leaf)
        return func(*args, **kwargs)

    def adopt_if_at_rest(self, p: torch.nn.Parameter) -> None:
        """A torch call read p: when p is at rest, its unit is gathered for the running module and, from now on,
        gathered by that module's hooks too."""
        u = self.modules.unit_of.get(id(p))
        if u is None or u.persistent or (u.data is DataState.GATHERED and not u.prefetched):
            return
        frames = self.state.frames
        frame = frames[-1] if frames else None
        module = frame.module if frame is not None else self.modules.root
        wanted = self.modules.needs.setdefault(module, [])
        if u.index not in wanted:
            wanted.append(u.index)
            self.hook_module(module)
            self.modules.changed = True
            if self.rank == 0:
                log.info("zkern stage 3: %s reads '%s' of unit '%s' outside that unit's modules; it gathers that "
                         "unit from now on", type(module).__name__, self.modules.param_name(p), u.name)
        u.touched = True
        self.state.in_hook = True
        try:
            self.acquire(u, frame, module)
        finally:
            self.state.in_hook = False
