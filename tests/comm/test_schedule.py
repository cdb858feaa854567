"""One collective schedule on every rank: the plan itself, and every rank's recorded sequence of collectives at
stages 0-3 when ranks use different parameters in a step (routed experts, a branch one rank takes) with HF
Trainer's two parameter groups."""

import contextlib

import pytest
import torch
import torch.distributed as dist

from zkern.comm.collectives import Comm
from zkern.comm.schedule import ReduceSchedule
from zkern.testing import TrainSpec, assert_params_close, engine_run, reference_run, spawn


def schedule(sizes, order):
    return ReduceSchedule(sizes, order, Comm(None, 0, 1, 10.0), torch.device("cpu"))


def test_buckets_launch_in_plan_order_whatever_order_they_complete_in():
    s = schedule([2, 1, 3], [2, 1, 0])
    assert s.add(0, 2) == []  # complete, but the plan starts with bucket 2
    assert s.add(1) == []
    assert s.add(2, 2) == [] and not s.launched(0)
    assert s.add(2) == [2, 1, 0] and s.launched(0)
    with pytest.raises(RuntimeError, match="bucket 2 received 4 contributions, it has 3"):
        s.add(2)


def test_flush_launches_the_rest_in_order_and_the_first_pass_fixes_the_plan():
    s = schedule([1, 1, 1], [0, 1, 2])
    assert s.add(2) == [] and s.add(1) == []
    assert s.flush() == [0, 1, 2]
    s.end()  # world 1: rank 0's own completion order (2, 1, then 0 which only the flush completed)
    assert s.plan == [2, 1, 0] and s.observed
    s.begin()
    assert s.add(0) == [] and s.add(1) == [] and s.add(2) == [2, 1, 0]
    s.end()
    assert s.plan == [2, 1, 0]  # later passes never change it
    with pytest.raises(ValueError, match="each of the 3 buckets once"):
        schedule([1, 1, 1], [0, 0, 2])


def test_deferred_buckets_wait_for_the_flush_and_the_others_do_not_wait_for_them():
    """Stage 3's reduce groups of divergent units (routed experts) launch only at the end of backward."""
    s = schedule([1, 1, 1], [2, 1, 0])
    s.begin(frozenset({1}))
    assert s.add(1) == []  # complete, and deferred
    assert s.add(2) == [2] and not s.launched(1)
    assert s.add(0) == [0]  # the plan goes on past the deferred bucket
    assert s.flush() == [1] and s.launched(1)
    s.begin(frozenset({1}))
    assert s.add(2) == [2] and s.flush() == [1, 0]  # plan order; 0 reduces what it has


# -- the recorded sequences ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def recording(calls: list):
    """Record every torch.distributed collective issued inside: (group, kind, numel, dtype), groups numbered by
    first use, which every rank shares."""
    import zkern.comm.collectives as comm

    groups: dict[int, int] = {}

    def wrap(kind, fn):
        def recorded(tensor, *args, group=None, **kwargs):
            target = args[0] if kind in ("all_gather", "reduce_scatter") else tensor
            calls.append((groups.setdefault(id(group), len(groups)), kind, target.numel(), str(target.dtype)))
            return fn(tensor, *args, group=group, **kwargs)
        return recorded

    names = ("_all_gather_single", "_reduce_scatter_single", "_all_gather_list", "_reduce_scatter_exchange")
    saved = (dist.all_reduce, dist.broadcast, *(getattr(comm, n) for n in names))
    dist.all_reduce, dist.broadcast = wrap("all_reduce", saved[0]), wrap("broadcast", saved[1])
    for name, fn in zip(names, saved[2:]):
        setattr(comm, name, wrap("all_gather" if "gather" in name else "reduce_scatter", fn))
    try:
        yield
    finally:
        dist.all_reduce, dist.broadcast = saved[:2]
        for name, fn in zip(names, saved[2:]):
            setattr(comm, name, fn)


