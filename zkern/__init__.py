"""zkern: ZeRO training on torch.distributed with DeepSpeed-compatible configs.

    engine = zkern.Engine(model, "ds_config.json"); engine.backward(engine(x).sum()); engine.step()

`import zkern` needs torch alone; optional backends are reported by `python -m zkern.env_report`.
"""

from zkern import checkpointing, ops
from zkern.config import Config, ConfigError
from zkern.engine.comm import CommError
from zkern.engine.engine import Engine
from zkern.engine.gathered import GatheredParameters
from zkern.engine.lifecycle import InvariantError
from zkern.engine.partition import estimate_memory
from zkern.engine.precision import LossScaleAtMinimum
from zkern.engine.sharded_init import init_sharded
from zkern.engine.units import register_external_parameter

__all__ = ["Engine", "Config", "ConfigError", "CommError", "InvariantError", "LossScaleAtMinimum", "GatheredParameters",
           "estimate_memory", "init_sharded", "register_external_parameter", "checkpointing", "ops"]
__version__ = "0.1.0"
