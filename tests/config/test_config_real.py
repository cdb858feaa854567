"""The DeepSpeed configs users arrive with (tests/data/ds_configs/): one file per real-world shape written for these
tests (DeepSpeed's short field names, accelerate's all-"auto" template, a recipe's own keys beside DeepSpeed's,
monitors and profiler, legacy spellings, a cosine schedule, fp16 + Lamb in Megatron's style, stage 3's offload_param
alone, Lion with a range test), and the stock configs the frameworks built on DeepSpeed ship (llamafactory_*,
msswift_*, axolotl_*: the keys and values of LLaMA-Factory's DeepSpeed examples and ms-swift's and axolotl's stock
configs). Each trains on zkern and DeepSpeed's own parser accepts the
same file; tests/data/ds_configs_refused/ holds stock configs DeepSpeed 0.19's parser refuses (zkern refuses the one
whose key asks for something, and takes the one whose keys ask for nothing in bf16, saying so),
naming the key. 3000 careless edits of them are each either accepted or a ConfigError naming the key, never another
exception.

    python -m pytest tests/config/test_config_real.py -q
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import zkern
from zkern.hf import fill_auto
from zkern.testing import TinyGPT

HERE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "ds_configs")
FILES = sorted(f for f in os.listdir(HERE) if f.endswith(".json"))
REFUSED = os.path.join(os.path.dirname(HERE), "ds_configs_refused")


def hf_args(**kw):
    """What fill_auto reads of transformers' TrainingArguments (as the HF Trainer and zkern.hf.Accelerator pass it)."""
    values = dict(per_device_train_batch_size=2, gradient_accumulation_steps=1, max_grad_norm=1.0,
                  learning_rate=1e-3, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
                  fp16=False, bf16=False, fp16_full_eval=False, bf16_full_eval=False, save_on_each_node=False)
    values.update(kw)
    return SimpleNamespace(get_warmup_steps=lambda n: 2, **values)


def prepared(name: str, root: str) -> dict:
    """The file as a user would hand it over: output paths in the test's directory, "auto" filled as the HF paths
    fill it (a file without "auto" is untouched)."""
    with open(os.path.join(HERE, name)) as f:
        text = f.read().replace("OUT/", f"{root}/")
    raw = json.loads(text)
    if '"auto"' in text:
        raw = fill_auto(raw, agreeing_args(raw), world_size=1, num_training_steps=10)
    return raw


def agreeing_args(raw: dict) -> SimpleNamespace:
    """TrainingArguments that agree with the file's fixed values, as its framework sets them (a file with
    bf16.enabled true is run with --bf16; one with gradient_clipping 0.001 with max_grad_norm 0.001): HF's
    DeepSpeed integration refuses a contradiction, as zkern's filling does."""
    def enabled(section: str) -> bool:
        return (raw.get(section) or raw.get("bfloat16" if section == "bf16" else section) or {}).get("enabled") is True

    clip = raw.get("gradient_clipping")
    return hf_args(bf16=enabled("bf16"), fp16=enabled("fp16"),
                   **({"max_grad_norm": clip} if isinstance(clip, (int, float)) else {}))


def train(cfg: dict, steps: int = 3):
    torch.manual_seed(0)
    engine = zkern.Engine(TinyGPT(), {**cfg, "device": "cpu"},
                          optimizer=None if "optimizer" in cfg else lambda p: None)
    idx = torch.randint(0, 67, (cfg.get("train_micro_batch_size_per_gpu", 2), 17))
    accumulation = engine.gradient_accumulation_steps
    for _ in range(steps * accumulation):
        engine.backward(engine(idx[:, :-1], idx[:, 1:]))
        engine.step()
    return engine


@pytest.mark.parametrize("name", FILES)
def test_each_file_trains_on_zkern(name, tmp_path, caplog):
    cfg = prepared(name, str(tmp_path))
    if "optimizer" not in cfg:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-3}}
    caplog.set_level(logging.INFO, logger="zkern")
    engine = train(cfg)
    assert engine.global_steps == 3 and engine.skipped_steps == 0 or cfg.get("fp16", {}).get("enabled")
    assert "zkern config:" in caplog.text  # the start-up block
    engine.destroy()


