"""Stage 3's units held whole outside a forward: zkern.GatheredParameters (pin and unpin, a modifier rank's writes
into every shard) and gathered_for_generation (every unit pinned, module hooks aside).

    python -m pytest tests/stage3/test_gathered.py -q
"""

from __future__ import annotations

import contextlib

import torch

from zkern.comm.divergence import TagKind, describe_mismatch, exchange_tags
from zkern.errors import CommError, InvariantError
from zkern.stage3.gatherer import Gatherer
from zkern.stage3.hooks import Stage3Hooks
from zkern.stage3.lifecycle import DataState, Unit
from zkern.stage3.shards import Shards


@contextlib.contextmanager
def hooks_suspended(hooks: Stage3Hooks, units: list[Unit]):
    """While every unit is pinned whole and gradients are off (gathered_for_generation), a forward has nothing
    to gather, free or record: the module hooks step aside, and the passes do not enter the order trace."""
    if hooks.state.frames or any(u.pins == 0 and not u.plan.persistent for u in units):
        raise InvariantError("zkern stage 3: hooks_suspended needs every unit pinned and no forward running")
    hooks.suspended = True
    try:
        yield
    finally:
        hooks.suspended = False


def generation_params(units: list[Unit], max_live: int) -> tuple[list[torch.nn.Parameter], int, int]:
    """The parameters of the units that fit stage3_max_live_parameters together, in unit order (all of them
    unless the user set a bound below the model), with the elements they hold and the model's total."""
    chosen, held = [], 0
    for u in units:
        if held + u.bucket.padded > max_live:
            continue  # too big for what is left of the bound: it stays gathered and freed per use
        held += u.bucket.padded
        chosen.extend(u.plan.params)
    return chosen, held, sum(u.bucket.padded for u in units)


def pin(s: Shards, gatherer: Gatherer, params: list[torch.nn.Parameter], modifier_rank: int | None) -> list[Unit]:
    """Make the units of params whole and keep them so (a collective, checked across ranks)."""
    units = sorted({id(s.unit_of[id(p)]): s.unit_of[id(p)] for p in params}.values(), key=lambda u: u.index)
    if modifier_rank is not None and modifier_rank >= s.comm.world:
        raise ValueError(f"GatheredParameters: modifier_rank {modifier_rank} is not a rank of this world of "
                         f"{s.comm.world}")
    pinned = []
    try:
        for u in units:
            agree_pin(s, gatherer, u, modifier_rank)
            if u.data is DataState.REST:
                gatherer.gather(u, async_op=False, exact=True)
            gatherer.finish(u)
            u.check_fresh(gatherer.version)
            u.pins += 1
            u.touched = True
            pinned.append(u)
    except BaseException:
        unpin(s, gatherer, pinned, None)
        raise
    return units


def agree_pin(s: Shards, gatherer: Gatherer, u: Unit, modifier_rank: int | None) -> None:
    tag = (TagKind.PIN, u.index, -1 if modifier_rank is None else modifier_rank)
    tags = exchange_tags(s.comm, tag, gatherer.device)
    if any(t != tags[0] for t in tags):
        what = describe_mismatch(tags, [v.name for v in s.units], [])
        raise CommError(f"zkern rank {s.comm.rank} of {s.comm.world}: GatheredParameters was entered with "
                        f"different parameters or modifier ranks on different ranks ({what}); every rank must "
                        f"pass the same parameters in the same order")


def unpin(s: Shards, gatherer: Gatherer, units: list[Unit], modifier_rank: int | None, before_landing=None) -> None:
    """Leave a GatheredParameters context; with modifier_rank, write that rank's values into every shard (the
    working copy, and the fp32 master where a value changed; before_landing runs once that is known, before a
    delayed update lands). Where no rank's values changed, nothing is written:
    a context that only read leaves the run exactly as it was (a delayed update in flight stays in flight)."""
    if modifier_rank is not None:
        with torch.no_grad():
            edits = _edits(s, units, modifier_rank)
            flag = torch.tensor([1.0 if any(changed.any() for _, _, changed in edits) else 0.0],
                                device=gatherer.device)
            if s.comm.world > 1:
                s.comm.all_reduce(flag, "GatheredParameters: whether any rank's parameters changed", kind="control",
                                  op=torch.distributed.ReduceOp.MAX)
            if before_landing is not None:  # the changes are known: the trained view closes before a landing
                before_landing()
            if flag.item():
                s.store.land_update()  # a delayed update in flight lands first: its weights must not arrive later
                for u, mine, changed in edits:
                    _write(s, u, mine, changed)
                for u, _, _ in edits:  # whole copies that outlive the context (persistent, or pinned again) follow
                    if u.persistent or u.pins > 1:  # the shards: a landing refreshed them before the write
                        gatherer.regather(u, "parameters written in a GatheredParameters context")
    for u in units:
        u.unpin()
        gatherer.release(u, outside_autograd=True)  # a view taken inside the context keeps its bytes


def _edits(s: Shards, units: list[Unit], modifier_rank: int) -> list[tuple[Unit, torch.Tensor, torch.Tensor]]:
    """Per unit: this rank's chunk of the modifier rank's values (broadcast to every rank), and which of its elements
    differ from the shard it was gathered from (NaN where NaN was is no change)."""
    out = []
    for u in units:
        s.comm.broadcast(u.buffer, f"GatheredParameters: unit '{u.name}' modified on rank {modifier_rank}",
                         src=modifier_rank)
        b = u.bucket
        # a copy: a landing before the write regathers pinned units into their buffers
        mine = u.buffer[s.comm.rank * b.chunk:(s.comm.rank + 1) * b.chunk].clone()
        if s.store.in_int8(u.index):
            before = s.store.int8.get(u.index, mine.dtype).to(mine.device)
        else:
            # in the working dtype, as the gather read it (cast from the master where no working shard is kept)
            before = s.store.read(s.source[b.shard_offset:b.shard_offset + b.chunk]).to(mine.device, mine.dtype)
        changed = (mine != before) & ~(mine.isnan() & before.isnan())
        out.append((u, mine, changed))
    return out


def _write(s: Shards, u: Unit, mine: torch.Tensor, changed: torch.Tensor) -> None:
    """The changed elements of u's chunk into its working shard (where one is kept) and its fp32 master; the others
    keep the values there (the master's own, which the 16-bit copy only rounded; a landed update's)."""
    b = u.bucket
    if s.secondary is not None:  # every rank writes, so every rank forgets alike
        s.secondary.forget(u.index)
    if s.store.in_int8(u.index):
        s.store.int8.write(u.index, mine)
        return
    if s.master is not None:
        region = s.master[b.shard_offset:b.shard_offset + b.chunk]
        master = s.store.read(region)
        where = changed.to(master.device)
        s.store.write(region, torch.where(where, mine.to(master.device, master.dtype), master))
    if s.param_shard is None:  # the gathers cast from the master
        return
    resting = s.param_shard[b.shard_offset:b.shard_offset + b.chunk]
    working = s.store.read(resting)
    where = changed.to(working.device)
    s.store.write(resting, torch.where(where, mine.to(working.device), working))
