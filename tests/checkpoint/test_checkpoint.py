"""Checkpoints resume bit for bit at world 2 (stages 0-3, fp32, fp16 with loss-scale changes, bf16, offload,
accumulation, a client optimizer with two groups), and an asynchronous save writes the state of the moment it was
called.

    python -m pytest tests/checkpoint/test_checkpoint.py -q
"""

from __future__ import annotations

import pytest
import torch
from checkpoint_runs import SCHEDULER, assert_same_state, build, resume_first_half, resume_second_half, spec_for, train

import zkern
from zkern.checkpoint import CheckpointError, load_fp32_state_dict, load_optimizer_state_dict
from zkern.testing.ranks import spawn

FP16 = {"initial_scale_power": 16, "hysteresis": 1, "loss_scale_window": 2}


def variants(world: int) -> dict:
    base = {"extra_config": SCHEDULER}
    return {
        "stage0": spec_for(world, stage=0, **base),
        "stage1_accum2": spec_for(world, stage=1, accumulation=2, **base),
        "stage2": spec_for(world, stage=2, **base),
        "stage3": spec_for(world, stage=3, **base),
        "stage2_fp16": spec_for(world, stage=2, precision="fp16", fp16=FP16, **base),
        "stage3_fp16": spec_for(world, stage=3, precision="fp16", fp16=FP16, **base),
        "stage2_offload": spec_for(world, stage=2, zero={"offload_optimizer": {"device": "cpu"}}, **base),
        "stage3_bf16_offload": spec_for(world, stage=3, precision="bf16",
                                        zero={"offload_optimizer": {"device": "cpu"},
                                              "offload_param": {"device": "cpu"}}, **base),
        "stage1_client_groups": spec_for(world, stage=1, param_groups=True),
        # frozen layers at stage 3: fc.bias lies wholly in rank 1's chunk of its unit (rank 0 holds none of it)
        "stage3_frozen": spec_for(world, stage=3, model={"frozen": ("fc",)}, **base),
        "stage3_frozen_int8": spec_for(world, stage=3, model={"frozen": ("qkv", "fc", "fc_out")},
                                       zero={"zero_quantized_nontrainable_weights": True,
                                             "zeropp_weight_group_size": 64}, **base),
    }


def test_resume_is_bit_exact_at_every_stage(tmp_path):
    world = 2
    specs = variants(world)
    first = spawn(resume_first_half, world, specs, str(tmp_path))
    second = spawn(resume_second_half, world, specs, str(tmp_path))  # fresh processes
    for name in specs:
        for rank in range(world):
            a, b = first[rank][name], second[rank][name]
            u = a["uninterrupted"]
            assert b["path"] == str(tmp_path / name / "ckpt" / "global_step3")
            assert b["client"] == {"epoch": 1, "rank_note": [name]}
            assert b["after_load"] == a["at_save"], name
            assert torch.equal(b["rng"], a["rng"]), f"{name}: rank {rank}'s generator state was not restored"
            assert b["losses"] == u["losses"][3:], f"{name}: losses after resuming differ"
            for key in ("global_steps", "skipped", "micro_steps", "loss_scale", "lrs"):
                assert b[key] == u[key], f"{name}: {key} {b[key]} != {u[key]}"
        # Masters, Adam moments and step counts, whole, as both runs saved them at the end.
        ends = [tmp_path / name / run for run in ("uninterrupted", "resumed")]
        assert_same_state(load_fp32_state_dict(ends[0], "end"), load_fp32_state_dict(ends[1], "end"), name)
        assert_same_state(load_optimizer_state_dict(ends[0], "end"), load_optimizer_state_dict(ends[1], "end"),
                            name)
    # The fp16 runs changed their loss scale inside the first 3 steps (a skip, or a growth), so the scaler's state
    # was part of what had to resume.
    for name in ("stage2_fp16", "stage3_fp16"):
        assert first[0][name]["at_save"]["loss_scale"] != 2.0 ** FP16["initial_scale_power"], name


def test_async_save_writes_the_state_of_its_call_while_training_goes_on(tmp_path):
    spec = spec_for(1, stage=2, extra_config=SCHEDULER)
    engine = build(spec, 1)
    train(engine, spec, 0, 2, 0, 1)
    expected_weights = engine.full_state_dict()
    engine.save_checkpoint(tmp_path / "sync", tag="at2")
    assert engine.save_checkpoint(tmp_path / "async", tag="at2", async_save=True) is None
    train(engine, spec, 2, 4, 0, 1)  # changes every master and moment while the writer may still run
    assert engine.wait_checkpoint() == str(tmp_path / "async" / "at2")
    got = load_fp32_state_dict(tmp_path / "async")
    assert_same_state(got, expected_weights, "async weights")
    assert_same_state(load_optimizer_state_dict(tmp_path / "async"), load_optimizer_state_dict(tmp_path / "sync"),
                        "async optimizer state")


def test_async_save_keeps_the_client_state_of_its_call(tmp_path):
    spec = spec_for(1, stage=1)
    engine = build(spec, 1)
    train(engine, spec, 0, 1, 0, 1)
    client = {"epoch": 3, "seen": [1, 2]}
    engine.save_checkpoint(tmp_path, client_state=client, async_save=True)
    client["epoch"] += 1  # the loop goes on while the writer runs
    client["seen"].append(3)
    engine.wait_checkpoint()
    _, loaded = build(spec, 1).load_checkpoint(tmp_path)
    assert loaded == {"epoch": 3, "seen": [1, 2]}


