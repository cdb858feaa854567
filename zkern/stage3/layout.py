"""How stage 3 lays a model out: fetch units, this rank's shards in their homes, the initial partition, the
optimizer's shard groups, and the map a checkpoint saves and loads by.

    python -m pytest tests/stage3/test_stage3.py tests/comm/test_zeropp_frozen.py -q

Functions of the runtime (rt: a Stage3Runtime under construction or built); runtime.py calls them once each, in the
order they appear here, and shard_map per save or load.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zkern import ops
from zkern.comm.zeropp import FrozenStore
from zkern.core.partition import plan_unit_layout
from zkern.core.runtime import ShardMap
from zkern.core.shard_groups import Chunk, ShardGroup
from zkern.core.spec import RuntimeSpec
from zkern.offload.store import ShardStore
from zkern.stage3.lifecycle import Unit
from zkern.stage3.sharded_init import forget_sharding, full_shape, gather_built, is_sharded, release_freed_memory
from zkern.stage3.units import plan_units

if TYPE_CHECKING:
    from zkern.stage3.runtime import Stage3Runtime


def plan(rt: Stage3Runtime, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], zero) -> dict:
    """The fetch units (units.py) with their parameters ordered by optimizer group, the layout of their chunks
    (one bucket per unit, padded to whole 64-element chunks), and per parameter its full shape and offset in its
    unit (recorded while parameters are still whole: at rest .data is empty; a model built under init_sharded
    arrives at rest).
    Returns `needs`: module -> the units its forward gathers."""
    plans, needs = plan_units(model, tuple(zero.stage3_fetch_units), zero.stage3_param_persistence_threshold,
                              zero.leaf_module_names, zero.leaf_module_name_suffixes)
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g}
    frozen = len(groups)
    for unit_plan in plans:  # within a unit: parameters of group 0, group 1, ..., then frozen ones
        order = sorted(range(len(unit_plan.params)), key=lambda i: group_of.get(id(unit_plan.params[i]), frozen))
        unit_plan.params = [unit_plan.params[i] for i in order]
        unit_plan.names = [unit_plan.names[i] for i in order]
    if zero.zero_quantized_nontrainable_weights:
        plans, needs = frozen_last(plans, needs)
    rt.layout = plan_unit_layout([[full_shape(p).numel() for p in u.params] for u in plans], rt.comm.world)
    paths = {id(m): name for name, m in model.named_modules()}
    readers: dict[int, list[str]] = {}
    for module, wanted in needs.items():
        for ui in wanted:
            readers.setdefault(ui, []).append(paths[id(module)] or "<root>")
    rt.units = [Unit(i, unit_plan, b, sum(p.requires_grad for p in unit_plan.params),
                     readers=tuple(readers.get(i, ())))
                for i, (unit_plan, b) in enumerate(zip(plans, rt.layout.buckets))]
    rt.all_params = [p for u in plans for p in u.params]
    rt.all_names = [n for u in plans for n in u.names]
    rt.params = [p for p in rt.all_params if p.requires_grad]
    rt.names = [n for p, n in zip(rt.all_params, rt.all_names) if p.requires_grad]
    rt._trainable_index = {id(p): i for i, p in enumerate(rt.params)}
    rt._frozen_ids = {id(p) for p in rt.all_params if not p.requires_grad}
    rt._unit_of = {id(p): u for u in rt.units for p in u.plan.params}
    rt._full_shape = {id(p): full_shape(p) for p in rt.all_params}
    rt._offset = {}
    for u in rt.units:
        off = 0
        for p in u.plan.params:
            rt._offset[id(p)] = off
            off += rt._full_shape[id(p)].numel()
    return needs


def allocate(rt: Stage3Runtime, spec: RuntimeSpec, store: ShardStore, param_files) -> None:
    """This rank's shards, each in its home (ShardStore): the working copy, the fp32 master, the gradient shard and,
    under zero_quantized_nontrainable_weights, the int8 store of units with nothing to train (laid out last by
    frozen_last, so the dense buffers end where they begin)."""
    zero, dtype, device = spec.zero, spec.dtype, spec.device
    frozen_units = [u for u in rt.units if nothing_to_train(u.plan)] if zero.zero_quantized_nontrainable_weights \
        else []
    shard = frozen_units[0].bucket.shard_offset if frozen_units else rt.layout.shard_numel
    rt.store = store
    rt.param_store = None
    if param_files is not None:  # offload_param "nvme": the working shard rests in a file, read per gather
        rt.param_store = param_files(shard, dtype, {u.index: (u.bucket.shard_offset, u.bucket.chunk)
                                                    for u in rt.units if u.bucket.shard_offset < shard})
        rt.param_shard = store.attach_param_file(rt.param_store)
    elif rt.params_on_host:  # offload_param: the working shard rests on the host, copied up per gather
        rt.param_shard = store.allocate(shard, dtype, "host", pin=spec.pin_params)
    else:
        rt.param_shard = store.allocate(shard, dtype, "device")
    # offload_optimizer: the fp32 master shard lives on the host, in fp32 runs too (the optimizer's copy).
    rt.master = None
    if spec.offload_optimizer == "nvme":  # the master is a region of the optimizer's files
        rt.master = store.allocate(shard, spec.master_dtype, "nvme")
    elif spec.offload_optimizer == "cpu":
        rt.master = store.allocate(shard, spec.master_dtype, "host", pin=spec.pin_optimizer)
    elif spec.mixed or rt.params_on_host:
        # offload_param without offload_optimizer keeps the optimizer on the device: an fp32 master there (in fp32
        # runs too), whose step writes each updated chunk to the host shard
        rt.master = store.allocate(shard, spec.master_dtype, "device")
    # data_types.grad_accum_dtype; empty unless kept between steps (its memory goes before the first backward, and
    # comes back zeroed: GradReducer.ensure_grads)
    alloc = torch.zeros if spec.zero.keep_gradient_buffers else torch.empty
    rt.grad_shard = alloc(shard, dtype=spec.accum_dtype, device=device)
    rt._empty = torch.empty(0, dtype=dtype, device=device)
    if frozen_units:
        store.keep_int8(FrozenStore({u.index: u.bucket.chunk for u in frozen_units}, zero.zeropp_weight_group_size,
                                    torch.device("cpu") if rt.param_store is not None else rt.param_shard.device,
                                    pin=rt.param_shard.is_pinned()))


def partition(rt: Stage3Runtime) -> None:
    """Keep this rank's chunk of every unit (fp32 master and working copy); parameters go to rest. One unit
    is whole at a time, on the device (the parameters may be on the host: the model is never whole on the
    device): rank 0's values are broadcast for it, and parameters partitioned by init_sharded (equal on every
    rank already) are gathered for it and dropped again."""
    rank = rt.comm.rank
    device = rt._empty.device
    with torch.no_grad():
        for u in rt.units:
            b = u.bucket
            built = [is_sharded(p) for p in u.plan.params]
            values = [gather_built(p, rt.comm, "a parameter built under init_sharded, for the stage-3 layout")
                      if sharded else p.detach() for p, sharded in zip(u.plan.params, built)]
            full = ops.flatten(values, torch.float32, pad_to=b.padded).to(device)  # (b.padded,)
            del values
            if not all(built):
                rt.comm.broadcast(full, f"initial values of unit '{u.plan.name}' from rank 0")
            mine = full[rank * b.chunk:(rank + 1) * b.chunk]
            if rt.store.in_int8(u.index):
                rt.store.int8.put(u.index, mine)  # from the fp32 values, not a 16-bit rounding of them
            else:
                rt.store.write(rt.param_shard[b.shard_offset:b.shard_offset + b.chunk], mine)
                if rt.master is not None:
                    rt.store.write(rt.master[b.shard_offset:b.shard_offset + b.chunk], mine)
            for p in u.plan.params:
                p.data = rt._empty
                if is_sharded(p):
                    forget_sharding(p)
            del full, mine
            release_freed_memory()  # the unit's whole values go back to the OS now, not when building ends


def make_shard_groups(rt: Stage3Runtime, groups: list[list[torch.nn.Parameter]]) -> list[ShardGroup]:
    """Per optimizer group: its pieces, and per unit the contiguous sub-range of its pieces."""
    base = rt.master if rt.master is not None else rt.param_shard
    out_base = rt.param_shard if rt.master is not None else None
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g}
    pieces: list[list[torch.Tensor]] = [[] for _ in groups]
    spans: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (group, unit) -> (piece, shard, numel)
    rt._pieces_param: list[list[int]] = [[] for _ in groups]  # trainable index of each piece
    rt._pieces_start: list[list[int]] = [[] for _ in groups]  # first element of the parameter it holds
    for piece in rt.layout.pieces(rt.comm.rank):
        p = rt.all_params[piece.param]
        gi = group_of.get(id(p))
        if gi is None:
            continue  # frozen
        t = base[piece.shard_start:piece.shard_start + piece.numel]
        if piece.numel == rt._full_shape[id(p)].numel():
            t = t.view(rt._full_shape[id(p)])
        spans.setdefault((gi, piece.bucket), []).append((len(pieces[gi]), piece.shard_start, piece.numel))
        pieces[gi].append(t)
        rt._pieces_param[gi].append(rt._trainable_index[id(p)])
        rt._pieces_start[gi].append(piece.param_start)
    result = []
    for gi in range(len(groups)):
        chunks = []
        for u in rt.units:
            span = spans.get((gi, u.index))
            if not span:
                continue
            lo, hi = span[0][1], span[-1][1] + span[-1][2]
            chunks.append(Chunk(param=base[lo:hi], grad=rt.grad_shard[lo:hi],
                                out=None if out_base is None else out_base[lo:hi],
                                pieces=[(index, start - lo, numel) for index, start, numel in span]))
        result.append(ShardGroup(pieces=pieces[gi], chunks=chunks))
    return result


def shard_map(rt: Stage3Runtime) -> ShardMap:
    pieces = [[(i, s, True) for i, s in zip(idx, starts)]
              for idx, starts in zip(rt._pieces_param, rt._pieces_start)]
    resting, masters = [], {}
    staged: dict[int, torch.Tensor] = {}  # int8-resting units: their chunk dequantized, to save or load into
    for piece in rt.layout.pieces(rt.comm.rank):
        p = rt.all_params[piece.param]
        if p.requires_grad:
            continue
        u = rt.units[piece.bucket]
        if rt.store.in_int8(u.index):
            # fp32, code x scale exactly: quantizing these again gives the same codes and scales (a load into a
            # model initialised otherwise gets the saved weights bit for bit; a 16-bit copy would move them)
            if u.index not in staged:
                staged[u.index] = rt.store.int8.get(u.index, torch.float32)
            lo = piece.shard_start - u.bucket.shard_offset
            view = staged[u.index][lo:lo + piece.numel]
        else:
            view = rt.param_shard[piece.shard_start:piece.shard_start + piece.numel]
            if rt.master is not None:
                masters[(id(p), piece.param_start)] = rt.master[piece.shard_start:piece.shard_start + piece.numel]
        resting.append((p, rt._full_shape[id(p)], piece.param_start, view))
    listed = {id(p) for p, _, _, _ in resting}
    for p in rt.all_params:  # a frozen parameter wholly in other ranks' chunks is at rest here too
        if not p.requires_grad and id(p) not in listed:
            listed.add(id(p))
            resting.append((p, rt._full_shape[id(p)], 0, rt._empty))

    def commit() -> None:  # a load wrote into the staged chunks: store what changed
        for ui, values in staged.items():
            if rt.store.int8.write(ui, values) and rt.secondary is not None:
                rt.secondary.forget(ui)

    return ShardMap(pieces=pieces, shapes=[rt._full_shape[id(p)] for p in rt.params], resting=resting,
                    commit=commit if staged else None, resting_masters=masters)

def watch_optional_children(model: torch.nn.Module, units: list[Unit], needs: dict) -> list:
    """For units whose modules hold a ModuleList/ModuleDict (an MoE layer declared as one fetch unit: its experts),
    note which of those children ran forward, so that the parameters of the others count as complete when backward
    begins (Unit.optional). A child whose subtree holds every module that gathers the unit is left out: the unit's
    own `touched` already says whether it ran."""
    unit_of = {id(p): (u, i) for u in units for i, p in enumerate(u.plan.params)}
    readers: dict[int, set[int]] = {}  # unit index -> ids of the modules that gather it
    for m, wanted in needs.items():
        for ui in wanted:
            readers.setdefault(ui, set()).add(id(m))
    watched: dict[int, tuple[torch.nn.Module, list[Unit]]] = {}
    for container in model.modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        for child in container.children():
            subtree = {id(m) for m in child.modules()}
            for p in {id(p): p for p in child.parameters()}.values():
                if not p.requires_grad or id(p) not in unit_of:
                    continue
                u, position = unit_of[id(p)]
                if readers.get(u.index, set()) <= subtree:
                    continue
                u.optional.setdefault(id(child), []).append(position)
                entry = watched.setdefault(id(child), (child, []))
                if u not in entry[1]:
                    entry[1].append(u)
    handles = []
    for child, owners in watched.values():
        def ran(module, args, owners=owners) -> None:
            if torch.is_grad_enabled():  # a no_grad forward (generation, evaluation) gives no gradient
                for u in owners:
                    u.ran.add(id(module))
        handles.append(child.register_forward_pre_hook(ran))
    return handles


def frozen_last(plans: list, needs: dict) -> tuple[list, dict]:
    """The units with nothing to train (and not persistent) moved to the end, so that their chunks end every
    rank's shard and the dense buffers stop before them; `needs` renumbered to match."""
    frozen = [i for i, plan in enumerate(plans) if nothing_to_train(plan)]
    order = [i for i in range(len(plans)) if i not in frozen] + frozen
    new_index = {old: new for new, old in enumerate(order)}
    return [plans[i] for i in order], {m: sorted(new_index[i] for i in wanted) for m, wanted in needs.items()}


def nothing_to_train(plan) -> bool:
    """A unit that rests as int8 under zero_quantized_nontrainable_weights (persistent units stay whole anyway)."""
    return not plan.persistent and not any(p.requires_grad for p in plan.params)
