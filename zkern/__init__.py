"""zkern: ZeRO training on torch.distributed with DeepSpeed-compatible configs.

    engine = zkern.Engine(model, "ds_config.json"); engine.backward(engine(x).sum()); engine.step()

`import zkern` needs torch alone; optional backends are reported by `python -m zkern.env_report`. The names below
are imported on first use, so tools that need no torch (`python -m zkern.checkpoint consolidate` of an fp32
checkpoint) do not pay for importing it.
"""

import importlib

_EXPORTS = {
    "Engine": "zkern.engine.engine",
    "initialize": "zkern.engine.initialize",
    "Config": "zkern.config",
    "ConfigError": "zkern.errors",
    "CommError": "zkern.errors",
    "InvariantError": "zkern.errors",
    "LossScaleAtMinimum": "zkern.errors",
    "GatheredParameters": "zkern.stage3.gathered",
    "estimate_memory": "zkern.core.partition",
    "init_sharded": "zkern.stage3.sharded_init",
    "register_external_parameter": "zkern.stage3.units",
    **{name: "zkern.stage3.leaf_modules" for name in (
        "set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module")},
    "CheckpointError": "zkern.errors",
    "safe_get_full_grad": "zkern.engine.param_views",
    "safe_get_full_fp32_param": "zkern.engine.param_views",
    "safe_get_full_optimizer_state": "zkern.engine.param_views",
    "safe_set_full_fp32_param": "zkern.engine.param_views",
    "safe_set_full_optimizer_state": "zkern.engine.param_views",
    **{name: "zkern.engine.local_views" for name in (
        "safe_set_full_grad", "safe_update_full_grad_vectorized", "safe_get_local_grad", "safe_set_local_grad",
        "safe_get_local_fp32_param",
        "safe_set_local_fp32_param", "safe_get_local_optimizer_state", "safe_set_local_optimizer_state")},
}
_MODULES = {"activation_checkpointing", "checkpointing", "ops", "checkpoint", "hf"}

__all__ = [*_EXPORTS, *sorted(_MODULES)]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(f"zkern.{name}")
    else:
        raise AttributeError(f"module 'zkern' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