def test_async_save_error_surfaces_on_the_next_call(tmp_path):
    spec = spec_for(1, stage=1)
    engine = build(spec, 1)
    train(engine, spec, 0, 1, 0, 1)
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the checkpoint directory should be")
    engine.save_checkpoint(blocker, async_save=True)
    with pytest.raises(CheckpointError, match="not_a_dir"):
        engine.wait_checkpoint()
    engine.wait_checkpoint()  # reported once, then the engine saves again
    assert engine.save_checkpoint(tmp_path / "ok") == str(tmp_path / "ok" / "global_step1")


def test_save_refuses_what_it_cannot_keep(tmp_path):
    spec = spec_for(1, stage=0, accumulation=2)
    engine = build(spec, 1)
    train(engine, spec, 0, 1, 0, 1)
    with pytest.raises(CheckpointError, match="tuple.*use a list"):
        engine.save_checkpoint(tmp_path, client_state={"pair": (1, 2)})
    with pytest.raises(CheckpointError, match="Tensor"):
        engine.save_checkpoint(tmp_path, client_state={"t": torch.ones(2)})
    with pytest.raises(CheckpointError, match="key 3"):
        engine.save_checkpoint(tmp_path, client_state={3: "int key"})
    with pytest.raises(CheckpointError, match="directory name"):
        engine.save_checkpoint(tmp_path, tag="../escape")
    assert not any(p.name.startswith("global") for p in tmp_path.iterdir())


def _micro(engine, k: int) -> float:
    idx = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(k))
    loss = engine(idx, idx)
    engine.backward(loss)
    engine.step()
    return loss.item()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_save_between_micro_steps_holds_the_last_step_and_changes_nothing(stage, tmp_path):
    """DeepSpeed's test_save_before_accum_grad_is_done: a save between the micro-steps of an accumulation holds the
    state at the last optimizer step (the pending gradients are not part of it): a resume from it equals a resume
    from the save at that step, and the saving run goes on with its gradients as if it had not saved."""
    spec = spec_for(1, stage=stage, accumulation=2)
    runs = {}
    for name, save_at in (("boundary", 4), ("mid", 5), ("none", None)):
        engine = build(spec, 1)
        losses = []
        for k in range(8):  # micro-steps; the optimizer steps after 1, 3, 5, 7
            if k == save_at:
                engine.save_checkpoint(tmp_path / name, tag="t")
            losses.append(_micro(engine, k))
        runs[name] = (losses, engine.full_state_dict())
        engine.destroy()
    assert runs["mid"][0] == runs["none"][0]  # the save changed nothing in the run that saved
    assert all(torch.equal(v, runs["none"][1][k]) for k, v in runs["mid"][1].items())
    resumed = {}
    for name in ("boundary", "mid"):
        engine = build(spec, 1)
        engine.load_checkpoint(tmp_path / name, tag="t")
        assert engine.global_steps == 2 and engine.is_gradient_accumulation_boundary() is False
        resumed[name] = ([_micro(engine, k) for k in range(4, 8)], engine.full_state_dict())
        engine.destroy()
    assert resumed["mid"][0] == resumed["boundary"][0] == runs["none"][0][4:]
    for key, value in resumed["boundary"][1].items():
        assert torch.equal(resumed["mid"][1][key], value), key


def test_nothing_to_load_warns_and_returns_none(tmp_path, caplog):
    spec = spec_for(1, stage=1)
    engine = build(spec, 1)
    assert engine.load_checkpoint(tmp_path / "empty") == (None, None)
    assert engine.load_checkpoint(tmp_path, tag="global_step7") == (None, None)
    assert "nothing to load" in caplog.text


def test_module_only_and_fresh_optimizer_loads(tmp_path):
    spec = spec_for(1, stage=2, extra_config=SCHEDULER)
    engine = build(spec, 1)
    train(engine, spec, 0, 3, 0, 1)
    engine.save_checkpoint(tmp_path)
    saved = engine.full_state_dict()
    fresh = build(spec, 1)
    fresh.load_checkpoint(tmp_path, load_module_only=True)
    assert_same_state(fresh.full_state_dict(), saved, "weights")
    assert fresh.global_steps == 0 and fresh.optimizer.steps[0][0] == 0
    assert float(fresh.optimizer.exp_avg[0].abs().sum()) == 0.0
    other = build(spec, 1)
    other.load_checkpoint(tmp_path, load_optimizer_states=False)
    assert other.global_steps == 3 and float(other.optimizer.exp_avg[0].abs().sum()) == 0.0
    assert other.lr_scheduler.last_batch_iteration == engine.lr_scheduler.last_batch_iteration


def test_exported_names():
    assert zkern.CheckpointError is CheckpointError
    assert callable(zkern.Engine.save_checkpoint) and callable(zkern.Engine.load_checkpoint)


class _StillWriting:
    def done(self) -> bool:
        return False

    def wait(self) -> None:
        return None


def in_flight_worker(rank: int, world: int, root: str) -> tuple[bool, bool]:
    spec = spec_for(world, stage=1)
    engine = build(spec, world)
    train(engine, spec, 0, 1, rank, world)
    idle = engine.checkpoint_in_flight
    engine.save_checkpoint(root, async_save=True)
    engine.wait_checkpoint()
    if rank == 1:
        engine.checkpointer.pending = _StillWriting()  # rank 1's writer is slower than rank 0's
    return idle, engine.checkpoint_in_flight


def test_checkpoint_in_flight_is_the_same_answer_on_every_rank(tmp_path):
    assert spawn(in_flight_worker, 2, str(tmp_path)) == [(False, True), (False, True)]
