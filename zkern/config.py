"""DeepSpeed-style JSON / dict -> frozen dataclasses.

    cfg = zkern.Config.load("ds_config.json")            # parse and validate the keys
    cfg = cfg.resolve(world_size=2, model=model)          # fill "auto", check the batch arithmetic

Keys mean what they mean in DeepSpeed, with DeepSpeed's code defaults, so a user's existing file works
unchanged. Three kinds of key exist here:
  - implemented: parsed into the dataclasses below;
  - known to DeepSpeed but not implemented by zkern: accepted only at DeepSpeed's default value (it then
    asks for nothing zkern lacks), otherwise a ConfigError that says it is not implemented;
  - unknown: a ConfigError that names the key path and the nearest known key.
Nothing is ignored silently.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from zkern import config_keys as keys
from zkern.config_keys import AUTO


class ConfigError(ValueError):
    """A config key or value zkern cannot accept; the message names the key path and what to do."""


# ----------------------------------------------------------------------------------------------------------------
# The dataclasses (what the engine reads)


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "adamw"  # "adam" or "adamw", lower case
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    # DeepSpeed's "Adam" is decoupled-weight-decay Adam unless params.adam_w_mode is false.
    adamw: bool = True
    # Run torch.optim.Adam/AdamW on the shard instead of zkern's fused step (same math, slower).
    torch_adam: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    type: str  # "WarmupLR" or "WarmupDecayLR"
    warmup_min_lr: float = 0.0
    warmup_max_lr: float = 1e-3
    warmup_num_steps: int = 1000
    warmup_type: str = "log"
    total_num_steps: int | None = None  # WarmupDecayLR only


@dataclass(frozen=True)
class FP16Config:
    enabled: bool = False
    loss_scale: float = 0.0  # 0 = dynamic; > 0 = static scale
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0


@dataclass(frozen=True)
class BF16Config:
    enabled: bool = False


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 0
    overlap_comm: bool | None = None  # None until resolve(): DeepSpeed's code default is stage == 3
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    ignore_unused_parameters: bool = True
    # Stage 3 (DeepSpeed's code defaults; its docs say 5e8 for the prefetch bucket)
    stage3_prefetch_bucket_size: int = 50_000_000  # elements gathered ahead of use
    stage3_param_persistence_threshold: int = 100_000  # fetch units smaller than this stay whole on every rank
    stage3_max_live_parameters: int = 1_000_000_000  # bound on gathered elements (prefetch stops at it)
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_gather_fp16_weights_on_model_save: bool = False
    stage3_fetch_units: tuple[str, ...] = ()  # module class names: each instance is one fetch unit
    stage3_merge_divergent_modules: bool = True  # ranks gathering different units: gather their container whole
    # ZeRO-Offload: "none" or "cpu" (fp32 master and Adam moments on the host; stages 1-3), and for stage 3 the
    # parameter shards at rest on the host. pin_memory: page-locked host buffers (CUDA only).
    offload_optimizer_device: str = "none"
    offload_optimizer_pin_memory: bool = False
    offload_param_device: str = "none"
    offload_param_pin_memory: bool = False
    # offload_optimizer.device "nvme" (ZeRO-Infinity, engine/nvme.py): fp32 master and moments in files under
    # nvme_path, stepped in tiles of sub_group_size elements through buffer_count host buffer sets.
    offload_optimizer_nvme_path: str | None = None
    offload_optimizer_buffer_count: int = 4
    offload_optimizer_fast_init: bool = False
    sub_group_size: int = 1_000_000_000
    # offload_param.device "nvme" (stage 3, engine/nvme_params.py): the parameter shard in a file under nvme_path,
    # read ahead by at most buffer_count reads / buffer_size elements, up to max_in_cpu elements cached on the host.
    offload_param_nvme_path: str | None = None
    offload_param_buffer_count: int = 5
    offload_param_buffer_size: int = 100_000_000
    offload_param_max_in_cpu: int = 1_000_000_000
    # ZeRO++ (engine/zeropp.py)
    zero_quantized_weights: bool = False  # qwZ: stage 3's all-gathers send int8 codes + an fp32 scale per group
    zero_quantized_nontrainable_weights: bool = False  # stage 3: units with nothing to train rest as int8 codes
    zero_hpz_partition_size: int = 1  # hpZ: a secondary copy over groups of k ranks serves backward's gathers
    zero_quantized_gradients: bool = False  # qgZ: gradients reduced by two int4 all-to-all hops (stages 2, 3)
    loco_err_beta: float | None = None  # LoCo error feedback (zeropp_loco_param): None = off
    loco_reset_t: int = 1024
    zeropp_weight_group_size: int = 2048  # zkern's own: int8 weight elements per scale
    zeropp_grad_group_size: int = 64  # zkern's own: int4 gradient elements per scale


@dataclass(frozen=True)
class AioConfig:
    """DeepSpeed's aio section: the NVMe reader's blocks, queue and threads (cpu/aio.py)."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1  # intra_op_parallelism in newer DeepSpeed; either key sets it
    single_submit: bool = False
    overlap_events: bool = True


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """DeepSpeed's activation_checkpointing section (zkern.checkpointing reads it)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


@dataclass(frozen=True)
class Config:
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = 0.0  # DeepSpeed's code default (its docs say 1.0)
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    steps_per_print: int = 10
    zero_allow_untested_optimizer: bool = False
    comm_timeout_s: float = 600.0  # zkern's own key: collective timeout, so a dead rank ends the job
    device: str = "auto"  # zkern's own key: "auto" (cuda:LOCAL_RANK when CUDA is available), "cpu" or "cuda"
    ranks_per_node: int | None = None  # zkern's own key: None = the launcher's LOCAL_WORLD_SIZE, else one node
    activation_checkpointing: ActivationCheckpointingConfig | None = None  # None: no section in the config
    aio: AioConfig = field(default_factory=AioConfig)
    gradient_predivide_factor: float | None = None  # None: the world size (resolve() fills it)
    communication_data_type: str | None = None  # "fp32" | "fp16" | "bf16"; None: the working dtype
    grad_accum_dtype: str | None = None  # data_types.grad_accum_dtype; None: the working dtype
    world_size: int | None = None  # set by resolve()

    # -- construction ------------------------------------------------------------------------------------------
    @staticmethod
    def load(source: Config | dict | str | os.PathLike) -> Config:
        """Parse a dict, a path to a JSON file, or pass a Config through."""
        if isinstance(source, Config):
            return source
        if isinstance(source, (str, os.PathLike)):
            source = read_json(source, "config")
        if not isinstance(source, dict):
            raise ConfigError(f"config must be a dict, a JSON path or a zkern.Config, not {type(source).__name__}")
        return _parse(source)

    def resolve(self, world_size: int, model: Any = None) -> Config:
        """Fill "auto" values from the model and world, and check batch arithmetic against world_size."""
        from zkern.config_resolve import resolve

        return resolve(self, world_size, model)

    @property
    def precision(self) -> str:
        """'fp16', 'bf16' or 'fp32'."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def read_json(path: str | os.PathLike, what: str) -> dict:
    """A JSON object from a file; ConfigError naming `what` and the path when it is missing, invalid or no object."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError as e:
        raise ConfigError(f"{what} file {os.fspath(path)!r} does not exist") from e
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} file {os.fspath(path)!r} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{what} file {os.fspath(path)!r} holds a {type(data).__name__}, not a JSON object")
    return data


# ----------------------------------------------------------------------------------------------------------------
# Parsing


_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16", "half": "fp16",
           "bf16": "bf16", "bfloat16": "bf16"}


def _nearest(key: str, known: list[str], path: str) -> str:
    """A hint naming the nearest known key: first at this level, then anywhere in the config."""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{path}{close[0]}'?"
    leaves = {p.rsplit(".", 1)[-1]: p for p in keys.ALL_KNOWN_PATHS}
    close = difflib.get_close_matches(key, list(leaves), n=1, cutoff=0.75)
    if close:
        return f"; did you mean '{leaves[close[0]]}'?"
    return f"; known keys here: {', '.join(sorted(known))}"


def _value(path: str, kind: str, value: Any) -> Any:
    """Check one value's type; integral floats (5e8) are accepted for ints as JSON writes them."""
    if value == AUTO and kind.endswith("_auto"):
        return AUTO
    if value == AUTO:
        raise ConfigError(f"'{path}': \"auto\" is not resolvable by zkern here (an HF Trainer fills it from its own "
                          f"arguments); set a number")
    base = kind.removesuffix("_auto")
    if base == "section":  # checked by its own parser
        return value
    if base == "dtype_or_null":
        if value is None:
            return None
        dtype = _DTYPES.get(value) if isinstance(value, str) else None
        if dtype is None:
            raise ConfigError(f"'{path}' must be \"fp32\", \"fp16\" or \"bf16\" (or null), got {value!r}")
        return dtype
    if base == "int_or_null":
        return None if value is None else _value(path, "int", value)
    if base == "str_or_null":
        return None if value is None else _value(path, "str", value)
    if base == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"'{path}' must be true or false, got {value!r}")
        return value
    if base == "int":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(f"'{path}' must be a whole number, got {value!r}")
        return int(value)
    if base == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"'{path}' must be a number, got {value!r}")
        return float(value)
    if base == "str":
        if not isinstance(value, str):
            raise ConfigError(f"'{path}' must be a string, got {value!r}")
        return value
    if base == "str_list":
        if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"'{path}' must be a list of module class names like [\"Block\"], got {value!r}")
        return tuple(value)
    if base == "betas":
        if (not isinstance(value, (list, tuple)) or len(value) != 2
                or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in value)):
            raise ConfigError(f"'{path}' must be a list of two numbers like [0.9, 0.999], got {value!r}")
        return (float(value[0]), float(value[1]))
    raise AssertionError(kind)


