"""The delayed update (offload_optimizer.delayed_update, ZeRO-Offload's DPU): each step's host Adam runs in the
background through the next step's forward and backward, and its weights arrive at the next step(). Against
single-process torch AdamW with the same delay (zkern.testing.reference_run) at stages 1-3 and stage 3 with
offload_param, with accumulation and clipping; and not against the same reference without the delay (the bar tells
the two apart). A checkpoint saved with an update in flight resumes exactly; a write through the store (a weight
set between steps) is not overwritten when the update lands; an error in the background step surfaces at the next
step; the configs it cannot serve are refused.

    python -m pytest tests/offload/test_delayed_update.py -q
"""

from __future__ import annotations

import dataclasses
import json
import threading

import pytest
import torch

import zkern
from zkern.config import ConfigError
from zkern.testing import TinyGPT, TrainSpec, assert_params_close, engine_run, reference_run, spawn
from zkern.testing.compare import compare_params

DELAYED = {"offload_optimizer": {"device": "cpu", "delayed_update": True}}
CASES = {
    "stage1": TrainSpec(stage=1, zero=DELAYED, reduce_bucket_size=5000, steps=8),
    "stage2-accum-clip": TrainSpec(stage=2, zero=DELAYED, accumulation=2, clip=0.05, reduce_bucket_size=5000, steps=8),
    "stage3": TrainSpec(stage=3, zero=DELAYED, steps=8),
    "stage3-param": TrainSpec(stage=3, zero={**DELAYED, "offload_param": {"device": "cpu"}}, steps=8),
}


def _runs(rank, world, specs):
    return [engine_run(rank, world, s) for s in specs]


@pytest.mark.dist
def test_the_delayed_update_trains_as_torch_adamw_with_the_same_delay_and_not_without_it():
    names = list(CASES)
    per_rank = spawn(_runs, 2, [CASES[n] for n in names])
    for i, name in enumerate(names):
        spec, got = CASES[name], per_rank[0][i]
        assert got["global_steps"] == spec.steps, name
        delayed_state, delayed_losses = reference_run(spec, 2)
        assert_params_close(got["state"], delayed_state, lr=spec.lr, steps=spec.steps)
        losses = [(a + b) / 2 for a, b in zip(per_rank[0][i]["losses"], per_rank[1][i]["losses"])]  # global batch's
        gap = max(abs(a - b) / abs(b) for a, b in zip(losses, delayed_losses))
        assert gap < 1e-5, f"{name}: loss curves differ from the delayed reference by {gap:.2e} relative"
        plain = dataclasses.replace(spec, zero={**spec.zero, "offload_optimizer": {"device": "cpu"}})
        plain_state, _ = reference_run(plain, 2)
        assert compare_params(got["state"], plain_state, lr=spec.lr, steps=spec.steps), \
            f"{name}: the bar cannot tell the delayed update from the plain one"


def _config(stage: int, **offload) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "device": "cpu",
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0,
                                  "offload_optimizer": {"device": "cpu", "delayed_update": True, **offload}}}


def _train(engine, steps: range) -> list[float]:
    losses = []
    for step in steps:
        ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = engine(ids, ids)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_saved_with_an_update_in_flight_resumes_exactly(stage, tmp_path):
    torch.manual_seed(0)
    engine = zkern.Engine(TinyGPT(), _config(stage))
    _train(engine, range(3))
    engine.save_checkpoint(tmp_path, tag="t")  # lands nothing: the update in flight stays so, saved as pending
    straight = _train(engine, range(3, 6))
    final = engine.full_state_dict()
    engine.destroy()
    torch.manual_seed(1)
    resumed_engine = zkern.Engine(TinyGPT(), _config(stage))
    resumed_engine.load_checkpoint(tmp_path, tag="t")
    assert _train(resumed_engine, range(3, 6)) == straight
    for name, value in resumed_engine.full_state_dict().items():
        assert torch.equal(value, final[name]), name
    resumed_engine.destroy()


