"""Partial optimizer offload (offload_optimizer.ratio < 1, zkern/offload/partial.py): that share of each rank's shard
on the host, the rest stepped on the device, training as the plain engine does.

    python -m pytest tests/offload/test_partial.py -q

On a CPU the two parts are one memory, and both steps run the same Adam kernel on the same values: a run with a
partial offload must give the plain engine's weights bit for bit. What tells the parts apart here is the books: the
host staging covers only the host part's chunks, the device part's chunks are marked and stepped in place, and the
memory report puts each part's master and moments where they live.
"""

from __future__ import annotations

import pytest
import torch
from checkpoint_runs import assert_same_state, spec_for, topology_source, topology_target, with_stage

import zkern
from zkern.checkpoint import load_optimizer_state_dict
from zkern.errors import ConfigError
from zkern.testing import TinyGPT, TrainSpec, engine_run, spawn


def _partial(ratio: float, **more) -> dict:
    return {"offload_optimizer": {"device": "cpu", "ratio": ratio, **more}}


def _runs(rank: int, world: int, specs: list[TrainSpec]) -> list[dict]:
    return [engine_run(rank, world, spec) for spec in specs]


@pytest.mark.dist
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_partial_offload_trains_as_the_plain_engine(stage):
    """World 2, bf16, accumulation and clipping; ratios 0.3 and 0.7 (with and without the staging ring) and 0 (all on
    the device) against no offload and full offload."""
    base = dict(stage=stage, steps=3, precision="bf16", reduce_bucket_size=3000, accumulation=2, clip=0.5)
    zeros = [{}, _partial(1.0), _partial(0.3), _partial(0.7, staging_chunks=0), _partial(0.0)]
    specs = [TrainSpec(**base, zero=z) for z in zeros]
    plain, *others = spawn(_runs, 2, specs, timeout=900)[0]
    for zero, result in zip(zeros[1:], others):
        assert result["losses"] == plain["losses"], zero
        for name, value in plain["state"].items():
            assert torch.equal(result["state"][name], value), f"stage {stage} {zero}: {name} differs"


def _engine(stage: int, ratio: float, **more) -> zkern.Engine:
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "bf16": {"enabled": True},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, **_partial(ratio, **more)},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    return zkern.Engine(TinyGPT(), cfg)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.9])
def test_the_host_stages_only_its_share_and_the_books_split_where_the_parts_live(stage, ratio):
    engine = _engine(stage, ratio)
    try:
        step = engine.host_step
        chunks = [c for g in step.host_groups for c in g.chunks]
        device = [c for c in chunks if c.on_device]
        host = [c for c in chunks if not c.on_device]
        assert device and host
        share = step.host_numel / (step.host_numel + step.device_numel)
        # the split falls where a piece ends: within the largest piece of the ratio asked for
        largest = max(numel for g in step.host_groups for c in g.chunks for _, _, numel in c.pieces)
        assert abs(share - ratio) <= largest / (step.host_numel + step.device_numel) + 1e-9
        assert step.grad_bytes == sum(c.grad.nbytes for c in host)  # only the host part comes down
        staged = {t.data_ptr() for t in step.staging_tensors()}
        assert not staged & {c.grad.data_ptr() for c in device}
        report = engine.memory_report()  # fp32 master and moments, each part where it lives (with its padding)
        on_device, on_host = report["cpu"]["master"], report["host"]["master"]
        assert on_device >= 4 * step.device_numel and on_host >= 4 * step.host_numel
        assert abs(on_host / (on_device + on_host) - share) < 0.02
        moments = report["cpu"]["optimizer"] + report["host"]["optimizer"]
        assert report["cpu"]["optimizer"] > 0 and abs(report["host"]["optimizer"] / moments - share) < 0.02
        idx = torch.randint(0, 67, (2, 16))
        loss = engine(idx, idx)
        engine.backward(loss)
        engine.step()
        assert step.last_step["device_chunks"] == len(device)
        assert step.last_step["grad_bytes_in_backward"] + step.last_step["grad_bytes_at_step"] == step.grad_bytes
    finally:
        engine.destroy()


@pytest.mark.dist
def test_a_partial_offload_checkpoint_resumes_on_other_layouts(tmp_path):
    """Saved at world 2 stage 2 with ratio 0.5, loaded at world 1 stage 3 without offload and at world 4 stage 1 with
    ratio 0.3: the optimizer state comes back exact and training goes on as the run that saved."""
    source = spec_for(2, stage=2, reduce_bucket_size=3000, zero=_partial(0.5))
    src = spawn(topology_source, 2, source, str(tmp_path / "src"))[0]
    saved = load_optimizer_state_dict(tmp_path / "src")
    for name, (world, stage, zero) in {"w1_stage3": (1, 3, {}), "w4_stage1_partial": (4, 1, _partial(0.3))}.items():
        out = spawn(topology_target, world, with_stage(source, world, stage, **zero), str(tmp_path / "src"),
                    str(tmp_path / name))[0]
        assert_same_state(load_optimizer_state_dict(tmp_path / name), saved, f"{name}: optimizer state after loading")
        for key, value in src["final"].items():
            assert torch.allclose(out["final"][key], value, rtol=1e-5, atol=1e-6), f"{name}: {key}"


@pytest.mark.parametrize("clash, words", [
    ({"device": "nvme", "nvme_path": "/tmp/zkern-partial"}, "device \"cpu\""),
    ({"delayed_update": True}, "delayed_update"),
    ({"speculative_step": True}, "speculative_step"),
])
def test_partial_offload_refuses_what_it_cannot_split(clash, words):
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.5, **clash}}}
    with pytest.raises(ConfigError, match="ratio") as caught:
        zkern.Engine(TinyGPT(), cfg)
    assert words in str(caught.value)


def test_partial_offload_refuses_offload_param():
    """(Muon with partial offload trains: tests/optim/test_muon.py.)"""
    zero = {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {**zero, "offload_param": {"device": "cpu"}}}
    with pytest.raises(ConfigError, match="ratio.*offload_param"):
        zkern.Engine(TinyGPT(), cfg)
