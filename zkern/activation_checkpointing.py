"""Activation checkpointing with DeepSpeed's API and config section, on torch's non-reentrant checkpoint.

    python -m pytest tests/engine/test_activation_checkpointing.py -q

    hidden = zkern.checkpointing.checkpoint(block, hidden, mask)   # as deepspeed.checkpointing.checkpoint

The region's activations are not kept: backward runs `function` again to recompute them (torch.utils.checkpoint
with use_reentrant=False, RNG state preserved, so dropout repeats). What is kept are the region's tensor inputs,
and with `cpu_checkpointing` those go to host memory until backward needs them: a copy to the host that autograd
tracks (so gradients still reach the inputs), and back to the device when the region runs or is recomputed. On
a machine without a GPU the host copy is made all the same, so the path a GPU takes is the path tested here.

zkern.Engine applies the config's `activation_checkpointing` section through configure(); DeepSpeed's
configure(mpu_, deepspeed_config=..., ...) works too. Of its keys, `partition_activations`,
`contiguous_memory_optimization` and `number_checkpoints` act on activations split across model-parallel ranks,
which zkern does not have: they change nothing, and configure says so once. `synchronize_checkpoint_boundary`
synchronises the GPU at each region's start and end; `profile` times each region's forward and recomputation.
stats() reports calls, recomputations, the bytes moved to the host and the profiled seconds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, fields

import torch
import torch.utils.checkpoint

from zkern.config import ActivationCheckpointingConfig, Config

log = logging.getLogger("zkern")

_NO_EFFECT = ("partition_activations", "contiguous_memory_optimization", "number_checkpoints")


@dataclass
class _Stats:
    calls: int = 0
    recomputations: int = 0
    offloaded_bytes: int = 0  # inputs copied to host memory by cpu_checkpointing
    forward_seconds: float = 0.0  # with profile
    recompute_seconds: float = 0.0


@dataclass
class _State:
    settings: ActivationCheckpointingConfig = field(default_factory=ActivationCheckpointingConfig)
    configured: bool = False
    said: set = field(default_factory=set)
    stats: _Stats = field(default_factory=_Stats)


_state = _State()


def configure(mpu_=None, deepspeed_config=None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """Set how checkpoint() behaves (DeepSpeed's signature). deepspeed_config: a zkern.Config, dict or JSON path
    whose activation_checkpointing section is read first; the keyword arguments override it."""
    if mpu_ is not None:
        raise ValueError("zkern.checkpointing.configure: zkern has no model parallelism, so there is no mpu to give; "
                         "pass None")
    settings = ActivationCheckpointingConfig()
    if deepspeed_config is not None:
        section = Config.load(deepspeed_config).activation_checkpointing
        settings = section if section is not None else settings
    overrides = {"partition_activations": partition_activations,
                 "contiguous_memory_optimization": contiguous_checkpointing, "number_checkpoints": num_checkpoints,
                 "cpu_checkpointing": checkpoint_in_cpu, "synchronize_checkpoint_boundary": synchronize,
                 "profile": profile}
    values = {f.name: getattr(settings, f.name) for f in fields(settings)}
    values.update({k: v for k, v in overrides.items() if v is not None})
    _state.settings = ActivationCheckpointingConfig(**values)
    _state.configured = True
    for key in _NO_EFFECT:
        if values[key] not in (False, None) and key not in _state.said:
            _state.said.add(key)
            log.info("zkern.checkpointing: activation_checkpointing.%s acts on activations split across "
                     "model-parallel ranks; zkern has none, so it changes nothing (said once)", key)


def is_configured() -> bool:
    return _state.configured


def reset() -> None:
    """Back to the defaults (no host offload, no synchronisation, no profile) and zeroed stats."""
    global _state
    _state = _State()


def stats() -> dict:
    """What checkpoint() did since the last reset_stats()."""
    return dict(vars(_state.stats))


def reset_stats() -> None:
    _state.stats = _Stats()


def _synchronize() -> None:
    if _state.settings.synchronize_checkpoint_boundary and torch.cuda.is_available():
        torch.cuda.synchronize()


def checkpoint(function, *args):
    """function(*args), keeping only the inputs for backward, which recomputes the rest (DeepSpeed's
    deepspeed.checkpointing.checkpoint; positional arguments only, as there)."""
    settings, stats = _state.settings, _state.stats
    stats.calls += 1
    runs = [0]

    def run(*inputs):
        recompute = runs[0] > 0  # torch calls it again in backward: the recomputation
        runs[0] += 1
        stats.recomputations += recompute
        if settings.cpu_checkpointing:
            inputs = tuple(x.to(device, non_blocking=True) if device is not None else x
                           for x, device in zip(inputs, devices))
        if not settings.profile:
            return function(*inputs)
        _synchronize_for_timing()
        start = time.perf_counter()
        try:  # a recomputation ends by raising once it has what backward needs (torch's early stop)
            return function(*inputs)
        finally:
            _synchronize_for_timing()
            seconds = time.perf_counter() - start
            if recompute:
                stats.recompute_seconds += seconds
            else:
                stats.forward_seconds += seconds

    devices: list[torch.device | None] = []
    anchors: list[torch.Tensor] = []
    if settings.cpu_checkpointing:
        moved = []
        for a in args:
            if isinstance(a, torch.Tensor):
                devices.append(a.device)
                moved.append(a.to("cpu", copy=True))  # tracked: the gradient flows back to the device input
                stats.offloaded_bytes += a.numel() * a.element_size()
            else:
                devices.append(None)
                moved.append(a)
        args = tuple(moved)
        anchors = rng_anchors(devices)
    _synchronize()
    if anchors:
        # torch's checkpoint saves the generator state of the devices its arguments are on; the host copies alone
        # would leave the GPU's out, and the recomputation would draw other dropout masks. An empty tensor on each
        # original device puts it back in the list.
        def run_anchored(*anchored):
            return run(*anchored[len(anchors):])

        out = torch.utils.checkpoint.checkpoint(run_anchored, *anchors, *args, use_reentrant=False)
    else:
        out = torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)
    _synchronize()
    return out


def rng_anchors(devices: list[torch.device | None]) -> list[torch.Tensor]:
    """An empty tensor on each distinct accelerator the region's inputs came from (none for host inputs)."""
    seen = []
    for d in devices:
        if d is not None and d.type != "cpu" and d not in seen:
            seen.append(d)
    return [torch.empty(0, device=d) for d in seen]


def _synchronize_for_timing() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()
