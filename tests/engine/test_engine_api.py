"""The engine's contract beyond plain equivalence: client optimizers and schedulers, misuse errors, and a
dead or stalled rank ending the job with an error that names it."""

import dataclasses
import os
import time

import pytest
import torch
import torch.distributed as dist

import zkern
from zkern import ConfigError
from zkern.testing import TinyGPT, TrainSpec, assert_params_close, global_batch, spawn


def base_config(**kw):
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "device": "cpu"}
    cfg.update(kw)
    return cfg


def two_groups(model, opt_cls, **kw):
    """HF-style groups: weight decay on matrices, none on biases and norms."""
    decay = [p for p in model.parameters() if p.dim() >= 2 and p.requires_grad]
    rest = [p for p in model.parameters() if p.dim() < 2 and p.requires_grad]
    return opt_cls([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}], **kw)


def make_client(kind, model):
    match kind:
        case "adamw_groups":
            return two_groups(model, torch.optim.AdamW, lr=3e-3)
        case "sgd":
            return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def make_schedule(kind):
    match kind:
        case None:
            return None
        case "halving":  # a callable optimizer -> scheduler, as DeepSpeed accepts
            return lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)


def client_worker(rank, world, stage, kind, schedule, extra_cfg, init_group_first):
    """Train with a client torch optimizer (and scheduler) through zkern; rank 0 returns the fp32 weights."""
    if init_group_first and world > 1:
        dist.init_process_group("gloo")  # the user's own group: zkern must make its own and work beside it
    spec = TrainSpec(stage=stage, steps=6, accumulation=2)
    model = spec.make_model()
    opt = make_client(kind, model)
    zero = {"stage": stage, "stage3_param_persistence_threshold": 100}  # stage 3: really partition the tiny model
    engine = zkern.Engine(model, base_config(gradient_accumulation_steps=2, zero_optimization=zero, **extra_cfg),
                          optimizer=opt, lr_scheduler=make_schedule(schedule))
    assert engine.optimizer is opt
    batches = spec.batches(world)
    lrs = []
    for step in range(spec.steps):
        for micro in range(spec.accumulation):
            idx, tgt = batches[step][micro][rank]
            engine.backward(engine(idx, tgt))
            engine.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return {"state": engine.full_state_dict(rank0_only=True), "lrs": lrs}


def client_reference(kind, schedule, world):
    spec = TrainSpec(steps=6, accumulation=2)
    model = spec.make_model()
    opt = make_client(kind, model)
    sched = make_schedule(schedule)
    sched = sched(opt) if sched else None
    batches = spec.batches(world)
    for step in range(spec.steps):
        opt.zero_grad()
        idx, tgt = global_batch(batches, step)
        model(idx, tgt).backward()
        opt.step()
        if sched:
            sched.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_client_adamw_with_two_param_groups_and_a_client_scheduler(stage):
    results = spawn(client_worker, 2, stage, "adamw_groups", "halving", {}, stage >= 2)
    assert_params_close(results[0]["state"], client_reference("adamw_groups", "halving", 2), lr=3e-3, steps=6)
    assert results[0]["lrs"][-1] == [3e-3 * 0.5**6] * 2


@pytest.mark.dist
def test_untested_client_optimizer_needs_the_opt_in_and_then_matches():
    with pytest.raises(ConfigError, match="SGD is an untested ZeRO optimizer.*zero_allow_untested_optimizer"):
        client_worker(0, 1, 1, "sgd", None, {}, False)
    results = spawn(client_worker, 2, 1, "sgd", None, {"zero_allow_untested_optimizer": True}, False)
    assert_params_close(results[0]["state"], client_reference("sgd", None, 2), lr=0.05, steps=6)


def test_torch_adam_option_runs_torch_on_the_shard_and_matches():
    spec = TrainSpec(stage=1, steps=5)
    from zkern.testing import engine_run, reference_run

    class TorchAdamSpec(TrainSpec):
        def config(self, world):
            cfg = super().config(world)
            cfg["optimizer"]["params"]["torch_adam"] = True
            return cfg

    spec = TorchAdamSpec(stage=1, steps=5)
    result = engine_run(0, 1, spec)
    assert_params_close(result["state"], reference_run(spec, 1)[0], lr=spec.lr, steps=spec.steps)


