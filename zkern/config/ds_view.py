"""engine.config as DeepSpeed's engine shows it: the user's own sections, nested as written, with the values DeepSpeed
fills itself (the batch trio, "auto" where the model or the world decided it) filled, and the sections zkern's
resolved config implies (the stage, fp16's and bf16's `enabled`, the offload devices) present. Frameworks read it as
a dict (OpenRLHF: engine.config["zero_optimization"]["offload_optimizer"]["device"]); each read is a fresh copy, so
a write changes nothing the engine does.

    python -c "import zkern; print(zkern.Config.load({'train_batch_size': 8, 'zero_optimization': {'stage': 2}})\
.resolve(2)['train_micro_batch_size_per_gpu'])"
"""

from __future__ import annotations

import copy

AUTO = "auto"


def _fill(section: dict, key: str, value) -> None:
    """section[key] = value where the user wrote "auto" or nothing (a value the user wrote is theirs)."""
    if value is not None and section.get(key, AUTO) == AUTO:
        section[key] = value


def deepspeed_dict(cfg) -> dict:
    """The nested view of cfg (a zkern.Config) described in the module docstring."""
    out = copy.deepcopy(cfg.source) if cfg.source else {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        _fill(out, key, getattr(cfg, key))
    if out.get("gradient_clipping") == AUTO:
        out["gradient_clipping"] = cfg.gradient_clipping
    zero, resolved = out.setdefault("zero_optimization", {}), cfg.zero_optimization
    _fill(zero, "stage", resolved.stage)
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold"):
        if zero.get(key) == AUTO:
            zero[key] = getattr(resolved, key)
    for section, device in (("offload_optimizer", resolved.offload_optimizer_device),
                            ("offload_param", resolved.offload_param_device)):
        if device != "none":
            _fill(zero.setdefault(section, {}), "device", device)
    for name in ("fp16", "bf16"):  # present either way: frameworks read engine.config["bf16"]["enabled"]
        _fill(out.setdefault(name, {}), "enabled", getattr(cfg, name).enabled)
    if cfg.optimizer is not None and isinstance(out.get("optimizer"), dict):
        params = out["optimizer"].setdefault("params", {})
        for key in ("lr", "betas", "eps", "weight_decay"):
            if params.get(key) == AUTO:
                value = getattr(cfg.optimizer, key)
                params[key] = list(value) if isinstance(value, tuple) else value
    return out
