"""How stage 3 lays a model out: fetch units, this rank's shards in their homes, the initial partition, the
optimizer's shard groups, the map a checkpoint saves and loads by, and the ds_* attributes frameworks read.

    python -m pytest tests/stage3/test_stage3.py tests/comm/test_zeropp_frozen.py -q

Functions that fill and read this rank's Shards (shards.py); runtime.py calls them once each, in the order they
appear here, and shard_map per save or load.
"""

from __future__ import annotations

import torch

from zkern import ops
from zkern.comm.zeropp import FrozenStore
from zkern.core.buffers import aligned_empty, aligned_zeros
from zkern.core.partition import ALIGN, plan_unit_layout
from zkern.core.runtime import ShardMap
from zkern.core.shard_groups import Chunk, ShardGroup
from zkern.core.spec import RuntimeSpec
from zkern.offload.partial import place_chunks, split_point
from zkern.offload.store import ShardStore
from zkern.stage3.ds_attributes import mark
from zkern.stage3.lifecycle import Unit
from zkern.stage3.sharded_init import forget_sharding, full_shape, gather_built, is_sharded, release_freed_memory
from zkern.stage3.shards import Shards
from zkern.stage3.units import plan_units


def plan(s: Shards, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], zero) -> dict:
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
    s.layout = plan_unit_layout([[full_shape(p).numel() for p in u.params] for u in plans], s.comm.world)
    paths = {id(m): name for name, m in model.named_modules()}
    readers: dict[int, list[str]] = {}
    for module, wanted in needs.items():
        for ui in wanted:
            readers.setdefault(ui, []).append(paths[id(module)] or "<root>")
    s.units = [Unit(i, unit_plan, b, sum(p.requires_grad for p in unit_plan.params),
                     readers=tuple(readers.get(i, ())))
                for i, (unit_plan, b) in enumerate(zip(plans, s.layout.buckets))]
    s.all_params = [p for u in plans for p in u.params]
    s.all_names = [n for u in plans for n in u.names]
    s.params = [p for p in s.all_params if p.requires_grad]
    s.names = [n for p, n in zip(s.all_params, s.all_names) if p.requires_grad]
    s.trainable_index = {id(p): i for i, p in enumerate(s.params)}
    s.frozen_ids = {id(p) for p in s.all_params if not p.requires_grad}
    s.unit_of = {id(p): u for u in s.units for p in u.plan.params}
    s.full_shapes = {id(p): full_shape(p) for p in s.all_params}
    # each parameter at a multiple of ALIGN elements from its unit's start (partition.py): every view a gathered
    # unit hands the model starts 256-byte aligned in the 16-bit dtypes
    index = {id(p): i for i, p in enumerate(s.all_params)}
    s.offsets = {id(p): s.layout.offsets[index[id(p)]] - u.bucket.offset for u in s.units for p in u.plan.params}
    return needs


def allocate(s: Shards, spec: RuntimeSpec, store: ShardStore, param_files) -> None:
    """This rank's shards, each in its home (ShardStore): the working copy, the fp32 master, the gradient shard and,
    under zero_quantized_nontrainable_weights, the int8 store of units with nothing to train (laid out last by
    frozen_last, so the dense buffers end where they begin)."""
    zero, dtype, device = spec.zero, spec.dtype, spec.device
    frozen_units = [u for u in s.units if nothing_to_train(u.plan)] if zero.zero_quantized_nontrainable_weights \
        else []
    shard = frozen_units[0].bucket.shard_offset if frozen_units else s.layout.shard_numel
    s.store = store
    s.param_store = None
    if param_files is not None:  # offload_param "nvme": the working shard rests in a file, read per gather
        s.param_store = param_files(shard, dtype, {u.index: (u.bucket.shard_offset, u.bucket.chunk)
                                                    for u in s.units if u.bucket.shard_offset < shard})
        s.param_shard = store.attach_param_file(s.param_store)
    elif s.params_on_host:  # offload_param: the working shard rests on the host, copied up per gather
        s.param_shard = store.allocate(shard, dtype, "host", pin=spec.pin_params)
    elif not spec.casts_from_master:
        s.param_shard = store.allocate(shard, dtype, "device")
    # offload_optimizer: the fp32 master shard lives on the host, in fp32 runs too (the optimizer's copy).
    s.master = None
    if spec.offload_optimizer == "nvme":  # the master is a region of the optimizer's files
        s.master = store.allocate(shard, spec.master_dtype, "nvme")
    elif spec.partial:  # the shard's start on the device, the rest on the host (offload/partial.py)
        trained = [(q.shard_start, q.shard_start + q.numel) for q in s.layout.pieces(s.comm.rank)
                   if q.shard_start < shard and s.all_params[q.param].requires_grad]
        s.master = store.allocate_split(shard, split_point(shard, spec.offload_ratio, trained), spec.master_dtype,
                                        pin=spec.pin_optimizer)
    elif spec.offload_optimizer == "cpu":
        s.master = store.allocate(shard, spec.master_dtype, "host", pin=spec.pin_optimizer)
    elif spec.mixed or s.params_on_host:
        # offload_param without offload_optimizer keeps the optimizer on the device: an fp32 master there (in fp32
        # runs too), whose step writes each updated chunk to the host shard
        s.master = store.allocate(shard, spec.master_dtype, "device")
    # data_types.grad_accum_dtype; empty unless kept between steps (its memory goes before the first backward, and
    # comes back zeroed: GradReducer.ensure_grads)
    alloc = aligned_zeros if spec.zero.keep_gradient_buffers else aligned_empty
    s.grad_shard = alloc(shard, spec.accum_dtype, device)
    s.empty = torch.empty(0, dtype=dtype, device=device)
    if frozen_units:
        store.keep_int8(FrozenStore({u.index: u.bucket.chunk for u in frozen_units}, zero.zeropp_weight_group_size,
                                    torch.device("cpu") if s.param_store is not None else s.source.device,
                                    pin=s.source.is_pinned()))