@pytest.mark.parametrize("how", ["GatheredParameters", "safe_set_full_fp32_param"])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_weight_set_between_steps_is_not_overwritten_when_the_update_lands(stage, how):
    torch.manual_seed(0)
    engine = zkern.Engine(TinyGPT(), _config(stage))
    _train(engine, range(2))  # an update is in flight
    p = dict(engine.module.named_parameters())["blocks.0.fc.weight"]
    value = torch.full(tuple(engine.runtime.full_shape(p)), 0.25)
    if how == "GatheredParameters":
        with zkern.GatheredParameters([p], modifier_rank=0):
            p.data.copy_(value)
    else:
        zkern.safe_set_full_fp32_param(p, value)
    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(9))
    engine.backward(engine(ids, ids))
    engine.step()  # lands nothing (the write landed the update first), starts the next in the background
    with zkern.GatheredParameters([p]):  # the weights the forward computes with (exports include the next update)
        working = p.detach().clone()
    assert torch.equal(working.float(), value), "the landing overwrote the weight set between the steps"
    engine.destroy()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_write_of_the_values_held_before_the_update_in_flight_is_a_write(stage):
    """Inside GatheredParameters(modifier_rank=0) with an update in flight, a layer norm reset to ones (the values the
    forward still computes with before the update lands) is reset: the context shows the trained weights, so every
    written element differs from them and is written. Before, the context showed the weights before the update, a
    reset element compared equal to them, and it kept the update's value (2026-11-28, fuzz seed 457105)."""
    torch.manual_seed(0)
    engine = zkern.Engine(TinyGPT(), _config(stage))
    _train(engine, range(1))  # update 0 in flight: the working weights are still the initial ones
    p = dict(engine.module.named_parameters())["blocks.0.ln1.weight"]
    with zkern.GatheredParameters([p], modifier_rank=0):
        assert not torch.equal(p.detach().float(), torch.ones_like(p, dtype=torch.float32)), \
            "the context shows the weights before the update in flight"
        p.data.fill_(1.0)
    state = engine.full_state_dict()
    assert torch.equal(state["blocks.0.ln1.weight"], torch.ones_like(state["blocks.0.ln1.weight"]))
    assert not torch.equal(state["blocks.0.ln2.weight"], torch.ones_like(state["blocks.0.ln2.weight"]))  # landed
    engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_the_next_backward_copies_a_chunk_down_only_once_the_delayed_adam_is_done_with_it(stage):
    """The background Adam steps the chunks in the order they landed, and the next backward's copy of a chunk waits
    for that chunk's Adam only. Here the Adam's first chunk is held until the next backward asks for its buffer (or
    the step lands the update): a copy that did not wait would overwrite the gradients the held Adam has yet to
    read, and the weights would differ from the same run unheld."""
    orders = []

    def run(hold: bool) -> tuple[dict, int]:
        torch.manual_seed(0)
        engine = zkern.Engine(TinyGPT(), _config(stage))
        host, gate, first, held, stuck = engine.host_step, threading.Event(), {}, [0], [False]
        gate.set()
        if hold:
            launch, wait_down, wait_chunk, settle = host._launch, host._wait_down, host._wait_chunk, host.settle

            def held_launch(optimizer, grad_scale, active, order):
                orders.append((list(order), list(host._landed)))
                first["chunk"] = order[0]
                gate.clear()
                launch(optimizer, grad_scale, active, order)

            def held_wait_down(gi, ci):
                # until the next backward asks for a chunk's buffer, or the update lands (the bound only keeps a
                # broken wait from hanging the suite)
                if (gi, ci) == first.get("chunk") and not gate.wait(timeout=300):
                    stuck[0] = True
                wait_down(gi, ci)

            def released_by_copy(key):
                if not gate.is_set():  # the first copy since the launch: the Adam's first chunk is still held
                    held[0] += 1
                    gate.set()
                return wait_chunk(key)

            def released_by_settle():
                gate.set()
                return settle()

            host._launch, host._wait_down = held_launch, held_wait_down
            host._wait_chunk, host.settle = released_by_copy, released_by_settle
        assert sum(len(g.chunks) for g in host.host_groups) > 2
        _train(engine, range(4))
        state = engine.full_state_dict()
        engine.destroy()
        assert not stuck[0], "the held chunk was never released: nothing asked for its buffer or landed the update"
        return state, held[0]

    free, _ = run(hold=False)
    held_state, times_held = run(hold=True)
    for name, value in free.items():
        assert torch.equal(held_state[name], value), name
    # every launch but the last is followed by a backward whose first copy finds the Adam held
    assert times_held == 3, f"the Adam's first chunk was held at {times_held} copies, not 3"
    for order, landed in orders:  # the chunks as they landed in backward (here all of them), each once
        assert landed and order[:len(landed)] == landed and len(set(order)) == len(order)


