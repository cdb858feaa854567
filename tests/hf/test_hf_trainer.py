"""zkern.hf.Trainer against transformers.Trainer (DDP) on the same tiny GPT-2 (dropout on), data, seed and
arguments at world 2: logged losses, learning rates and gradient norms at stages 0-3; resuming from a save_steps
checkpoint; save_model's directory loads with from_pretrained; the "auto" configs HF users have train; a config that
contradicts the TrainingArguments is an error naming both.

    python -m pytest tests/hf/test_hf_trainer.py -q
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from hf_runs import compare_worker, config_worker, resume_worker, training_args

from zkern.config import ConfigError
from zkern.hf import fill_auto
from zkern.testing.ranks import spawn

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
AUTO_BATCH = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto"}
ADAMW_AUTO = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
# Losses are means over 32 tokens x 2 samples; one step's update moves them by ~1e-3, and the runs differ only in the
# order of fp32 sums (a few ulps, ~1e-7 relative, per step): 1e-5 absolute over 20 steps leaves a 10x margin and is
# crossed by any change in the arithmetic (a step with another LR, a missed micro-batch, one more clip).
LOSS_ATOL = 1e-5


def stage_config(stage: int, **extra) -> dict:
    return {**AUTO_BATCH, "zero_optimization": {"stage": stage}, **extra}


def assert_logs_match(got: list[dict], want: list[dict], what: str) -> None:
    assert [e["step"] for e in got] == [e["step"] for e in want] == list(range(1, len(want) + 1)), what
    for g, w in zip(got, want):
        assert abs(g["loss"] - w["loss"]) <= LOSS_ATOL, (what, g, w)
        assert math.isclose(g["learning_rate"], w["learning_rate"], rel_tol=1e-12, abs_tol=1e-15), (what, g, w)
        assert math.isclose(float(g["grad_norm"]), float(w["grad_norm"]), rel_tol=1e-4), (what, g, w)


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """One world-2 job: transformers.Trainer with DDP, then zkern.hf.Trainer at stages 0-3 (the Trainer's own
    AdamW and scheduler), at stage 2 with the config's fused AdamW, and at stage 3 with HF's gradient
    checkpointing (compared with the DDP run without it: recomputation changes no value)."""
    out = str(tmp_path_factory.mktemp("hf"))
    runs = [{"name": "ddp", "kind": "ddp"}]
    runs += [{"name": f"stage{s}", "kind": "zkern", "config": stage_config(s), "save": s == 3} for s in range(4)]
    runs.append({"name": "stage2_fused", "kind": "zkern", "config": stage_config(2, optimizer=ADAMW_AUTO)})
    # HF's gradient_checkpointing_enable() (torch's checkpoint, which restores the RNG for the recomputation)
    runs.append({"name": "stage3_checkpointing", "kind": "zkern", "config": stage_config(3),
                 "args": {"gradient_checkpointing": True}})
    results = spawn(compare_worker, 2, out, runs, timeout=600)
    return out, results


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", ["stage0", "stage1", "stage2", "stage3", "stage2_fused", "stage3_checkpointing"])
def test_logged_losses_equal_transformers_trainer_with_ddp(compared, name):
    _, results = compared
    want = results[0]["ddp"]["logs"]
    assert len(want) == 20 and want[-1]["loss"] < want[0]["loss"]
    for rank in range(2):  # every rank logs the same values (HF averages the loss over ranks)
        assert_logs_match(results[rank][name]["logs"], want, f"{name} rank {rank}")


@pytest.mark.dist
@pytest.mark.slow
def test_save_model_writes_what_from_pretrained_loads_and_the_engine_holds(compared):
    from transformers import GPT2LMHeadModel

    out, results = compared
    assert results[0]["stage3"]["engine_is_module"]
    loaded = GPT2LMHeadModel.from_pretrained(os.path.join(out, "stage3", "final"))
    full = results[0]["stage3"]["full_state"]
    state = loaded.state_dict()
    assert set(state) == set(full)
    for name, value in full.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=name)
    assert os.path.isfile(os.path.join(out, "stage3", "final", "model.safetensors"))
    # The save_steps checkpoint holds zkern's checkpoint, HF's state and a loadable model.
    checkpoint = os.path.join(out, "stage3", "checkpoint-10")
    assert {"zkern", "trainer_state.json", "model.safetensors", "config.json"} <= set(os.listdir(checkpoint))
    assert not [f for f in os.listdir(checkpoint) if f.endswith((".pth", ".pt"))]  # nothing pickled by zkern


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_resuming_a_save_steps_checkpoint_reproduces_the_later_steps_exactly(compared, tmp_path, stage):
    out, results = compared
    straight = results[0][f"stage{stage}"]["logs"]
    resumed = spawn(resume_worker, 2, str(tmp_path), stage_config(stage),
                    os.path.join(out, f"stage{stage}", "checkpoint-10"), timeout=300)
    for rank in range(2):
        assert [e["step"] for e in resumed[rank]] == list(range(1, 21))
        assert resumed[rank][10:] == straight[10:]  # steps 11-20, exactly: weights, moments, LR, RNG, data order


def config_path(name: str) -> str:
    return os.path.join(DATA, name)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name,precision", [("hf_zero2_offload.json", "bf16"), ("hf_zero3_offload.json", "fp32"),
                                            ("hf_zero3_bf16.json", "bf16")])
def test_the_auto_configs_hf_users_have_train(tmp_path, name, precision):
    overrides = {"bf16": True} if precision == "bf16" else {}
    result = spawn(config_worker, 2, str(tmp_path), config_path(name), overrides, timeout=600)[0]
    assert result["precision"] == precision
    assert (result["micro"], result["accumulation"], result["train_batch"], result["clip"]) == (2, 2, 8, 1.0)
    assert result["reduce_bucket_size"] == 32 * 32  # hidden**2
    if result["stage"] == 3:
        assert (result["prefetch"], result["persistence"]) == (int(0.9 * 32 * 32), 10 * 32)
    if result["optimizer_lr"] is not None:
        assert result["optimizer_lr"] == 3e-3 and result["group_decay"] == [0.01, 0.0]  # HF's decay split
    if result["lr_max"] is not None:
        assert result["lr_max"] == 3e-3
    losses = [e["loss"] for e in result["logs"]]
    assert len(losses) == 30 and all(math.isfinite(x) for x in losses)
    # The counting task is learnable: the last five steps average well below the first five and below log(vocab).
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first and last < math.log(67), losses


@pytest.mark.dist
def test_a_muon_config_trains_through_the_trainer_with_hf_decay_groups_split(tmp_path):
    """DeepSpeed's Muon section as an HF user writes it ("auto" lr for AdamW, Muon's own, "auto" weight decay), stage 3
    at world 2: the Trainer's decay group holds GPT-2's matrices (Muon's), its no-decay group the biases and norms
    (AdamW's); the counting task is learned."""
    import json

    path = tmp_path / "muon.json"
    path.write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
        "optimizer": {"type": "Muon", "params": {"lr": "auto", "muon_lr": 0.02, "weight_decay": "auto"}}}))
    result = spawn(config_worker, 2, str(tmp_path), str(path), {}, timeout=600)[0]
    assert result["group_muon"] == [True, False] and result["group_decay"] == [0.01, 0.0]
    losses = [e["loss"] for e in result["logs"]]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert all(math.isfinite(x) for x in losses) and last < 0.8 * first, losses


