"""Gradient numerics as DeepSpeed configures them: gradient_predivide_factor (the average before the sum, so fp16
sums do not overflow world times sooner than they must), communication_data_type and
data_types.grad_accum_dtype."""

import pytest
import torch

import zkern
from zkern import ConfigError
from zkern.testing import TinyGPT, TrainSpec, spawn


class Probe(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1, bias=False)
        torch.nn.init.constant_(self.lin.weight, 0.01)

    def forward(self, x):
        return self.lin(x).sum()


def overflow_worker(rank, world, stage, predivide):
    """Every rank's fp16 gradient is 30000 (x = 30000, static loss scale 1): it fits fp16 (max 65504), the sum of
    four does not (120000)."""
    cfg = {"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True, "loss_scale": 1.0}, "device": "cpu",
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}}, "steps_per_print": 0,
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if predivide is not None:
        cfg["gradient_predivide_factor"] = predivide
    engine = zkern.Engine(Probe(), cfg)
    x = torch.full((1, 4), 30000.0, dtype=torch.float16)
    for _ in range(2):
        engine.backward(engine(x))
        engine.step()
    return {"skipped": engine.skipped_steps, "weight": engine.full_state_dict()["lin.weight"],
            "norm": engine.last_grad_norm}


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp16_sums_of_four_ranks_no_longer_overflow_when_averaged_first(stage):
    summed_first = spawn(overflow_worker, 4, stage, 1.0)[0]  # DeepSpeed's stage-3 default: sum, then divide
    assert summed_first["skipped"] == 2
    averaged_first = spawn(overflow_worker, 4, stage, None)[0]  # zkern's default: divide by the world first
    assert averaged_first["skipped"] == 0
    # the true mean gradient is 30000 per element: Adam moves each weight by lr per step, and the norm is exact
    torch.testing.assert_close(averaged_first["weight"], torch.full((1, 4), 0.01 - 2e-3), rtol=0, atol=2e-5)
    assert averaged_first["norm"] == pytest.approx(30000.0 * 2, rel=1e-6)


def grads_worker(rank, world, spec):
    """One accumulated step's reduced gradients, read before the optimizer step."""
    engine = zkern.Engine(spec.make_model(), spec.config(world))
    batches = spec.batches(world)
    for micro in range(spec.accumulation):
        idx, tgt = batches[0][micro][rank]
        engine.backward(engine(idx, tgt))
        if micro < spec.accumulation - 1:
            engine.step()
    names = {id(p): n for n, p in engine.module.named_parameters()}
    grads = {names[k]: v for k, v in engine.runtime.full_grads().items()}
    return grads


def reference_grads(spec, world, ranks_first):
    """The arithmetic zkern must do, written out: each rank's bf16 gradient of loss / (accumulation * world),
    widened to fp32, summed over ranks per micro-step then over micro-steps (stages 2-3), or over micro-steps on
    each rank then over ranks (stages 0-1, which reduce once at the boundary)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run: the same kernels, the same sums
    try:
        torch.manual_seed(spec.seed)
        model = TinyGPT(**spec.model).to(torch.bfloat16)
        batches = spec.batches(world)
        per = {}  # (micro, rank) -> {name: fp32 grad}
        for micro in range(spec.accumulation):
            for rank in range(world):
                model.zero_grad()
                idx, tgt = batches[0][micro][rank]
                (model(idx, tgt) * (1.0 / (spec.accumulation * world))).backward()
                per[micro, rank] = {n: p.grad.float() for n, p in model.named_parameters()}
    finally:
        torch.set_num_threads(threads)
    out = {}
    for name in per[0, 0]:
        if ranks_first:
            total = None
            for micro in range(spec.accumulation):
                reduced = per[micro, 0][name] + per[micro, 1][name]
                total = reduced if total is None else total + reduced
        else:
            on_rank = [per[0, r][name] + per[1, r][name] for r in range(world)]
            total = on_rank[0] + on_rank[1]
        out[name] = total
    return out


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_bf16_gradients_reduced_and_accumulated_in_fp32_equal_the_fp32_arithmetic_bit_for_bit(stage):
    """World 2: one fp32 addition per element per reduction, which commutes, so the order of the ranks cannot
    matter and the result must be the written-out arithmetic exactly."""
    spec = TrainSpec(stage=stage, precision="bf16", accumulation=2, steps=1, reduce_bucket_size=3000,
                     extra_config={"communication_data_type": "fp32", "data_types": {"grad_accum_dtype": "fp32"}})
    got = spawn(grads_worker, 2, spec)[0]
    want = reference_grads(spec, 2, ranks_first=stage >= 2)
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], value), (name, (got[name] - value).abs().max())


def test_the_options_are_checked():
    with pytest.raises(ConfigError, match="'gradient_predivide_factor' must be >= 1e-30"):
        zkern.Config.load({"train_batch_size": 1, "gradient_predivide_factor": 0})
    with pytest.raises(ConfigError, match="'communication_data_type' must be \"fp32\", \"fp16\" or \"bf16\""):
        zkern.Config.load({"train_batch_size": 1, "communication_data_type": "int8"})
    with pytest.raises(ConfigError, match="did you mean 'data_types.grad_accum_dtype'"):
        zkern.Config.load({"train_batch_size": 1, "data_types": {"grad_accum": "fp32"}})
    cfg = zkern.Config.load({"train_batch_size": 8, "communication_data_type": "bfloat16"}).resolve(4)
    assert cfg.communication_data_type == "bf16" and cfg.gradient_predivide_factor == 4.0
