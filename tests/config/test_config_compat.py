"""Configs and call sites that DeepSpeed takes and zkern refused, from real repositories and the frameworks built on
DeepSpeed: each now accepted with DeepSpeed's meaning (said in the start-up block where it changes something), or
refused where it could never train.

    python -m pytest tests/config/test_config_compat.py -q
"""

import pytest
import torch

import zkern
from zkern import Config, ConfigError
from zkern.testing import TinyGPT


def load(**kw):
    return Config.load({"train_micro_batch_size_per_gpu": 1, **kw})


def test_the_clipping_default_is_the_installed_deepspeeds():
    constants = pytest.importorskip("deepspeed.runtime.constants")
    assert load().gradient_clipping == constants.GRADIENT_CLIPPING_DEFAULT
    assert load(gradient_clipping=0).gradient_clipping == 0.0  # set: as given, no note
    assert not any(k == "gradient_clipping" for k, _ in load(gradient_clipping=0).notes.filled)


def test_a_count_no_run_reaches_is_refused():
    # 1e+30 micro-steps before the first step: the engine never stepped, and nothing said why
    with pytest.raises(ConfigError, match="'gradient_accumulation_steps' must be from 1 to"):
        load(gradient_accumulation_steps=1e30)


def test_bf16_loss_scale_and_auto_cast_are_taken_as_deepspeed_took_them():
    cfg = load(bf16={"enabled": True, "loss_scale": 0, "auto_cast": True})
    assert cfg.bf16.auto_cast
    assert any(p == "bf16.loss_scale" for p, _ in cfg.notes.inert)
    seen = {}

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x):
            seen["dtype"] = x.dtype
            return self.lin(x).float().sum()

    engine = zkern.Engine(Net(), {"train_micro_batch_size_per_gpu": 1, "device": "cpu", "optimizer": {"type": "AdamW"},
                                  "bf16": {"enabled": True, "auto_cast": True}})
    engine(torch.randn(1, 4))
    assert seen["dtype"] == torch.bfloat16


def test_a_zero_warmup_is_deepspeeds_minimum_of_two_steps():
    cfg = load(optimizer={"type": "AdamW"}, scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 0}})
    assert cfg.scheduler.params["warmup_num_steps"] == 0
    assert ("scheduler.params.warmup_num_steps", "0: warmup over 2 steps (DeepSpeed's minimum)") in cfg.notes.filled


def test_model_parameters_beside_a_client_optimizer_are_ignored_with_a_word(caplog):
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with caplog.at_level("WARNING", logger="zkern"):
        engine = zkern.Engine(model, {"train_micro_batch_size_per_gpu": 1, "device": "cpu",
                                      "zero_optimization": {"stage": 1}}, optimizer=opt,
                              model_parameters=model.parameters())
    assert engine.optimizer is opt
    assert any("beside an optimizer= they choose nothing" in r.getMessage() for r in caplog.records)


def test_zkerns_own_cpu_adam_is_a_tested_client_optimizer():
    cpu = pytest.importorskip("zkern.cpu")
    model = TinyGPT()
    engine = zkern.Engine(model, {"train_micro_batch_size_per_gpu": 1, "device": "cpu",
                                  "zero_optimization": {"stage": 1}}, optimizer=cpu.CPUAdam(model.parameters()))
    idx = torch.randint(0, 67, (1, 16))
    engine.backward(engine(idx, idx))
    engine.step()
    assert engine.global_steps == 1


def test_a_leaf_module_base_class_makes_its_subclasses_units():
    from zkern.testing import MoEBlock

    model = zkern.testing.TinyMoE()
    assert all(isinstance(b, MoEBlock) for b in model.blocks)
    engine = zkern.Engine(model, {"train_micro_batch_size_per_gpu": 1, "device": "cpu", "optimizer": {"type": "AdamW"},
                                  "zero_optimization": {"stage": 3, "leaf_module": {"classes": ["Block"]},
                                                        "stage3_param_persistence_threshold": 0}})
    names = {u.name for u in engine.runtime.units}
    assert {"blocks.0", "blocks.1"} <= names  # MoEBlock is a Block: each block one unit, as isinstance matches


def _leaf_engine(leaf: dict):
    return zkern.Engine(zkern.testing.TinyMoE(), {
        "train_micro_batch_size_per_gpu": 1, "device": "cpu", "optimizer": {"type": "AdamW"},
        "zero_optimization": {"stage": 3, "leaf_module": leaf, "stage3_param_persistence_threshold": 0}})


def test_leaf_modules_by_name_and_by_name_suffix_are_fetch_units():
    """DeepSpeed's leaf_module.names (a named_modules() path) and name_suffixes (a path ending) each make the module
    picked one fetch unit with its subtree, as leaf_module.classes does."""
    engine = _leaf_engine({"names": ["blocks.0"], "name_suffixes": [".experts"]})
    names = {u.name for u in engine.runtime.units}
    assert {"blocks.0", "blocks.1.experts"} <= names
    assert not any(n.startswith("blocks.0.") or n.startswith("blocks.1.experts.") for n in names), names
    assert "blocks.1.qkv" in names  # what nothing picked keeps its own unit


def test_a_leaf_module_name_that_picks_nothing_is_named():
    with pytest.raises(ValueError, match=r"\['blocks.7', '.mlp'\].*blocks.0.experts"):
        _leaf_engine({"names": ["blocks.7"], "name_suffixes": [".mlp"]})


def leaf_names_worker(rank: int, world: int, spec):
    from zkern.testing import engine_run

    return engine_run(rank, world, spec)


@pytest.mark.dist
def test_moe_blocks_picked_by_name_and_suffix_train_like_one_process():
    from zkern.testing import TrainSpec, assert_params_close, reference_run, spawn

    spec = TrainSpec(stage=3, arch="moe", steps=3, forced_routes={0: [0, 1]},
                     zero={"leaf_module": {"names": ["blocks.0"], "name_suffixes": ["blocks.1"]},
                           "stage3_param_persistence_threshold": 0})
    results = spawn(leaf_names_worker, 2, spec)
    want, _ = reference_run(spec, 2)
    assert_params_close(results[0]["state"], want, lr=spec.lr, steps=spec.steps)
    # each MoE block, routed experts and all, was one unit from the start: no divergence for zkern to find
    assert not [m for m in results[0]["log"] if "now gathers its" in m]
