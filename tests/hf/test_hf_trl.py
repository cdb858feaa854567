"""TRL's SFTTrainer and DPOTrainer training on zkern, against the same TRL run on DDP, at world 2 on a tiny GPT-2.

The change a TRL script makes (docs/frameworks.md):

    class SFTTrainer(zkern.hf.Trainer, trl.SFTTrainer): pass
    trainer = SFTTrainer(model=..., args=SFTConfig(...), ..., zkern_config="ds_config.json")

TRL's loss, data collation, metrics and (DPO) reference log-probabilities stay TRL's; the engine takes the backward,
reduction and step. DPO's reference model goes into a zkern engine without an optimizer (partitioned at stage 3).

    python -m pytest tests/hf/test_hf_trl.py -q
"""

from __future__ import annotations

import math

import pytest
from trl_runs import trl_worker

from zkern.testing.ranks import spawn

pytest.importorskip("trl")  # in the test extra; a user's environment without TRL skips only this file

AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "gradient_clipping": "auto"}
# Both sides compute in fp32 (bf16=False: TRL's default bf16=True means autocast under DDP, but bf16 working weights
# under a DeepSpeed-style engine, which is another arithmetic) and differ only in the order of fp32 sums, a few ulps
# (~1e-7 relative) per step; over 6 steps 1e-5 on losses (~4 and ~0.7) leaves a 10x margin that a changed step
# (another LR, a missed micro-batch, a reference model that moves) crosses.
LOSS_ATOL = 1e-5


def _config(stage: int) -> dict:
    return {**AUTO, "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}


RUNS = [{"name": "sft_ddp", "trainer": "sft", "kind": "ddp"},
        {"name": "sft_stage0", "trainer": "sft", "kind": "zkern", "config": _config(0)},
        {"name": "sft_stage3", "trainer": "sft", "kind": "zkern", "config": _config(3)},
        {"name": "dpo_ddp", "trainer": "dpo", "kind": "ddp"},
        {"name": "dpo_stage1", "trainer": "dpo", "kind": "zkern", "config": _config(1)},
        {"name": "dpo_stage3", "trainer": "dpo", "kind": "zkern", "config": _config(3)},
        {"name": "dpo_sync_stage3", "trainer": "dpo", "kind": "zkern", "config": _config(3),
         "args": {"sync_ref_model": True}}]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    return spawn(trl_worker, 2, str(tmp_path_factory.mktemp("trl")), RUNS, timeout=600)


def _assert_same_training(got: dict, want: dict, what: str) -> None:
    assert [e["step"] for e in got["logs"]] == [e["step"] for e in want["logs"]] == list(range(1, 7)), what
    for g, w in zip(got["logs"], want["logs"]):
        assert abs(g["loss"] - w["loss"]) <= LOSS_ATOL, (what, g, w)
        assert math.isclose(g["learning_rate"], w["learning_rate"], rel_tol=1e-12), (what, g, w)
        assert math.isclose(float(g["grad_norm"]), float(w["grad_norm"]), rel_tol=1e-4), (what, g, w)
    assert len(got["margins"]) == len(want["margins"]), what
    for g, w in zip(got["margins"], want["margins"]):
        assert abs(g - w) <= LOSS_ATOL, (what, got["margins"], want["margins"])


@pytest.mark.dist
@pytest.mark.parametrize("name", ["sft_stage0", "sft_stage3"])
def test_trl_sft_trains_on_zkern_as_on_ddp(trained, name):
    for rank in (0, 1):
        _assert_same_training(trained[rank][name], trained[rank]["sft_ddp"], f"{name} rank {rank}")
    losses = [e["loss"] for e in trained[0][name]["logs"]]
    assert losses[-1] < losses[0]  # it learns (dropout on: the generators follow DDP's too)


@pytest.mark.dist
@pytest.mark.parametrize("name", ["dpo_stage1", "dpo_stage3"])
def test_trl_dpo_trains_on_zkern_with_its_reference_in_an_engine_without_optimizer(trained, name):
    for rank in (0, 1):
        got = trained[rank][name]
        _assert_same_training(got, trained[rank]["dpo_ddp"], f"{name} rank {rank}")
        assert got["reference"] == "Engine" and not got["reference_trainable"]
        assert any(m != 0 for m in got["margins"])  # the policy moved away from the reference
    if name == "dpo_stage3":  # partitioned at rest: each rank holds its half of every parameter (and padding)
        held, full = [trained[r][name]["reference_held"] for r in (0, 1)], trained[0][name]["reference_full"]
        assert sum(held) >= full and max(held) < 0.6 * full
    else:
        assert trained[0][name]["reference_held"] == trained[0][name]["reference_full"]
    assert trained[0]["dpo_ddp"]["reference"] == "GPT2LMHeadModel"


@pytest.mark.dist
def test_a_synced_reference_at_stage_3_is_refused_naming_what_works(trained):
    for rank in (0, 1):
        error = trained[rank]["dpo_sync_stage3"]["error"]
        assert error.startswith("ConfigError") and "sync_ref_model" in error and "stage 0-2" in error
