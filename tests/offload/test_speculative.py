"""The speculative offloaded step (offload_optimizer.speculative_step, or DeepSpeed's super_offload): each gradient
chunk's host Adam runs in the boundary's backward as the chunk lands, guessing an unclipped step, and step() keeps
the guess or undoes it. Against the same engine without it, bit for bit, at stages 1-3: with fp16 overflow on one
rank and clipping that bites (guesses undone), with bf16 and clipping that does not (guesses kept), with a learning
rate changed, a weight and a gradient written, and gradients dropped between backward and step, and across a
checkpoint resumed by a fresh engine; the step's accounting says which guesses stood and why the others did not.

    python -m pytest tests/offload/test_speculative.py -q
"""

from __future__ import annotations

import pytest
import torch
from fake_cuda import FakeCuda

import zkern
from zkern.config import ConfigError
from zkern.testing import TinyGPT, spawn


def _config(stage: int, speculative: bool, precision: str, clip: float, offload_param: bool = False) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu", "speculative_step": speculative}}
    if offload_param:  # stage 3's parameter shard rests on the host: the guessed chunks' new values wait in staging
        zero["offload_param"] = {"device": "cpu"}
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 0,
           "device": "cpu", "gradient_clipping": clip, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
           "zero_optimization": zero}
    if precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    else:
        cfg["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
        cfg["bf16_stochastic_rounding"] = True  # the redone steps must draw the same rounding bits
    return cfg


def _backward(engine, rank: int, seed: int, poison: bool = False) -> None:
    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(100 * seed + rank))
    loss = engine(ids, ids)
    engine.backward(loss * float("inf") if poison else loss)


def _run(rank: int, stage: int, speculative: bool, precision: str, clip: float, ckpt: str,
         offload_param: bool = False) -> dict:
    torch.manual_seed(0)
    cfg = _config(stage, speculative, precision, clip, offload_param)
    engine = zkern.Engine(TinyGPT(), cfg)
    fates = []

    def micro(seed: int, poison: bool = False, before_step=None) -> None:
        _backward(engine, rank, seed, poison)
        if before_step is not None:
            before_step()
        steps = engine.global_steps
        engine.step()
        if engine.global_steps != steps:  # an accumulation boundary: what became of its guess
            fates.append(engine.host_step.last_step["speculation"] if engine.was_step_applied() else "skipped")

    def halve_a_gradient():
        p = dict(engine.module.named_parameters())["blocks.0.fc.weight"]
        zkern.safe_set_full_grad(p, zkern.safe_get_full_grad(p) * 0.5)

    def set_a_weight():
        p = dict(engine.module.named_parameters())["blocks.1.fc.weight"]
        zkern.safe_set_full_fp32_param(p, zkern.safe_get_full_fp32_param(p) * 0.5)

    def lower_the_lr():
        for group in engine.optimizer.param_groups:
            group["lr"] = 5e-3

    micro(0), micro(1)
    micro(2), micro(3, before_step=set_a_weight)
    micro(4), micro(5, before_step=halve_a_gradient)
    micro(6), micro(7, before_step=lower_the_lr)
    micro(8, poison=rank == 1), micro(9)  # an overflow on one rank: the step is skipped
    opt = engine.optimizer  # read directly, not through the engine: the skip itself must have undone the guess
    after_skip = [t.clone() for t in (*opt.exp_avg, *opt.exp_avg_sq)] + \
        [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    micro(10)
    _backward(engine, rank, 11)
    engine.zero_grad()  # the boundary backward's gradients, and its guesses, are dropped
    micro(12)
    engine.save_checkpoint(ckpt, tag=f"s{stage}-{speculative}-{precision}")
    engine.destroy()
    torch.manual_seed(1)
    engine = zkern.Engine(TinyGPT(), cfg)
    engine.load_checkpoint(ckpt, tag=f"s{stage}-{speculative}-{precision}")
    micro(14), micro(15)
    chunks = sum(len(g.chunks) for g in engine.host_step.host_groups)
    state = engine.full_state_dict()
    engine.destroy()
    return {"state": state, "fates": fates, "chunks": chunks, "after_skip": after_skip}


RECIPES = {"fp16-clipped": ("fp16", 0.05), "bf16-unclipped": ("bf16", 1e6)}


def _worker(rank, world, stage, ckpt, offload_param):
    return {(recipe, speculative): _run(rank, stage, speculative, *RECIPES[recipe], ckpt, offload_param)
            for recipe in RECIPES for speculative in (True, False)}


@pytest.mark.dist
@pytest.mark.parametrize("stage, offload_param", [(1, False), (2, False), (3, False), (3, True)])
def test_the_speculative_step_trains_bit_for_bit_as_the_plain_one_kept_or_undone(stage, offload_param, tmp_path):
    results = spawn(_worker, 2, stage, str(tmp_path), offload_param)
    for rank, r in enumerate(results):
        for recipe in RECIPES:
            guessed, plain = r[(recipe, True)], r[(recipe, False)]
            for name, value in plain["state"].items():
                assert torch.equal(guessed["state"][name], value), (rank, recipe, name)
            assert all(map(torch.equal, guessed["after_skip"], plain["after_skip"])), (rank, recipe)
            assert set(plain["fates"]) <= {"off", "skipped"}, plain["fates"]
        # with clipping that bites, every guess is undone (the skipped step's too); without, those stand where
        # nothing moved under them between backward and step
        for recipe, fates in (("fp16-clipped", ["clipped", "w", "w", "clipped", "skipped", "clipped", "clipped"]),
                              ("bf16-unclipped", ["kept", "w", "w", "hyper-parameters changed", "skipped", "kept",
                                                  "kept"])):
            got = r[(recipe, True)]["fates"]
            # "w": withdrawn before step() by the weight's write (the store) and the gradient's (at stage 3 its read
            # goes through the store first)
            written = ("host state read or written", "gradients written")
            assert ["w" if f in written else f for f in got] == fates, (recipe, got)


def _single_config(**offload) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "device": "cpu", "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 3000,
                                  "offload_optimizer": {"device": "cpu", **offload}}}


