"""Stage 3's units held whole outside a forward: zkern.GatheredParameters (pin and unpin, a modifier rank's writes
into every shard) and gathered_for_generation (every unit pinned, module hooks aside).

    python -m pytest tests/stage3/test_gathered.py -q
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch

from zkern.comm.divergence import TagKind, describe_mismatch, exchange_tags
from zkern.errors import CommError, InvariantError
from zkern.stage3.lifecycle import DataState, Unit

if TYPE_CHECKING:
    from zkern.stage3.runtime import Stage3Runtime


@contextlib.contextmanager
def hooks_suspended(rt: Stage3Runtime):
    """While every unit is pinned whole and gradients are off (gathered_for_generation), a forward has nothing
    to gather, free or record: the module hooks step aside, and the passes do not enter the order trace."""
    if rt.hooks.frames or any(u.pins == 0 and not u.plan.persistent for u in rt.units):
        raise InvariantError("zkern stage 3: hooks_suspended needs every unit pinned and no forward running")
    rt.hooks.suspended = True
    try:
        yield
    finally:
        rt.hooks.suspended = False


def generation_params(rt: Stage3Runtime) -> tuple[list[torch.nn.Parameter], int, int]:
    """The parameters of the units that fit stage3_max_live_parameters together, in unit order (all of them
    unless the user set a bound below the model), with the elements they hold and the model's total."""
    chosen, held = [], 0
    for u in rt.units:
        if held + u.bucket.padded > rt.gatherer.max_live:
            continue  # too big for what is left of the bound: it stays gathered and freed per use
        held += u.bucket.padded
        chosen.extend(u.plan.params)
    return chosen, held, sum(u.bucket.padded for u in rt.units)


def pin(rt: Stage3Runtime, params: list[torch.nn.Parameter], modifier_rank: int | None) -> list[Unit]:
    """Make the units of params whole and keep them so (a collective, checked across ranks)."""
    units = sorted({id(rt._unit_of[id(p)]): rt._unit_of[id(p)] for p in params}.values(), key=lambda u: u.index)
    if modifier_rank is not None and modifier_rank >= rt.comm.world:
        raise ValueError(f"GatheredParameters: modifier_rank {modifier_rank} is not a rank of this world of "
                         f"{rt.comm.world}")
    pinned = []
    try:
        for u in units:
            agree_pin(rt, u, modifier_rank)
            if u.data is DataState.REST:
                rt.gatherer.gather(u, async_op=False, exact=True)
            rt.gatherer.finish(u)
            u.check_fresh(rt.gatherer.version)
            u.pins += 1
            u.touched = True
            pinned.append(u)
    except BaseException:
        rt.unpin(pinned, None)
        raise
    return units


def agree_pin(rt: Stage3Runtime, u: Unit, modifier_rank: int | None) -> None:
    tag = (TagKind.PIN, u.index, -1 if modifier_rank is None else modifier_rank)
    tags = exchange_tags(rt.comm, tag, rt.gatherer.device)
    if any(t != tags[0] for t in tags):
        what = describe_mismatch(tags, [v.name for v in rt.units], [])
        raise CommError(f"zkern rank {rt.comm.rank} of {rt.comm.world}: GatheredParameters was entered with "
                        f"different parameters or modifier ranks on different ranks ({what}); every rank must "
                        f"pass the same parameters in the same order")


def unpin(rt: Stage3Runtime, units: list[Unit], modifier_rank: int | None) -> None:
    """Leave a GatheredParameters context; with modifier_rank, write that rank's values into every shard (the
    working copy, and the fp32 master where a value changed)."""
    if modifier_rank is not None:
        with torch.no_grad():
            for u in units:
                rt.comm.broadcast(u.buffer, f"GatheredParameters: unit '{u.name}' modified on rank "
                                            f"{modifier_rank}", src=modifier_rank)
                b = u.bucket
                mine = u.buffer[rt.comm.rank * b.chunk:(rt.comm.rank + 1) * b.chunk]
                if rt.secondary is not None:  # every rank writes, so every rank forgets alike
                    rt.secondary.forget(u.index)
                if rt.store.in_int8(u.index):
                    rt.store.int8.write(u.index, mine)
                    continue
                resting = rt.param_shard[b.shard_offset:b.shard_offset + b.chunk]
                working = rt.store.read(resting)
                if rt.master is not None:
                    # Only the elements that changed take the 16-bit value: the others keep their fp32 master
                    # value, which the 16-bit copy had only rounded.
                    region = rt.master[b.shard_offset:b.shard_offset + b.chunk]
                    master = rt.store.read(region)
                    changed = (mine.to(working.device) != working).to(master.device)
                    merged = torch.where(changed, mine.to(master.device, master.dtype), master)
                    rt.store.write(region, merged)
                rt.store.write(resting, mine)
    for u in units:
        u.unpin()
        rt.gatherer.release(u)
