"""A checkpoint loads at any world size, stage and offload setting with no conversion step, and consolidates
into files Hugging Face and safetensors load.

    python -m pytest tests/checkpoint/test_checkpoint_topology.py -q
"""

from __future__ import annotations

import subprocess
import sys

import torch
from checkpoint_runs import assert_same_state, spec_for, topology_source, topology_target, with_stage
from safetensors.torch import load_file

from zkern.checkpoint import consolidate, load_fp32_state_dict, load_optimizer_state_dict
from zkern.testing.compare import assert_params_close
from zkern.testing.ranks import spawn

LR = 1e-3


def test_world2_stage3_resumes_at_world4_stage2_world1_stage0_world2_stage1_offload(tmp_path):
    source = spec_for(2, stage=3, lr=LR)
    src = spawn(topology_source, 2, source, str(tmp_path / "src"))[0]
    saved = load_fp32_state_dict(tmp_path / "src")
    assert_same_state(saved, src["at_save"], "the checkpoint's weights")
    saved_optimizer = load_optimizer_state_dict(tmp_path / "src")
    targets = {"w4_stage2": (4, 2, {}), "w1_stage0": (1, 0, {}),
               "w2_stage1_offload": (2, 1, {"offload_optimizer": {"device": "cpu"}})}
    for name, (world, stage, zero) in targets.items():
        spec = with_stage(source, world, stage, **zero)
        out = spawn(topology_target, world, spec, str(tmp_path / "src"), str(tmp_path / name))[0]
        assert out["global_steps"] == 3
        assert_same_state(out["after_load"], saved, f"{name}: weights right after loading")
        # What the loaded engine holds, saved again in its own layout: the same whole tensors, moments included.
        assert_same_state(load_optimizer_state_dict(tmp_path / name), saved_optimizer,
                          f"{name}: optimizer state after loading")
        assert_params_close(out["final"], src["final"], lr=LR, steps=3)


CHAIN = [(2, 3), (4, 1), (1, 3), (2, 0), (4, 3), (1, 1), (2, 2), (4, 0), (1, 2), (4, 2), (2, 1), (1, 0)]


def test_every_stage_and_world_saves_and_loads_in_a_chain(tmp_path):
    """Each (world, stage) of stages 0-3 x worlds 1, 2, 4 loads the previous one's checkpoint, checks it holds
    exactly what was saved, trains one step and saves in its own layout; the chain ends within rounding of one
    run that never changed layout."""
    base = spec_for(2, stage=3, lr=LR)
    previous = None
    for k, (world, stage) in enumerate(CHAIN):
        spec = with_stage(base, world, stage)
        here = tmp_path / f"{k}_w{world}_s{stage}"
        if previous is None:
            spawn(topology_source, world, spec, str(here))  # 3 steps, save, (3 more: unused here)
            previous = here
            continue
        out = spawn(chain_link, world, spec, str(previous), str(here), 3 + k - 1)[0]
        assert_same_state(out["after_load"], load_fp32_state_dict(previous), f"link {k} (world {world}, stage {stage})")
        assert_same_state(load_optimizer_state_dict(here, "loaded"), load_optimizer_state_dict(previous),
             f"link {k} (world {world}, stage {stage}): optimizer state")
        previous = here
    steps = 3 + len(CHAIN) - 1
    reference = spawn(straight_run, 2, base, steps)[0]
    assert_params_close(load_fp32_state_dict(previous), reference, lr=LR, steps=steps)


def chain_link(rank: int, world: int, spec, source: str, out: str, step: int) -> dict:
    from checkpoint_runs import build, train

    engine = build(spec, world)
    engine.load_checkpoint(source)
    assert engine.global_steps == step
    after_load = engine.full_state_dict()
    engine.save_checkpoint(out, tag="loaded", save_latest=False)
    train(engine, spec, step, step + 1, rank, world)
    engine.save_checkpoint(out)
    return {"after_load": after_load}


def straight_run(rank: int, world: int, spec, steps: int) -> dict:
    from checkpoint_runs import build, train

    engine = build(spec, world)
    train(engine, spec, 0, steps, rank, world)
    return engine.full_state_dict()


def test_consolidation_loads_with_safetensors_and_transformers(tmp_path):
    from checkpoint_runs import build

    from zkern.testing.runs import TrainSpec

    spec = TrainSpec(stage=3, arch="hf_gpt2", micro_batch=4, precision="bf16")
    engine = build(spec, 1)
    idx = torch.arange(64).view(4, 16) % 50
    for _ in range(2):
        engine.backward(engine(input_ids=idx, labels=idx).loss)
        engine.step()
    expected = engine.full_state_dict()
    engine.save_checkpoint(tmp_path / "ckpt")
    # The CLI, whole: one file.
    cli = subprocess.run([sys.executable, "-m", "zkern.checkpoint", "consolidate", str(tmp_path / "ckpt"),
                          str(tmp_path / "one")], capture_output=True, text=True)
    assert cli.returncode == 0, cli.stderr
    assert_same_state(load_file(tmp_path / "one" / "model.safetensors"), expected, "consolidated fp32")
    # Sharded, in bf16: an index and several files, every tensor there rounded as torch rounds it.
    files = consolidate(tmp_path / "ckpt", tmp_path / "sharded", dtype="bf16", max_shard_size="20kB")
    assert len(files) > 2 and files[-1].endswith("model.safetensors.index.json")
    got = {}
    for f in files[:-1]:
        got.update(load_file(f))
    rounded = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in expected.items()}
    assert_same_state(got, rounded, "bf16 shards")
    # Hugging Face loads the directory without zkern.
    import transformers

    model = engine.module
    model.config.save_pretrained(tmp_path / "one")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one", torch_dtype=torch.float32)
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, expected[name]), name
    inspect = subprocess.run([sys.executable, "-m", "zkern.checkpoint", "inspect", str(tmp_path / "ckpt")],
                             capture_output=True, text=True)
    assert "step 2" in inspect.stdout and "checksums: all hold" in inspect.stdout, inspect.stdout