def partition(s: Shards) -> None:
    """Keep this rank's chunk of every unit (fp32 master and working copy); parameters go to rest. One unit
    is whole at a time, on the device (the parameters may be on the host: the model is never whole on the
    device): rank 0's values are broadcast for it, and parameters partitioned by init_sharded (equal on every
    rank already) are gathered for it and dropped again."""
    rank = s.comm.rank
    device = s.empty.device
    with torch.no_grad():
        for u in s.units:
            b = u.bucket
            built = [is_sharded(p) for p in u.plan.params]
            values = [gather_built(p, s.comm, "a parameter built under init_sharded, for the stage-3 layout")
                      if sharded else p.detach() for p, sharded in zip(u.plan.params, built)]
            if s.param_shard is None and not s.store.in_int8(u.index):
                # a frozen parameter's master holds its working-dtype value, as a working shard would
                values = [v if p.requires_grad else v.to(s.dtype) for p, v in zip(u.plan.params, values)]
            full = ops.flatten(values, torch.float32, align=ALIGN, pad_to=b.padded).to(device)  # (b.padded,)
            del values
            if not all(built):
                s.comm.broadcast(full, f"initial values of unit '{u.plan.name}' from rank 0")
            mine = full[rank * b.chunk:(rank + 1) * b.chunk]
            if s.store.in_int8(u.index):
                s.store.int8.put(u.index, mine)  # from the fp32 values, not a 16-bit rounding of them
            else:
                if s.param_shard is not None:
                    s.store.write(s.param_shard[b.shard_offset:b.shard_offset + b.chunk], mine)
                if s.master is not None:
                    s.store.write(s.master[b.shard_offset:b.shard_offset + b.chunk], mine)
            for p in u.plan.params:
                p.data = s.empty
                if is_sharded(p):
                    forget_sharding(p)
            del full, mine
            release_freed_memory()  # the unit's whole values go back to the OS now, not when building ends


def make_shard_groups(s: Shards, groups: list[list[torch.nn.Parameter]]) -> list[ShardGroup]:
    """Per optimizer group: its pieces, and per unit the contiguous sub-range of its pieces."""
    base = s.master if s.master is not None else s.param_shard
    out_base = s.param_shard if s.master is not None else None  # None too where the gathers cast from the master
    group_of = {id(p): gi for gi, g in enumerate(groups) for p in g}
    pieces: list[list[torch.Tensor]] = [[] for _ in groups]
    spans: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (group, unit) -> (piece, shard, numel)
    s.pieces_param = [[] for _ in groups]  # trainable index of each piece
    s.pieces_start = [[] for _ in groups]  # first element of the parameter it holds
    for piece in s.layout.pieces(s.comm.rank):
        p = s.all_params[piece.param]
        gi = group_of.get(id(p))
        if gi is None:
            continue  # frozen
        t = base[piece.shard_start:piece.shard_start + piece.numel]
        if piece.numel == s.full_shapes[id(p)].numel():
            t = t.view(s.full_shapes[id(p)])
        spans.setdefault((gi, piece.bucket), []).append((len(pieces[gi]), piece.shard_start, piece.numel))
        pieces[gi].append(t)
        s.pieces_param[gi].append(s.trainable_index[id(p)])
        s.pieces_start[gi].append(piece.param_start)
    result = []
    for gi in range(len(groups)):
        chunks = []
        for u in s.units:
            span = spans.get((gi, u.index))
            if not span:
                continue
            lo, hi = span[0][1], span[-1][1] + span[-1][2]
            chunks.append(Chunk(param=base[lo:hi], grad=s.grad_shard[lo:hi],
                                out=None if out_base is None else out_base[lo:hi],
                                pieces=[(index, start - lo, numel) for index, start, numel in span]))
        if s.master is not None and s.store.split_of(s.master) is not None:  # partial offload: real part slices
            pieces[gi] = [s.store.resident(t) for t in pieces[gi]]
            chunks = place_chunks(chunks, s.store)
        result.append(ShardGroup(pieces=pieces[gi], chunks=chunks))
    return result


