"""Which engine runtime partitions a parameter: a weak reference on the parameter, set once the runtime owns it; and
the hooks a runtime leaves on the model's tensors, which hold it weakly too.

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



def weak_grad_hook(method, *args):
    """A gradient hook for a parameter (register_post_accumulate_grad_hook) that calls method(*args, p) while
    method's object lives and does nothing after. A hook stored on a tensor is held from C++, where Python's
    collector cannot see the way back: a hook holding its runtime (which holds the parameters) would keep the
    runtime, its buffers, its optimizer and its host state alive forever once the engine is dropped. args must not
    hold the runtime or its parameters either."""
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, p)
    return hook


def weak_tensor_hook(method, *args):
    """A tensor hook (Tensor.register_hook) that returns method(*args, grad) while method's object and args live, and
    leaves the gradient as it is after. An output or a view a module keeps can outlive its engine (the user's model
    holds it), and a hook on it is held from C++, out of the collector's sight: holding the runtime, or the module
    the view came from (which holds the view), would keep the module, the model and the engine alive for good. So
    both are held weakly (args must take weak references: modules do)."""
    ref = weakref.WeakMethod(method)
    arg_refs = [weakref.ref(a) for a in args]

    def hook(grad: torch.Tensor):
        bound, live = ref(), [r() for r in arg_refs]
        if bound is None or any(a is None for a in live):
            return None
        return bound(*live, grad)
    return hook