def test_config_scheduler_drives_the_lr_and_waits_on_skipped_steps():
    model = TinyGPT()
    cfg = base_config(optimizer={"type": "AdamW", "params": {"lr": 1.0}}, fp16={"enabled": True, "hysteresis": 1},
                      scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                "warmup_num_steps": 4, "warmup_type": "linear"}})
    engine = zkern.Engine(model, cfg)
    idx = torch.randint(0, 67, (2, 17))
    seen = []
    for step in range(6):
        loss = engine(idx[:, :-1], idx[:, 1:])
        if step == 2:
            loss = loss * float("inf")  # an overflowing step: skipped, the schedule does not advance
        engine.backward(loss)
        engine.step()
        seen.append(engine.optimizer.param_groups[0]["lr"])
    # DeepSpeed: lr = min at construction; each taken step advances the iteration k = 0, 1, ...: 0.01 * k / 4
    assert seen == [0.0, 0.0025, 0.0025, 0.005, 0.0075, 0.01]
    assert engine.skipped_steps == 1 and engine.global_steps == 6


def test_misuse_gets_clear_errors():
    cfg = base_config(optimizer={"type": "AdamW"})
    forward_only = zkern.Engine(TinyGPT(), base_config())  # no optimizer: a reference model (DeepSpeed's meaning)
    with pytest.raises(RuntimeError, match="built without an optimizer"):
        forward_only.step()
    model = TinyGPT()
    with pytest.raises(ConfigError, match="an optimizer is given twice"):
        zkern.Engine(model, cfg, optimizer=torch.optim.AdamW(model.parameters()))
    with pytest.raises(TypeError, match="parameter 'pos' is torch.bfloat16; zkern keeps fp32 master weights.*\"bf16\""):
        zkern.Engine(TinyGPT().bfloat16(), cfg)
    model = TinyGPT()
    partial = torch.optim.AdamW(model.blocks.parameters())
    with pytest.raises(ValueError, match="require grad but are in no optimizer param group"):
        zkern.Engine(model, base_config(), optimizer=partial)
    frozen = TinyGPT()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        zkern.Engine(frozen, cfg)

    engine = zkern.Engine(TinyGPT(), base_config(optimizer={"type": "AdamW"}, zero_optimization={"stage": 1},
                                                 gradient_accumulation_steps=2, train_batch_size=4))
    idx = torch.randint(0, 67, (2, 17))
    with torch.no_grad():
        loss = engine(idx[:, :-1], idx[:, 1:])
    with pytest.raises(ValueError, match="does not require grad"):
        engine.backward(loss)
    # Between steps the gradients are None, as torch leaves them: a torch-style zero_grad there changes nothing.
    engine.module.zero_grad()
    engine.backward(engine(idx[:, :-1], idx[:, 1:]))  # the first micro-step of two
    engine.module.zero_grad()  # mid-accumulation: would drop the gradients the engine accumulates into
    with pytest.raises(RuntimeError, match="was replaced or set to None outside the engine"):
        engine.backward(engine(idx[:, :-1], idx[:, 1:]))


def test_an_empty_client_param_group_keeps_the_groups_aligned():
    model = TinyGPT()
    opt = torch.optim.AdamW([{"params": [], "lr": 9.0}, {"params": list(model.parameters()), "lr": 1e-3}])
    engine = zkern.Engine(model, base_config(), optimizer=opt)
    assert opt.param_groups[0]["params"] == [] and len(opt.param_groups[1]["params"]) > 0
    idx = torch.randint(0, 67, (2, 17))
    before = engine.full_state_dict()["blocks.0.fc.weight"]
    engine.backward(engine(idx[:, :-1], idx[:, 1:]))
    engine.step()
    moved = (engine.full_state_dict()["blocks.0.fc.weight"] - before).abs().max().item()
    assert 0 < moved < 2e-3  # stepped with lr 1e-3 (Adam moves an element by about lr), not 9.0


def test_unused_parameters_error_when_asked():
    model = TinyGPT(extra_branch=True)
    engine = zkern.Engine(model, base_config(optimizer={"type": "AdamW"},
                                             zero_optimization={"stage": 2, "ignore_unused_parameters": False}))
    idx = torch.randint(0, 67, (2, 17))
    engine.backward(engine(idx[:, :-1], idx[:, 1:]))
    with pytest.raises(RuntimeError, match=r"\['extra.bias', 'extra.weight'\] got no gradient"):
        engine.step()


def test_world_size_one_needs_no_process_group():
    engine = zkern.Engine(TinyGPT(), base_config(optimizer={"type": "AdamW"}, zero_optimization={"stage": 2}))
    assert not dist.is_initialized() and engine.world_size == 1
    idx = torch.randint(0, 67, (2, 17))
    engine.backward(engine(idx[:, :-1], idx[:, 1:]))
    engine.step()
    assert engine.global_steps == 1 and engine.comm_stats()["reduce_scatter"] == 0