def test_a_value_that_contradicts_the_training_arguments_names_both(tmp_path):
    args = training_args(str(tmp_path), per_device_train_batch_size=2, max_grad_norm=1.0, learning_rate=1e-3)
    config = {**AUTO_BATCH, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.5,
              "optimizer": {"type": "AdamW", "params": {"lr": 2e-3}}}
    with pytest.raises(ConfigError) as caught:
        fill_auto(config, args, 2, 20)
    text = str(caught.value)
    assert "'train_micro_batch_size_per_gpu' = 4" in text and "per_device_train_batch_size = 2" in text
    assert "'gradient_clipping' = 0.5" in text and "max_grad_norm = 1.0" in text
    assert "'optimizer.params.lr' = 0.002" in text and "learning_rate = 0.001" in text
    with pytest.raises(ConfigError, match=r"'bf16.enabled' = True in the config vs TrainingArguments.bf16"):
        fill_auto({"bf16": {"enabled": True}}, args, 2, 20)


def test_fill_auto_fills_what_the_trainer_owns_and_leaves_the_rest(tmp_path):
    args = training_args(str(tmp_path), per_device_train_batch_size=3, gradient_accumulation_steps=4,
                         learning_rate=2e-4, weight_decay=0.1, warmup_steps=0.25, bf16=True)
    raw = {"train_batch_size": "auto", "optimizer": {"type": "AdamW"},
           "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto"}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"}}
    filled = fill_auto(raw, args, 4, 40)
    assert raw["train_batch_size"] == "auto"  # the caller's dict is not changed
    assert filled["train_batch_size"] == 3 * 4 * 4
    assert (filled["train_micro_batch_size_per_gpu"], filled["gradient_accumulation_steps"]) == (3, 4)
    assert filled["gradient_clipping"] == 1.0 and filled["bf16"] == {"enabled": True} and "fp16" not in filled
    assert filled["optimizer"]["params"] == {"lr": 2e-4, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.1}
    assert filled["scheduler"]["params"] == {"warmup_max_lr": 2e-4, "warmup_num_steps": 10, "total_num_steps": 40}
    assert filled["zero_optimization"]["reduce_bucket_size"] == "auto"  # from the model's hidden size, at resolve()


def test_the_trainer_refuses_deepspeed_arguments_and_needs_a_config(tmp_path):
    from hf_runs import tiny_gpt2

    from zkern.hf import Trainer

    with pytest.raises(TypeError, match="zkern_config"):
        Trainer(model=tiny_gpt2(), args=training_args(str(tmp_path)))
    with pytest.raises(ConfigError, match="does not exist"):
        Trainer(model=tiny_gpt2(), args=training_args(str(tmp_path)), zkern_config=str(tmp_path / "none.json"))


@pytest.mark.parametrize("scheduler", [
    {"type": "WarmupCosineLR", "params": {"warmup_num_steps": "auto", "total_num_steps": "auto",
                                           "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
    {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 5}},
    {"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 1e-4, "lr_range_test_step_size": 5}},
])
def test_fill_auto_gives_each_scheduler_only_its_own_keys_and_the_config_parses(tmp_path, scheduler):
    # WarmupLR's lr and warmup keys were planted into every scheduler section, which the strict parse then refused
    # (ms-swift's stock zero2.json and zero3_offload.json with a WarmupCosineLR)
    from zkern import Config

    args = training_args(str(tmp_path), per_device_train_batch_size=2, learning_rate=1e-3, warmup_steps=4)
    filled = fill_auto({"train_batch_size": "auto", "optimizer": {"type": "AdamW"}, "scheduler": scheduler,
                        "zero_optimization": {"stage": 2}}, args, 2, 40)
    params = filled["scheduler"]["params"]
    if scheduler["type"] == "WarmupCosineLR":
        assert params == {"warmup_num_steps": 4, "total_num_steps": 40, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}
    else:
        assert params == scheduler["params"]
    Config.load(filled)  # parses: no key its type does not have