def _is_default(value: Any, default: Any) -> bool:
    if default is keys.SECTION_OFF:  # off: empty, {"enabled": false}, or an offload section with device "none"
        if not isinstance(value, dict):
            return value is None
        if "enabled" in value:
            return value["enabled"] is False
        if "device" in value:
            return value["device"] in (None, "none")
        return not value
    return value == default or value == AUTO


def _section(path: str, raw: Any, specs: dict, not_implemented: dict) -> dict:
    """Validate one section: returns {key: checked value} for implemented keys present in raw."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"'{path.rstrip('.')}' must be a JSON object, got {raw!r}")
    out = {}
    for key, value in raw.items():
        if key in specs:
            out[key] = _value(path + key, specs[key][0], value)
        elif key in not_implemented:
            if not _is_default(value, not_implemented[key]):
                default = not_implemented[key]
                shown = "absent or disabled" if default is keys.SECTION_OFF else json.dumps(default)
                raise ConfigError(f"'{path}{key}' is a DeepSpeed key that zkern does not implement yet; "
                                  f"remove it or set it to its default ({shown})")
        else:
            raise ConfigError(f"unknown config key '{path}{key}'{_nearest(key, [*specs, *not_implemented], path)}")
    return out


def _parse_offload(name: str, raw: Any) -> dict:
    """ZeroConfig's fields ({name}_device, {name}_pin_memory, ...) from zero_optimization.offload_optimizer /
    offload_param."""
    path = f"zero_optimization.{name}."
    values = _section(path, raw, keys.OFFLOAD_KEYS[name], keys.NOT_IMPLEMENTED_OFFLOAD[name])
    device = values.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise ConfigError(f"'{path}device' must be \"none\", \"cpu\" or \"nvme\", got {device!r}")
    if device == "nvme" and not values.get("nvme_path"):
        raise ConfigError(f"'{path}nvme_path' is required with device \"nvme\": a directory on the local NVMe drive "
                          f"(each rank makes its own sub-directory there)")
    if name == "offload_optimizer" and values.get("buffer_count", 4) < 3:
        raise ConfigError(f"'{path}buffer_count' must be >= 3 (a tile read ahead, one stepping, one written "
                          f"behind), got {values['buffer_count']}")
    for key in ("buffer_count", "buffer_size") if name == "offload_param" else ():
        if values.get(key, 1) < 1:
            raise ConfigError(f"'{path}{key}' must be >= 1, got {values[key]}")
    if values.get("max_in_cpu", 0) < 0:
        raise ConfigError(f"'{path}max_in_cpu' must be >= 0 elements, got {values['max_in_cpu']}")
    return {f"{name}_{key}": value for key, value in values.items()}


def _parse_optimizer(raw: Any) -> OptimizerConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ConfigError(f"'optimizer' must be a JSON object like {{\"type\": \"AdamW\", \"params\": {{...}}}}, "
                          f"got {raw!r}")
    extra = set(raw) - {"type", "params", "legacy_fusion"}
    if extra:
        key = sorted(extra)[0]
        raise ConfigError(f"unknown config key 'optimizer.{key}'{_nearest(key, ['type', 'params'], 'optimizer.')}")
    if raw.get("legacy_fusion", False):
        raise ConfigError("'optimizer.legacy_fusion' is a DeepSpeed key that zkern does not implement; remove it")
    kind = raw.get("type")
    if not isinstance(kind, str):
        raise ConfigError(f"'optimizer.type' must name an optimizer (Adam or AdamW), got {kind!r}")
    name = kind.lower()
    if name in keys.NOT_IMPLEMENTED_OPTIMIZERS:
        raise ConfigError(f"'optimizer.type' {kind!r} is a DeepSpeed optimizer that zkern does not implement; "
                          f"use Adam or AdamW, or pass a torch optimizer as zkern.Engine(model, cfg, optimizer=...)")
    if name not in ("adam", "adamw"):
        raise ConfigError(f"'optimizer.type' {kind!r} is unknown{_nearest(name, ['adam', 'adamw'], '')}")
    params = _section("optimizer.params.", raw.get("params"), keys.ADAM_PARAMS, keys.NOT_IMPLEMENTED_OPTIMIZER_PARAMS)
    lr = params.get("lr", 1e-3)
    if lr < 0:
        raise ConfigError(f"'optimizer.params.lr' must be >= 0, got {lr}")
    betas = params.get("betas", (0.9, 0.999))
    if not all(0.0 <= b < 1.0 for b in betas):
        raise ConfigError(f"'optimizer.params.betas' must each be in [0, 1), got {list(betas)}")
    return OptimizerConfig(
        type=name,
        lr=lr,
        betas=betas,
        eps=params.get("eps", 1e-8),
        weight_decay=params.get("weight_decay", 0.0),
        # DeepSpeed: AdamW always decouples; Adam decouples unless adam_w_mode is false.
        adamw=name == "adamw" or params.get("adam_w_mode", True),
        torch_adam=params.get("torch_adam", False),
    )


def _parse_scheduler(raw: Any) -> SchedulerConfig | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise ConfigError(f"'scheduler' must be a JSON object like {{\"type\": \"WarmupLR\", \"params\": {{...}}}}, "
                          f"got {raw!r}")
    extra = set(raw) - {"type", "params"}
    if extra:
        key = sorted(extra)[0]
        raise ConfigError(f"unknown config key 'scheduler.{key}'{_nearest(key, ['type', 'params'], 'scheduler.')}")
    kind = raw["type"]
    if kind in keys.NOT_IMPLEMENTED_SCHEDULERS:
        raise ConfigError(f"'scheduler.type' {kind!r} is a DeepSpeed scheduler that zkern does not implement; "
                          f"use WarmupLR or WarmupDecayLR, or pass a torch scheduler as Engine(..., lr_scheduler=...)")
    if kind not in keys.SCHEDULER_PARAMS:
        raise ConfigError(f"'scheduler.type' {kind!r} is unknown{_nearest(kind, list(keys.SCHEDULER_PARAMS), '')}")
    params = _section("scheduler.params.", raw.get("params"), keys.SCHEDULER_PARAMS[kind], {})
    if params.get("warmup_type", "log") not in ("log", "linear"):
        raise ConfigError(f"'scheduler.params.warmup_type' must be \"log\" or \"linear\", got "
                          f"{params['warmup_type']!r}")
    if kind == "WarmupDecayLR" and "total_num_steps" not in params:
        raise ConfigError("'scheduler.params.total_num_steps' is required by WarmupDecayLR (the step at which the "
                          "learning rate reaches 0)")
    if params.get("warmup_num_steps", 1000) < 0:
        raise ConfigError("'scheduler.params.warmup_num_steps' must be >= 0")
    return SchedulerConfig(type=kind, **params)


def _parse(raw: dict) -> Config:
    top = _section("", raw, keys.IMPLEMENTED_TOP, keys.NOT_IMPLEMENTED_TOP)
    if "bf16" in raw and "bfloat16" in raw:
        raise ConfigError("both 'bf16' and 'bfloat16' are set; they are the same section, keep 'bf16'")
    fp16 = FP16Config(**_section("fp16.", raw.get("fp16"), keys.FP16_KEYS, keys.NOT_IMPLEMENTED_FP16))
    bf16 = BF16Config(**_section("bf16.", raw.get("bf16", raw.get("bfloat16")), keys.BF16_KEYS,
                                 keys.NOT_IMPLEMENTED_BF16))
    zero = _section("zero_optimization.", raw.get("zero_optimization"), keys.ZERO_KEYS, keys.NOT_IMPLEMENTED_ZERO)
    for name in ("offload_optimizer", "offload_param"):
        zero.update(_parse_offload(name, zero.pop(name, None)))
    loco = zero.pop("zeropp_loco_param", None)
    if loco is not None:
        loco = _section("zero_optimization.zeropp_loco_param.", loco, keys.LOCO_KEYS, {})
        zero["loco_err_beta"] = loco.get("err_beta", 0.8)
        zero["loco_reset_t"] = loco.get("reset_T", 1024)
    zero_cfg = ZeroConfig(**zero)
    _check_values(top, fp16, bf16, zero_cfg)
    aio = _parse_aio(raw.get("aio"))
    checkpointing = None
    if raw.get("activation_checkpointing") is not None:
        checkpointing = ActivationCheckpointingConfig(**_section(
            "activation_checkpointing.", raw["activation_checkpointing"], keys.ACTIVATION_CHECKPOINTING_KEYS, {}))
        if checkpointing.number_checkpoints is not None and checkpointing.number_checkpoints < 1:
            raise ConfigError(f"'activation_checkpointing.number_checkpoints' must be >= 1 or null, got "
                              f"{checkpointing.number_checkpoints}")
    return Config(
        train_batch_size=top.get("train_batch_size"),
        train_micro_batch_size_per_gpu=top.get("train_micro_batch_size_per_gpu"),
        gradient_accumulation_steps=top.get("gradient_accumulation_steps"),
        gradient_clipping=top.get("gradient_clipping", 0.0),
        optimizer=_parse_optimizer(raw.get("optimizer")),
        scheduler=_parse_scheduler(raw.get("scheduler")),
        fp16=fp16,
        bf16=bf16,
        zero_optimization=zero_cfg,
        steps_per_print=top.get("steps_per_print", 10),
        zero_allow_untested_optimizer=top.get("zero_allow_untested_optimizer", False),
        comm_timeout_s=top.get("comm_timeout_s", 600.0),
        device=top.get("device", "auto"),
        ranks_per_node=top.get("ranks_per_node"),
        activation_checkpointing=checkpointing,
        aio=aio,
        gradient_predivide_factor=top.get("gradient_predivide_factor"),
        communication_data_type=top.get("communication_data_type"),
        grad_accum_dtype=_section("data_types.", raw.get("data_types"), keys.DATA_TYPES_KEYS, {}).get(
            "grad_accum_dtype"),
    )


def _parse_aio(raw: Any) -> AioConfig:
    values = _section("aio.", raw, keys.AIO_KEYS, keys.NOT_IMPLEMENTED_AIO)
    if "intra_op_parallelism" in values:
        threads = values.pop("intra_op_parallelism")
        if values.get("thread_count", threads) != threads:
            raise ConfigError(f"'aio.thread_count' ({values['thread_count']}) and 'aio.intra_op_parallelism' "
                              f"({threads}) are the same setting under DeepSpeed's old and new names; keep one")
        values["thread_count"] = threads
    for key in ("block_size", "queue_depth", "thread_count"):
        if values.get(key, 1) < 1:
            raise ConfigError(f"'aio.{key}' must be >= 1, got {values[key]}")
    if values.get("block_size", 4096) % 4096:
        raise ConfigError(f"'aio.block_size' must be a multiple of 4096 bytes (direct I/O moves whole 4 KiB blocks; "
                          f"DeepSpeed's default is 1048576), got {values['block_size']}")
    return AioConfig(**values)


def _check_values(top: dict, fp16: FP16Config, bf16: BF16Config, zero: ZeroConfig) -> None:
    if fp16.enabled and bf16.enabled:
        raise ConfigError("'fp16.enabled' and 'bf16.enabled' are both true; choose one precision")
    match zero.stage:
        case 0 | 1 | 2 | 3:
            pass
        case other:
            raise ConfigError(f"'zero_optimization.stage' must be 0, 1, 2 or 3, got {other}")
    if top.get("gradient_clipping", 0.0) < 0:
        raise ConfigError(f"'gradient_clipping' must be >= 0 (0 turns clipping off), got {top['gradient_clipping']}")
    if top.get("device", "auto") not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"'device' must be \"auto\", \"cpu\" or \"cuda\", got {top['device']!r}")
    if top.get("gradient_predivide_factor") is not None and top["gradient_predivide_factor"] <= 0:
        raise ConfigError(f"'gradient_predivide_factor' must be > 0, got {top['gradient_predivide_factor']}")
    if top.get("comm_timeout_s", 600.0) <= 0:
        raise ConfigError(f"'comm_timeout_s' must be > 0 seconds, got {top['comm_timeout_s']}")
    for key in ("reduce_bucket_size", "allgather_bucket_size", "stage3_max_live_parameters"):
        value = getattr(zero, key)
        if value != AUTO and value <= 0:
            raise ConfigError(f"'zero_optimization.{key}' must be > 0 elements, got {value}")
    if zero.stage3_prefetch_bucket_size != AUTO and zero.stage3_prefetch_bucket_size < 0:
        raise ConfigError(f"'zero_optimization.stage3_prefetch_bucket_size' must be >= 0 elements (0: no prefetch), "
                          f"got {zero.stage3_prefetch_bucket_size}")
    if zero.offload_optimizer_device != "none" and zero.stage == 0:
        raise ConfigError("'zero_optimization.offload_optimizer' needs ZeRO stage 1, 2 or 3 (each rank offloads "
                          "its optimizer shard); set 'zero_optimization.stage'")
    if zero.offload_param_device != "none" and zero.stage != 3:
        raise ConfigError(f"'zero_optimization.offload_param' partitions parameters and so needs ZeRO stage 3, "
                          f"the config says stage {zero.stage}; use offload_optimizer at stages 1-2")
    if zero.sub_group_size < 1:
        raise ConfigError(f"'zero_optimization.sub_group_size' must be >= 1 element, got {zero.sub_group_size}")
    if zero.offload_param_device != "none" and zero.offload_optimizer_device == "none":
        raise ConfigError("'zero_optimization.offload_param' needs 'zero_optimization.offload_optimizer' with device "
                          "\"cpu\" or \"nvme\" too: the optimizer writes the updated parameter shards where they rest, "
                          "from the host")
    if zero.stage3_param_persistence_threshold != AUTO and zero.stage3_param_persistence_threshold < 0:
        raise ConfigError("'zero_optimization.stage3_param_persistence_threshold' must be >= 0 (0: nothing stays "
                          "whole)")
    _check_zeropp(top, zero)
    if fp16.loss_scale < 0:
        raise ConfigError(f"'fp16.loss_scale' must be 0 (dynamic) or a positive static scale, got {fp16.loss_scale}")
    if fp16.min_loss_scale <= 0:
        raise ConfigError(f"'fp16.min_loss_scale' must be > 0, got {fp16.min_loss_scale}")
    if fp16.hysteresis < 1 or fp16.loss_scale_window < 1:
        raise ConfigError("'fp16.hysteresis' and 'fp16.loss_scale_window' must be >= 1")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if top.get(key) not in (None, AUTO) and top[key] < 1:
            raise ConfigError(f"'{key}' must be >= 1, got {top[key]}")


def _check_zeropp(top: dict, zero: ZeroConfig) -> None:
    """ZeRO++'s keys against the stage and each other (the world is checked in _resolve)."""
    if zero.zero_quantized_weights and zero.stage != 3:
        raise ConfigError(f"'zero_optimization.zero_quantized_weights' (qwZ) quantizes stage 3's parameter "
                          f"all-gather; the config says stage {zero.stage}")
    if zero.zero_quantized_nontrainable_weights and zero.stage != 3:
        raise ConfigError(f"'zero_optimization.zero_quantized_nontrainable_weights' stores stage 3's frozen parameter "
                          f"shards as int8; the config says stage {zero.stage} (frozen parameters are whole on every "
                          f"rank below stage 3)")
    if zero.zero_hpz_partition_size < 1:
        raise ConfigError(f"'zero_optimization.zero_hpz_partition_size' must be >= 1 (1: off), got "
                          f"{zero.zero_hpz_partition_size}")
    if zero.zero_hpz_partition_size > 1 and zero.stage != 3:
        raise ConfigError(f"'zero_optimization.zero_hpz_partition_size' (hpZ) keeps a secondary copy of stage 3's "
                          f"partitioned parameters; the config says stage {zero.stage}")
    if zero.zero_quantized_gradients and zero.stage not in (2, 3):
        raise ConfigError(f"'zero_optimization.zero_quantized_gradients' (qgZ) replaces the gradient reduce-scatter "
                          f"of stages 2 and 3; the config says stage {zero.stage}")
    if zero.zero_quantized_gradients and not zero.reduce_scatter:
        raise ConfigError("'zero_optimization.zero_quantized_gradients' replaces the reduce-scatter, and "
                          "'reduce_scatter' is false; drop one of them")
    if zero.loco_err_beta is not None:
        if not zero.zero_quantized_gradients:
            raise ConfigError("'zero_optimization.zeropp_loco_param' is error feedback for quantized gradients; set "
                              "'zero_quantized_gradients': true or remove it")
        if not 0.0 <= zero.loco_err_beta < 1.0:
            raise ConfigError(f"'zero_optimization.zeropp_loco_param.err_beta' must be in [0, 1), got "
                              f"{zero.loco_err_beta}")
        if zero.loco_reset_t < 1:
            raise ConfigError(f"'zero_optimization.zeropp_loco_param.reset_T' must be >= 1 steps, got "
                              f"{zero.loco_reset_t}")
    for key in ("zeropp_weight_group_size", "zeropp_grad_group_size"):
        value = getattr(zero, key)
        if value < 2 or value & (value - 1):
            raise ConfigError(f"'zero_optimization.{key}' must be a power of two >= 2 (the kernels' tiles are), got "
                              f"{value}")
    if top.get("ranks_per_node") is not None and top["ranks_per_node"] < 1:
        raise ConfigError(f"'ranks_per_node' must be >= 1, got {top['ranks_per_node']}")
