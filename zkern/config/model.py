"""zkern.Config: DeepSpeed-style JSON / dict -> frozen dataclasses, the combinations of keys checked once it is
built (check_combinations), and its resolution against a world and a model (Config.resolve: "auto" filled, the
batch arithmetic, the ranks per node).

    cfg = zkern.Config.load("ds_config.json")            # parse and validate the keys (parse.py)
    cfg = cfg.resolve(world_size=2, model=model)          # fill "auto", check the batch arithmetic
    python -m zkern.config check ds_config.json           # what zkern makes of a file, without a job

Keys mean what they mean in DeepSpeed, with DeepSpeed's code defaults, so a user's existing file works unchanged
(keys.py lists every key of DeepSpeed 0.19 and what zkern does with it). Every spelling DeepSpeed accepts is
accepted; a key DeepSpeed has but zkern does not implement is accepted when its value asks for nothing zkern would
do differently (said in the start-up block), else a ConfigError; a key that is not DeepSpeed's is one warning, unless
it is a near-miss of a known key (a typo), which is a ConfigError that says "did you mean". Nothing is ignored
without a word: Config.notes holds what was inert, warned, renamed and filled, and the engine logs it at start-up.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from zkern.config import keys as K
from zkern.config.ds_view import deepspeed_dict
from zkern.config.keys import AUTO
from zkern.config.parse import parse_config
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
    TorchAutocastConfig,
    ZeroConfig,
    _default,
)
from zkern.errors import CheckpointError, ConfigError
from zkern.safe_io import parse_json, read_capped


@dataclass(frozen=True)
class Config:
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int | None = None
    # DeepSpeed's default since 0.19.2 (0.0 before): absent, gradients are clipped
    gradient_clipping: float = _default(K.TOP, "gradient_clipping")
    optimizer: OptimizerConfig | None = None
    scheduler: SchedulerConfig | None = None
    fp16: FP16Config = field(default_factory=FP16Config)
    bf16: BF16Config = field(default_factory=BF16Config)
    # the forward under torch.autocast, weights fp32 (precision stays "fp32": nothing is cast at rest)
    torch_autocast: TorchAutocastConfig = field(default_factory=TorchAutocastConfig)
    zero_optimization: ZeroConfig = field(default_factory=ZeroConfig)
    steps_per_print: int | None = _default(K.TOP, "steps_per_print")  # None: no progress lines
    zero_allow_untested_optimizer: bool = _default(K.TOP, "zero_allow_untested_optimizer")
    # zkern's own key: collective timeout, so a dead rank ends the job
    comm_timeout_s: float = _default(K.TOP, "comm_timeout_s")
    # zkern's own key: bf16 master/moments round stochastically, not to nearest
    bf16_stochastic_rounding: bool = _default(K.TOP, "bf16_stochastic_rounding")
    # zkern's own key: "auto" (cuda:LOCAL_RANK when CUDA is available), "cpu" or "cuda"
    device: str = _default(K.TOP, "device")
    ranks_per_node: int | None = None  # zkern's own key: None = the launcher's LOCAL_WORLD_SIZE, else one node
    activation_checkpointing: ActivationCheckpointingConfig | None = None  # None: no section in the config
    aio: AioConfig = field(default_factory=AioConfig)
    gradient_predivide_factor: float | None = None  # None: the world size (resolve() fills it)
    gradient_allreduce_op: str = _default(K.TOP, "gradient_allreduce_op")  # "mean" or "sum" over the ranks
    communication_data_type: str | None = None  # "fp32" | "fp16" | "bf16"; None: the working dtype
    grad_accum_dtype: str | None = None  # data_types.grad_accum_dtype; None: the working dtype
    # forward / backward / step / collective times every steps_per_print
    wall_clock_breakdown: bool = _default(K.TOP, "wall_clock_breakdown")
    memory_breakdown: bool = _default(K.TOP, "memory_breakdown")  # memory_report() every steps_per_print
    flops_profiler: FlopsProfilerConfig = field(default_factory=FlopsProfilerConfig)
    comms_logger: CommsLoggerConfig = field(default_factory=CommsLoggerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    dataloader_drop_last: bool = _default(K.TOP, "dataloader_drop_last")  # zkern.initialize's loader
    notes: ConfigNotes = field(default_factory=ConfigNotes, compare=False)
    world_size: int | None = None  # set by resolve()
    # the user's dict as given (a copy): engine.config's DeepSpeed view starts from it (ds_view.py)
    source: dict = field(default_factory=dict, compare=False, repr=False)

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
        cfg = Config(**parse_config(source), source=copy.deepcopy(source))
        check_combinations(cfg)
        return cfg

    def resolve(self, world_size: int, model: Any = None) -> Config:
        """Fill "auto" values from the model and world, and check batch arithmetic against world_size."""
        return resolve_config(self, world_size, model)

    @property
    def precision(self) -> str:
        """'fp16', 'bf16' or 'fp32'."""
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"

    def to_dict(self) -> dict:
        """Every resolved field, flat as zkern keeps them (the user's own dict is `source`, and engine.config's view
        of it is what indexing gives)."""
        out = dataclasses.asdict(self)
        out.pop("source")
        return out

    # Dict access, as frameworks read DeepSpeed's engine.config: cfg["zero_optimization"]["offload_optimizer"]
    # ["device"]. The user's sections nested as DeepSpeed keeps them (ds_view.py); each read a fresh copy.
    def __getitem__(self, key: str):
        return deepspeed_dict(self)[key]

    def get(self, key: str, default=None):
        return deepspeed_dict(self).get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in deepspeed_dict(self)

    def keys(self):
        return deepspeed_dict(self).keys()

    def items(self):
        return deepspeed_dict(self).items()


def read_json(path: str | os.PathLike, what: str) -> dict:
    """A JSON object from a file; ConfigError naming `what` and the path when it is missing, invalid or no object."""
    try:
        data = parse_json(read_capped(os.fspath(path), 64 << 20, what), os.fspath(path), what)
    except FileNotFoundError as e:
        raise ConfigError(f"{what} file {os.fspath(path)!r} does not exist") from e
    except CheckpointError as e:
        raise ConfigError(str(e).replace(f"the {what} is not valid JSON", "not valid JSON")) from e
    if not isinstance(data, dict):
        raise ConfigError(f"{what} file {os.fspath(path)!r} holds a {type(data).__name__}, not a JSON object")
    return data


# -- what one key alone cannot say: combinations of keys, checked once a Config is built from them ---------------
def check_combinations(cfg: Config) -> None:
    """What one key alone cannot say: combinations."""
    zero = cfg.zero_optimization
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"'device' must be \"auto\", \"cpu\" or \"cuda\", got {cfg.device!r}")
    if cfg.gradient_allreduce_op not in ("mean", "sum"):
        raise ConfigError(f"'gradient_allreduce_op' must be \"mean\" or \"sum\", got {cfg.gradient_allreduce_op!r}")
    if zero.offload_optimizer_device != "none" and zero.stage == 0:
        raise ConfigError("'zero_optimization.offload_optimizer' needs ZeRO stage 1, 2 or 3 (each rank offloads "
                          "its optimizer shard); set 'zero_optimization.stage'")
    if zero.offload_param_device == "nvme" and zero.offload_optimizer_device == "none":
        raise ConfigError("'zero_optimization.offload_param' device \"nvme\" needs 'offload_optimizer' with device "
                          "\"cpu\" or \"nvme\" too: the optimizer writes the updated shards into the parameter file "
                          "from the host")
    _check_delayed_update(cfg)
    _check_speculative_step(cfg)
    _check_partial_offload(cfg)
    _check_muon(cfg)
    _check_zeropp(cfg)
    _check_bf16_state(cfg)
    _check_torch_autocast(cfg)


def _check_delayed_update(cfg: Config) -> None:
    zero = cfg.zero_optimization
    if not zero.offload_optimizer_delayed_update:
        return
    if zero.offload_optimizer_device != "cpu":
        raise ConfigError("'zero_optimization.offload_optimizer.delayed_update' delays the host Adam of "
                          "offload_optimizer device \"cpu\"; set that device (with \"nvme\" the step streams its "
                          "state from files and cannot run behind the next step)")
    if zero.offload_param_device == "nvme":
        raise ConfigError("'zero_optimization.offload_optimizer.delayed_update' with offload_param device \"nvme\": "
                          "the delayed update would write the parameter file while the forward reads it; use "
                          "offload_param device \"cpu\" or \"none\"")
    if cfg.optimizer is None or cfg.optimizer.type not in ("adam", "adamw") or cfg.optimizer.torch_adam:
        raise ConfigError("'zero_optimization.offload_optimizer.delayed_update' runs zkern's own Adam/AdamW in the "
                          "background: give an 'optimizer' section of type Adam or AdamW (without torch_adam), not "
                          "a torch optimizer")


def _check_partial_offload(cfg: Config) -> None:
    """offload_optimizer.ratio < 1: the host and the device each step their part of the shard in step()."""
    zero = cfg.zero_optimization
    if zero.offload_optimizer_ratio >= 1.0:
        return
    name = f"'zero_optimization.offload_optimizer.ratio' {zero.offload_optimizer_ratio:g}"
    if zero.offload_optimizer_device != "cpu":
        raise ConfigError(f"{name} splits the optimizer between the device and the host; it needs offload_optimizer "
                          f"device \"cpu\" (got \"{zero.offload_optimizer_device}\")")
    clashes = [(zero.offload_optimizer_delayed_update, "'delayed_update'", "the host part would run a step behind the "
                "device part"),
               (zero.offload_optimizer_speculative_step or zero.offload_optimizer_super_offload,
                "'speculative_step' (or 'super_offload')", "its guessed step and rollback cover the whole shard"),
               (zero.offload_param_device != "none", "offload_param", "the device part of the optimizer would write "
                "parameters that rest on the host")]
    for on, what, why in clashes:
        if on:
            raise ConfigError(f"{name} with {what} is not supported: {why}; set ratio to 1 or drop {what}")


def _check_muon(cfg: Config) -> None:
    if cfg.optimizer is None or cfg.optimizer.type != "muon":
        return
    bf16 = cfg.bf16
    keys = [k for k in ("bf16_optimizer_states", "bf16_master_weights_and_grads") if bf16.enabled and getattr(bf16, k)]
    if keys:
        raise ConfigError(f"'bf16.{keys[0]}' keeps zkern's fused Adam's state in bf16; Muon keeps its momentum and "
                          f"AdamW's moments in fp32: remove '{keys[0]}'")


def _check_speculative_step(cfg: Config) -> None:
    zero = cfg.zero_optimization
    if not (zero.offload_optimizer_speculative_step or zero.offload_optimizer_super_offload):
        return
    key = "speculative_step" if zero.offload_optimizer_speculative_step else "super_offload"
    name = f"'zero_optimization.offload_optimizer.{key}'"
    if zero.offload_optimizer_device != "cpu":
        raise ConfigError(f"{name} runs the host Adam of offload_optimizer device \"cpu\" during backward; set that "
                          f"device (with \"nvme\" the step streams its state from files)")
    if zero.offload_optimizer_delayed_update:
        raise ConfigError(f"{name} and 'delayed_update' both move the host Adam off the step's critical path, one "
                          f"exactly (a guess checked at step()) and one a step late; choose one")
    if zero.offload_param_device == "nvme" and zero.stage == 3:
        raise ConfigError(f"{name} with offload_param device \"nvme\": the kept chunks' parameters would be written "
                          f"to the parameter file at step(), on the step's critical path; use offload_param device "
                          f"\"cpu\" (or \"none\")")
    if not zero.offload_optimizer_copy_grads_during_backward:
        raise ConfigError(f"{name} steps each gradient chunk as it lands in backward, and "
                          f"'copy_grads_during_backward' is false (no chunk lands before step()); set it to true")
    if cfg.optimizer is None or cfg.optimizer.type not in ("adam", "adamw") or cfg.optimizer.torch_adam:
        raise ConfigError(f"{name} runs zkern's own Adam/AdamW chunk by chunk during backward: give an 'optimizer' "
                          f"section of type Adam or AdamW (without torch_adam), not a torch optimizer")


def _check_torch_autocast(cfg: Config) -> None:
    if not cfg.torch_autocast.enabled:
        return
    if cfg.precision != "fp32":
        raise ConfigError(f"'torch_autocast.enabled' and '{cfg.precision}.enabled' are both true: the {cfg.precision} "
                          f"section casts the weights to {cfg.precision}, torch_autocast keeps them fp32 and casts per "
                          f"operation in the forward; choose one")
    if cfg.zero_optimization.zero_quantized_weights:
        raise ConfigError("'torch_autocast.enabled' with 'zero_optimization.zero_quantized_weights' (qwZ): DeepSpeed "
                          "refuses the pair too (int8 weight gathers of fp32 weights under autocast); drop one")


def _check_bf16_state(cfg: Config) -> None:
    """bf16 master weights and moments: DeepSpeed's keys, with its conditions (bf16 on, a ZeRO stage); zkern also
    takes bf16_optimizer_states alone (an fp32 master with bf16 moments), which DeepSpeed refuses."""
    bf16 = cfg.bf16
    for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        if getattr(bf16, key) and not bf16.enabled:
            raise ConfigError(f"'bf16.{key}' keeps optimizer state in bf16 for bf16 training, and 'bf16.enabled' is "
                              f"false; set it to true or remove '{key}'")
        if getattr(bf16, key) and cfg.zero_optimization.stage == 0:
            raise ConfigError(f"'bf16.{key}' applies to the ZeRO optimizer's shard (stages 1, 2 and 3), as in "
                              f"DeepSpeed; set 'zero_optimization.stage' to 1 or more or remove it")
    if cfg.bf16_stochastic_rounding and not (bf16.bf16_master_weights_and_grads or bf16.bf16_optimizer_states):
        raise ConfigError("'bf16_stochastic_rounding' rounds the optimizer state kept in bf16, and none is: set "
                          "'bf16.bf16_optimizer_states' or 'bf16.bf16_master_weights_and_grads', or remove it")


def _check_zeropp(cfg: Config) -> None:
    """ZeRO++'s keys against the stage and each other (the world is checked in resolve)."""
    zero = cfg.zero_optimization
    if zero.zero_quantized_weights and zero.stage != 3:
        raise ConfigError(f"'zero_optimization.zero_quantized_weights' (qwZ) quantizes stage 3's parameter "
                          f"all-gather; the config says stage {zero.stage}")
    if zero.zero_quantized_nontrainable_weights and zero.stage != 3:
        raise ConfigError(f"'zero_optimization.zero_quantized_nontrainable_weights' stores stage 3's frozen parameter "
                          f"shards as int8; the config says stage {zero.stage} (frozen parameters are whole on every "
                          f"rank below stage 3)")
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
        if not zero.loco_err_beta < 1.0:
            raise ConfigError(f"'zero_optimization.zeropp_loco_param.err_beta' must be in [0, 1), got "
                              f"{zero.loco_err_beta}")
    for key in ("zeropp_weight_group_size", "zeropp_grad_group_size"):
        value = getattr(zero, key)
        if value < 2 or value & (value - 1):
            raise ConfigError(f"'zero_optimization.{key}' must be a power of two >= 2 (the kernels' tiles are), got "
                              f"{value}")


