"""The config's other optimizers (SGD with momentum and Nesterov, Adagrad, Lion, Lamb) on sharded states at stages
0-3 and with offload, each against a single-process reference on the same global batches: torch's own SGD and
Adagrad, and Lion and Lamb written out here from their papers' and DeepSpeed's formulas (Lamb's trust ratio needs
each parameter's whole norm, which zkern sums over the ranks holding its pieces).

    python -m pytest tests/optim/test_optimizers.py -q
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import zkern
from zkern.testing import TrainSpec, assert_params_close, engine_run, global_batch, spawn
from zkern.verify.reference_math import RefLamb, RefLion  # Lion and Lamb written out, none of zkern's code

LR = 1e-2
OPTIMIZERS = {
    "sgd": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}},
    "adagrad": {"type": "Adagrad", "params": {"lr": LR, "lr_decay": 0.01, "weight_decay": 0.01}},
    "lion": {"type": "Lion", "params": {"lr": LR / 10, "betas": [0.9, 0.99], "weight_decay": 0.01}},
    "lamb": {"type": "Lamb", "params": {"lr": LR, "weight_decay": 0.01, "eps": 1e-6, "max_coeff": 10.0,
                                       "min_coeff": 0.01}},
}


def spec_for(name: str, stage: int, **kwargs) -> TrainSpec:
    return TrainSpec(stage=stage, steps=5, accumulation=2, extra_config={"optimizer": OPTIMIZERS[name]},
                     reduce_bucket_size=3000, **kwargs)


def reference(name: str, spec: TrainSpec, world: int) -> dict:
    model = spec.make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    o = {**OPTIMIZERS[name]["params"]}
    if name == "sgd":
        opt = torch.optim.SGD(params, **o)
    elif name == "adagrad":
        opt = torch.optim.Adagrad(params, **o)
    elif name == "lion":
        opt = RefLion(params, lr=o["lr"], betas=tuple(o["betas"]), weight_decay=o["weight_decay"])
    else:
        opt = RefLamb(params, **o)
    batches = spec.batches(world)
    for step in range(spec.steps):
        opt.zero_grad()
        idx, tgt = global_batch(batches, step)
        spec.loss(model, idx, tgt, step).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def runs(rank, world, specs):
    return [engine_run(rank, world, s) for s in specs]


CASES = [(name, stage, {}) for name in OPTIMIZERS for stage in (0, 1, 2, 3)] + [
    ("lamb", 2, {"offload_optimizer": {"device": "cpu"}}), ("sgd", 3, {"offload_optimizer": {"device": "cpu"}})]


@pytest.mark.dist
def test_each_optimizer_on_sharded_states_equals_one_process():
    world = 2
    specs = [replace(spec_for(name, stage), zero=zero) for name, stage, zero in CASES]
    per_rank = spawn(runs, world, specs, timeout=900)
    for i, (name, stage, zero) in enumerate(CASES):
        spec = specs[i]
        expected = reference(name, spec, world)
        got = per_rank[0][i]["state"]
        what = f"{name} at stage {stage} {zero}"
        assert per_rank[0][i]["skipped"] == 0, what
        lr = OPTIMIZERS[name]["params"]["lr"]
        if name == "lion":
            # sign() turns a rounding-sized difference of a near-zero element into a 2 lr step: held to that, and to
            # almost every element equal
            for key, e in expected.items():
                diff = (got[key] - e).abs()
                assert float(diff.max()) <= 2 * lr * spec.steps + 1e-6, (what, key)
                assert float((diff > 1e-5).float().mean()) < 0.01, (what, key)
        else:
            assert_params_close(got, expected, lr=lr, steps=spec.steps)


def test_lamb_norms_are_whole_parameter_norms_on_every_rank():
    """Lamb's coefficients come from whole parameters: at stage 3 every rank computes the same coefficient for a
    parameter whose pieces it splits with the other rank (checked through the reference above too)."""
    spec = spec_for("lamb", 1)
    engine = zkern.Engine(spec.make_model(), spec.config(1))
    assert type(engine.optimizer).__name__ == "Lamb" and engine.optimizer.reduce is None  # world 1: nothing to sum


def test_unknown_or_missing_optimizers_say_what_to_use():
    cfg = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(zkern.ConfigError, match="'FusedLamb' is a DeepSpeed optimizer that zkern does not implement"):
        zkern.Config.load({**cfg, "optimizer": {"type": "FusedLamb"}})
    with pytest.raises(zkern.ConfigError, match="'OneBitAdam' asks for 1-bit Adam, removed from DeepSpeed"):
        zkern.Config.load({**cfg, "optimizer": {"type": "OneBitAdam"}})
    with pytest.raises(zkern.ConfigError, match="'Adamm' is unknown; did you mean"):
        zkern.Config.load({**cfg, "optimizer": {"type": "Adamm"}})
    with pytest.raises(zkern.ConfigError, match="unknown config key 'optimizer.params.momentun'; did you mean"):
        zkern.Config.load({**cfg, "optimizer": {"type": "SGD", "params": {"momentun": 0.9}}})


def test_lamb_steps_piece_by_piece_without_a_copy_of_the_shard():
    """Lamb's update of every piece was kept at once (a full fp32 copy of the shard, plus float64 copies for the
    norms and a host read per piece); now one piece's temporaries at a time, measured by the allocator."""
    from zkern.optim.lamb_lion import Lamb
    from zkern.testing import allocation_peak

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(100_000)) for _ in range(10)]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = Lamb(params, lr=1e-3, weight_decay=0.01)
    opt.step()  # the moments exist from here on
    _, m = allocation_peak(opt.step)
    piece = 100_000 * 4
    assert m.peak["cpu"] <= 4 * piece, m  # a few temporaries of one piece, never ten pieces' updates
    assert len(opt.lamb_coeffs) == 10 and all(0.01 <= c <= 10.0 for c in opt.lamb_coeffs)
