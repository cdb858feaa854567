"""ZeRO stage 3 beyond the shared equivalence matrix (tests/engine/test_engine.py runs stage 3 there too): real-model
shapes, prefetch and its re-recording, memory and communication, eval loops, saving, and diverging ranks."""

import os
import time

import pytest
import torch

import zkern
from zkern.core.partition import ALIGN, bucket_multiple
from zkern.stage3.lifecycle import DataState
from zkern.testing import TinyGPT, TrainSpec, assert_params_close, engine_run, reference_run, spawn


def engine_runs(rank, world, specs):
    return [engine_run(rank, world, s) for s in specs]


@pytest.mark.dist
@pytest.mark.parametrize("fetch_units", [(), ("Block",)])
def test_real_model_shapes_match_single_process_adamw(fetch_units):
    # tied embedding/head (default TinyGPT), a block run twice per forward, the head computed in the root's own
    # forward from tok.weight, frozen and sometimes-unused parameters; per-module and per-block fetch units
    specs = [
        TrainSpec(stage=3, model=dict(reuse_first_block=True), zero={"stage3_fetch_units": list(fetch_units)},
                  accumulation=2, clip=0.05),
        TrainSpec(stage=3, model=dict(functional_head=True, extra_branch=True, freeze_pos=True), extra_every=2,
                  zero={"stage3_fetch_units": list(fetch_units)}, reduce_bucket_size=5000),
    ]
    per_rank = spawn(engine_runs, 2, specs)
    for i, spec in enumerate(specs):
        ref_state, ref_losses = reference_run(spec, 2)
        assert_params_close(per_rank[0][i]["state"], ref_state, lr=spec.lr, steps=spec.steps)
        # the hooks' own bookkeeping: between forward and backward nothing but the persistent unit stays whole
        assert all(g == [] for r in per_rank for g in r[i]["gathered_after_forward"])
    assert any("reads 'tok.weight'" in m for m in per_rank[0][1]["log"])


@pytest.mark.dist
def test_order_change_re_records_says_so_once_and_stays_correct():
    spec = TrainSpec(stage=3, reverse_at=(3, 6), steps=8, zero={"stage3_prefetch_bucket_size": 6000})
    results = spawn(engine_runs, 2, [spec])
    ref_state, _ = reference_run(spec, 2)
    assert_params_close(results[0][0]["state"], ref_state, lr=spec.lr, steps=spec.steps)
    said = [m for m in results[0][0]["log"] if "re-recorded" in m]
    assert len(said) == 1 and "the forward pass gathered unit" in said[0]


