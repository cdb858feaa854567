"""bf16 optimizer state (DeepSpeed's bf16.bf16_optimizer_states and bf16.bf16_master_weights_and_grads, and zkern's
bf16_stochastic_rounding): the fused Adam on every backend against an fp64 reference written here, and the engine
at every stage and offload against its own fp32-state run rounded step by step.

    python -m pytest tests/optim/test_bf16_state.py -q

The kernel reads a bf16 value exactly, computes the step in fp32 and stores the result rounded. So the stored value
must be the bf16 rounding of a number within fp32 rounding of the exact step: to nearest even, at most half a bf16
unit in the last place (2**-8 relative) away, and where that number is not within fp32 rounding of a tie, exactly
the nearest; stochastically, one of the two bf16 neighbours, unbiased. The engine's step then reads the moments it
stored, so a bf16-state engine is an fp32-state engine whose state is rounded after every step: the test rounds the
fp32 engine's state with torch's own cast and checks the bf16 engine holds those bits.
"""

from __future__ import annotations

import math

import pytest
import torch

import zkern
import zkern.checkpoint
import zkern.cpu
from zkern import reference
from zkern.cpu import _ext
from zkern.errors import ConfigError
from zkern.testing import TinyGPT, TrainSpec, engine_run, spawn

LR, BETAS, EPS, WD = 1e-2, (0.9, 0.999), 1e-8, 0.1


# -- the kernel ----------------------------------------------------------------------------------------------------
def backends() -> list[tuple[str, object]]:
    """(name, adam_step_) for every implementation this machine runs: each CPU path, the torch reference and, under
    the interpreter, the Triton kernel."""
    out = [(f"cpu-{isa}", lambda *a, isa=isa, **k: _ext.adam_step_(*a, isa=isa, **k)) for isa in _ext.SUPPORTED]
    out.append(("reference", reference.adam_step_))
    from zkern.triton import adam as triton_adam  # conftest sets TRITON_INTERPRET=1 where there is no GPU

    out.append(("triton", triton_adam.adam_step_ if not torch.cuda.is_available() else on_the_gpu(triton_adam)))
    return out


def on_the_gpu(triton_adam):
    """The compiled Triton kernel where a GPU is present: the host tensors go to it, the results come back in place."""
    def step(p, g, m, v, param_out=None, **hyper):
        dp, dg, dm, dv = (t.cuda() for t in (p, g, m, v))
        out = None if param_out is None else param_out.cuda()
        triton_adam.adam_step_(dp, dg, dm, dv, param_out=out, **hyper)
        for host, dev in ((p, dp), (m, dm), (v, dv), (param_out, out)):
            if host is not None:
                host.copy_(dev)
    return step


BACKENDS = backends()


def exact_step(p, g, m, v, step):
    """One AdamW step in float64 from the given (already stored) values: the number each stored result rounds."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    p = p * (1 - LR * WD)
    m = m + (1 - BETAS[0]) * (g - m)
    v = BETAS[1] * v + (1 - BETAS[1]) * g * g
    denom = v.sqrt() / math.sqrt(1 - BETAS[1] ** step) + EPS
    p = p - LR / (1 - BETAS[0] ** step) * m / denom
    return p, m, v


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at |x| (2**(e-7) for x in [2**e, 2**(e+1)))."""
    e = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.exp2(e - 7)