# -- Config.resolve: "auto" filled from the world size and the model, the batch arithmetic, ranks per node -------
def node_size(cfg: Config, world: int) -> int:
    """Ranks per node: the config's ranks_per_node, else the launcher's LOCAL_WORLD_SIZE, else the whole world."""
    if cfg.ranks_per_node is not None:
        return cfg.ranks_per_node
    local = os.environ.get("LOCAL_WORLD_SIZE")
    return int(local) if local and local.isdigit() and int(local) >= 1 else world


def _hidden_size(model: Any, key: str) -> int:
    """The model's hidden size, where HF integrations read it: model.config.hidden_size (or hidden_sizes, the largest),
    else its text_config's (a multimodal model)."""
    config = getattr(model, "config", None)
    for where in (config, getattr(config, "text_config", None)):
        for attr in ("hidden_size", "d_model", "n_embd"):
            value = getattr(where, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
        sizes = getattr(where, "hidden_sizes", None)
        if sizes:
            return max(sizes)
    raise ConfigError(f"'{key}' is \"auto\" but the model has no config.hidden_size to derive it from "
                      f"(DeepSpeed's HF integration uses hidden_size**2); set a number")


def _resolve_batch(cfg: Config, world: int) -> tuple[int, int, int]:
    """DeepSpeed's rule: train = micro x accumulation x world; any two give the third."""
    train, micro, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    autos = [k for k, v in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                            ("gradient_accumulation_steps", gas)) if v == AUTO]
    if len(autos) > 1:
        raise ConfigError(f"{' and '.join(repr(a) for a in autos)} are \"auto\"; zkern can derive one of the three "
                          f"batch keys from the other two and the world size ({world}), not more")
    train, micro, gas = (None if v == AUTO else v for v in (train, micro, gas))
    if train is not None and micro is not None and gas is not None:
        if train != micro * gas * world:
            raise ConfigError(f"'train_batch_size' ({train}) != 'train_micro_batch_size_per_gpu' ({micro}) x "
                              f"'gradient_accumulation_steps' ({gas}) x world size ({world}) = {micro * gas * world}")
    elif train is not None and micro is not None:
        if train % (micro * world):
            raise ConfigError(f"'train_batch_size' ({train}) is not divisible by 'train_micro_batch_size_per_gpu' "
                              f"({micro}) x world size ({world}) = {micro * world}; gradient_accumulation_steps "
                              f"would not be a whole number")
        gas = train // (micro * world)
    elif train is not None and gas is not None:
        if train % (gas * world):
            raise ConfigError(f"'train_batch_size' ({train}) is not divisible by 'gradient_accumulation_steps' ({gas}) "
                              f"x world size ({world}) = {gas * world}; train_micro_batch_size_per_gpu would not be "
                              f"a whole number")
        micro = train // (gas * world)
    elif micro is not None and gas is not None:
        train = micro * gas * world
    elif train is not None:
        gas = 1
        if train % world:
            raise ConfigError(f"'train_batch_size' ({train}) is not divisible by the world size ({world})")
        micro = train // world
    elif micro is not None:
        gas = 1
        train = micro * world
    else:
        raise ConfigError("set 'train_batch_size' or 'train_micro_batch_size_per_gpu' (DeepSpeed needs one of them)")
    return train, micro, gas