def test_every_chunk_steps_in_backward_when_the_guess_stands_and_the_saves_cost_what_the_state_does():
    torch.manual_seed(0)
    engine = zkern.Engine(TinyGPT(), _single_config(speculative_step=True))
    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(ids, ids))
    engine.step()
    step = engine.host_step.last_step
    chunks = sum(len(g.chunks) for g in engine.host_step.host_groups)
    assert chunks > 1 and step["speculation"] == "kept" and step["speculated_chunks"] == chunks, step
    assert engine.host_step.ring is None  # the new parameters wait in staging for the decision: no ring
    saves = sum(t.numel() * t.element_size() for group in engine.optimizer.saves for t in group)
    assert saves == engine.optimizer.state_bytes() * 3 // 2  # fp32 master and two moments, once each
    assert engine.memory_report()["host"]["speculation_saves"] == saves  # counted in the host's books
    engine.destroy()


def test_with_the_parameters_on_the_host_the_guesses_stage_in_a_second_copy_counted_in_the_books():
    """Stage 3's offload_param (DeepSpeed's SuperOffload shape): the host parameter shard is what the next gathers
    read, so the guessed parameters go to staging of their own, as large as the gradients' (both bf16 here)."""
    def host_books(speculative: bool) -> dict:
        cfg = _single_config(speculative_step=speculative)
        cfg["bf16"] = {"enabled": True}
        cfg["zero_optimization"].update(stage=3, stage3_param_persistence_threshold=0,
                                        offload_param={"device": "cpu"})
        engine = zkern.Engine(TinyGPT(), cfg)
        books = engine.memory_report()["host"]
        engine.destroy()
        return books

    plain, guessing = host_books(False), host_books(True)
    assert plain["offload_buffers"] > 0 and guessing["offload_buffers"] == 2 * plain["offload_buffers"]
    assert guessing["params"] == plain["params"] and guessing["speculation_saves"] > 0


def test_super_offload_turns_the_speculative_step_on():
    engine = zkern.Engine(TinyGPT(), _single_config(super_offload=True))
    assert engine.host_step.speculative
    engine.destroy()