def shard_map(s: Shards) -> ShardMap:
    pieces = [[(i, start, True) for i, start in zip(idx, starts)]
              for idx, starts in zip(s.pieces_param, s.pieces_start)]
    resting, masters, rounded = [], {}, set()
    staged: dict[int, torch.Tensor] = {}  # int8-resting units: their chunk dequantized, to save or load into
    for piece in s.layout.pieces(s.comm.rank):
        p = s.all_params[piece.param]
        if p.requires_grad:
            continue
        u = s.units[piece.bucket]
        if s.store.in_int8(u.index):
            # fp32, code x scale exactly: quantizing these again gives the same codes and scales (a load into a
            # model initialised otherwise gets the saved weights bit for bit; a 16-bit copy would move them)
            if u.index not in staged:
                staged[u.index] = s.store.int8.get(u.index, torch.float32)
            lo = piece.shard_start - u.bucket.shard_offset
            view = staged[u.index][lo:lo + piece.numel]
        elif s.param_shard is None:  # no working shard: the master's slice, holding working-dtype values (partition)
            view = s.master[piece.shard_start:piece.shard_start + piece.numel]
            rounded.add((id(p), piece.param_start))
        else:
            view = s.param_shard[piece.shard_start:piece.shard_start + piece.numel]
            if s.master is not None:
                masters[(id(p), piece.param_start)] = s.master[piece.shard_start:piece.shard_start + piece.numel]
        resting.append((p, s.full_shapes[id(p)], piece.param_start, view))
    listed = {id(p) for p, _, _, _ in resting}
    for p in s.all_params:  # a frozen parameter wholly in other ranks' chunks is at rest here too
        if not p.requires_grad and id(p) not in listed:
            listed.add(id(p))
            resting.append((p, s.full_shapes[id(p)], 0, s.empty))

    def commit() -> None:  # a load wrote into the staged chunks: store what changed
        for ui, values in staged.items():
            if s.store.int8.write(ui, values) and s.secondary is not None:
                s.secondary.forget(ui)

    return ShardMap(pieces=pieces, shapes=[s.full_shapes[id(p)] for p in s.params], resting=resting,
                    commit=commit if staged else None, resting_masters=masters,
                    resting_rounded=rounded)


def attach_ds_attributes(s: Shards, gathered: set[int]) -> None:
    """DeepSpeed's ds_* attributes (ds_attributes.py) on every parameter stage 3 partitions, and its status:
    AVAILABLE for the units whose index is in `gathered` (whole now), NOT_AVAILABLE for the rest."""
    shard = s.param_shard
    rank = s.comm.rank
    for index, p in enumerate(s.all_params):
        shape = s.full_shapes[id(p)]
        p.ds_id = index
        p.ds_shape = shape
        p.ds_numel = shape.numel()
        p.ds_tensor = _ds_partition(s, p, shape.numel(), rank, shard)
    for u in s.units:
        mark(u.plan.params, "AVAILABLE" if u.index in gathered else "NOT_AVAILABLE")


def _ds_partition(s: Shards, p: torch.nn.Parameter, numel: int, rank: int, shard: torch.Tensor) -> torch.Tensor:
    """This rank's elements of p in its working shard (empty when its chunk holds none of them; a meta tensor of
    that length where the shard rests in a file or as int8 codes, or where no working shard is kept and the
    gathers cast from the fp32 master)."""
    u = s.unit_of[id(p)]
    b = u.bucket
    off = s.offsets[id(p)]
    lo, hi = max(off, rank * b.chunk), min(off + numel, (rank + 1) * b.chunk)
    n = max(0, hi - lo)
    start = b.shard_offset + lo - rank * b.chunk if n else b.shard_offset
    if shard is None or s.store.in_files(shard) or s.store.in_int8(u.index):
        return torch.empty(n, dtype=s.dtype, device="meta")
    return shard[start:start + n]


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
