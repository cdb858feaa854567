"""loss.backward() instead of engine.backward(loss), as DeepSpeed 0.19 takes it (its TestZeroUserBackwardBasic): the
same pass, with the same scaling (fp16's loss scale, the mean over an accumulation, the division before the sum over
ranks) and reductions, at stages 0-3; the numbers equal engine.backward's bit for bit where the factor is a power of
two. A loss that reaches a parameter without passing the engine's outputs is refused naming engine.backward; a user
backward that raised leaves nothing open.

    python -m pytest tests/engine/test_user_backward.py -q
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import zkern
from zkern.testing import TrainSpec, spawn

CASES = [TrainSpec(stage=s, steps=3, accumulation=2, precision=p, reduce_bucket_size=3000)
         for s, p in ((0, "fp32"), (1, "fp16"), (2, "bf16"), (3, "fp32"), (3, "fp16"))]


def _train(rank: int, world: int, spec: TrainSpec, user: bool) -> dict:
    torch.manual_seed(spec.seed)
    engine = zkern.Engine(spec.make_model(), spec.config(world))
    losses = []
    for micro_steps in spec.batches(world):
        for micro in micro_steps:
            idx, tgt = micro[rank]
            loss = engine(idx, tgt)
            if user:
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    out = {"losses": losses, "state": engine.full_state_dict(), "steps": engine.global_steps,
           "scale": engine.loss_scale}
    engine.destroy()
    return out


def _both(rank: int, world: int) -> list:
    return [(_train(rank, world, s, False), _train(rank, world, s, True)) for s in CASES]


@pytest.mark.dist
def test_loss_backward_trains_as_engine_backward_at_every_stage():
    for rank, pairs in enumerate(spawn(_both, 2)):
        for spec, (called, user) in zip(CASES, pairs):
            where = f"rank {rank} stage {spec.stage} {spec.precision}"
            assert user["steps"] == called["steps"] == 3 and user["scale"] == called["scale"], where
            assert user["losses"] == called["losses"], where
            for name, value in called["state"].items():
                assert torch.equal(user["state"][name], value), f"{where}: {name}"


def test_a_loss_that_does_not_pass_the_outputs_is_refused_and_a_failed_backward_leaves_nothing_open():
    spec = dataclasses.replace(CASES[3], accumulation=1)
    torch.manual_seed(spec.seed)
    engine = zkern.Engine(spec.make_model(), spec.config(1))
    (idx, tgt), = spec.batches(1)[0][0]
    with pytest.raises(RuntimeError, match="without passing the engine's outputs.*engine.backward"):
        sum(p.square().sum() for p in engine.module.parameters() if p.numel()).backward()

    def fail(grad):
        raise RuntimeError("planted: out of memory")
    def watch(module, args, out):
        out.register_hook(fail)
    hook = engine.module.blocks[0].register_forward_hook(watch)
    out = engine(idx, tgt)
    hook.remove()
    with pytest.raises(RuntimeError, match="planted"):
        out.backward()  # raises inside the pass its output opened
    assert engine.user_backward.factor is not None
    loss = engine(idx, tgt)  # the next forward drops the pass the failed backward opened
    loss.backward()
    engine.step()
    assert engine.global_steps == 1
    engine.destroy()
