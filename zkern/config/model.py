"""DeepSpeed-style JSON / dict -> frozen dataclasses.

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

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from zkern.config import keys as K
from zkern.config.checks import check_combinations
from zkern.config.parse import parse_config
from zkern.config.resolve import resolve_config
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
        cfg = Config(**parse_config(source))
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
        return dataclasses.asdict(self)

    # Read-only dict access, as frameworks read DeepSpeed's engine.config: cfg["zero_optimization"]["stage"].
    def __getitem__(self, key: str):
        return self.to_dict()[key]

    def get(self, key: str, default=None):
        return self.to_dict().get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.to_dict()

    def keys(self):
        return self.to_dict().keys()


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
