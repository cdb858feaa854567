"""Parse a DeepSpeed-style config dict against the key tables (keys.py) into zkern.Config.

    python -m pytest tests/test_config.py tests/test_config_real.py -q

One walk over the file, section by section: aliases and deprecated spellings are read as the key they stand for,
inert keys are noted, values checked for type, finiteness and range (with the key path and the accepted range in
the error), "auto" that nothing in zkern resolves takes DeepSpeed's default (noted; the HF Trainer and
zkern.hf.Accelerator fill theirs first), unknown keys are a warning at the top level and an error inside a section
whose DeepSpeed model forbids them; a near-miss of a known key is always an error that says "did you mean".
"""

from __future__ import annotations

import difflib
import json
import math
from typing import Any

from zkern.config import keys
from zkern.config.keys import AUTO, Alias, DefaultOnly, Inert, Key, SectionOff
from zkern.config.sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    ConfigNotes,
    FlopsProfilerConfig,
    FP16Config,
    MonitorConfig,
    OptimizerConfig,
    SchedulerConfig,
    ZeroConfig,
)
from zkern.errors import ConfigError

_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
           "bf16": "bf16", "bfloat16": "bf16"}
NEAR_MISS = 0.85  # difflib ratio at or above which an unknown key is taken for a typo of a known one


class Notes:
    def __init__(self):
        self.inert: list[tuple[str, str]] = []
        self.warned: list[tuple[str, str]] = []
        self.renamed: list[tuple[str, str]] = []
        self.filled: list[tuple[str, str]] = []

    def frozen(self) -> ConfigNotes:
        return ConfigNotes(tuple(self.inert), tuple(self.warned), tuple(self.renamed), tuple(self.filled))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _near_miss(key: str, known: list[str], prefixes: bool = False) -> str | None:
    """The known key `key` is a typo of, if any: a close spelling, or (inside a section) a key it begins or ends
    ("grad_accum" for "grad_accum_dtype")."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=NEAR_MISS)
    if close:
        return close[0]
    if prefixes and len(key) >= 4:
        return next((k for k in known if k.startswith(key) or key.startswith(k)), None)
    return None


def _hint(key: str, known: list[str], path: str) -> str:
    """A 'did you mean' naming the nearest key here, else anywhere in the config, else the keys of this section."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{_join(path, close[0])}'?"
    leaves = {p.rsplit(".", 1)[-1]: p for p in keys.all_known_paths()}
    close = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.75)
    if close and leaves[close[0]] != _join(path, key):  # never the refused key itself (another type's key there)
        return f"; did you mean '{leaves[close[0]]}'?"
    return f"; known keys here: {', '.join(sorted(known))}"


def _range_text(spec: Key) -> str:
    lo = None if spec.lo == -math.inf else spec.lo
    hi = None if spec.hi == math.inf else spec.hi
    if lo is not None and hi is not None:
        return f"from {lo:g} to {hi:g}"
    if lo is not None:
        return f">= {lo:g}"
    return f"<= {hi:g}" if hi is not None else "any finite number"


def check_value(path: str, spec: Key, value: Any) -> Any:
    """One value of one key: its type, finiteness and range; a ConfigError naming the key and what it accepts."""
    kind = spec.kind
    if kind.endswith("_or_null") and value is None:
        return None
    base = kind.removesuffix("_or_null")
    if base in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"'{path}' must be a number ({_range_text(spec)}), got {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"'{path}' must be a finite number ({_range_text(spec)}), got {value!r}")
        if base == "int":
            if int(value) != value:
                raise ConfigError(f"'{path}' must be a whole number ({_range_text(spec)}), got {value!r}")
            value = int(value)
        else:
            value = float(value)
        if not spec.lo <= value <= spec.hi:
            raise ConfigError(f"'{path}' must be {_range_text(spec)}, got {value!r}")
        return value
    if base == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"'{path}' must be true or false, got {value!r}")
        return value
    if base == "str":
        if not isinstance(value, str):
            raise ConfigError(f"'{path}' must be a string, got {value!r}")
        return value
    if base == "str_list":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"'{path}' must be a list of names like [\"Block\"], got {value!r}")
        return tuple(value)
    if base == "betas":
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b)
                           and 0.0 <= b < 1.0 for b in value)):
            raise ConfigError(f"'{path}' must be a list of two numbers in [0, 1) like [0.9, 0.999], got {value!r}")
        return (float(value[0]), float(value[1]))
    if base == "dtype":
        dtype = _DTYPES.get(value) if isinstance(value, str) else None
        if dtype is None:
            raise ConfigError(f"'{path}' must be \"fp32\", \"fp16\" or \"bf16\" (or null), got {value!r}")
        return dtype
    if base == "json":
        return value
    if base == "section":
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"'{path}' must be a JSON object, got {value!r}")
        return value
    raise AssertionError(kind)