def test_deepspeed_s_own_parser_accepts_every_file(tmp_path):
    """Side by side: each file, as filled, passes DeepSpeed 0.19's DeepSpeedConfig (the peer installed for tests)."""
    from deepspeed.runtime.config import DeepSpeedConfig

    for name in FILES:
        cfg = prepared(name, str(tmp_path))
        DeepSpeedConfig(copy.deepcopy(cfg))  # raises on anything DeepSpeed refuses
        zkern.Config.load(cfg).resolve(1, SimpleNamespace(config=SimpleNamespace(hidden_size=32)))


@pytest.mark.parametrize("name, key", [("axolotl_zero1_torch_compile.json", "'compile'")])
def test_stock_configs_deepspeed_refuses_are_refused_naming_the_key(name, key):
    """axolotl's torch-compile config (a compile section in an older DeepSpeed's keys): DeepSpeed 0.19's parser
    refuses it, so zkern does, naming the key."""
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig

    with open(os.path.join(REFUSED, name)) as f:
        raw = json.load(f)
    filled = fill_auto(raw, agreeing_args(raw), world_size=1, num_training_steps=10)
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        DeepSpeedConfig(copy.deepcopy(filled))
    with pytest.raises(zkern.ConfigError, match=key):
        zkern.Config.load(filled)


def test_what_zkern_made_of_each_shape(tmp_path):
    notes = {name: zkern.Config.load(prepared(name, str(tmp_path))).notes for name in FILES}
    short = notes["zero3_short_names.json"]
    assert ("zero_optimization.prefetch_bucket_size", "zero_optimization.stage3_prefetch_bucket_size") in short.renamed
    foreign = [p for p, _ in notes["foreign_keys_zero2.json"].warned]
    assert foreign == ["_comment", "comms_config", "monitor_config", "zero3_init_flag"]
    legacy = zkern.Config.load(prepared("legacy_spellings.json", str(tmp_path)))
    assert legacy.precision == "bf16" and legacy.zero_optimization.offload_optimizer_device == "cpu"
    only = zkern.Config.load(prepared("zero3_offload_param_only.json", str(tmp_path))).zero_optimization
    assert only.offload_param_device == "cpu" and only.offload_optimizer_device == "none"
    ignored = zkern.Config.load(prepared("lion_zero1_stage_offload_ignored.json", str(tmp_path)))
    assert ignored.zero_optimization.offload_param_device == "none"
    assert any("ignored" in m for _, m in ignored.notes.warned)


def test_accelerate_template_auto_for_a_true_false_key_takes_deepspeeds_default():
    """accelerate's templates leave stage3_gather_16bit_weights_on_model_save at "auto", which only Accelerate's own
    plugin fills: elsewhere it is DeepSpeed's default (false), said in the start-up block (it once was an error
    asking for a number)."""
    with open(os.path.join(HERE, "accelerate_zero3_template.json")) as f:
        raw = json.load(f)
    cfg = zkern.Config.load(fill_auto(raw, hf_args(), world_size=1, num_training_steps=10))
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is False
    assert "zero_optimization.stage3_gather_16bit_weights_on_model_save" in dict(cfg.notes.filled)


def test_fill_auto_fills_the_legacy_bfloat16_section_in_place():
    """transformers' own bf16 ZeRO-3 config in the legacy spelling: filling "auto" must not add a bf16 section beside
    it (zkern refused the pair)."""
    raw = {"train_micro_batch_size_per_gpu": "auto", "bfloat16": {"enabled": "auto"},
           "zero_optimization": {"stage": 3}}
    filled = fill_auto(raw, hf_args(bf16=True), world_size=1, num_training_steps=10)
    assert "bf16" not in filled and filled["bfloat16"] == {"enabled": True}
    assert zkern.Config.load(filled).precision == "bf16"


