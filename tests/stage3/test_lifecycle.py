"""The stage-3 unit lifecycle: only legal transitions, invariants that name what broke, stale copies refused."""

import pytest
import torch

import zkern
from zkern.comm.collectives import Work
from zkern.core.partition import plan_unit_layout
from zkern.stage3.lifecycle import DataState, GradState, InvariantError, Unit, pass_end_violations
from zkern.stage3.units import UnitPlan
from zkern.testing import TrainSpec


def make_unit(name="blocks.0.fc", persistent=False) -> Unit:
    p = torch.nn.Parameter(torch.zeros(6))
    bucket = plan_unit_layout([[6]], world=2).buckets[0]
    return Unit(0, UnitPlan(name, [p], ["weight"], persistent=persistent), bucket, trainable=1,
                readers=("blocks.0.fc",))


def test_data_transitions_follow_the_machine_and_refuse_the_rest():
    u = make_unit()
    with pytest.raises(InvariantError, match="unit 'blocks.0.fc'.*marked gathered before"):
        u.arrive()
    with pytest.raises(InvariantError, match="put to rest"):
        u.rest()
    u.issue(torch.empty(6), Work(None, None, ""), version=3)
    with pytest.raises(InvariantError, match="not at rest"):
        u.issue(torch.empty(6), Work(None, None, ""), version=3)
    u.work = None
    u.arrive()
    assert u.data is DataState.GATHERED and u.live
    u.ref()
    with pytest.raises(InvariantError, match="while held"):
        u.rest()
    u.unref()
    with pytest.raises(InvariantError, match="did not hold it"):
        u.unref()
    u.rest()
    assert u.data is DataState.REST and u.buffer is None


def test_a_stale_copy_is_recognised():
    u = make_unit()
    u.issue(torch.empty(6), None, version=1)
    u.arrive()
    u.check_fresh(1)
    with pytest.raises(InvariantError, match="shard version 1 .* version 2 \\(a stale copy\\)"):
        u.check_fresh(2)


def test_gradient_transitions_once_per_pass():
    u = make_unit()
    with pytest.raises(InvariantError, match="completed twice|ended before"):
        u.close_grads()
    u.open_grads()
    with pytest.raises(InvariantError, match="were not closed"):
        u.open_grads()
    u.complete_grads()
    with pytest.raises(InvariantError, match="completed twice"):
        u.complete_grads()
    u.close_grads()
    assert u.grads is GradState.IDLE


def test_pass_end_violations_name_the_unit_and_what_is_wrong():
    u, persistent = make_unit(), make_unit("<persistent>", persistent=True)
    assert pass_end_violations([u, persistent], "backward") == []
    persistent.data = DataState.GATHERED  # the persistent unit stays whole: not a violation
    u.held = True
    u.open_grads()
    bad = pass_end_violations([u, persistent], "backward")
    assert len(bad) == 2 and "gradients still pending" in bad[0] and "held True" in bad[1]
    u.pins = 1  # pinned by GatheredParameters: whole on purpose
    assert len(pass_end_violations([u], "forward")) == 0


def test_the_optimizer_step_never_leaves_a_stale_gathered_copy():
    spec = TrainSpec(stage=3, steps=1)
    engine = zkern.Engine(spec.make_model(), spec.config(1))
    idx, tgt = spec.batches(1)[0][0][0]
    engine.backward(engine(idx, tgt))
    unit = next(u for u in engine.runtime.units if not u.persistent and u.name)
    engine.runtime.gatherer.gather(unit, async_op=False)  # a copy nobody released, as a broken hook would leave
    with pytest.raises(InvariantError, match=f"unit '{unit.name}'.*still gathered after the optimizer step"):
        engine.step()
