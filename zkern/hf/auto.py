"""Fill a DeepSpeed-style config's "auto" values from Hugging Face TrainingArguments, as HF's DeepSpeed integration
does, and refuse values that contradict them.

    python -m pytest tests/test_hf_auto.py -q

Pure dict work on duck-typed arguments (no transformers import), so it is tested without a Trainer. What the Trainer
owns (batch sizes, accumulation, clipping, precision, the optimizer's and the warmup scheduler's hyper-parameters)
comes from TrainingArguments: "auto" takes the argument's value, and so does a key the config leaves out inside a
section it has (HF leaves such a key at DeepSpeed's default, which silently disagrees with the Trainer: no clipping
while max_grad_norm says 1.0); a number that differs is an error naming both. The hidden-size keys
(reduce_bucket_size = hidden², stage3_prefetch_bucket_size = 0.9·hidden², stage3_param_persistence_threshold =
10·hidden) are filled from the model by zkern.Config.resolve.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from zkern.config import ConfigError, keys, read_json

AUTO = "auto"


def read_config(source: dict | str | os.PathLike) -> dict:
    """The raw config as a dict (a deep copy: filling never changes the caller's dict)."""
    if isinstance(source, dict):
        return copy.deepcopy(source)
    if isinstance(source, (str, os.PathLike)):
        return read_json(source, "zkern_config")
    raise ConfigError(f"zkern_config must be a dict or a path to a DeepSpeed-style JSON file, "
                      f"not {type(source).__name__}")


def _equal(config_value: Any, hf_value: Any) -> bool:
    if isinstance(config_value, (list, tuple)) and isinstance(hf_value, (list, tuple)):
        return len(config_value) == len(hf_value) and all(_equal(a, b) for a, b in zip(config_value, hf_value))
    if isinstance(config_value, bool) or isinstance(hf_value, bool):
        return config_value is hf_value or config_value == hf_value
    if isinstance(config_value, (int, float)) and isinstance(hf_value, (int, float)):
        return float(config_value) == float(hf_value)
    return config_value == hf_value


class _Filler:
    def __init__(self, config: dict):
        self.config = config
        self.mismatches: list[str] = []

    def _node(self, path: str) -> tuple[dict | None, str]:
        """The dict holding path's last key, creating sub-sections (optimizer.params) inside a top-level section the
        config has; None when that section is absent (the Trainer's own optimizer or scheduler then)."""
        *sections, key = path.split(".")
        node = self.config
        for depth, s in enumerate(sections):
            if s not in node and depth > 0:
                node[s] = {}
            node = node.get(s)
            if not isinstance(node, dict):
                return None, key
        return node, key

    def match(self, path: str, hf_value: Any, hf_name: str, fill_missing: bool = True) -> None:
        """path "a.b.c": "auto" (or absent, when fill_missing) takes hf_value; any other value must equal it."""
        node, key = self._node(path)
        if node is None:
            return
        if key not in node:
            if fill_missing:
                node[key] = hf_value
            return
        if node[key] == AUTO:
            node[key] = hf_value
        elif not _equal(node[key], hf_value):
            self.mismatches.append(f"'{path}' = {node[key]!r} in the config vs TrainingArguments.{hf_name} = "
                                   f"{hf_value!r}")

    def fill(self, path: str, value: Any) -> None:
        """"auto" or absent takes value; a number stays (values the Trainer derives, never compared, as HF)."""
        node, key = self._node(path)
        if node is not None and node.get(key, AUTO) == AUTO:
            node[key] = value


def fill_auto(config: dict, args: Any, world_size: int, num_training_steps: int) -> dict:
    """A copy of config with every TrainingArguments-owned "auto" filled; a ConfigError lists every contradiction.

    args: a transformers.TrainingArguments (or anything with its attribute names). num_training_steps: the
    Trainer's max_steps (for the scheduler's warmup and total steps)."""
    cfg = copy.deepcopy(config)
    f = _Filler(cfg)
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    f.match("train_micro_batch_size_per_gpu", micro, "per_device_train_batch_size")
    f.match("gradient_accumulation_steps", accumulation, "gradient_accumulation_steps")
    f.match("train_batch_size", micro * accumulation * world_size,
            f"per_device_train_batch_size x gradient_accumulation_steps x world size ({world_size})")
    f.match("gradient_clipping", args.max_grad_norm, "max_grad_norm")
    # The optimizer's keys, only those its type has: Adam's betas and eps planted into an SGD or Lion section were
    # refused by the strict parse, so the Trainer could not run them.
    kind = cfg["optimizer"].get("type") if isinstance(cfg.get("optimizer"), dict) else None
    takes = keys.OPTIMIZERS.get(str(kind).lower()) if kind is not None else None
    for key, value, name in (("lr", args.learning_rate, "learning_rate"),
                             ("betas", [args.adam_beta1, args.adam_beta2], "adam_beta1/adam_beta2"),
                             ("eps", args.adam_epsilon, "adam_epsilon"),
                             ("weight_decay", args.weight_decay, "weight_decay")):
        if takes is None or key in takes:
            f.match(f"optimizer.params.{key}", value, name)
    # The scheduler's keys, only those its type has: WarmupLR's lr and step keys planted into a WarmupCosineLR,
    # OneCycle or LRRangeTest section were refused by the strict parse, so the Trainer could not run them.
    kind = cfg["scheduler"].get("type") if isinstance(cfg.get("scheduler"), dict) else None
    warmup = max(1, args.get_warmup_steps(num_training_steps))  # DeepSpeed 0.19.6 refuses warmup_num_steps <= 0
    if kind in ("WarmupLR", "WarmupDecayLR"):
        f.match("scheduler.params.warmup_min_lr", 0, "(warmup from 0)", fill_missing=False)
        f.match("scheduler.params.warmup_max_lr", args.learning_rate, "learning_rate")
    if kind in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        f.fill("scheduler.params.warmup_num_steps", warmup)
    if kind in ("WarmupDecayLR", "WarmupCosineLR"):
        f.fill("scheduler.params.total_num_steps", num_training_steps)
    if getattr(args, "save_on_each_node", False):  # as transformers does: each node's disk holds its own ranks'
        cfg.setdefault("checkpoint", {})["use_node_local_storage"] = True
    # Precision: the section follows the Trainer's flags; an absent section is created only when a flag is on. The
    # legacy "bfloat16" section is filled where it is (a "bf16" beside it would be two sections for one setting).
    for kind in ("fp16", "bf16"):
        want = bool(getattr(args, kind) or getattr(args, f"{kind}_full_eval", False))
        section = "bfloat16" if kind == "bf16" and "bfloat16" in cfg and "bf16" not in cfg else kind
        if section not in cfg and want:
            cfg[section] = {"enabled": True}
        f.match(f"{section}.enabled", want, f"{kind} (or {kind}_full_eval)")
    if f.mismatches:
        raise ConfigError("the zkern config contradicts the TrainingArguments:\n  - " + "\n  - ".join(f.mismatches)
                          + "\nset these config values to \"auto\" (or leave them out) so the Trainer fills them, or "
                          "change the TrainingArguments")
    return cfg