def resolve_config(cfg: Config, world: int, model: Any) -> Config:
    if not isinstance(world, int) or world < 1:
        raise ConfigError(f"world size must be a positive integer, got {world!r}")
    train, micro, gas = _resolve_batch(cfg, world)
    zero = cfg.zero_optimization
    # DeepSpeed's HF integration: reduce_bucket_size = hidden^2, stage3_prefetch_bucket_size = 0.9 hidden^2,
    # stage3_param_persistence_threshold = 10 hidden.
    autos = {"reduce_bucket_size": lambda h: h * h, "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
             "stage3_param_persistence_threshold": lambda h: 10 * h}
    filled = [*cfg.notes.filled]
    for key, rule in autos.items():
        if getattr(zero, key) == AUTO:
            value = rule(_hidden_size(model, f"zero_optimization.{key}"))
            zero = dataclasses.replace(zero, **{key: value})
            filled.append((f"zero_optimization.{key}", f"{value} (from the model's hidden size)"))
    for key, value in (("train_batch_size", train), ("train_micro_batch_size_per_gpu", micro),
                       ("gradient_accumulation_steps", gas)):
        if getattr(cfg, key) == AUTO:
            filled.append((key, f"{value} (from the other two and the world size {world})"))
    if zero.overlap_comm is None:
        zero = dataclasses.replace(zero, overlap_comm=zero.stage == 3)
    k = zero.zero_hpz_partition_size
    if world % k:
        raise ConfigError(f"'zero_optimization.zero_hpz_partition_size' ({k}) must divide the world size ({world}): "
                          f"{world} ranks = {world // k} groups of {k} + {world % k} left over; set it to the ranks "
                          f"per node, a divisor of {world}")
    per_node = node_size(cfg, world)
    if world % per_node:
        raise ConfigError(f"ranks per node ({per_node}, from 'ranks_per_node' or LOCAL_WORLD_SIZE) must divide the "
                          f"world size ({world})")
    predivide = float(world) if cfg.gradient_predivide_factor is None else cfg.gradient_predivide_factor
    notes = dataclasses.replace(cfg.notes, filled=tuple(filled))
    return dataclasses.replace(cfg, train_batch_size=train, train_micro_batch_size_per_gpu=micro,
                               gradient_accumulation_steps=gas, zero_optimization=zero, world_size=world,
                               gradient_predivide_factor=predivide, notes=notes)
