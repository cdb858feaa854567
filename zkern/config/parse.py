"""Parse a DeepSpeed-style config dict against the key tables (keys.py) into zkern.Config.

    python -m pytest tests/config/test_config.py tests/config/test_config_real.py -q

One walk over the file, section by section (walk.py reads each section against its key table); here, what each
section becomes: the dataclasses of sections.py, with DeepSpeed's older spellings and its section-level rules. The
HF Trainer and zkern.hf.Accelerator fill their "auto" values before this.
"""

from __future__ import annotations

import json
from typing import Any

from zkern.config import keys
from zkern.config.keys import AUTO, Key
from zkern.config.sections import (
    ActivationCheckpointingConfig,
    AioConfig,
    BF16Config,
    CheckpointConfig,
    CommsLoggerConfig,
    FlopsProfilerConfig,
    FP16Config,
    MonitorConfig,
    OptimizerConfig,
    SchedulerConfig,
    TorchAutocastConfig,
    ZeroConfig,
)
from zkern.config.walk import Notes, did_you_mean, section, unknown_key
from zkern.errors import ConfigError


# -- the sections -------------------------------------------------------------------------------------------------
def parse_config(raw: dict) -> dict[str, Any]:
    """The fields of a zkern.Config from a DeepSpeed config dict (Config.load builds it and checks its combinations)."""
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
        torch_autocast=_torch_autocast(raw.get("torch_autocast"), notes),
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


# DeepSpeed's DtypeEnum spellings of the two autocast dtypes
_AUTOCAST_DTYPES = {"torch.float16": "fp16", "fp16": "fp16", "float16": "fp16", "half": "fp16",
                    "torch.bfloat16": "bf16", "bf16": "bf16", "bfloat16": "bf16"}


def _torch_autocast(raw: Any, notes: Notes) -> TorchAutocastConfig:
    values = section("torch_autocast", raw, keys.TORCH_AUTOCAST, notes)
    dtype = values.get("dtype")
    if dtype is not None:
        if dtype not in _AUTOCAST_DTYPES:
            raise ConfigError(f"'torch_autocast.dtype' must be float16 or bfloat16 (DeepSpeed's spellings: "
                              f"{', '.join(_AUTOCAST_DTYPES)}), got {dtype!r}: torch.autocast casts to a 16-bit type")
        values["dtype"] = _AUTOCAST_DTYPES[dtype]
    if values.get("enabled"):
        notes.inert.append(("torch_autocast.lower_precision_safe_modules",
                            "every gradient is reduced in fp32 (DeepSpeed reduces those of these modules, by default "
                            "Linear and Conv, in the autocast dtype); set communication_data_type to reduce all of "
                            "them in 16 bits"))
    return TorchAutocastConfig(**values)


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
    if name == "offload_optimizer" and "cpuadam_cores_perc" in values:
        _cores_share(path, values, notes)
    if name == "offload_param":
        for key in ("buffer_count", "buffer_size"):
            if values.get(key, 1) < 1:
                if device == "nvme":
                    raise ConfigError(f"'{path}.{key}' must be >= 1, got {values[key]}")
                values.pop(key)
    return {f"{name}_{key}": value for key, value in values.items()}


def _cores_share(path: str, values: dict, notes: Notes) -> None:
    """cpuadam_cores_perc: a share of the threads above 0 (DeepSpeed's SuperOffload refuses 0 when it starts its Adam
    process); it steers only the Adam that runs beside the training thread, so set without one it is said."""
    share = values["cpuadam_cores_perc"]
    if share <= 0:
        raise ConfigError(f"'{path}.cpuadam_cores_perc' is the share of the CPU Adam's threads the background "
                          f"host Adam uses, in (0, 1]; got {share!r} (0.8 is DeepSpeed's default)")
    if not any(values.get(key) for key in ("super_offload", "speculative_step", "delayed_update")):
        notes.warned.append((f"{path}.cpuadam_cores_perc",
                             "steers the host Adam that runs beside the training thread (super_offload / "
                             "speculative_step, delayed_update), and none is on: the step's Adam uses every thread "
                             "(ZKERN_CPU_THREADS sets how many)"))