@pytest.mark.dist
def test_prefetch_and_live_bounds():
    # 12608-element blocks as units; prefetch allows ~1.5 blocks ahead, the live bound ~2.5 blocks
    zero = {"stage3_fetch_units": ["Block"], "stage3_prefetch_bucket_size": 19000,
            "stage3_max_live_parameters": 32000, "stage3_param_persistence_threshold": 0}
    spec = TrainSpec(stage=3, steps=4, zero=zero, model=dict(n_layer=4))
    results = spawn(engine_runs, 2, [spec])
    ref_state, _ = reference_run(spec, 2)
    assert_params_close(results[0][0]["state"], ref_state, lr=spec.lr, steps=spec.steps)
    for r in results:
        assert r[0]["peak_live"] <= 32000
        assert all(g == [] for g in r[0]["gathered_after_forward"])


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_memory_report_and_comm_stats(world):
    specs = [TrainSpec(stage=3, precision=p, steps=2, accumulation=2, zero={"stage3_param_persistence_threshold": 200})
             for p in ("fp32", "bf16")]
    model = specs[0].make_model()
    psi = sum(p.numel() for p in model.parameters())
    seen, unit_sizes = set(), []  # a module's own parameters not owned by an earlier module (the tied head)
    for m in model.modules():
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own)
        if own:
            unit_sizes.append(sum(p.numel() for p in own))
    persistent = sum(n for n in unit_sizes if n < 200)
    units = sum(1 for n in unit_sizes if n >= 200)
    per_rank = spawn(engine_runs, world, specs)
    for i, spec in enumerate(specs):
        results = [r[i] for r in per_rank]
        mixed = spec.precision != "fp32"
        want = zkern.estimate_memory(psi, world, 3, precision="mixed" if mixed else "fp32")
        width = 2 if mixed else 4
        for r in results:
            mem = r["memory"]["cpu"]
            held = mem["params"] + mem["grads"] + mem["optimizer"] + mem["master"]
            # padding: fewer than bucket_multiple(world) elements per unit (units + the persistent one), 20 bytes
            # each at most; plus the persistent parameters' whole working copy
            slack = (units + 1) * bucket_multiple(world) * 20 + (persistent + world) * width
            # and the optimizer's state (at most 12 bytes an element) covers this rank's pieces only, not a chunk's
            # padding after its last piece: a rank whose chunks hold more of the padding holds less than psi / world
            short = (units + 1) * bucket_multiple(world) * 12
            assert want["total"] - short <= held <= want["total"] + slack, (spec.precision, mem, want)
            sent = {k: r["comm_end"][k] - r["comm_start"][k] for k in ("reduce_scatter", "all_gather", "all_reduce")}
            # every micro-step reduce-scatters each unit's padded gradient once (one default-size group)
            padded_units = psi + (units + 1) * bucket_multiple(world)  # upper bound of the padded total
            rs = sent["reduce_scatter"] / (spec.steps * spec.accumulation * width * (world - 1) / world)
            assert psi <= rs <= padded_units + world
            # all-gathers: the forward and backward gather every non-persistent unit (the tied tok unit once more
            # in the forward, for the head); each step refreshes the persistent unit; every gather of a unit also
            # carries its padding, fewer than bucket_multiple(world) elements
            ag = sent["all_gather"] / (width * (world - 1) / world)
            tok = model.tok.weight.numel()
            low = spec.steps * spec.accumulation * (2 * (psi - persistent) + tok)
            gathers = spec.steps * spec.accumulation * (2 * units + 1) + spec.steps
            high = low * 1.02 + spec.steps * (persistent + world) + gathers * bucket_multiple(world)
            assert low <= ag <= high, (ag, low)
            assert sent["all_reduce"] == 0


def eval_worker(rank, world, spec):
    """Train 2 steps, then generate under no_grad + eval (growing lengths), then train again: no hang, the same
    logits as a plain model holding the engine's weights."""
    engine = zkern.Engine(spec.make_model(), spec.config(world))
    batches = spec.batches(world)
    for step in range(2):
        idx, tgt = batches[step][0][rank]
        engine.backward(engine(idx, tgt))
        engine.step()
    engine.eval()
    prompt = batches[0][0][rank][0][:1, :4]
    with torch.no_grad():
        seq = prompt
        for _ in range(6):
            logits = engine(seq)
            seq = torch.cat([seq, logits[:, -1:].argmax(-1)], dim=1)
    gathered_after_eval = engine.runtime.gathered_units()
    state = engine.full_state_dict()
    engine.train()
    idx, tgt = batches[2][0][rank]
    engine.backward(engine(idx, tgt))
    engine.step()
    return {"seq": seq, "logits": logits, "state": state, "gathered": gathered_after_eval,
            "position_ids": engine.module.position_ids.clone(), "steps": engine.global_steps}


@pytest.mark.dist
def test_generation_under_no_grad_and_eval_then_training_continues():
    spec = TrainSpec(stage=3, steps=3)
    results = spawn(eval_worker, 2, spec)
    for r in results:
        plain = TinyGPT()
        plain.load_state_dict(r["state"])
        plain.eval()
        with torch.no_grad():
            expected = plain(r["seq"][:, :-1])
        torch.testing.assert_close(r["logits"], expected, rtol=1e-5, atol=1e-5)
        assert r["gathered"] == [] and r["steps"] == 3
        assert torch.equal(r["position_ids"], torch.arange(16))  # buffers stay whole