def stalled_peer_worker(rank, world, mode, timeout_s):
    """Rank 1 dies (mode "dies") or stalls past the timeout (mode "stalls") instead of its first step; rank 0
    must end with a CommError naming itself and the collective, within the timeout."""
    engine = zkern.Engine(TinyGPT(), base_config(optimizer={"type": "AdamW"}, zero_optimization={"stage": 2},
                                                 comm_timeout_s=timeout_s))
    if rank == 1:
        if mode == "stalls":
            time.sleep(timeout_s + 8)
        return {"rank": 1}
    idx = torch.randint(0, 67, (2, 17))
    start = time.monotonic()
    try:
        engine.backward(engine(idx[:, :-1], idx[:, 1:]))
        engine.step()
    except zkern.CommError as e:
        return {"rank": 0, "error": str(e), "seconds": time.monotonic() - start}
    return {"rank": 0, "error": None}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dies", "stalls"])
def test_a_dead_or_stalled_rank_ends_the_job_with_an_error(mode):
    timeout_s = 4.0
    results = spawn(stalled_peer_worker, 2, mode, timeout_s, timeout=60)
    error = results[0]["error"]
    assert error is not None, "rank 0 finished a step without its peer"
    assert "zkern rank 0 of 2: reduce_scatter" in error and "comm_timeout_s=4s" in error
    assert results[0]["seconds"] < timeout_s + 5


def test_a_second_gradient_after_the_bucket_was_sent_is_an_error():
    """Reentrant checkpointing runs a second backward for a segment: a parameter's gradient can then arrive
    after its bucket was reduced, which would corrupt the reduction. zkern raises instead."""
    import torch.utils.checkpoint as ckpt

    class Twice(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 8)

        def forward(self, x):
            y = ckpt.checkpoint(self.a, x, use_reentrant=True)
            return (self.b(y) + self.a(x)).sum()  # a's weight gets a gradient from two separate backward passes

    for stage in (0, 2):
        engine = zkern.Engine(Twice(), base_config(optimizer={"type": "AdamW"}, zero_optimization={"stage": stage}))
        x = torch.randn(4, 8, requires_grad=True)
        with pytest.raises(RuntimeError, match="received a second gradient in one backward"):
            engine.backward(engine(x))


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_optimizer_state_dict_round_trip_resumes_exactly(stage):
    """Save the optimizer state after 3 steps, load it into a fresh engine over the same weights, and both
    engines continue identically; a state from another layout is refused."""
    cfg = base_config(optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
                      zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 100})
    torch.manual_seed(0)
    first = zkern.Engine(TinyGPT(), cfg)
    idx = torch.randint(0, 67, (2, 17), generator=torch.Generator().manual_seed(3))
    for _ in range(3):
        first.backward(first(idx[:, :-1], idx[:, 1:]))
        first.step()
    saved = first.optimizer.state_dict()
    model = TinyGPT()
    model.load_state_dict(first.full_state_dict())
    second = zkern.Engine(model, cfg)
    second.optimizer.load_state_dict(saved)
    for engine in (first, second):
        for _ in range(2):
            engine.backward(engine(idx[:, :-1], idx[:, 1:]))
            engine.step()
    a, b = first.full_state_dict(), second.full_state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    other = zkern.Engine(TinyGPT(vocab=61), cfg)
    with pytest.raises(ValueError):
        other.optimizer.load_state_dict(saved)


@pytest.mark.parametrize("stage", [1, 3])
def test_groups_with_frozen_parameters_train_the_trainable_ones(stage):
    """model.parameters() of a partly frozen model (every LoRA/PEFT model), as model_parameters or in a client
    optimizer's groups: the frozen ones are left out, as torch's optimizers skip them, and the run equals the one
    given only the trainable parameters, bit for bit."""
    cfg = base_config(optimizer={"type": "AdamW", "params": {"lr": 1e-2}}, zero_optimization={"stage": stage})
    client_cfg = base_config(zero_optimization={"stage": stage})
    idx = torch.randint(0, 67, (2, 17))

    def run(build) -> dict:
        torch.manual_seed(0)
        model = TinyGPT(frozen=("qkv", "fc"))
        engine = build(model)
        for _ in range(3):
            engine.backward(engine(idx[:, :-1], idx[:, 1:]))
            engine.step()
        return engine.full_state_dict()

    plain = run(lambda m: zkern.Engine(m, cfg))
    runs = {"model_parameters": run(lambda m: zkern.Engine(m, cfg, model_parameters=m.parameters())),
            "initialize": run(lambda m: zkern.initialize(model=m, model_parameters=m.parameters(), config=cfg)[0]),
            "client": run(lambda m: zkern.Engine(m, client_cfg, optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2,
                                                                                            weight_decay=0.0)))}
    torch.manual_seed(0)
    initial = TinyGPT(frozen=("qkv", "fc")).state_dict()
    for name, state in runs.items():
        if name == "client":  # torch's AdamW against zkern's: the same arithmetic, within the drift bound
            assert_params_close(state, plain, lr=1e-2, steps=3)
        else:
            assert all(torch.equal(state[k], v) for k, v in plain.items()), name
        assert torch.equal(state["blocks.0.qkv.weight"], initial["blocks.0.qkv.weight"]), name  # frozen stayed put
        assert not torch.equal(state["blocks.0.proj.weight"], initial["blocks.0.proj.weight"]), name  # trained


