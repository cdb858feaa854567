"""Config.resolve's half of the config: "auto" values filled from the world size and the model, the batch
arithmetic checked, and the ranks per node.

    cfg = zkern.Config.load("ds_config.json").resolve(world_size=2, model=model)
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from zkern.config.keys import AUTO
from zkern.errors import ConfigError

if TYPE_CHECKING:
    from zkern.config.model import Config


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