def test_a_forward_that_raises_leaves_nothing_gathered_and_training_goes_on():
    spec = TrainSpec(stage=3, steps=2)
    engine = zkern.Engine(spec.make_model(), spec.config(1))
    idx, tgt = spec.batches(1)[0][0][0]
    with pytest.raises(IndexError):
        engine(idx + 1000, tgt)  # out-of-range token ids: the embedding raises on the first, recording step
    assert engine.runtime.gathered_units() == [] and torch._C._len_torch_function_stack() == 0
    for _ in range(2):
        engine.backward(engine(idx, tgt))
        engine.step()
    assert engine.global_steps == 2 and engine.runtime.gathered_units() == []
    rt = engine.runtime  # the running count of gathered elements agrees with the units' own states
    assert rt.live_elements() == sum(u.bucket.padded for u in rt.units if u.data is not DataState.REST)


class LateReader(torch.nn.Module):
    """From step 3 on, `mix` reads `other.weight`, which `other` owns: a read zkern's first step cannot see."""

    def __init__(self):
        super().__init__()
        self.other = torch.nn.Linear(16, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.mix.late = False
        self.mix.forward = self._mix_forward

    def _mix_forward(self, x):
        y = torch.nn.functional.linear(x, self.mix.weight, self.mix.bias)
        return y + torch.nn.functional.linear(x, self.other.weight) if self.mix.late else y

    def forward(self, x):
        return self.mix(self.other(x)).square().mean()


@pytest.mark.parametrize("declared", [True, False])
def test_a_late_external_read_works_when_declared(declared):
    cfg = {"train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "device": "cpu",
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
    torch.manual_seed(0)
    model, ref = LateReader(), LateReader()
    ref.load_state_dict(model.state_dict())
    if declared:
        zkern.register_external_parameter(model.mix, model.other.weight)
    engine = zkern.Engine(model, cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    for step in range(4):
        model.mix.late = ref.mix.late = step >= 2
        if not declared and step == 2:
            with pytest.raises(RuntimeError) as error:  # other.weight is at rest (empty) when mix reads it
                engine(x)
            assert "zkern.register_external_parameter(reading_module, parameter)" in "".join(error.value.__notes__)
            return
        engine.backward(engine(x))
        engine.step()
        opt.zero_grad()
        ref(x).backward()
        opt.step()
    assert_params_close(engine.full_state_dict(), {k: v.detach() for k, v in ref.state_dict().items()}, lr=1e-2,
                        steps=4)


def save_worker(rank, world, tmp, flag):
    cfg = TrainSpec(stage=3, precision="bf16").config(world)
    cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = flag
    engine = zkern.Engine(TinyGPT(), cfg)
    try:
        engine.save_16bit_model(tmp)
    except RuntimeError as e:
        return str(e)
    return engine.full_state_dict()


@pytest.mark.dist
def test_save_16bit_model(tmp_path):
    results = spawn(save_worker, 2, str(tmp_path), True)
    saved = torch.load(tmp_path / "pytorch_model.bin")
    assert set(saved) == set(results[0]) and all(t.dtype in (torch.bfloat16, torch.int64) for t in saved.values())
    for name, value in saved.items():
        if value.is_floating_point():
            torch.testing.assert_close(value, results[0][name].bfloat16(), rtol=0, atol=0)
    errors = spawn(save_worker, 2, str(tmp_path / "off"), False)
    assert all("stage3_gather_16bit_weights_on_model_save" in e for e in errors)
    assert not os.path.exists(tmp_path / "off")


def diverging_worker(rank, world, timeout_s):
    """Rank 1 runs a unit that rank 0 skips (the extra branch), with the automatic merge off: both must end with a
    CommError."""
    spec = TrainSpec(stage=3, model=dict(extra_branch=True), zero={"stage3_merge_divergent_modules": False})
    cfg = spec.config(world)
    cfg["comm_timeout_s"] = timeout_s
    engine = zkern.Engine(spec.make_model(), cfg)
    idx, tgt = spec.batches(world)[0][0][rank]
    start = time.monotonic()
    try:
        for _ in range(2):
            engine.backward(engine(idx, tgt, use_extra=rank == 1))
            engine.step()
    except zkern.CommError as e:
        return {"error": str(e), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.dist
@pytest.mark.slow
def test_a_rank_that_skips_a_unit_ends_the_job_with_an_error():
    """The ranks would issue different collectives. No rank may hang: the first step verifies each gather across
    ranks, so every rank ends with zkern's CommError naming it and both ranks' units, before any data moves."""
    timeout_s = 4.0
    start = time.monotonic()
    results = spawn(diverging_worker, 2, timeout_s, timeout=90)
    assert time.monotonic() - start < 3 * timeout_s + 30
    for r, e in enumerate(results):
        assert e["error"] is not None, results
        assert f"zkern rank {r} of 2:" in e["error"] and "rank 1 was about to all-gather unit 'extra'" in e["error"]
        assert "stage3_merge_divergent_modules is false" in e["error"]


# ---------------------------------------------------------------------------------------------------------------
# Sharded construction


LAYERS, WIDTH = 16, 1024  # 16 x 4 MiB = 64 MiB of fp32 weights


def construction_peak_worker(rank, world):
    """Peak resident-memory growth (MiB) while building a 64 MiB model under init_sharded."""
    import torch.distributed as dist

    from zkern.testing import peak_rss_bytes, reset_peak_rss

    if world > 1:
        dist.init_process_group("gloo")
    cfg = {"train_batch_size": world, "zero_optimization": {"stage": 3}, "device": "cpu"}
    reset_peak_rss()
    before = peak_rss_bytes()
    with zkern.init_sharded(cfg):
        model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])
    grown = (peak_rss_bytes() - before) / 2**20
    held = sum(p._zkern_shard.numel() * 4 for p in model.parameters()) / 2**20
    return {"grown_mib": grown, "shards_mib": held}


@pytest.mark.dist
@pytest.mark.slow
def test_sharded_construction_peak_memory_scales_as_one_over_n():
    model_mib = LAYERS * WIDTH * WIDTH * 4 / 2**20
    layer_mib = model_mib / LAYERS
    peaks = {}
    for world in (1, 2, 4):
        results = spawn(construction_peak_worker, world, subprocess=True)
        peaks[world] = max(r["grown_mib"] for r in results)
        assert all(abs(r["shards_mib"] - model_mib / world) < 0.01 for r in results)
        # this rank's shards, plus one module built whole before it is cut, plus allocator slack
        assert peaks[world] <= model_mib / world + 2 * layer_mib + 8, (world, peaks)
    assert peaks[4] < 0.45 * peaks[1] and peaks[2] < 0.7 * peaks[1], peaks


def sharded_training_worker(rank, world, spec):
    torch.manual_seed(spec.seed + 1000 * rank)  # ranks draw different values: rank 0's must win everywhere
    with zkern.init_sharded(spec.config(world)):
        torch.manual_seed(spec.seed) if rank == 0 else None
        model = TinyGPT(**spec.model)
    assert all(p.data.numel() == 0 for p in model.parameters())
    engine = zkern.Engine(model, spec.config(world))
    persistent = sorted(n for u in engine.runtime.units if u.persistent for n in u.plan.names)
    batches = spec.batches(world)
    for step in range(spec.steps):
        idx, tgt = batches[step][0][rank]
        engine.backward(engine(idx, tgt))
        engine.step()
    return engine.full_state_dict(rank0_only=True), persistent


@pytest.mark.dist
def test_a_sharded_model_trains_like_the_plainly_built_one():
    spec = TrainSpec(stage=3, steps=5)
    results = spawn(sharded_training_worker, 2, spec)
    ref_state, _ = reference_run(spec, 2)
    assert_params_close(results[0][0], ref_state, lr=spec.lr, steps=spec.steps)
    # the same units stay whole as for a plainly built model (sized by their full shapes, not the empty stand-ins)
    plain = zkern.Engine(spec.make_model(), spec.config(1)).runtime
    assert results[0][1] == sorted(n for u in plain.units if u.persistent for n in u.plan.names)


def test_sharded_construction_honours_a_parent_re_initialising_a_child():
    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)  # partitioned when Linear.__init__ returns
            with torch.no_grad():
                self.lin.weight.fill_(0.5)  # ... so this call must see it whole
            self.scale = torch.nn.Parameter(torch.ones(3) * self.lin.weight.shape[0])

    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"},
           "device": "cpu"}
    with zkern.init_sharded(cfg):
        model = Parent()
    state = zkern.Engine(model, cfg).full_state_dict()
    assert torch.equal(state["lin.weight"], torch.full((8, 8), 0.5))
    assert torch.equal(state["scale"], torch.full((3,), 8.0))


