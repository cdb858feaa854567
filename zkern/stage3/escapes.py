"""Views of a gathered unit that outlive the module call that made them: a module returning a slice of its parameter
(a learned positional embedding's `self.pe[:, :T]`), an `expand` of a CLS token, a transpose, or keeping such a view on
itself. Stage 3 frees a unit's storage at rest (resize to zero bytes, core/buffers.py), which is safe for what
autograd saved inside the module (backward regathers before those are read) but not for a view someone else holds:
reading it would read freed memory (a segmentation fault on the CPU, an illegal address on a GPU).

    python -m pytest tests/stage3/test_stage3_views.py -q

So when a module's forward ends, the tensors it returned and the tensors it keeps as attributes are checked against
the storages of the units it holds; a unit whose storage one of them shares is marked `escaped`, and its release
leaves that storage to its holders (the memory comes back when they let go) while the next gather fills a fresh
one. A parameter returned itself (not a view) would become an empty tensor at release: it is handed out as a
view of itself instead (the same values; its gradient flows to the parameter as before).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves, tree_map

from zkern.stage3.lifecycle import DataState, Unit


def _storage_key(t: torch.Tensor) -> int:
    """The address of t's storage, 0 for none (empty, meta, or a tensor subclass without one)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return 0


# the unit's own parameters point into it until release; none of these is a view that leaves the call
_MODULE_OWN = frozenset({"_parameters", "_buffers", "_modules"})


def _kept_tensors(module: torch.nn.Module):
    """The module's own tensor attributes (outside _parameters, _buffers and _modules, which are the unit's own or
    none of its business), one level into lists, tuples and dicts."""
    for key, value in module.__dict__.items():
        if key in _MODULE_OWN:
            continue
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))
        elif isinstance(value, dict):
            yield from (v for v in value.values() if isinstance(v, torch.Tensor))


def mark_escaped(output, module: torch.nn.Module, units: list[Unit]) -> list[torch.Tensor]:
    """Mark the gathered units among `units` whose storage a tensor leaving `module`'s call shares: one of its
    output's leaves, or one it keeps as an attribute. Returns the kept ones that are such views: autograd reaches
    the parameter through them without passing the module's outputs, so they need the backward hook too."""
    slots = {}
    for u in units:
        if u.data is not DataState.REST and u.slot is not None:
            key = _storage_key(u.slot)
            if key:
                slots[key] = u
    if not slots:
        return []
    for t in tree_leaves(output):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            u = slots.get(_storage_key(t))
            if u is not None:
                u.escaped = True
    kept = []
    for t in _kept_tensors(module):
        u = None if isinstance(t, torch.nn.Parameter) else slots.get(_storage_key(t))
        if u is not None:
            u.escaped = True
            kept.append(t)
    return kept


def holders(slot: torch.Tensor, params) -> int:
    """The tensors sharing slot's storage besides slot itself and the parameters in `params` that view it (what the
    gather left: a communication library may keep views of its output for a while). -1 where this torch cannot
    count them."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return -1
    storage = slot.untyped_storage()
    viewing = sum(1 for p in params if p.untyped_storage().data_ptr() == storage.data_ptr() and p.numel())
    return use_count(storage._cdata) - 2 - viewing  # less slot's own tensor and the storage object made to ask


def held_elsewhere(slot: torch.Tensor, since_gather: int) -> bool:
    """Does a tensor share slot's storage that did not when it was gathered (since_gather: holders() then)? Where
    autograd can have saved none of it (gradients off, or a GatheredParameters context ending), such a tensor is a
    user's view, which release would leave pointing at freed memory. Where torch cannot count, assume one (the bytes
    are kept, never read freed)."""
    if since_gather < 0:
        return True
    return holders(slot, ()) > since_gather


def alias_parameters(output, units: list[Unit]):
    """`output` with every parameter of `units` replaced by a view of itself: the view shares the unit's storage
    (mark_escaped then keeps it for its holder) where the parameter itself goes empty at release."""
    if not any(isinstance(leaf, torch.nn.Parameter) for leaf in tree_leaves(output)):
        return output
    params = {id(p) for u in units for p in u.plan.params}
    return tree_map(lambda t: t.view_as(t) if isinstance(t, torch.nn.Parameter) and id(t) in params else t, output)