def recording_worker(rank, world, specs):
    runs = []
    for spec in specs:
        calls = []
        with recording(calls):
            result = engine_run(rank, world, spec)
        result["calls"] = calls
        runs.append(result)
    return runs


def diverging_specs(stage, world, bucket):
    apart = {0: list(range(world)), 2: list(range(world))[::-1]}  # rank r's sequences to expert r, then reversed
    return [
        TrainSpec(stage=stage, arch="moe", steps=4, param_groups=True, forced_routes=apart, reduce_bucket_size=bucket),
        TrainSpec(stage=stage, steps=4, accumulation=2, param_groups=True, model=dict(extra_branch=True),
                  extra_ranks=(1,), reduce_bucket_size=bucket),  # a branch only rank 1 takes
    ]


@pytest.mark.dist
@pytest.mark.parametrize("world,bucket", [(2, 64), (4, 1000)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_rank_issues_the_same_collectives_and_the_result_is_single_process_adamw(stage, world, bucket):
    specs = diverging_specs(stage, world, bucket)
    per_rank = spawn(recording_worker, world, specs)
    for i, spec in enumerate(specs):
        # Per process group: collectives pair up within a group (stage 3 reduces on a group of its own, so how its
        # reductions interleave with the gathers may differ between ranks; each group's own sequence may not).
        sequences = [{g: [c for c in r[i]["calls"] if c[0] == g] for g in {c[0] for c in r[i]["calls"]}}
                     for r in per_rank]
        assert sum(len(seq) for seq in sequences[0].values()) > 10
        for rank, by_group in enumerate(sequences[1:], 1):
            assert by_group.keys() == sequences[0].keys()
            for g, seq in by_group.items():
                ref = sequences[0][g]
                first = next((k for k, (a, b) in enumerate(zip(ref, seq)) if a != b), min(len(ref), len(seq)))
                assert seq == ref, (f"group {g}: rank {rank} departs from rank 0 at collective {first}: "
                                    f"{seq[first:first + 1]} vs {ref[first:first + 1]}")
        ref_state, _ = reference_run(spec, world)
        assert_params_close(per_rank[0][i]["state"], ref_state, lr=spec.lr, steps=spec.steps)
        assert per_rank[0][i]["skipped"] == 0


def stage2_buffers_worker(rank, world, specs):
    import zkern
    from zkern.testing import engine_training_loop

    out = []
    for spec in specs:
        model = spec.make_model()
        engine = zkern.Engine(model, spec.config(world), optimizer=spec.client_optimizer(model))
        launched_in_backward = []
        hook = model.tok.weight.register_post_accumulate_grad_hook(in_flight_counter(engine, launched_in_backward))
        engine_training_loop(spec, rank, world, engine)
        hook.remove()
        out.append({"buffers": sum(g._buffer_count for g in engine.runtime.groups),
                    "launched_before_last_grad": launched_in_backward})
    return out


def in_flight_counter(engine, seen: list):
    """A gradient hook that records how many bucket reductions are in flight when it fires (during backward)."""
    def count(p):
        seen.append(sum(len(g.reducer) for g in engine.runtime.groups))
    return count


@pytest.mark.dist
def test_stage2_with_an_unused_parameter_still_overlaps_and_holds_no_more_buffers():
    """tok.weight (the tied embedding) gets its gradient last in backward. By then buckets must already be in
    flight, with or without a parameter that gets no gradient (the extra branch, unused); and the unused
    parameter must not make the run allocate more bucket buffers."""
    base = dict(stage=2, steps=3, reduce_bucket_size=3000, model=dict(extra_branch=True))
    used, unused = TrainSpec(**base, extra_every=1), TrainSpec(**base)
    results = spawn(stage2_buffers_worker, 2, [used, unused])
    for r in results:
        with_extra, without = r
        assert all(n > 0 for n in without["launched_before_last_grad"]), without
        assert without["buffers"] <= with_extra["buffers"], (without, with_extra)