def meta_built_worker(rank, world):
    """Modules built without storage under init_sharded: torch.nn.utils.skip_init (then initialised by the user in
    the context), and a meta-device module given storage by to_empty() and left uninitialised."""
    cfg = {"train_batch_size": world, "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"},
           "device": "cpu"}
    torch.manual_seed(rank)  # uninitialised memory and draws differ per rank: rank 0's must win everywhere
    with zkern.init_sharded(cfg):
        skipped = torch.nn.utils.skip_init(torch.nn.Linear, 8, 6)
        with torch.no_grad():
            skipped.weight.fill_(0.5)
            skipped.bias.zero_()
        empty = torch.nn.Linear(6, 4, device="meta").to_empty(device="cpu")
        model = torch.nn.Sequential(skipped, empty)
    held = {n: p.data.numel() for n, p in model.named_parameters()}
    return held, zkern.Engine(model, cfg).full_state_dict()


@pytest.mark.dist
def test_modules_built_on_the_meta_device_are_partitioned_when_they_get_storage():
    results = spawn(meta_built_worker, 2)
    for held, state in results:
        assert held == {"0.weight": 0, "0.bias": 0, "1.weight": 0, "1.bias": 0}  # nothing whole at rest
        assert torch.equal(state["0.weight"], torch.full((6, 8), 0.5)) and torch.equal(state["0.bias"], torch.zeros(6))
        assert state["1.weight"].shape == (4, 6)
    for name in ("1.weight", "1.bias"):  # the uninitialised values agree across ranks
        assert torch.equal(results[0][1][name].nan_to_num(), results[1][1][name].nan_to_num()), name