def test_an_error_in_the_background_step_surfaces_at_the_next_step(monkeypatch):
    torch.manual_seed(0)
    engine = zkern.Engine(TinyGPT(), _config(2))

    def broken(*args, **kwargs):
        raise ValueError("planted")

    monkeypatch.setattr(engine.optimizer, "step", broken)
    _train(engine, range(1))  # the background Adam fails
    with pytest.raises(RuntimeError, match="delayed host Adam step failed.*planted"):
        _train(engine, range(1, 2))


@pytest.mark.parametrize("change", [
    {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "delayed_update": True}},
    {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}},
    {"optimizer": None},
], ids=["optimizer-on-nvme", "parameters-on-nvme", "a-torch-optimizer"])
def test_what_the_delayed_update_cannot_serve_is_refused(change):
    cfg = _config(3)
    if "optimizer" in change:
        cfg.pop("optimizer")
    else:
        cfg["zero_optimization"] = {**cfg["zero_optimization"], **change}
    with pytest.raises(ConfigError, match="delayed_update"):
        zkern.Config.load(cfg)


def _count_refreshes(engine, stage: int) -> list[int]:
    """A list that grows by one each time the runtime brings its whole copies up to date."""
    calls, runtime = [], engine.runtime
    owner, name = (runtime.gatherer, "after_step") if stage == 3 else (runtime.groups[0], "gather_params")
    inner = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("stage", [2, 3])
def test_a_delayed_step_refreshes_the_whole_copies_once_and_a_skipped_one_still_shows_the_landed_update(stage):
    torch.manual_seed(0)
    engine = zkern.Engine(TinyGPT(), _config(stage))
    calls = _count_refreshes(engine, stage)
    _train(engine, range(3))
    assert len(calls) == 3, f"{len(calls)} refreshes of the whole copies in 3 steps (a landing and after_step each)"
    # a step whose gradient is not finite is skipped, and still lands the update in flight: the next forward must
    # compute with it, so the whole copies follow
    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(5))
    engine.backward(engine(ids, ids) * float("inf"))
    engine.step()
    assert engine.skipped_steps == 1 and len(calls) == 4
    master = engine.full_state_dict()
    working = engine.full_working_state_dict()
    for k, v in master.items():
        assert torch.equal(working[k], v.to(working[k].dtype)), f"{k}: the forward's copy is not the landed weights"
    engine.destroy()


@pytest.mark.parametrize("stage", [2, 3])
def test_exports_after_the_last_step_hold_the_trained_model(stage, tmp_path):
    # The trained model of a delayed run includes the last step's update (the delayed reference lands it at the
    # end); every export gives it, though the forward's weights still trail it, and giving it changes nothing.
    spec = TrainSpec(stage=stage, zero={**DELAYED, "stage3_gather_16bit_weights_on_model_save": True}, steps=4,
                     reduce_bucket_size=5000, lr=1e-2)
    engine = spec.build_engine(spec.make_model(), 1)
    batches = spec.batches(1)
    for step in range(spec.steps):
        idx, tgt = batches[step][0][0]
        engine.backward(spec.loss(engine, idx, tgt, step))
        engine.step()
    trained, _ = reference_run(spec, 1)
    master = engine.full_state_dict()
    exports = {"full_working_state_dict": engine.full_working_state_dict(),
               "stream_full_weights": {n: t for b in engine.stream_full_weights() for n, t in b}}
    path = engine.save_16bit_model(tmp_path)
    exports["save_16bit_model"] = torch.load(path, weights_only=True)
    names = [n for n, _ in engine.module.named_parameters()]
    for how, state in exports.items():
        for name in names:  # fp32 training: the working weights are the masters' own values
            assert torch.equal(state[name], master[name]), f"{how}: {name} is not the trained weight"
        assert_params_close({n: state[n] for n in names}, {n: trained[n] for n in names}, lr=spec.lr,
                            steps=spec.steps)
    assert engine.host_step.pending(), "an export landed the update the next forward must not see yet"
    engine.destroy()


