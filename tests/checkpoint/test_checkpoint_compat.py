"""A checkpoint saved by an earlier manifest version loads with today's code: weights, optimizer state, counters,
loss scaler, LR scheduler and the torch generator all come back as the files hold them.

    python -m pytest tests/checkpoint/test_checkpoint_compat.py -q
"""

from __future__ import annotations

import shutil

import torch
from checkpoint_runs import V2, assert_same_state, build, train, v2_spec
from safetensors.torch import load_file

from zkern.checkpoint import load_fp32_state_dict, load_optimizer_state_dict
from zkern.checkpoint.manifest import read_manifest


def test_a_version_2_checkpoint_loads_whole(tmp_path):
    saved = tmp_path / "v2"
    shutil.copytree(V2, saved)
    manifest = read_manifest(str(saved / "global_step3"))
    assert manifest["version"] == 2
    engine = build(v2_spec(), 1)
    torch.rand(5)  # the generator moves away from the saved state
    path, client = engine.load_checkpoint(saved)
    assert path == str(saved / "global_step3") and client == {"epoch": 1}
    assert (engine.global_steps, engine.skipped_steps, engine.micro_steps) == (3, 0, 3)
    assert engine.loss_scale == manifest["loss_scaler"]["scale"] == 131072.0
    assert engine.lr_scheduler.state_dict()["last_batch_iteration"] == 2
    assert engine.get_global_grad_norm() == manifest["last_grad_norm"]
    rng = load_file(str(saved / "global_step3" / "rank00000.safetensors"))["rng.cpu:rank0:0"]
    assert torch.equal(torch.get_rng_state(), rng)
    # what the engine now holds, written by today's code, is what the old files hold
    engine.save_checkpoint(tmp_path / "again", tag="global_step3")
    assert_same_state(load_fp32_state_dict(tmp_path / "again"), load_fp32_state_dict(saved), "masters")
    assert_same_state(load_optimizer_state_dict(tmp_path / "again"), load_optimizer_state_dict(saved), "moments")
    losses = train(engine, v2_spec(), 3, 5, 0, 1)
    assert all(torch.isfinite(torch.tensor(losses))) and engine.global_steps == 5
