"""ZeRO-Offload: the optimizer step on the host (stages 1-3) and stage 3's parameter shards at rest on the host
give the same training as the same engine without offload, and as single-process torch AdamW."""

import dataclasses

import pytest
import torch

import zkern
import zkern.testing
from zkern.core.partition import aligned_numel, bucket_multiple
from zkern.testing import TrainSpec, assert_params_close, engine_run, reference_run, spawn

OPT = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}  # pin_memory is a no-op without CUDA
PARAM = {"offload_param": {"device": "cpu"}}


def engine_runs(rank, world, specs):
    return [engine_run(rank, world, s) for s in specs]


CASES = {
    # sometimes-unused parameters, unused in the first step: pieces that do not step (not even once yet) must
    # come back from the host unchanged
    "stage1": TrainSpec(stage=1, zero=OPT, model=dict(extra_branch=True), extra_every=2, extra_phase=1,
                        reduce_bucket_size=5000),
    "stage2-accum-clip": TrainSpec(stage=2, zero=OPT, accumulation=2, clip=0.05, reduce_bucket_size=5000),
    "stage3-optimizer": TrainSpec(stage=3, zero=OPT, model=dict(reuse_first_block=True)),
    "stage3-optimizer-param": TrainSpec(stage=3, zero={**OPT, **PARAM}, model=dict(reuse_first_block=True)),
}


def without_offload(spec: TrainSpec) -> TrainSpec:
    zero = {k: v for k, v in spec.zero.items() if not k.startswith("offload")}
    return dataclasses.replace(spec, zero=zero)


@pytest.mark.dist
def test_offload_matches_the_same_engine_without_it_and_torch():
    names = list(CASES)
    specs = [CASES[n] for n in names] + [without_offload(CASES[n]) for n in names]
    per_rank = spawn(engine_runs, 2, specs)
    k = len(names)
    for i, name in enumerate(names):
        spec = CASES[name]
        off, plain = per_rank[0][i], per_rank[0][k + i]
        assert off["global_steps"] == plain["global_steps"] == spec.steps, name
        assert_params_close(off["state"], plain["state"], lr=spec.lr, steps=spec.steps)
        ref_state, ref_losses = reference_run(spec, 2)
        assert_params_close(off["state"], ref_state, lr=spec.lr, steps=spec.steps)
        gap = max(abs(a - b) / abs(b) for a, b in zip(off["losses"], plain["losses"]))
        assert gap < 1e-5, f"{name}: loss curves differ by {gap:.2e} relative"
        for r in range(2):
            mem = per_rank[r][i]["memory"]
            assert set(mem) == {"cpu", "host", "measured"}, name
            if "offload_optimizer" in spec.zero:
                # the master shard and both Adam moments: 12 bytes per element of this rank's fp32 shard, less the
                # moments of a stage-3 chunk's padding after its last piece (fewer than bucket_multiple(2) elements
                # per unit, 20 units here)
                gap = 2 * mem["host"]["master"] - mem["host"]["optimizer"]
                assert mem["host"]["optimizer"] > 0 and 0 <= gap <= 8 * bucket_multiple(2) * 20, (name, gap)
                assert mem["cpu"]["optimizer"] == mem["cpu"]["master"] == 0, name
                assert mem["host"]["offload_buffers"] > 0, name
            if "offload_param" in spec.zero:
                assert mem["host"]["params"] > 0, name
        # the host's bytes are the formula's (fp32: moments plus the host's own copy of the shard), per element of the
        # layout (each parameter's 128-element slot: its views start 256-byte aligned), to the buckets' padding
        trainable = sum(aligned_numel(p.numel()) for p in spec.make_model().parameters() if p.requires_grad)
        formula = zkern.estimate_memory(trainable, 2, spec.stage,
                                        offload_optimizer=True, offload_param="offload_param" in spec.zero,
                                        precision="fp32")
        host = per_rank[0][i]["memory"]["host"]
        # (a 3,000-element bucket ends with up to 255 padding elements at world 2: up to 4% of this tiny model)
        assert host["master"] + host["optimizer"] + host["params"] == pytest.approx(formula["host"], rel=0.04), name