def test_fill_auto_plants_only_the_optimizer_keys_its_type_has():
    """An SGD, Lion or Adagrad section without betas or eps: the Trainer's Adam betas and eps planted into it were
    refused by the strict parse (whose hint proposed the very key it refused), so the Trainer could not train it."""
    for kind, absent in (("SGD", {"betas", "eps"}), ("Lion", {"eps"}), ("Adagrad", {"betas"})):
        raw = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": kind, "params": {"lr": 1e-3}}}
        filled = fill_auto(raw, hf_args(), world_size=1, num_training_steps=10)
        assert not absent & set(filled["optimizer"]["params"]), (kind, filled["optimizer"])
        assert filled["optimizer"]["params"]["weight_decay"] == 0.0  # a key every optimizer has is filled
        zkern.Config.load(filled)
    with pytest.raises(zkern.ConfigError) as refused:
        zkern.Config.load({"train_micro_batch_size_per_gpu": 2,
                           "optimizer": {"type": "SGD", "params": {"lr": 1e-3, "betas": [0.9, 0.99]}}})
    assert "did you mean 'optimizer.params.betas'" not in str(refused.value)
    assert "known keys here" in str(refused.value)


# -- careless edits ---------------------------------------------------------------------------------------------
_ODD = [None, True, False, 0, -1, 1, 2.5, 1e30, -1e30, float("nan"), float("inf"), -float("inf"), "auto", "x",
        "", [], [1, 2], {}, {"enabled": True}, 10**20, "1e9", 1e-40]


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


def mutate(cfg: dict, rng: random.Random) -> dict:
    """One careless edit: a value replaced by an odd one, a key deleted, misspelt, duplicated under a new name, or a
    stray key added."""
    out = copy.deepcopy(cfg)
    paths = list(_paths(out))
    path = rng.choice(paths)
    node = out
    for k in path[:-1]:
        node = node[k]
    key = path[-1]
    match rng.randrange(5):
        case 0:
            node[key] = rng.choice(_ODD)
        case 1:
            del node[key]
        case 2:
            i = rng.randrange(len(key)) if key else 0
            node[key[:i] + rng.choice("aeiouxz_") + key[i + 1:]] = node.pop(key)
        case 3:
            node[key + rng.choice(["s", "_", "2"])] = node[key]
        case _:
            node[rng.choice(["extra", "enabled", "stage", "lr", "_note"])] = rng.choice(_ODD)
    return out


def test_three_thousand_careless_edits_are_accepted_or_a_config_error(tmp_path):
    rng = random.Random(20261124)
    bases = [prepared(name, str(tmp_path)) for name in FILES]
    outcomes = {"accepted": 0, "ConfigError": 0}
    slowest = 0.0
    for i in range(3000):
        cfg = mutate(rng.choice(bases), rng)
        start = time.perf_counter()
        try:
            zkern.Config.load(cfg).resolve(1, SimpleNamespace(config=SimpleNamespace(hidden_size=32)))
            outcomes["accepted"] += 1
        except zkern.ConfigError as e:
            outcomes["ConfigError"] += 1
            assert "'" in str(e), f"edit {i}: the error names no key: {e}"
        except Exception as e:  # anything else escaped the parser
            raise AssertionError(f"edit {i}: {type(e).__name__}: {e}\n{json.dumps(cfg, default=str)[:400]}") from e
        slowest = max(slowest, time.perf_counter() - start)
    assert outcomes["accepted"] > 300 and outcomes["ConfigError"] > 300, outcomes
    assert slowest < 1.0, slowest  # an absurd value (2**1e30) never computes


def test_nan_never_trains(tmp_path):
    for cfg in ({"optimizer": {"type": "AdamW", "params": {"lr": math.nan}}},
                {"gradient_clipping": math.inf}, {"zero_optimization": {"reduce_bucket_size": math.nan}}):
        with pytest.raises(zkern.ConfigError, match="finite"):
            zkern.Config.load({"train_micro_batch_size_per_gpu": 1, **cfg})


