"""zkern.hf.from_pretrained: each rank reads only its shards of a 113 MiB GPT-2; its peak resident memory while
loading stays within its share of the model plus the largest tensor; the weights equal transformers' own
from_pretrained; missing tensors are initialised by the model; damaged or pickled checkpoints are refused.

    python -m pytest tests/hf/test_hf_pretrained.py -q
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from zkern.errors import CheckpointError
from zkern.testing.ranks import spawn

VOCAB, DIM, LAYERS = 8192, 512, 8  # 29.5M parameters: 113 MiB of fp32, the embedding (16 MiB) the largest tensor
OVERHEAD_MIB = 8  # Python objects, the module tree, allocator slack (measured 4-8 MiB at worlds 1, 2 and 4)


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=DIM, n_layer=LAYERS, n_head=8)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from transformers import GPT2LMHeadModel

    path = str(tmp_path_factory.mktemp("gpt2"))
    torch.manual_seed(0)
    GPT2LMHeadModel(gpt2_config()).save_pretrained(path)
    return path


def stage3(world: int) -> dict:
    return {"train_batch_size": world, "device": "cpu", "optimizer": {"type": "AdamW"},
            "zero_optimization": {"stage": 3, "reduce_bucket_size": DIM * DIM}}


def load_worker(rank: int, world: int, path: str) -> dict:
    import zkern
    from zkern.testing import gpt2_load_peak

    model, grown, _ = gpt2_load_peak(path, stage3(world))
    shards = sum(p._zkern_shard.numel() * 4 for p in {id(p): p for p in model.parameters()}.values())
    engine = zkern.Engine(model, stage3(world))
    full = engine.full_state_dict(rank0_only=True)
    return {"grown": grown, "shards": shards, "full": full}


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 4])
def test_each_rank_reads_its_shards_within_its_share_of_memory_and_the_weights_are_exact(saved, world):
    from transformers import GPT2LMHeadModel

    results = spawn(load_worker, world, saved, subprocess=True, timeout=300)
    reference = GPT2LMHeadModel.from_pretrained(saved)
    model_bytes = sum(p.numel() * 4 for p in reference.parameters())  # tied lm_head counted once
    largest = max(p.numel() * 4 for p in reference.parameters())
    assert model_bytes > 100 * 2**20
    for rank, r in enumerate(results):
        assert abs(r["shards"] - model_bytes / world) <= 4 * world * len(list(reference.parameters()))  # padding
        bound = model_bytes / world + largest + OVERHEAD_MIB * 2**20
        assert r["grown"] <= bound, (world, rank, r["grown"] / 2**20, bound / 2**20)
    want = reference.state_dict()
    got = results[0]["full"]
    assert set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)


def missing_worker(rank: int, world: int, path: str) -> dict:
    import transformers
    from transformers import GPT2LMHeadModel

    import zkern

    transformers.utils.logging.set_verbosity_error()
    model = zkern.hf.from_pretrained(GPT2LMHeadModel, path, stage3(world), resid_pdrop=0.0)
    engine = zkern.Engine(model, stage3(world))
    return {"full": engine.full_state_dict(), "dropout": model.config.resid_pdrop}


@pytest.mark.dist
def test_tensors_missing_from_the_checkpoint_are_initialised_by_the_model(tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    small = GPT2Config(vocab_size=67, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    GPT2LMHeadModel(small).save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    full = {k: v.clone() for k, v in weights.items()}
    # Each missing tensor has a loaded sibling in its module, which the model's _init_weights would reset too (the
    # c_attn weight by 1.7 in the worst element before the fix)
    lost = ("transformer.ln_f.weight", "transformer.h.1.ln_2.bias", "transformer.h.0.attn.c_attn.bias")
    for name in lost:
        weights[name] = None
    save_file({k: v for k, v in weights.items() if v is not None}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    results = spawn(missing_worker, 2, str(tmp_path), timeout=300)
    got = results[0]["full"]
    assert results[0]["dropout"] == 0.0  # a config override
    torch.testing.assert_close(got["transformer.ln_f.weight"], torch.ones(32), rtol=0, atol=0)  # GPT-2's init
    torch.testing.assert_close(got["transformer.h.1.ln_2.bias"], torch.zeros(32), rtol=0, atol=0)
    torch.testing.assert_close(got["transformer.h.0.attn.c_attn.bias"], torch.zeros(96), rtol=0, atol=0)
    for name, value in full.items():
        if name not in lost:
            torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(results[1]["full"]["transformer.ln_f.weight"], torch.ones(32), rtol=0, atol=0)


def test_pickled_shape_mismatched_or_unknown_inputs_are_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    import zkern

    small = GPT2Config(vocab_size=67, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    small.save_pretrained(tmp_path)
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin.*never unpickles"):
        zkern.hf.from_pretrained(GPT2LMHeadModel, tmp_path, stage3(1))
    with pytest.raises(FileNotFoundError, match="local model directory"):
        zkern.hf.from_pretrained(GPT2LMHeadModel, tmp_path / "nothing", stage3(1))
    other = tmp_path / "other"
    GPT2LMHeadModel(GPT2Config(vocab_size=67, n_positions=16, n_embd=32, n_layer=1, n_head=2)).save_pretrained(other)
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 71
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"'transformer.wte.weight' has shape \[67, 32\].*\[71, 32\]"):
        zkern.hf.from_pretrained(GPT2LMHeadModel, other, stage3(1))
    with pytest.raises(TypeError, match="not_a_key"):
        zkern.hf.from_pretrained(GPT2LMHeadModel, other, stage3(1), not_a_key=3)
    assert os.path.isfile(other / "model.safetensors")


def test_an_auto_class_or_a_class_name_and_the_config_keyword_of_the_design(tmp_path):
    """DESIGN's spelling, from_pretrained(cls_or_name, path, config=...): AutoModelForCausalLM resolves to the
    checkpoint's own class; the weights are those transformers loads."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    import zkern

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=67, n_positions=16, n_embd=32, n_layer=1, n_head=2)).save_pretrained(tmp_path)
    want = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    for cls in (AutoModelForCausalLM, "AutoModelForCausalLM", "GPT2LMHeadModel"):
        model = zkern.hf.from_pretrained(cls, tmp_path, config=stage3(1))
        assert type(model) is GPT2LMHeadModel
        got = zkern.Engine(model, stage3(1)).full_state_dict()
        for name, value in got.items():
            torch.testing.assert_close(value, want[name], rtol=0, atol=0, msg=name)
    with pytest.raises(TypeError, match="'gpt2' is not a transformers model class name"):
        zkern.hf.from_pretrained("gpt2", tmp_path, stage3(1))
    with pytest.raises(TypeError, match="the same argument"):
        zkern.hf.from_pretrained(GPT2LMHeadModel, tmp_path, stage3(1), config=stage3(1))