def _optimizer(raw: Any, notes: Notes) -> OptimizerConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"'optimizer' must be a JSON object like {{\"type\": \"AdamW\", \"params\": {{...}}}}, "
                          f"got {raw!r}")
    for key in sorted(set(raw) - {"type", "params", "legacy_fusion"}):
        unknown_key("optimizer", key, raw[key], ["type", "params", "legacy_fusion"], notes, strict=False)
    if raw.get("legacy_fusion", False):
        raise ConfigError("'optimizer.legacy_fusion' asks for DeepSpeed's legacy fused optimizer, which zkern does "
                          "not implement; remove it")
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise ConfigError(f"'optimizer.type' must name an optimizer (Adam, AdamW, Lamb, Lion, SGD, Adagrad, Muon), got "
                          f"{kind!r}")
    name = kind.lower()
    if name in keys.REMOVED_OPTIMIZERS:
        raise ConfigError(f"'optimizer.type' {kind!r} asks for {keys.REMOVED_OPTIMIZERS[name]}, "
                          f"{keys.REMOVED_UPSTREAM}, and zkern does not implement it; use Adam or AdamW (their "
                          f"compressed communication has no counterpart here)")
    if name in keys.MISSING_OPTIMIZERS:
        raise ConfigError(f"'optimizer.type' {kind!r} is a DeepSpeed optimizer that zkern does not implement; use "
                          f"Adam, AdamW, Lamb, Lion, SGD, Adagrad or Muon, or pass a torch optimizer as "
                          f"zkern.Engine(model, cfg, optimizer=...)")
    if name not in keys.OPTIMIZERS:
        raise ConfigError(f"'optimizer.type' {kind!r} is unknown{did_you_mean(name, list(keys.OPTIMIZERS), '')}")
    params = section("optimizer.params", raw.get("params"), keys.OPTIMIZERS[name], notes)
    table = keys.OPTIMIZERS[name]
    full = {k: params.get(k, spec.default) for k, spec in table.items() if isinstance(spec, Key)}
    full.update(params)
    if name == "muon":
        _muon_rates(full)
    return OptimizerConfig(
        type=name, lr=full["lr"], betas=tuple(full.get("betas", (0.9, 0.999))), eps=full.get("eps", 1e-8),
        weight_decay=full["weight_decay"],
        # DeepSpeed: AdamW always decouples; Adam decouples unless adam_w_mode is false.
        adamw=name == "adamw" or (name == "adam" and full.get("adam_w_mode", True)),
        torch_adam=full.get("torch_adam", False), params=full)


def _muon_rates(full: dict) -> None:
    """Muon's two learning rates as DeepSpeed resolves them: muon_lr, else lr, else 0.02 for the Muon half; adam_lr,
    else lr, else 3e-4 for the AdamW half. full["lr"] becomes the Muon half's (what a scheduler's base reads)."""
    if full["ns_method"] not in ("gram", "standard"):
        raise ConfigError(f"'optimizer.params.ns_method' must be \"gram\" (DeepSpeed's default: Newton-Schulz on the "
                          f"Gram matrix) or \"standard\" (torch.optim.Muon's iteration), got {full['ns_method']!r}")
    lr = full["lr"]
    full["muon_lr"] = next(v for v in (full["muon_lr"], lr, keys.MUON_DEFAULT_LR) if v is not None)
    full["adam_lr"] = next(v for v in (full["adam_lr"], lr, keys.MUON_ADAM_DEFAULT_LR) if v is not None)
    full["lr"] = full["muon_lr"]


def _scheduler(raw: Any, notes: Notes) -> SchedulerConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ConfigError(f"'scheduler' must be a JSON object like {{\"type\": \"WarmupLR\", \"params\": {{...}}}}, "
                          f"got {raw!r}")
    for key in sorted(set(raw) - {"type", "params"}):
        unknown_key("scheduler", key, raw[key], ["type", "params"], notes, strict=False)
    kind = raw["type"]
    if kind not in keys.SCHEDULERS:
        raise ConfigError(f"'scheduler.type' {kind!r} is unknown{did_you_mean(kind, list(keys.SCHEDULERS), '')}")
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