def test_python_m_zkern_config_check(tmp_path):
    good = os.path.join(HERE, "foreign_keys_zero2.json")
    run = subprocess.run([sys.executable, "-m", "zkern.config", "check", good, "--world", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "usable by zkern" in run.stdout and "warning: comms_config" in run.stdout
    assert "accepted, changes nothing in zkern: zero_optimization.round_robin_gradients" in run.stdout
    bad = tmp_path / "typo.json"
    bad.write_text(json.dumps({"train_batch_size": 8, "zero_optimisation": {"stage": 2}}))
    run = subprocess.run([sys.executable, "-m", "zkern.config", "check", str(bad)], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1 and "did you mean 'zero_optimization'" in run.stderr


def test_zkerns_defaults_are_deepspeeds_key_by_key():
    """Every field of DeepSpeed 0.19's config models that zkern implements, or accepts only at its default, has
    DeepSpeed's default in zkern's tables (a field zkern marks inert takes any value; the deliberate difference,
    bf16.check_grad_overflow, is inert: zkern always checks)."""
    from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    from zkern.config import keys

    models = {"zero_optimization": DeepSpeedZeroConfig, "fp16": DeepSpeedFP16Config, "bf16": DeepSpeedBF16Config,
              "zero_optimization.offload_optimizer": DeepSpeedZeroOffloadOptimizerConfig,
              "zero_optimization.offload_param": DeepSpeedZeroOffloadParamConfig, "tensorboard": TensorBoardConfig,
              "csv_monitor": CSVConfig, "wandb": WandbConfig, "comet": CometConfig}
    unknown, differ = [], []
    for section, model in models.items():
        table = keys.SECTIONS[section]
        for name, field in model.model_fields.items():
            spec = table.get(field.alias or name) or table.get(name)
            if isinstance(spec, keys.Alias):
                spec = table[spec.canonical]
            if spec is None:
                if name not in ("cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
                                "stage3_gather_fp16_weights_on_model_save"):  # read by config.parse._zero
                    unknown.append(f"{section}.{name}")
                continue
            if isinstance(spec, (keys.Inert, keys.SectionOff)) or field.is_required() or field.default_factory:
                continue
            ds = field.default
            ds = ds.value if hasattr(ds, "value") else ds
            mine = spec.default
            if isinstance(mine, tuple):
                mine = list(mine)
            if isinstance(ds, tuple):
                ds = list(ds)
            if mine != ds and not (mine is None and ds in ({}, None)):
                differ.append(f"{section}.{name}: zkern {mine!r}, DeepSpeed {ds!r}")
    assert unknown == [], f"DeepSpeed fields zkern's tables do not list: {unknown}"
    assert differ == [], differ


def test_fp16_keys_left_in_a_bf16_section_are_taken_and_said():
    """LLaMA-Factory's ALST config carries fp16's loss-scaling keys in its bf16 section. DeepSpeed 0.19's strict parser
    refuses them (older DeepSpeed took them); they ask for nothing in bf16, which never scales its loss, so zkern takes
    them, each said in the start-up block (and its sequence_parallel section, no DeepSpeed key, warned)."""
    import pydantic
    from deepspeed.runtime.config import DeepSpeedConfig

    with open(os.path.join(REFUSED, "llamafactory_z3_alst.json")) as f:
        raw = json.load(f)
    filled = fill_auto(raw, agreeing_args(raw), world_size=1, num_training_steps=10)
    with pytest.raises(pydantic.ValidationError, match="Extra inputs are not permitted"):
        DeepSpeedConfig(copy.deepcopy(filled))
    notes = zkern.Config.load(filled).notes
    inert = dict(notes.inert)
    for key in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
        assert "bf16 never scales its loss" in inert[f"bf16.{key}"]
    assert "sequence_parallel" in dict(notes.warned)