def moe_worker(rank: int, world: int, path: str) -> dict:
    from transformers import MixtralForCausalLM

    import zkern
    import zkern.hf

    cfg = {"train_batch_size": world, "device": "cpu", "optimizer": {"type": "AdamW"},
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 10}}
    model = zkern.hf.from_pretrained(MixtralForCausalLM, path, cfg)
    shard_numels = [p._zkern_shard.numel() for p in model.parameters()]
    engine = zkern.Engine(model, cfg)
    return {"full": engine.full_state_dict(rank0_only=True), "shard_numels": shard_numels}


@pytest.mark.dist
def test_a_checkpoint_transformers_converts_on_load_is_read_through_its_conversions(tmp_path):
    """A Mixtral checkpoint stores each expert's matrices apart (experts.0.w1.weight, ...) where transformers 5's
    model holds them fused (experts.gate_up_proj); read by name, the experts would keep their initial values. The
    model built here has transformers' own weights for every tensor, each rank holding only its shards."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=64)
    torch.manual_seed(0)
    MixtralForCausalLM(config).save_pretrained(str(tmp_path))
    results = spawn(moe_worker, 2, str(tmp_path), timeout=300)
    want = MixtralForCausalLM.from_pretrained(str(tmp_path)).state_dict()
    got = results[0]["full"]
    assert any(".experts.gate_up_proj" in name for name in want) and set(got) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    whole = sum(v.numel() for v in want.values())
    assert sum(results[0]["shard_numels"]) < 0.6 * whole  # a shard each, not the whole model