@pytest.mark.dist
def test_offload_in_bf16_matches_bf16_without_it():
    spec = TrainSpec(stage=2, precision="bf16", zero=OPT, reduce_bucket_size=5000, steps=6)
    per_rank = spawn(engine_runs, 2, [spec, without_offload(spec)])
    off, plain = per_rank[0]
    assert_params_close(off["state"], plain["state"], lr=spec.lr, steps=spec.steps)
    assert off["losses"] == pytest.approx(plain["losses"], rel=1e-6)


@pytest.mark.parametrize("zero, match", [
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "nvme"}},
     "offload_param.nvme_path' is required"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "needs ZeRO stage 1, 2 or 3"),
    ({"stage": 3, "offload_optimizer": {"device": "gpu"}}, "must be \"none\", \"cpu\" or \"nvme\""),
    ({"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, "needs 'offload_optimizer'"),
    ({"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "ratio": 0.5}}, "ratio"),
])
def test_offload_config_errors_say_what_to_do(zero, match):
    with pytest.raises(zkern.ConfigError, match=match):
        zkern.Config.load({"zero_optimization": zero})


def test_offload_param_at_stage_2_is_ignored_with_a_warning_as_deepspeed_ignores_it():
    cfg = zkern.Config.load({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}})
    assert cfg.zero_optimization.offload_param_device == "none"
    assert any("offload_param.device" in path and "ignored" in msg for path, msg in cfg.notes.warned)


@pytest.mark.dist
def test_offload_param_alone_trains_as_without_it():
    """Stage 3's parameters at rest on the host while the optimizer stays on the device (DeepSpeed allows
    offload_param without offload_optimizer): each step writes the updated chunks to the host shard."""
    specs = [TrainSpec(stage=3, precision=p, zero={"offload_param": {"device": "cpu"}}, reduce_bucket_size=5000,
                       steps=5) for p in ("fp32", "bf16")]
    per_rank = spawn(engine_runs, 2, [*specs, *(without_offload(s) for s in specs)])
    for off, plain, precision in zip(per_rank[0][:2], per_rank[0][2:], ("fp32", "bf16")):
        assert off["losses"] == plain["losses"]
        assert all(torch.equal(off["state"][k], v) for k, v in plain["state"].items())
        shard = off["memory"]["host"]["params"]  # the resting working shard, reported on the host
        # on the device: the persistent units only (bf16 without offload keeps no working shard either: its gathers
        # cast from the master)
        device, kept = off["memory"]["cpu"]["params"], plain["memory"]["cpu"]["params"]
        assert shard > 0 and (device < kept if precision == "fp32" else device == kept)


def test_offload_sections_parse_with_deepspeed_defaults():
    cfg = zkern.Config.load({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True, "buffer_count": 4},
        "offload_param": {"device": "none", "pin_memory": False}}})
    z = cfg.zero_optimization
    assert (z.offload_optimizer_device, z.offload_optimizer_pin_memory, z.offload_param_device) == ("cpu", True, "none")


def test_a_gathered_parameters_write_survives_a_step_where_that_parameter_gets_no_gradient():
    """Host offload stages the updated parameters on the host and sends them back to the device shard: only the
    pieces that stepped may go, or a piece without a gradient would overwrite a GatheredParameters write made
    since the staging copy was last filled with the value from before it."""
    torch.manual_seed(0)
    model = zkern.testing.TinyGPT(vocab=67, dim=32, n_layer=1, n_head=2, seq=16, extra_branch=True)
    cfg = {"train_micro_batch_size_per_gpu": 2, "device": "cpu", "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                 "stage3_param_persistence_threshold": 10}}
    engine = zkern.Engine(model, cfg)
    idx = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(1))
    for use_extra in (True, False):
        engine.backward(engine(idx, idx, use_extra=use_extra))
        engine.step()
        if use_extra:
            with zkern.GatheredParameters([model.extra.weight], modifier_rank=0), torch.no_grad():
                model.extra.weight.fill_(0.5)
    with zkern.GatheredParameters([model.extra.weight]):  # the working copy the next forward would use
        working = model.extra.weight.detach().clone()
    assert torch.equal(working, torch.full_like(working, 0.5))
    assert torch.equal(engine.full_state_dict()["extra.weight"], torch.full((32, 32), 0.5))
