"""zkern.Config: a DeepSpeed-style JSON or dict, parsed into frozen dataclasses the engine reads.

    cfg = zkern.Config.load("ds_config.json")            # parse and validate the keys
    cfg = cfg.resolve(world_size=2, model=model)          # fill "auto", check the batch arithmetic
    python -m zkern.config check ds_config.json           # what zkern makes of a file, without a job

The rooms, lowest first: keys.py (every key of DeepSpeed 0.19 and what zkern does with it), sections.py (one frozen
dataclass per section), parse.py (a dict -> the sections, with notes on what was inert, warned, renamed), model.py
(Config, which ties them together, with the combinations of keys it checks and "auto" and the batch arithmetic it
resolves against a world), report.py (the start-up block and the `check` command).
"""

from zkern.config.model import Config, read_json
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

__all__ = ["ActivationCheckpointingConfig", "AioConfig", "BF16Config", "CheckpointConfig", "CommsLoggerConfig",
           "Config", "ConfigError", "ConfigNotes", "FP16Config", "FlopsProfilerConfig", "MonitorConfig",
           "OptimizerConfig", "SchedulerConfig", "ZeroConfig", "read_json"]