def _asks_nothing(value: Any) -> bool:
    """A section DeepSpeed lists that zkern lacks asks for nothing: absent, empty, or every switch off."""
    if value is None or value is False:
        return True
    if not isinstance(value, dict):
        return False
    if "enabled" in value:
        return value["enabled"] in (False, None, AUTO)
    if "device" in value:
        return value["device"] in (None, "none")
    if "autotp_size" in value:
        return isinstance(value["autotp_size"], (int, float)) and value["autotp_size"] <= 1
    return all(v in (False, None, 0, {}, [], "none") or (isinstance(v, dict) and _asks_nothing(v))
               for v in value.values())


def section(path: str, raw: Any, table: dict, notes: Notes, *, strict: bool | None = None) -> dict:
    """{canonical key: checked value} for the implemented keys of one section present in raw."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"'{path}' must be a JSON object, got {raw!r}")
    strict = path in keys.STRICT if strict is None else strict
    known = [k for k, spec in table.items()]
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # canonical -> the spelling that set it
    for key, value in raw.items():
        where = _join(path, key)
        spec = table.get(key)
        if isinstance(spec, Alias):
            canonical = spec.canonical
            notes.renamed.append((where, _join(path, canonical)))
            spec = table[canonical]
        else:
            canonical = key
        if canonical in given:
            raise ConfigError(f"'{where}' and '{_join(path, given[canonical])}' set the same key (DeepSpeed's two "
                              f"spellings of it); keep one")
        given[canonical] = key
        if spec is None:
            _unknown(path, key, value, known, notes, strict)
            continue
        if isinstance(spec, Inert):
            notes.inert.append((where, spec.why))
            continue
        if isinstance(spec, DefaultOnly):
            if value != spec.default and value != AUTO and not (value in ([], {}) and spec.default in (None, "auto")):
                raise ConfigError(f"'{where}' = {json.dumps(value)} asks for {spec.what or 'a feature'}, which zkern "
                                  f"does not implement; remove it or set it to DeepSpeed's default "
                                  f"({json.dumps(spec.default)})")
            continue
        if isinstance(spec, SectionOff):
            if not _asks_nothing(value):
                raise ConfigError(f"'{where}' asks for {spec.what}, which zkern does not implement; remove the "
                                  f"section or turn it off")
            if value not in (None, {}):
                notes.inert.append((where, "off"))
            continue
        if value == AUTO and spec.kind != "section":
            if spec.resolve_auto:
                out[canonical] = AUTO
                continue
            # DeepSpeed drops "auto" from its config models, so the key takes its default (the HF Trainer and
            # zkern.hf.Accelerator fill the keys they own before this)
            notes.filled.append((_join(path, canonical), f"{json.dumps(spec.default)} (DeepSpeed's default for "
                                                         f"\"auto\": nothing here fills it)"))
            if spec.default is not None:
                out[canonical] = spec.default
            continue
        out[canonical] = check_value(where, spec, value)
    return out


def _unknown(path: str, key: str, value: Any, known: list[str], notes: Notes, strict: bool) -> None:
    where = _join(path, key)
    typo = _near_miss(key, known, prefixes=bool(path))
    if typo is not None:
        raise ConfigError(f"unknown config key '{where}'; did you mean '{_join(path, typo)}'? (a typo would train "
                          f"with the default silently)")
    if not path:  # not DeepSpeed's at all: DeepSpeed ignores it, so zkern says so and goes on
        elsewhere = {p.rsplit(".", 1)[-1]: p for p in keys.all_known_paths() if "." in p}
        near = _near_miss(key, list(elsewhere))
        if near is not None:
            raise ConfigError(f"unknown config key '{where}'; did you mean '{elsewhere[near]}'? (it belongs in "
                              f"its section)")
        notes.warned.append((where, "not a DeepSpeed key: ignored (as DeepSpeed ignores it)"))
        return
    if strict:
        raise ConfigError(f"unknown config key '{where}'{_hint(key, known, path)}")
    notes.warned.append((where, "not a key of this section: ignored (as DeepSpeed ignores it)"))


# -- the sections -------------------------------------------------------------------------------------------------
def parse_config(raw: dict) -> dict[str, Any]:
    """The fields of a zkern.Config from a DeepSpeed config dict (Config.load builds it and checks.py checks it)."""
    notes = Notes()
    raw = dict(raw)
    if "bfloat16" in raw and "bf16" in raw:
        raise ConfigError("'bf16' and 'bfloat16' are both set; they are the same section (bfloat16 is DeepSpeed's "
                          "older name): keep 'bf16'")
    top = section("", raw, keys.TOP, notes)
    fp16 = section("fp16", raw.get("fp16"), keys.FP16, notes)
    bf16 = section("bf16", raw.get("bf16", raw.get("bfloat16")), keys.BF16, notes)
    if fp16.get("enabled") and bf16.get("enabled"):
        raise ConfigError("'fp16.enabled' and 'bf16.enabled' are both true; choose one precision")
    zero = _zero(raw.get("zero_optimization"), notes)
    opt = _optimizer(raw.get("optimizer"), notes)
    sched = _scheduler(raw.get("scheduler"), notes)
    checkpointing = None
    if raw.get("activation_checkpointing") is not None:
        checkpointing = ActivationCheckpointingConfig(**section(
            "activation_checkpointing", raw["activation_checkpointing"], keys.ACTIVATION_CHECKPOINTING, notes))

    if "steps_per_print" not in top:  # a default DeepSpeed changed: said, as gradient_clipping's is
        notes.filled.append(("steps_per_print", "none (absent: DeepSpeed 0.19's default, no progress lines; older "
                                                "DeepSpeed printed every 10 steps)"))

    def given(name: str):  # the file's value, else the default keys.py gives the key (its one definition)
        return top[name] if name in top else keys.TOP[name].default

    return dict(
        train_batch_size=given("train_batch_size"),
        train_micro_batch_size_per_gpu=given("train_micro_batch_size_per_gpu"),
        gradient_accumulation_steps=given("gradient_accumulation_steps"),
        gradient_clipping=_clipping(top, notes),
        optimizer=opt, scheduler=sched,
        fp16=FP16Config(**fp16), bf16=BF16Config(**bf16), zero_optimization=zero,
        steps_per_print=given("steps_per_print"),
        zero_allow_untested_optimizer=given("zero_allow_untested_optimizer"),
        comm_timeout_s=given("comm_timeout_s"), device=given("device"),
        bf16_stochastic_rounding=given("bf16_stochastic_rounding"),
        ranks_per_node=given("ranks_per_node"), activation_checkpointing=checkpointing,
        aio=_aio(raw.get("aio"), notes),
        gradient_predivide_factor=given("gradient_predivide_factor"),
        gradient_allreduce_op=given("gradient_allreduce_op").lower(),  # any case, as DeepSpeed reads it
        communication_data_type=given("communication_data_type"),
        grad_accum_dtype=section("data_types", raw.get("data_types"), keys.DATA_TYPES, notes).get("grad_accum_dtype"),
        wall_clock_breakdown=given("wall_clock_breakdown"),
        memory_breakdown=given("memory_breakdown"),
        flops_profiler=FlopsProfilerConfig(**section("flops_profiler", raw.get("flops_profiler"),
                                                     keys.FLOPS_PROFILER, notes)),
        comms_logger=_comms_logger(raw, notes),
        monitor=_monitor(raw, notes),
        checkpoint=_checkpoint(raw.get("checkpoint"), notes),
        dataloader_drop_last=given("dataloader_drop_last"),
        notes=notes.frozen(),
    )


def _zero(raw: Any, notes: Notes) -> ZeroConfig:
    if isinstance(raw, bool):  # DeepSpeed's oldest form: "zero_optimization": true is stage 1
        notes.renamed.append((f"zero_optimization: {json.dumps(raw)}", f"zero_optimization.stage {int(raw)}"))
        raw = {"stage": int(raw)}
    if raw is not None and not isinstance(raw, dict):
        raise ConfigError(f"'zero_optimization' must be a JSON object, got {raw!r}")
    raw = dict(raw or {})
    # Deprecated spellings DeepSpeed still reads, as the keys that replaced them
    deprecated = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
    for old, new in deprecated.items():
        if old in raw:
            value = raw.pop(old)
            if not isinstance(value, bool):
                raise ConfigError(f"'zero_optimization.{old}' must be true or false, got {value!r}")
            if new in raw:
                raise ConfigError(f"'zero_optimization.{old}' (deprecated) and 'zero_optimization.{new}' are both "
                                  f"set; keep '{new}'")
            notes.renamed.append((f"zero_optimization.{old}", f"zero_optimization.{new}.device"))
            if value:
                raw[new] = {"device": "cpu"}
    pin = raw.pop("cpu_offload_use_pin_memory", None)
    if pin is not None:
        if not isinstance(pin, bool):
            raise ConfigError(f"'zero_optimization.cpu_offload_use_pin_memory' must be true or false, got {pin!r}")
        notes.renamed.append(("zero_optimization.cpu_offload_use_pin_memory", "offload_*.pin_memory"))
        for name in ("offload_optimizer", "offload_param"):
            if isinstance(raw.get(name), dict):
                raw[name] = {**raw[name], "pin_memory": raw[name].get("pin_memory", pin)}
    if "stage3_gather_fp16_weights_on_model_save" in raw:
        old = raw.pop("stage3_gather_fp16_weights_on_model_save")
        for new in ("stage3_gather_16bit_weights_on_model_save", "gather_16bit_weights_on_model_save"):
            if new in raw:
                raise ConfigError(f"'zero_optimization.stage3_gather_fp16_weights_on_model_save' (deprecated) and "
                                  f"'zero_optimization.{new}' are both set; keep '{new}'")
        notes.renamed.append(("zero_optimization.stage3_gather_fp16_weights_on_model_save",
                              "zero_optimization.stage3_gather_16bit_weights_on_model_save"))
        raw["stage3_gather_16bit_weights_on_model_save"] = old
    values = section("zero_optimization", raw, keys.ZERO, notes)
    for name in ("offload_optimizer", "offload_param"):
        values.update(_offload(name, values.pop(name, None), values.get("stage", 0), notes))
    loco = values.pop("zeropp_loco_param", None)
    if loco is not None:
        loco = section("zero_optimization.zeropp_loco_param", loco, keys.LOCO, notes)
        values["loco_err_beta"] = loco.get("err_beta", 0.8)
        values["loco_reset_t"] = loco.get("reset_T", 1024)
    leaf = values.pop("leaf_module", None)
    if leaf:
        leaf = section("zero_optimization.leaf_module", leaf, keys.LEAF_MODULE, notes)
        values["leaf_module_names"] = tuple(dict.fromkeys(leaf.get("names", ())))
        values["leaf_module_name_suffixes"] = tuple(dict.fromkeys(leaf.get("name_suffixes", ())))
        classes = tuple(c.rsplit(".", 1)[-1] for c in leaf.get("classes", ()))
        values["stage3_fetch_units"] = tuple(dict.fromkeys([*values.get("stage3_fetch_units", ()), *classes]))
        if classes:
            notes.renamed.append(("zero_optimization.leaf_module.classes", "zero_optimization.stage3_fetch_units"))
    if values.get("sub_group_size") == 0:  # DeepSpeed allows 0: no tiling
        values["sub_group_size"] = keys.ZERO["sub_group_size"].default
        notes.filled.append(("zero_optimization.sub_group_size", "1e9 (0: one tile, no sub-groups)"))
    if values.get("zero_hpz_partition_size") == 0:
        values["zero_hpz_partition_size"] = 1
        notes.filled.append(("zero_optimization.zero_hpz_partition_size", "1 (0 and 1 are both off)"))
    for key in ("reduce_bucket_size", "allgather_bucket_size"):
        if values.get(key) == 0:  # DeepSpeed allows 0: every parameter its own bucket
            values[key] = 1
            notes.filled.append((f"zero_optimization.{key}", "1 element (0: a bucket per parameter)"))
    return ZeroConfig(**values)


def _offload(name: str, raw: Any, stage: Any, notes: Notes) -> dict:
    path = f"zero_optimization.{name}"
    values = section(path, raw, keys.OFFLOAD[name], notes)
    device = values.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise ConfigError(f"'{path}.device' must be \"none\", \"cpu\" or \"nvme\", got {device!r}")
    if name == "offload_param" and device != "none" and stage != 3 and stage != AUTO:
        # DeepSpeed reads offload_param only at stage 3 and ignores it elsewhere
        notes.warned.append((f"{path}.device", f"\"{device}\" offloads parameters at ZeRO stage 3 only; at stage "
                                               f"{stage} it is ignored, as DeepSpeed ignores it"))
        return {}
    if device == "nvme" and not values.get("nvme_path"):
        raise ConfigError(f"'{path}.nvme_path' is required with device \"nvme\": a directory on the local NVMe drive "
                          f"(each rank makes its own sub-directory there)")
    if name == "offload_optimizer" and values.get("buffer_count", 4) < 3:
        if device == "nvme":
            raise ConfigError(f"'{path}.buffer_count' must be >= 3 (a tile read ahead, one stepping, one written "
                              f"behind), got {values['buffer_count']}")
        values.pop("buffer_count", None)  # only the NVMe pipeline reads it
    if name == "offload_param":
        for key in ("buffer_count", "buffer_size"):
            if values.get(key, 1) < 1:
                if device == "nvme":
                    raise ConfigError(f"'{path}.{key}' must be >= 1, got {values[key]}")
                values.pop(key)
    return {f"{name}_{key}": value for key, value in values.items()}


def _optimizer(raw: Any, notes: Notes) -> OptimizerConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"'optimizer' must be a JSON object like {{\"type\": \"AdamW\", \"params\": {{...}}}}, "
                          f"got {raw!r}")
    for key in sorted(set(raw) - {"type", "params", "legacy_fusion"}):
        _unknown("optimizer", key, raw[key], ["type", "params", "legacy_fusion"], notes, strict=False)
    if raw.get("legacy_fusion", False):
        raise ConfigError("'optimizer.legacy_fusion' asks for DeepSpeed's legacy fused optimizer, which zkern does "
                          "not implement; remove it")
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise ConfigError(f"'optimizer.type' must name an optimizer (Adam, AdamW, Lamb, Lion, SGD, Adagrad), got "
                          f"{kind!r}")
    name = kind.lower()
    if name in keys.MISSING_OPTIMIZERS:
        raise ConfigError(f"'optimizer.type' {kind!r} is a DeepSpeed optimizer that zkern does not implement; use "
                          f"Adam, AdamW, Lamb, Lion, SGD or Adagrad, or pass a torch optimizer as "
                          f"zkern.Engine(model, cfg, optimizer=...)")
    if name not in keys.OPTIMIZERS:
        raise ConfigError(f"'optimizer.type' {kind!r} is unknown{_hint(name, list(keys.OPTIMIZERS), '')}")
    params = section("optimizer.params", raw.get("params"), keys.OPTIMIZERS[name], notes)
    table = keys.OPTIMIZERS[name]
    full = {k: params.get(k, spec.default) for k, spec in table.items() if isinstance(spec, Key)}
    full.update(params)
    return OptimizerConfig(
        type=name, lr=full["lr"], betas=tuple(full.get("betas", (0.9, 0.999))), eps=full.get("eps", 1e-8),
        weight_decay=full["weight_decay"],
        # DeepSpeed: AdamW always decouples; Adam decouples unless adam_w_mode is false.
        adamw=name == "adamw" or (name == "adam" and full.get("adam_w_mode", True)),
        torch_adam=full.get("torch_adam", False), params=full)


def _scheduler(raw: Any, notes: Notes) -> SchedulerConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ConfigError(f"'scheduler' must be a JSON object like {{\"type\": \"WarmupLR\", \"params\": {{...}}}}, "
                          f"got {raw!r}")
    for key in sorted(set(raw) - {"type", "params"}):
        _unknown("scheduler", key, raw[key], ["type", "params"], notes, strict=False)
    kind = raw["type"]
    if kind not in keys.SCHEDULERS:
        raise ConfigError(f"'scheduler.type' {kind!r} is unknown{_hint(kind, list(keys.SCHEDULERS), '')}")
    table = keys.SCHEDULERS[kind]
    params = section("scheduler.params", raw.get("params"), table, notes)
    full = {k: params.get(k, spec.default) for k, spec in table.items()}
    if full.get("warmup_type", "log") not in ("log", "linear"):
        raise ConfigError(f"'scheduler.params.warmup_type' must be \"log\" or \"linear\", got {full['warmup_type']!r}")
    for key, spec in table.items():
        if full[key] is None and not spec.kind.endswith("_or_null"):
            raise ConfigError(f"'scheduler.params.{key}' is required by {kind}")
    if full.get("warmup_num_steps") == 0:  # older DeepSpeed took 0 and warmed up over its minimum of 2 steps
        notes.filled.append(("scheduler.params.warmup_num_steps", "0: warmup over 2 steps (DeepSpeed's minimum)"))
    if kind == "OneCycle" and full["cycle_max_lr"] < full["cycle_min_lr"]:
        raise ConfigError(f"'scheduler.params.cycle_max_lr' ({full['cycle_max_lr']}) is below cycle_min_lr "
                          f"({full['cycle_min_lr']})")
    return SchedulerConfig(type=kind, params=full)


def _aio(raw: Any, notes: Notes) -> AioConfig:
    values = section("aio", raw, keys.AIO, notes)
    if "intra_op_parallelism" in values:
        threads = values.pop("intra_op_parallelism")
        if values.get("thread_count", threads) != threads:
            raise ConfigError(f"'aio.thread_count' ({values['thread_count']}) and 'aio.intra_op_parallelism' "
                              f"({threads}) are the same setting under DeepSpeed's old and new names; keep one")
        values["thread_count"] = threads
    if values.get("block_size", 4096) % 4096:
        raise ConfigError(f"'aio.block_size' must be a multiple of 4096 bytes (direct I/O moves whole 4 KiB blocks; "
                          f"DeepSpeed's default is 1048576), got {values['block_size']}")
    return AioConfig(**values)


def _comms_logger(raw: dict, notes: Notes) -> CommsLoggerConfig:
    values = section("comms_logger", raw.get("comms_logger"), keys.COMMS_LOGGER, notes)
    # DeepSpeed turns the logger on when the section is present; "enabled" switches it
    if raw.get("comms_logger") is not None and "enabled" not in values:
        values["enabled"] = True
    return CommsLoggerConfig(**values)


def _monitor(raw: dict, notes: Notes) -> MonitorConfig:
    tables = {"tensorboard": keys.MONITOR_FILES, "csv_monitor": keys.MONITOR_FILES, "wandb": keys.WANDB,
              "comet": keys.COMET}
    out = {}
    for name, table in tables.items():
        values = section(name, raw.get(name), table, notes)
        if values.get("enabled"):
            out[name] = {k: values.get(k, spec.default) for k, spec in table.items() if isinstance(spec, Key)}
    return MonitorConfig(**out)


def _checkpoint(raw: Any, notes: Notes) -> CheckpointConfig:
    values = section("checkpoint", raw, keys.CHECKPOINT, notes)
    mode = values.get("tag_validation", keys.CHECKPOINT["tag_validation"].default)
    if mode.upper() not in ("IGNORE", "WARN", "FAIL"):
        raise ConfigError(f"'checkpoint.tag_validation' must be \"Ignore\", \"Warn\" or \"Fail\", got {mode!r}")
    return CheckpointConfig(tag_validation=mode.upper(),
                            use_node_local_storage=values.get("use_node_local_storage", False))


def _clipping(top: dict, notes) -> float:
    """gradient_clipping, or DeepSpeed's default when the config has none: 1.0 since DeepSpeed 0.19.2 (0.0 before,
    so the same file clipped or not by version): said in the start-up block."""
    if "gradient_clipping" in top:
        return top["gradient_clipping"]
    default = keys.TOP["gradient_clipping"].default
    notes.filled.append(("gradient_clipping", f"{default} (absent: DeepSpeed's default since 0.19.2; 0 turns clipping "
                                              "off)"))
    return default