def fp32_slack(exact: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """How far the kernel's fp32 result may be from the exact one: 8 fp32 units in the last place of the larger of
    the value and the terms that formed it (fused multiply-adds and a reciprocal square root round differently)."""
    return 8 * 2.0**-23 * torch.maximum(exact.abs(), scale)


def start_state(n: int, master: torch.dtype, states: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=gen).to(master)
    g = torch.randn(n, generator=gen)
    m = (0.1 * torch.randn(n, generator=gen)).to(states)
    v = (0.01 * torch.rand(n, generator=gen)).to(states)
    return p, g, m, v


def check_rounded(stored: torch.Tensor, exact: torch.Tensor, slack: torch.Tensor, what: str, *, stochastic: bool):
    """stored (bf16) is the rounding of a number within `slack` of exact: to nearest (half a unit, and exactly the
    nearest bf16 away from ties), or stochastically (one of the two neighbours: less than one unit)."""
    got = stored.double()
    ulp = bf16_ulp(exact)
    err = (got - exact).abs()
    bound = (ulp if stochastic else ulp / 2) + slack
    bad = err > bound
    assert not bad.any(), f"{what}: {int(bad.sum())} values off by more than {'one' if stochastic else 'half a'} " \
                          f"bf16 unit, e.g. {got[bad][:3].tolist()} for {exact[bad][:3].tolist()}"
    if not stochastic:
        nearest = exact.to(torch.bfloat16).double()  # torch rounds the fp64 exact value to nearest even
        # away from ties (further than the slack from the midpoint between neighbours) it must be the nearest
        midpoint_gap = ((exact - nearest).abs() - ulp / 2).abs()
        clear = midpoint_gap > slack
        wrong = clear & (got != nearest)
        assert not wrong.any(), f"{what}: {int(wrong.sum())} values are not the nearest bf16 of the exact step"


@pytest.mark.parametrize("name, step_fn", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("master, states", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32),
                                            (torch.bfloat16, torch.bfloat16)], ids=["states", "master", "both"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
def test_one_step_stores_the_rounding_of_the_exact_step(name, step_fn, master, states, stochastic):
    n = 4099  # a vector body and a ragged tail on every path
    p, g, m, v = start_state(n, master, states)
    out = torch.empty(n, dtype=torch.float16)
    ep, em, ev = exact_step(p, g, m, v, step=3)
    step_fn(p, g, m, v, step=3, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw=True, param_out=out,
            **({"sr_seed": 77, "sr_offset": 5} if stochastic else {}))
    update = torch.full_like(ep, LR * 10)  # the update term is at most lr / (1 - beta1^3) ~ 3.7 lr in size
    for t, exact, scale, what in ((p, ep, update, "master"), (m, em, g.abs().double(), "exp_avg"),
                                  (v, ev, (g * g).double(), "exp_avg_sq")):
        slack = fp32_slack(exact, scale)
        if t.dtype == torch.bfloat16:
            check_rounded(t, exact, slack, f"{name} {what}", stochastic=stochastic)
        else:
            assert ((t.double() - exact).abs() <= slack).all(), f"{name} {what} (fp32) is off the exact step"
    # the working copy is the stored master, in its own dtype
    assert torch.equal(out, p.to(torch.float16)), f"{name}: param_out is not the stored master's value"


@pytest.mark.parametrize("name, step_fn", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_stochastic_rounding_is_unbiased_and_reproducible(name, step_fn):
    """65,536 elements with one value and one gradient: every exact result is the same number x between two bf16
    neighbours; stochastic rounding must land on each with the probabilities that make the mean x (5 sigma), and
    the same seed must give the same bits."""
    n = 1 << 16
    p = torch.full((n,), 1.2345, dtype=torch.bfloat16)
    g, m, v = torch.full((n,), 0.37), torch.full((n,), 0.0313, dtype=torch.bfloat16), \
        torch.full((n,), 0.0021, dtype=torch.bfloat16)
    exact = exact_step(p, g, m, v, step=5)
    runs = []
    for seed in (11, 11, 12):
        tensors = [t.clone() for t in (p, m, v)]
        step_fn(tensors[0], g, tensors[1], tensors[2], step=5, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                adamw=True, sr_seed=seed, sr_offset=1000)
        runs.append(tensors)
    for k, what in enumerate(("master", "exp_avg", "exp_avg_sq")):
        got, x = runs[0][k].double(), exact[k][0].item()
        lo, hi = got.min().item(), got.max().item()
        assert lo <= x <= hi and hi - lo <= bf16_ulp(exact[k][:1]).item() * 1.0001, f"{name} {what}: {lo}..{hi} " \
                                                                                     f"is not x's two neighbours"
        share = (hi - x) / (hi - lo)  # the probability of rounding down that makes the mean x
        sigma = (hi - lo) * math.sqrt(share * (1 - share) / n)
        assert abs(got.mean().item() - x) <= 5 * sigma + 1e-7 * abs(x), f"{name} {what}: biased"
        assert torch.equal(runs[0][k], runs[1][k]), f"{name} {what}: the same seed gave other bits"
        assert not torch.equal(runs[0][k], runs[2][k]), f"{name} {what}: another seed gave the same bits"


def test_a_bf16_second_moment_cannot_decay_to_nearest_and_does_stochastically(caplog):
    """With beta2 = 0.999, beta2 * v is within half a bf16 unit of v: rounded to nearest, v with no new gradient
    stays where it is forever (what the engine warns about); rounded stochastically it decays as 0.999**t in
    expectation (within 5 sigma of the 4,096 elements' mean after 100 steps)."""
    n, steps = 4096, 100
    for stochastic in (False, True):
        p, g = torch.zeros(n), torch.zeros(n)
        m, v = torch.zeros(n, dtype=torch.bfloat16), torch.ones(n, dtype=torch.bfloat16)
        for step in range(1, steps + 1):
            _ext.adam_step_(p, g, m, v, step=step, lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0, adamw=True,
                            **({"sr_seed": 1000 + step} if stochastic else {}))
        if stochastic:
            # each step's rounding adds variance of at most a quarter unit squared: 100 steps, n elements
            sigma = math.sqrt(steps * 0.25 * 2.0**-14 / n)
            assert abs(v.float().mean().item() - BETAS[1] ** steps) <= 5 * sigma
        else:
            assert torch.all(v == 1.0)
    with caplog.at_level("WARNING", logger="zkern"):
        zkern.Engine(torch.nn.Linear(8, 8), base_config(bf16_optimizer_states=True)).destroy()
    assert "never decays" in caplog.text


def test_every_backend_draws_the_same_random_bits():
    """The hash is one function of (seed, element index): every path stores the same bf16 moments from the same
    input (their fp32 arithmetic agrees to the last place or so: at most a few elements in 100,000 may round to
    the other neighbour), however the range is cut into calls."""
    n = 100_003
    results = {}
    for name, step_fn in BACKENDS:
        p, g, m, v = start_state(n, torch.bfloat16, torch.bfloat16, seed=3)
        cut = 40_000  # two calls: the second's indices continue from sr_offset + cut
        for lo, hi in ((0, cut), (cut, n)):
            step_fn(p[lo:hi], g[lo:hi], m[lo:hi], v[lo:hi], step=2, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                    adamw=True, sr_seed=99, sr_offset=7 + lo)
        results[name] = (p, m, v)
    base = results["reference"]
    for name, got in results.items():
        for a, b, what in zip(got, base, ("master", "exp_avg", "exp_avg_sq")):
            differ = int((a != b).sum())
            assert differ <= n // 10_000, f"{name} {what}: {differ} of {n} differ from the reference's bits"


def test_bad_state_dtypes_are_refused():
    p, g, m, v = start_state(64, torch.float32, torch.float32)
    with pytest.raises(TypeError, match="exp_avg_sq must be torch.float32"):
        _ext.adam_step_(p, g, m, v.bfloat16(), step=1, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw=True)
    with pytest.raises(TypeError, match="param must be"):
        _ext.adam_step_(p.half(), g, m, v, step=1, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, adamw=True)
    with pytest.raises(TypeError, match="share one dtype"):
        reference.adam_step_(p, g, m, v.bfloat16(), step=1, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD,
                             adamw=True)


@pytest.mark.parametrize("fp32_states", [True, False], ids=["fp32-moments", "bf16-moments"])
def test_cpu_adam_steps_bf16_parameters_with_deepspeeds_fp32_optimizer_states(fp32_states):
    """zkern.cpu.CPUAdam as DeepSpeedCPUAdam: bf16 parameters, moments in fp32 or (fp32_optimizer_states=False) in
    the parameter's dtype; one step stores the rounding of the exact step (weight decay as AdamW's)."""
    p, g, m, v = start_state(1000, torch.bfloat16, torch.float32, seed=4)
    param = torch.nn.Parameter(p.clone())
    param.grad = g.bfloat16()
    opt = zkern.cpu.CPUAdam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fp32_optimizer_states=fp32_states)
    opt.step()
    state = opt.state[param]
    want = torch.float32 if fp32_states else torch.bfloat16
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == want and param.dtype == torch.bfloat16
    zeros = torch.zeros(1000)
    ep, em, ev = exact_step(p, g.bfloat16(), zeros, zeros, step=1)
    check_rounded(param.detach(), ep, fp32_slack(ep, torch.full_like(ep, LR * 2)), "CPUAdam bf16 param",
                  stochastic=False)
    if not fp32_states:
        check_rounded(state["exp_avg"], em, fp32_slack(em, g.abs().double()), "exp_avg", stochastic=False)
    with pytest.raises(TypeError, match="fp32 or bf16 CPU parameters"):
        bad = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
        bad.grad = torch.zeros(4, dtype=torch.float16)
        zkern.cpu.CPUAdam([bad]).step()


# -- the config ----------------------------------------------------------------------------------------------------
def base_config(stage: int = 2, **bf16) -> dict:
    return {"train_batch_size": 4, "bf16": {"enabled": True, **bf16}, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": LR}}}


def test_deepspeeds_keys_parse_and_deepspeed_accepts_the_same_file():
    pytest.importorskip("deepspeed", reason="DeepSpeed is in zkern's test extras; a GPU image may lack it")
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = base_config(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    ours = zkern.Config.load(cfg)
    assert ours.bf16.bf16_optimizer_states and ours.bf16.bf16_master_weights_and_grads
    from zkern.config.report import summary

    assert "optimizer state in bf16: master and moments, rounded to nearest even" in summary(ours)  # start-up block
    theirs = DeepSpeedConfig(dict(cfg, train_batch_size=4, train_micro_batch_size_per_gpu=4,
                                  gradient_accumulation_steps=1), mpu=None)
    assert theirs.bfloat16_config.bf16_optimizer_states and theirs.bfloat16_config.bf16_master_weights_and_grads


@pytest.mark.parametrize("cfg, match", [
    ({"train_batch_size": 4, "bf16": {"bf16_optimizer_states": True}, "zero_optimization": {"stage": 2}},
     "'bf16.enabled' is false"),
    (base_config(stage=0, bf16_master_weights_and_grads=True), "stages 1, 2 and 3"),
    (dict(base_config(), bf16_stochastic_rounding=True), "none is: set 'bf16.bf16_optimizer_states'"),
])
def test_config_mistakes_are_refused_with_what_to_do(cfg, match):
    with pytest.raises(ConfigError, match=match):
        zkern.Config.load(cfg)


def test_a_torch_optimizer_cannot_keep_bf16_state_and_says_so():
    model = torch.nn.Linear(8, 8)
    cfg = base_config(bf16_optimizer_states=True)
    del cfg["optimizer"]
    with pytest.raises(ConfigError, match="client optimizer.*zkern's fused Adam|zkern's fused Adam.*client optimizer"):
        zkern.Engine(model, cfg, optimizer=torch.optim.AdamW(model.parameters()))
    cfg = base_config(bf16_optimizer_states=True)
    cfg["optimizer"] = {"type": "Lion", "params": {"lr": 1e-3}}
    with pytest.raises(ConfigError, match="(?i)optimizer.type.*lion"):
        zkern.Engine(torch.nn.Linear(8, 8), cfg)


# -- the engine ----------------------------------------------------------------------------------------------------
def tiny_model():
    torch.manual_seed(0)
    return TinyGPT(vocab=67, dim=32, n_layer=2, n_head=2, seq=16)


def engine_config(stage: int, offload: str, **bf16) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 100}
    if offload != "none":
        zero["offload_optimizer"] = {"device": offload, "nvme_path": "/tmp"}
    # device cpu: these engines train on host tensors and read host memory, on a GPU machine too.
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
            "bf16": {"enabled": True, **bf16}, "zero_optimization": zero, "steps_per_print": 0, "device": "cpu",
            "comm_timeout_s": 120, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}


def piece_states(engine) -> list[tuple[int, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(group, index, master, exp_avg, exp_avg_sq) of every piece this rank steps, read wherever they live."""
    out, opt, store = [], engine.optimizer, engine.store
    for gi, group in enumerate(opt.shard_groups):
        for i, piece in enumerate(group.pieces):
            st = opt.piece_state(gi, i)
            out.append((gi, i, store.read(piece).clone(), store.read(st["exp_avg"], "exp_avg").clone(),
                        store.read(st["exp_avg_sq"], "exp_avg_sq").clone()))
    return out


def lockstep(rank, world, stage, offload, master_bf16, steps=4):
    """A bf16-state engine and an fp32-state engine from one model and one data stream: after every step the bf16
    engine holds torch's bf16 rounding of the fp32 engine's state, bit for bit; then the fp32 engine takes the bf16
    engine's (rounded) state, so the next step starts both from the same values."""
    torch.manual_seed(100 + rank)
    a = zkern.Engine(tiny_model(), engine_config(stage, offload, bf16_optimizer_states=True,
                                                 bf16_master_weights_and_grads=master_bf16))
    b = zkern.Engine(tiny_model(), engine_config(stage, offload))
    assert a.optimizer.exp_avg == [] or a.optimizer.exp_avg[0].dtype == torch.bfloat16
    if master_bf16:  # the bf16 master starts as the fp32 values rounded: so does the fp32 engine's
        for (gi, i, pa, _, _) in piece_states(a):
            b.store.write(b.optimizer.shard_groups[gi].pieces[i], pa.float())
    gen = torch.Generator().manual_seed(5 + rank)
    checked = 0
    for _ in range(steps):
        for _ in range(2):
            idx = torch.randint(0, 67, (2, 16), generator=gen)
            for e in (a, b):
                loss = e(idx, idx.roll(-1, 1))
                e.backward(loss)
                e.step()
        for (gi, i, pa, ma, va), (_, _, pb, mb, vb) in zip(piece_states(a), piece_states(b)):
            for got, fp32, what in ((ma, mb, "exp_avg"), (va, vb, "exp_avg_sq"), (pa, pb, "master")):
                expected = fp32.to(torch.bfloat16) if what != "master" or master_bf16 else fp32
                assert torch.equal(got.to(expected.dtype), expected), \
                    f"stage {stage} {offload} rank {rank}: {what} of piece {i} (group {gi}) is not the fp32 " \
                    f"engine's rounded"
                checked += got.numel()
            b.optimizer.set_piece_state(gi, i, {"exp_avg": ma.float(), "exp_avg_sq": va.float(),
                                                "step": b.optimizer.piece_state(gi, i)["step"]})
            if master_bf16:
                b.store.write(b.optimizer.shard_groups[gi].pieces[i], pa.float())
    memory = (a.memory_report(), b.memory_report())
    a.destroy()
    b.destroy()
    return checked, memory


@pytest.mark.dist
@pytest.mark.parametrize("stage, offload, master_bf16", [
    (1, "none", False), (2, "cpu", False), (3, "none", False), (3, "nvme", False),
    (2, "none", True), (3, "cpu", True), (1, "nvme", True),
])
def test_the_engine_keeps_its_fp32_state_rounded_to_bf16(stage, offload, master_bf16):
    results = spawn(lockstep, 2, stage, offload, master_bf16)
    for checked, (mem_a, mem_b) in results:
        assert checked > 0
        where = "host" if offload == "cpu" else "cpu"
        if offload != "nvme":
            # bf16 moments: half the fp32 engine's optimizer bytes; a bf16 master: none on the device (the working
            # copy is it), half the fp32 master's on the host
            assert mem_a[where]["optimizer"] * 2 == mem_b[where]["optimizer"] > 0
            if master_bf16:
                assert mem_a[where]["master"] * 2 == mem_b[where]["master"] if offload == "cpu" \
                    else mem_a[where]["master"] == 0
        else:
            # each file region is rounded up to whole 4 KiB blocks (2,048 bf16 elements, 1,024 fp32 ones): at most
            # one block more per moment for each of the optimizer's (here at most two) regions
            assert mem_a["nvme"]["optimizer"] <= mem_b["nvme"]["optimizer"] / 2 + 2 * 2 * 4096


def test_memory_report_and_estimate_memory_agree_on_the_bytes():
    """The formula with the new bytes per parameter (moments 4, master 0 on the device or 2 offloaded) against what
    the engine holds, at world 1 where nothing is padded for other ranks, per element of its layout (the parameters
    and the padding that starts each at a 256-byte boundary: a large share of this tiny model's 32-element norms)."""
    for offload, master_bf16 in (("none", False), ("none", True), ("cpu", True)):
        engine = zkern.Engine(tiny_model(), engine_config(2, offload, bf16_optimizer_states=True,
                                                          bf16_master_weights_and_grads=master_bf16))
        n = sum(g.layout.total for g in engine.runtime.groups)
        formula = zkern.estimate_memory(n, 1, 2, offload_optimizer=offload != "none", bf16_optimizer_states=True,
                                        bf16_master_weights_and_grads=master_bf16)
        mem = engine.memory_report()
        held = mem["host" if offload != "none" else "cpu"]
        assert held["optimizer"] + held["master"] == pytest.approx(
            formula["host" if offload != "none" else "optimizer_states"], rel=0.02), (offload, master_bf16)
        engine.destroy()


def final_loss(steps: int, stochastic: bool = False, **bf16) -> float:
    """The mean loss of the last 50 of `steps` steps: the tiny GPT on zkern.testing's learnable counting stream
    (whose loss curve is smooth: runs that round differently stay comparable), stage 2, world 1, lr 3e-3."""
    extra = {"bf16": {"enabled": True, **bf16}}
    if stochastic:
        extra["bf16_stochastic_rounding"] = True
    spec = TrainSpec(stage=2, steps=steps, precision="bf16", lr=3e-3, micro_batch=4, extra_config=extra)
    losses = engine_run(0, 1, spec)["losses"]
    assert losses[-1] < 0.5 * losses[0], "the run did not learn: nothing to compare"
    return sum(losses[-50:]) / 50


def test_training_with_bf16_state_ends_within_one_percent_of_fp32_state():
    """The issue's bar on a small model: 300 steps, the mean loss of the last 50 within 1% of the fp32-state run with
    bf16 moments (to nearest and stochastically) and with a bf16 master and moments rounded stochastically. A bf16
    master rounded to nearest loses every update smaller than half its unit (lr 3e-3 against weights near 1): it
    must end measurably worse than the stochastic one (6.7% against -0.6% when this was written), or the stochastic
    path is not rounding the master at all."""
    ref = final_loss(300)
    for stochastic, keys in ((False, {"bf16_optimizer_states": True}), (True, {"bf16_optimizer_states": True}),
                             (True, {"bf16_optimizer_states": True, "bf16_master_weights_and_grads": True})):
        end = final_loss(300, stochastic, **keys)
        assert abs(end - ref) <= 0.01 * ref, f"{keys}, stochastic={stochastic}: {end:.4f} against {ref:.4f}"
    nearest = final_loss(300, False, bf16_optimizer_states=True, bf16_master_weights_and_grads=True)
    assert nearest > 1.02 * ref, f"a bf16 master rounded to nearest ended at {nearest:.4f}, fp32 state at {ref:.4f}"


def test_checkpoints_cross_between_bf16_and_fp32_state_in_both_directions(tmp_path):
    """bf16 state is saved as it is held; a run with fp32 state loads it exactly (bf16 widens exactly), and a run
    with bf16 state loads fp32 state rounded to nearest, as torch's cast rounds it. The consolidated weights and
    load_optimizer_state_dict read the bf16 state too."""
    def trained(**bf16):
        engine = zkern.Engine(tiny_model(), engine_config(2, "none", **bf16))
        gen = torch.Generator().manual_seed(2)
        for _ in range(4):
            idx = torch.randint(0, 67, (2, 16), generator=gen)
            engine.backward(engine(idx, idx.roll(-1, 1)))
            engine.step()
        return engine

    def states(engine):
        return [(p.float(), m.float(), v.float()) for _, _, p, m, v in piece_states(engine)]

    bf16 = trained(bf16_optimizer_states=True, bf16_master_weights_and_grads=True)
    bf16.save_checkpoint(str(tmp_path / "bf16"), tag="t")
    into_fp32 = zkern.Engine(tiny_model(), engine_config(2, "none"))
    into_fp32.load_checkpoint(str(tmp_path / "bf16"), tag="t")
    for saved, loaded in zip(states(bf16), states(into_fp32)):
        for a, b in zip(saved, loaded):
            assert torch.equal(a, b)
    weights = zkern.checkpoint.load_fp32_state_dict(str(tmp_path / "bf16"), tag="t")
    live = bf16.full_state_dict()
    assert all(torch.equal(weights[k], live[k].float()) for k in live)
    moments = zkern.checkpoint.load_optimizer_state_dict(str(tmp_path / "bf16"), tag="t")
    assert moments, "the bf16 moments are readable from the checkpoint"

    fp32 = trained()
    fp32.save_checkpoint(str(tmp_path / "fp32"), tag="t")
    into_bf16 = zkern.Engine(tiny_model(), engine_config(2, "none", bf16_optimizer_states=True,
                                                          bf16_master_weights_and_grads=True))
    into_bf16.load_checkpoint(str(tmp_path / "fp32"), tag="t")
    for saved, loaded in zip(states(fp32), states(into_bf16)):
        for a, b in zip(saved, loaded):
            assert torch.equal(a.to(torch.bfloat16).float(), b)
    for e in (bf16, into_fp32, fp32, into_bf16):
        e.destroy()
