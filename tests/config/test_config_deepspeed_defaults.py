"""zkern's key tables against the DeepSpeed installed beside it: every key DeepSpeed's config models define is known
to zkern (read, inert, refused unless at its default, or another spelling), and every default zkern takes for a key
is DeepSpeed's, but for the differences listed here with their reason.

    python -m pytest tests/config/test_config_deepspeed_defaults.py -q
"""

from __future__ import annotations

import pytest

import zkern
from zkern.config import keys as K

pytest.importorskip("deepspeed")

from deepspeed.comm.config import CommsLoggerConfig  # noqa: E402
from deepspeed.monitor.config import CometConfig, CSVConfig, TensorBoardConfig, WandbConfig  # noqa: E402
from deepspeed.runtime import constants  # noqa: E402
from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config  # noqa: E402
from deepspeed.runtime.zero.config import DeepSpeedZeroConfig  # noqa: E402
from deepspeed.runtime.zero.leaf_module_config import DeepSpeedZeroLeafModuleConfig  # noqa: E402
from deepspeed.runtime.zero.offload_config import (  # noqa: E402
    DeepSpeedZeroOffloadOptimizerConfig,
    DeepSpeedZeroOffloadParamConfig,
)

SECTIONS = [
    ("zero_optimization", DeepSpeedZeroConfig, K.ZERO),
    ("zero_optimization.offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig, K.OFFLOAD["offload_optimizer"]),
    ("zero_optimization.offload_param", DeepSpeedZeroOffloadParamConfig, K.OFFLOAD["offload_param"]),
    ("zero_optimization.leaf_module", DeepSpeedZeroLeafModuleConfig, K.LEAF_MODULE),
    ("fp16", DeepSpeedFP16Config, K.FP16),
    ("bf16", DeepSpeedBF16Config, K.BF16),
    ("comms_logger", CommsLoggerConfig, K.COMMS_LOGGER),
    ("tensorboard", TensorBoardConfig, K.MONITOR_FILES),
    ("csv_monitor", CSVConfig, K.MONITOR_FILES),
    ("wandb", WandbConfig, K.WANDB),
    ("comet", CometConfig, K.COMET),
]

# DeepSpeed's deprecated spellings that zkern's parser maps itself (not through a key table), with a config that
# uses each and what zkern must make of it.
LEGACY = {
    "zero_optimization.cpu_offload": ({"stage": 2, "cpu_offload": True},
                                      lambda z: z.offload_optimizer_device == "cpu"),
    "zero_optimization.cpu_offload_param": ({"stage": 3, "cpu_offload_param": True},
                                            lambda z: z.offload_param_device == "cpu"),
    "zero_optimization.cpu_offload_use_pin_memory": ({"stage": 2, "cpu_offload_use_pin_memory": True},
                                                     lambda z: z.offload_optimizer_pin_memory),
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": (
        {"stage": 3, "stage3_gather_fp16_weights_on_model_save": True},
        lambda z: z.stage3_gather_16bit_weights_on_model_save),
}

# Where zkern's default is not the installed DeepSpeed's, on purpose.
DIFFERENT = {
    "gradient_predivide_factor": "absent, zkern averages before the sum (the world size), as DeepSpeed's ZeRO-1/2 do; "
                                 "DeepSpeed's 1.0 sums first and overflows fp16 world times sooner (docs/config.md)",
    "zero_optimization.leaf_module.classes": "DeepSpeed lists the Mixtral and Qwen MoE blocks so that ranks routing to "
                                             "different experts gather alike; zkern finds such modules as they run "
                                             "and gathers them whole (stage3_merge_divergent_modules), so it needs no "
                                             "list; classes given are fetch units",
}


def _same(a, b) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return list(a) == list(b)
    return a == b


def _fields(model):
    """(name, every spelling, default) of a DeepSpeed config model's fields."""
    for name, info in model.model_fields.items():
        spellings = {name, *(a for a in (info.alias, getattr(info, "validation_alias", None)) if isinstance(a, str))}
        yield name, spellings, info.get_default(call_default_factory=True)


def _canonical(table: dict, spellings: set[str]):
    for s in spellings:
        entry = table.get(s)
        if isinstance(entry, K.Alias):
            return entry.canonical, table.get(entry.canonical)
        if entry is not None:
            return s, entry
    return None, None


@pytest.mark.parametrize("path,model,table", SECTIONS, ids=[s[0] for s in SECTIONS])
def test_every_deepspeed_key_is_known_and_its_default_is_deepspeeds(path, model, table):
    unknown, differ = [], []
    for name, spellings, default in _fields(model):
        key, entry = _canonical(table, spellings)
        if entry is None:
            if f"{path}.{name}" not in LEGACY:
                unknown.append(name)
            continue
        if isinstance(entry, (K.Key, K.DefaultOnly)) and getattr(entry, "kind", None) not in ("section", "json"):
            if not _same(entry.default, default) and f"{path}.{key}" not in DIFFERENT:
                differ.append(f"{key}: zkern {entry.default!r}, DeepSpeed {default!r}")
    assert not unknown, f"{path}: DeepSpeed keys zkern's table does not know: {unknown}"
    assert not differ, f"{path}: defaults differ from the installed DeepSpeed's:\n  " + "\n  ".join(differ)


def test_top_level_defaults_are_deepspeeds():
    differ, compared = [], 0
    for key, entry in K.TOP.items():
        ds = getattr(constants, f"{key.upper()}_DEFAULT", "absent")
        if ds == "absent" or not isinstance(entry, (K.Key, K.DefaultOnly)):
            continue
        compared += 1
        if not _same(entry.default, ds) and key not in DIFFERENT:
            differ.append(f"{key}: zkern {entry.default!r}, DeepSpeed {ds!r}")
    assert compared >= 8, compared  # the constants were found: the comparison is not empty
    assert not differ, "top-level defaults differ from the installed DeepSpeed's:\n  " + "\n  ".join(differ)


@pytest.mark.parametrize("path", sorted(LEGACY))
def test_deprecated_spellings_mean_what_deepspeed_means(path):
    zero, holds = LEGACY[path]
    cfg = zkern.Config.load({"train_batch_size": 2, "zero_optimization": zero})
    assert holds(cfg.zero_optimization), path


def test_the_listed_differences_still_differ():
    """A difference DeepSpeed has since adopted must leave the list (and zkern's docs)."""
    key = "gradient_predivide_factor"
    assert not _same(K.TOP[key].default, getattr(constants, f"{key.upper()}_DEFAULT")), key
    classes = DeepSpeedZeroLeafModuleConfig.model_fields["classes"].get_default(call_default_factory=True)
    assert not _same(K.LEAF_MODULE["classes"].default, classes)


def test_the_config_dataclasses_take_their_defaults_from_the_key_tables():
    """A config that sets nothing reads as the key tables' defaults: the parser and the dataclasses agree."""
    cfg = zkern.Config.load({"train_batch_size": 2})
    assert cfg.steps_per_print == K.TOP["steps_per_print"].default
    assert cfg.gradient_clipping == K.TOP["gradient_clipping"].default
    for section, table in [(cfg.fp16, K.FP16), (cfg.zero_optimization, K.ZERO), (cfg.aio, K.AIO),
                           (cfg.flops_profiler, K.FLOPS_PROFILER), (cfg.comms_logger, K.COMMS_LOGGER)]:
        for name, entry in table.items():
            if isinstance(entry, K.Key) and hasattr(section, name) and entry.kind not in ("section", "json"):
                assert _same(getattr(section, name), entry.default), (type(section).__name__, name)