@pytest.mark.dist
@pytest.mark.parametrize("who", ["zkern_group", "user_group"])
def test_no_gloo_thread_outlives_the_exit_hooks(tmp_path, who):
    """A gloo thread still alive when the interpreter finalizes may need the GIL to drop a finished collective's
    tensors and abort the rank ("terminate called without an active exception") after all its work is done: a
    successful run that torchrun reports as failed. zkern closes the groups it made or uses at exit."""
    import os
    import subprocess
    import sys

    from zkern.testing.ranks import free_port

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = root
    out = str(tmp_path / "threads")
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), os.path.join(root, "tests", "exit_script.py"), out, who],
                          cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    # user_group: the script destroyed its group, but torch.distributed.nn.functional, imported by torch after the
    # script made it, held it as a default argument; zkern's exit hook lets that go too
    for rank in range(2):
        with open(f"{out}.{rank}") as f:
            assert int(f.read()) == 0, f"rank {rank}: a group's gloo threads alive after zkern's exit hooks"


def _call_orders(rank, world, stage):
    """Three ways into a step, each against the engine that should equal it; and loss.backward() refused."""
    from zkern.testing import TrainSpec

    spec = TrainSpec(stage=stage, steps=4, accumulation=1, lr=1e-2)
    out = {}
    b = spec.batches(world)

    def engine(accumulation=1):
        torch.manual_seed(spec.seed)
        return zkern.Engine(spec.make_model(), dataclasses.replace(spec, accumulation=accumulation).config(world))

    def batch(step):
        return b[step][0][rank]

    # a loop that drops a bad batch: backward, zero_grad, then the good batch's backward and the step
    dropped, clean = engine(), engine()
    dropped.backward(dropped(*batch(0)))
    dropped.zero_grad()
    dropped.backward(dropped(*batch(1)))
    dropped.step()
    clean.backward(clean(*batch(1)))
    clean.step()
    out["dropped"] = (dropped.full_state_dict(), clean.full_state_dict())
    # zero_grad after micro-step 2 of 4: the step comes at micro-step 4, with micro-steps 3-4's gradients
    mid, zeros = engine(4), engine(4)
    for k in range(4):
        mid.backward(mid(*batch(k)))
        if k == 1:
            mid.zero_grad()
        mid.step()
        zeros.backward(zeros(*batch(k)) * (0.0 if k < 2 else 1.0))
        zeros.step()
    out["mid"] = (mid.full_state_dict(), zeros.full_state_dict(), mid.global_steps, zeros.global_steps)
    # loss.backward() instead of engine.backward(loss): the same pass (engine/user_backward.py), the same numbers
    plain, called = engine(4), engine(4)
    for k in range(4):
        plain(*batch(k)).backward()
        plain.step()
        called.backward(called(*batch(k)))
        called.step()
    out["plain_backward"] = (plain.full_state_dict(), called.full_state_dict(), plain.global_steps)
    # a checkpoint right after a backward, before its step: the state at the last step (the gradients held are not
    # part of it), and the step then goes on with them
    late = engine()
    late.backward(late(*batch(0)))
    late.save_checkpoint(f"/tmp/zkern-call-orders-{os.getppid()}")  # one folder for every rank
    late.step()
    out["save"] = late.global_steps
    return out


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_grad_drops_what_a_backward_left_and_loss_backward_runs_the_engines_pass(stage):
    for r in spawn(_call_orders, 2, stage):
        dropped, clean = r["dropped"]
        for name in clean:
            assert torch.equal(dropped[name], clean[name]), name
        mid, zeros, mid_steps, zero_steps = r["mid"]
        assert mid_steps == zero_steps == 1
        for name in zeros:
            assert torch.equal(mid[name], zeros[name]), name
        plain, called, steps = r["plain_backward"]
        assert steps == 1
        for name in called:
            assert torch.equal(plain[name], called[name]), name
        assert r["save"] == 1
