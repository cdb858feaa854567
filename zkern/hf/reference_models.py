"""The models a TRL trainer keeps beside the one it trains, put in zkern engines without an optimizer.

TRL's DPO, KTO and GRPO trainers hold a frozen `ref_model`, its distillation trainer a `teacher_model`. Under
DeepSpeed TRL hands them to `prepare_deepspeed` (the training config without its optimizer and scheduler; ZeRO-3
stays, lower stages become plain replicas). Under zkern.hf.Trainer, TRL sees no DeepSpeed and keeps them whole on
every rank, so when the engine is built they go into reference engines (`zkern.Engine(model, config)` without an
optimizer): at stage 3 partitioned and gathered a unit at a time per forward, below it whole, cast to the training
precision either way, as DeepSpeed does. The trainer's attribute then holds the engine, which TRL calls as it calls
the model (the engine runs its module's forward).
"""

from __future__ import annotations

import copy

import torch

from zkern.config import ConfigError
from zkern.engine.engine import Engine

REFERENCE_ATTRIBUTES = ("ref_model", "teacher_model")


def reference_config(config: dict) -> dict:
    """The training config for a model that never steps: no optimizer, scheduler or optimizer offload (what
    TRL's prepare_deepspeed drops too); ZeRO's stage, precision and buckets kept."""
    kept = copy.deepcopy({k: v for k, v in config.items() if k not in ("optimizer", "scheduler")})
    zero = kept.get("zero_optimization")
    if isinstance(zero, dict):
        zero.pop("offload_optimizer", None)
    return kept


def _to_shard(trainer) -> list[tuple[str, torch.nn.Module]]:
    """The reference models still to put in engines. A model already in an engine, or None (TRL's PEFT and
    precomputed-reference cases), is left."""
    found = []
    for name in REFERENCE_ATTRIBUTES:
        model = getattr(trainer, name, None)
        if model is None or isinstance(model, Engine):
            continue
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"trainer.{name} is a {type(model).__name__}; zkern.hf.Trainer puts a torch.nn.Module "
                            f"there into an engine without an optimizer")
        found.append((name, model))
    return found


def check_reference_models(trainer, config: dict) -> None:
    """What a reference engine cannot do, refused before any engine is built (the same answer on every rank)."""
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    for name, _ in _to_shard(trainer):
        if name == "ref_model" and getattr(trainer.args, "sync_ref_model", False) and stage == 3:
            raise ConfigError("sync_ref_model=True with zero_optimization.stage 3: TRL's SyncRefModelCallback mixes "
                              "the reference's parameters with the policy's in place, which a partitioned reference "
                              "does not hold; use stage 0-2 for a synced reference, or sync_ref_model=False")


def shard_reference_models(trainer, config: dict) -> None:
    """Replace each reference model the trainer holds by a reference engine built from config (the filled training
    config)."""
    for name, model in _to_shard(trainer):
        setattr(trainer, name, Engine(model, reference_config(config)))