def test_sharded_construction_is_for_stage_3_only():
    with pytest.raises(ValueError, match="partitions parameters for ZeRO stage 3; the config says stage 2"):
        with zkern.init_sharded({"train_batch_size": 1, "zero_optimization": {"stage": 2}}):
            pass
    with zkern.init_sharded({"train_batch_size": 1, "zero_optimization": {"stage": 3}}):
        model = TinyGPT()
    with pytest.raises(ValueError, match="built under zkern.init_sharded.*the config says stage 1"):
        zkern.Engine(model, {"train_batch_size": 1, "zero_optimization": {"stage": 1}, "optimizer": {"type": "Adam"},
                             "device": "cpu"})
    assert torch.nn.Linear.__init__.__name__ == "__init__" and not hasattr(torch.nn.Linear.__init__, "__wrapped__")


class FailOnce(torch.autograd.Function):
    """Identity whose backward raises the first time (a user's custom op failing mid-backward)."""

    failed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        if not FailOnce.failed:
            FailOnce.failed = True
            raise RuntimeError("custom backward failed")
        return grad


class FailingHead(TinyGPT):
    def forward(self, idx, targets):
        return FailOnce.apply(super().forward(idx, targets))


def test_a_backward_that_raises_leaves_nothing_held_and_training_goes_on():
    spec = TrainSpec(stage=3, steps=2)
    torch.manual_seed(spec.seed)
    engine = zkern.Engine(FailingHead(), spec.config(1))
    idx, tgt = spec.batches(1)[0][0][0]
    with pytest.raises(RuntimeError, match="custom backward failed"):
        engine.backward(engine(idx, tgt))
    assert engine.runtime.gathered_units() == []
    assert all(not u.held and not u.lingering for u in engine.runtime.units)
    for _ in range(2):
        engine.backward(engine(idx, tgt))
        engine.step()
    assert engine.global_steps == 2 and engine.runtime.gathered_units() == []