READS = ["save", "async-save", "full_state_dict", "full_working_state_dict", "stream_full_weights",
         "GatheredParameters"]
MODES = {"cpu": {"device": "cpu"}, "delayed": {"device": "cpu", "delayed_update": True},
         "speculative": {"device": "cpu", "speculative_step": True}, "nvme": {"device": "nvme"}}


def _read_run(stage: int, mode: str, reads: bool, tmp) -> tuple[list[float], dict]:
    torch.manual_seed(0)
    cfg = _config(stage)
    offload = {**MODES[mode], **({"nvme_path": str(tmp / "nvme")} if mode == "nvme" else {})}
    cfg["zero_optimization"] = {**cfg["zero_optimization"], "offload_optimizer": offload,
                                "stage3_gather_16bit_weights_on_model_save": True}
    cfg["gradient_clipping"] = 0.0  # the speculative step's guesses stand
    engine = zkern.Engine(TinyGPT(), cfg)
    losses = _train(engine, range(2))
    if reads:
        engine.save_checkpoint(tmp / "ckpt", tag="sync")
        engine.save_checkpoint(tmp / "ckpt", tag="async", async_save=True)
        losses += _train(engine, range(2, 3))  # while the asynchronous save writes
        engine.wait_checkpoint()
        engine.full_state_dict()
        engine.full_working_state_dict()
        for _ in engine.stream_full_weights():
            pass
        p = dict(engine.module.named_parameters())["blocks.0.fc.weight"]
        with zkern.GatheredParameters([p], modifier_rank=0):  # entered to write, and nothing written
            pass
        with zkern.GatheredParameters([p]):
            pass
    else:
        losses += _train(engine, range(2, 3))
    losses += _train(engine, range(3, 6))
    state = engine.full_state_dict()
    engine.destroy()
    return losses, state


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("stage", [2, 3])
def test_a_save_or_a_read_never_changes_the_run(stage, mode, tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain_losses, plain_state = _read_run(stage, mode, False, tmp_path / "a")
    read_losses, read_state = _read_run(stage, mode, True, tmp_path / "b")
    assert read_losses == plain_losses, f"{READS} changed the run's losses: {read_losses} against {plain_losses}"
    for name, value in plain_state.items():
        assert torch.equal(read_state[name], value), name


def test_a_pending_update_resumed_by_an_engine_that_does_not_delay_lands_at_the_load(tmp_path, caplog):
    torch.manual_seed(0)
    engine = zkern.Engine(TinyGPT(), _config(2))
    _train(engine, range(2))
    engine.save_checkpoint(tmp_path, tag="t")
    trained = engine.full_state_dict()
    engine.destroy()
    manifest = json.loads((tmp_path / "t" / "manifest.json").read_text())["manifest"]
    assert manifest["pending_update"] and any(e["kind"] == "working" for e in manifest["tensors"])
    cfg = _config(3)
    cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    torch.manual_seed(1)
    plain = zkern.Engine(TinyGPT(), cfg)
    with caplog.at_level("INFO", logger="zkern"):
        plain.load_checkpoint(tmp_path, tag="t")
    assert "saved with a delayed update pending" in caplog.text
    working = plain.full_working_state_dict()
    for name, value in trained.items():  # the forward computes with the landed weights from the first step
        assert torch.equal(working[name], value.to(working[name].dtype)), name
    plain.destroy()