@pytest.mark.parametrize("offload, extra, words", [
    ({"delayed_update": True}, {}, "choose one"),
    ({}, {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, "offload_param device \"nvme\""),
    ({"copy_grads_during_backward": False}, {}, "copy_grads_during_backward"),
    ({"device": "nvme", "nvme_path": "/tmp"}, {}, "device \"cpu\""),
])
def test_the_configs_it_cannot_serve_are_refused(offload, extra, words):
    cfg = _single_config(speculative_step=True, **offload)
    cfg["zero_optimization"].update(extra)
    with pytest.raises(ConfigError, match=words):
        zkern.Engine(TinyGPT(), cfg)


def test_a_torch_optimizer_is_refused():
    cfg = _single_config(speculative_step=True)
    del cfg["optimizer"]
    model = TinyGPT()
    with pytest.raises(ConfigError, match="zkern's own Adam"):
        zkern.Engine(model, cfg, optimizer=torch.optim.AdamW(model.parameters()))


def test_on_cuda_each_chunk_steps_after_its_copy_down_and_goes_up_after_the_decision(monkeypatch):
    """The CUDA path's order of calls, with torch.cuda's streams and events faked (this machine has no GPU) under a
    host engine: in backward each chunk's copy down is queued on the side stream after it waits for the compute
    stream, an event is recorded behind it, and the background Adam synchronizes on that event before it steps the
    chunk; at step() the kept chunks' parameters go up on the side stream only after the verdict, and the compute
    stream waits for them before the next forward."""
    import threading

    from zkern import ops

    torch.manual_seed(0)
    engine = zkern.Engine(TinyGPT(), _single_config(speculative_step=True))
    host = engine.host_step
    cuda = FakeCuda(monkeypatch)  # from here on the engine's CUDA calls are logged
    log, calls = cuda.log, cuda.calls
    host.stream = cuda.side
    adam = ops.adam_step_
    monkeypatch.setattr(ops, "adam_step_", lambda *a, **k: (log(f"adam on {threading.current_thread().name}"),
                                                            adam(*a, **k))[1])
    copy = host._up
    monkeypatch.setattr(host, "_up", lambda gi, ci: (log("up"), copy(gi, ci))[1])
    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(0))
    engine.backward(engine(ids, ids))
    log("step")
    engine.step()
    assert host.last_step["speculation"] == "kept"
    chunks = sum(len(g.chunks) for g in host.host_groups)
    worker = [c for c in calls if c.startswith(("event", "adam on zkern")) and "recorded" not in c]
    # the background Adam: each chunk's event synchronized, then its Adam, in landing order
    assert worker == [e for n in range(1, chunks + 1) for e in (f"event {n} synchronized",
                                                              "adam on zkern-speculative-adam")], worker
    for n in range(1, chunks + 1):  # each copy down: behind the compute stream's fold, on the side stream, then its
        at = calls.index(f"event {n} recorded on side")  # event
        assert calls[at - 2:at] == ["side waits for compute", "on side"], calls[at - 2:at + 1]
    step = calls.index("step")
    ups = [i for i, c in enumerate(calls) if c == "up"]
    assert len(ups) == chunks and ups[0] > step and all(calls[i + 1] == "on side" for i in ups), calls[step:]
    assert "adam on MainThread" not in calls[step:]  # kept: no second Adam
    last = max(i for i, c in enumerate(calls) if c.startswith("adam on zkern"))
    assert last < ups[0]  # the parameters go up only once every guessed chunk has stepped
    assert calls[-1] == "compute waits for side"  # the next forward reads the uploaded parameters
    engine.destroy()


def _load_and_async_save(speculative: bool, root: str) -> dict:
    """A guess in flight (a boundary backward without its step) when a checkpoint loads, without its optimizer
    state; then an asynchronous save written while the next steps guess."""
    torch.manual_seed(0)
    cfg = {**_single_config(speculative_step=speculative), "gradient_clipping": 1e6}
    engine = zkern.Engine(TinyGPT(), cfg)

    def train(seed: int, step: bool = True) -> None:
        ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(seed))
        engine.backward(engine(ids, ids))
        if step:
            engine.step()

    train(0), train(1)
    engine.save_checkpoint(root, tag="a")
    train(2, step=False)  # a stray backward: its guess is in flight when the load begins
    engine.load_checkpoint(root, tag="a", load_optimizer_states=False)
    train(3)
    engine.save_checkpoint(root, tag="b", async_save=True)
    for seed in range(4, 8):  # the writer writes while these guess
        train(seed)
    engine.wait_checkpoint()
    state = engine.full_state_dict()
    fates = engine.host_step.last_step["speculation"]
    engine.destroy()
    return {"state": state, "fate": fates}


def test_a_load_and_an_asynchronous_save_with_a_guess_in_flight_train_as_without_guesses(tmp_path):
    guessed = _load_and_async_save(True, str(tmp_path / "guessed"))
    plain = _load_and_async_save(False, str(tmp_path / "plain"))
    assert guessed["fate"] == "kept"
    for name, value in plain["state"].items():
        assert torch.equal(guessed["state"][name], value), name