@pytest.mark.parametrize("freeze_pos", [False, True])
def test_adam_moments_cost_eight_bytes_per_trainable_element_whatever_the_groups(freeze_pos):
    """Decay/no-decay groups (what HF's Trainer passes) and frozen parameters: Adam keeps two fp32 moments per
    trainable element of the shard, never a whole shard per group nor moments for frozen elements."""
    spec = TrainSpec(stage=3, steps=1, model={"freeze_pos": freeze_pos})
    for split in (False, True):
        model = spec.make_model()
        groups = None
        if split:
            trainable = [p for p in model.parameters() if p.requires_grad]
            groups = [{"params": [p for p in trainable if p.dim() >= 2]},
                      {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        # each of a group's chunks (at most one per trainable parameter) may start up to ALIGN - 1 elements later in
        # the moments, to keep its 16-byte phase (shard_adam._compact_starts); padding itself has no moments
        gaps = (ALIGN - 1) * sum(1 for p in model.parameters() if p.requires_grad)
        engine = zkern.Engine(model, spec.config(1), model_parameters=groups)
        assert 8 * trainable <= engine.memory_report()["cpu"]["optimizer"] <= 8 * (trainable + gaps), (
            split, freeze_pos)


def _async_gathers(rank, world, spec):
    """Train spec; count the all-gathers issued ahead of use (async) per step, and the peak of gathered elements."""
    from zkern.stage3.gatherer import Gatherer

    issued = []
    original = Gatherer.gather

    def gather(self, u, *, async_op, exact=False):
        issued.append((u.name, async_op))
        return original(self, u, async_op=async_op, exact=exact)

    Gatherer.gather = gather
    try:
        result = engine_run(rank, world, spec)
    finally:
        Gatherer.gather = original
    blocks = [a for name, a in issued if name.startswith("blocks.")]
    return {"async": sum(blocks), "sync": len(blocks) - sum(blocks), "state": result["state"],
            "peak_live": result["peak_live"]}


@pytest.mark.dist
def test_units_larger_than_the_prefetch_bucket_are_still_gathered_ahead():
    # every block (12,608 elements, gathered whole) exceeds stage3_prefetch_bucket_size: at least the next unit still
    # goes ahead along the record, within stage3_max_live_parameters; 0 turns prefetch off
    zero = {"stage3_fetch_units": ["Block"], "stage3_prefetch_bucket_size": 1000,
            "stage3_max_live_parameters": 40000, "stage3_param_persistence_threshold": 0}
    spec = TrainSpec(stage=3, steps=4, zero=zero, model=dict(n_layer=4))
    off = TrainSpec(stage=3, steps=4, zero={**zero, "stage3_prefetch_bucket_size": 0}, model=dict(n_layer=4))
    ahead, none = spawn(_async_gathers, 2, spec), spawn(_async_gathers, 2, off)
    ref_state, _ = reference_run(spec, 2)
    assert_params_close(ahead[0]["state"], ref_state, lr=spec.lr, steps=spec.steps)
    # from the second step on, forward and backward each prefetch the blocks after the first one they use: 3 steps
    # x 2 passes x 3 blocks (counted: the all-gathers of blocks issued ahead of use)
    assert all(r["async"] >= 3 * 2 * 3 for r in ahead), [r["async"] for r in ahead]
    assert all(r["peak_live"] <= 40000 for r in ahead)
    assert all(r["async"] == 0 for r in none), [r["async"] for r in none]
