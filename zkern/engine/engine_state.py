"""The engine's own state components (optimizer, LR scheduler, loss scaler, counters, generators, offload
staging), registered beside the stage runtime's in one StateRegistry (state.py).

    python -m pytest tests/core/test_state.py -q
"""

from __future__ import annotations

import copy
import math

import torch

from zkern.checkpoint.plain import plain, same_kind
from zkern.core.generators import check_rng_state, rng_state, set_rng_state
from zkern.core.state import Component, StateRegistry, host_copy, hyper_parameters, restore_hyper_parameters
from zkern.engine.counters import Counters
from zkern.engine.parts import EngineParts
from zkern.engine.precision import LossScaler, autocast_dtype
from zkern.engine.reporting import Reporter
from zkern.optim.piece_states import PieceStates
from zkern.optim.shard_adam import ShardAdam


def build_registry(parts: EngineParts, reporter: Reporter) -> StateRegistry:
    """Every stateful piece of a built engine, runtime first (its gradients reset before the engine's counts),
    registered in parts.state (empty until now), which is returned."""
    registry = parts.state
    for component in parts.runtime.state_components():
        registry.add(component)
    registry.add(_module(parts))
    if parts.optimizer is not None:  # an engine without one runs forward only
        registry.add(_optimizer(parts.optimizer, parts.store))
    if parts.lr_scheduler is not None:
        registry.add(_scheduler(parts.lr_scheduler))
    registry.add(_scaler(parts))
    registry.add(_counters(parts.counters))
    counters = parts.counters
    registry.add(Component("accumulation", "transient", reset=counters.reset_accumulation,
                           snapshot=lambda: {"pending_micro_steps": counters.pending_micro_steps,
                                             "boundary": counters.boundary,
                                             "backward_unstepped": counters.backward_unstepped}))
    registry.add(_generators(parts.device))
    registry.add(Component("reporter.losses", "transient", reset=reporter.losses.clear,
                           tensors=lambda: list(reporter.losses)))
    if parts.host_step is not None:
        registry.add(Component("offload.staging", "derived", tensors=parts.host_step.staging_tensors))
        saves = getattr(parts.optimizer, "saves", [])  # the speculative step's (ShardAdam.keep_saves)
        registry.add(Component("offload.speculation_saves", "scratch", tensors=lambda: [t for g in saves for t in g]))
    registry.add(Component("comm.scratch", "scratch", tensors=parts.comm.scratch.tensors))  # reduce-scatters' receive
    nvme = parts.nvme
    if nvme is not None:
        registry.add(Component("nvme.tiles", "scratch",
                               tensors=lambda: [t for b in nvme._buffers or () for t in b.values()]))
    return registry


def _module(parts: EngineParts) -> Component:
    """What the runtime does not partition: the model's buffers, and frozen parameters that stay whole (stages
    0-2; at stage 3 frozen parameters rest in the runtime's shards)."""
    def own() -> dict[str, torch.Tensor]:
        partitioned = {id(t) for c in parts.runtime.state_components() if c.kind == "weights" for t in c.tensors()}
        with parts.runtime.unguarded():
            named = parts.module.state_dict(keep_vars=True)
        return {name: t for name, t in named.items() if id(t) not in partitioned}

    return Component("module", "weights", snapshot=lambda: host_copy(own()), tensors=lambda: list(own().values()))


def _optimizer(optimizer: torch.optim.Optimizer, store) -> Component:
    """Moments and step counts per shard piece, and the param groups' hyper-parameters (an LR scheduler moves lr).
    Fresh: the state a just-built optimizer has (none) and the hyper-parameters it was built with (after the
    scheduler's construction set the first lr). store: the engine's ShardStore (moments on NVMe are read from it)."""
    initial = hyper_parameters(optimizer)

    def reset() -> None:
        if isinstance(optimizer, PieceStates):
            optimizer.reset_state()
        else:
            optimizer.state.clear()
        restore_hyper_parameters(optimizer, initial)

    def snapshot() -> dict:
        pieces = []
        for gi, group in enumerate(optimizer.param_groups):
            for i, piece in enumerate(group["params"]):
                if isinstance(optimizer, PieceStates):
                    state = optimizer.piece_state(gi, i)
                    state = {k: (store.read(v, k) if isinstance(v, torch.Tensor) else v)
                             for k, v in state.items()}
                else:
                    state = dict(optimizer.state.get(piece, {}))
                    if "step" in state:  # torch counts in a float tensor, zkern in ints: compare the count
                        state["step"] = int(state["step"])
                pieces.append(state)
        return host_copy({"pieces": pieces, "hyper": hyper_parameters(optimizer)})

    def tensors() -> list[torch.Tensor]:
        if isinstance(optimizer, ShardAdam):
            return [*optimizer.exp_avg, *optimizer.exp_avg_sq, *(t for v in optimizer._views.values() for t in v)]
        return [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]

    return Component("optimizer", "optimizer", reset=reset, snapshot=snapshot, tensors=tensors)


def _scheduler(scheduler) -> Component:
    """The scheduler's state_dict; a saved one must have the live one's keys, each of the live value's kind, so that
    restoring it cannot fail half-way or plant a key the scheduler never had."""
    initial = copy.deepcopy(scheduler.state_dict())
    kind = type(scheduler).__name__

    def check(saved) -> None:
        _fields(saved, {"type": str, "state": dict})
        mine = scheduler.state_dict()
        if set(saved["state"]) != set(mine) or not all(same_kind(saved["state"][k], mine[k]) for k in mine):
            raise ValueError(f"the saved {saved['type']} state (keys {sorted(saved['state'])[:10]}) does not fit this "
                             f"engine's {kind} (keys {sorted(mine)[:10]}); pass load_lr_scheduler_states=False to "
                             f"keep the scheduler as it is")

    return Component("lr_scheduler", "lr_scheduler", reset=lambda: scheduler.load_state_dict(copy.deepcopy(initial)),
                     snapshot=lambda: host_copy(scheduler.state_dict()),
                     save=lambda: {"type": kind, "state": plain(scheduler.state_dict(), "the lr scheduler's state")},
                     check=check, restore=lambda saved: scheduler.load_state_dict(copy.deepcopy(saved["state"])))


def _scaler(parts: EngineParts) -> Component:
    """The loss scale a loss-scaling run reached (fp16, or torch_autocast in fp16). A checkpoint of a run that did
    not scale its loss, or an engine that does not, leaves the scaler at a fresh engine's value."""
    scaler = parts.scaler

    def reset() -> None:
        vars(scaler).update(vars(LossScaler.from_config(parts.config, autocast_dtype(parts.config, parts.device))))

    def check(saved) -> None:
        _fields(saved, {"loss_scaled": bool, "state": dict})
        _fields(saved["state"], {"scale": (int, float), "hysteresis_left": int, "iter": int,
                                 "last_overflow_iter": int})

    def restore(saved) -> None:
        reset()
        if saved["loss_scaled"] and scaler.loss_scaled:
            scaler.load_state_dict(saved["state"])

    return Component("loss_scaler", "training", reset=reset, snapshot=scaler.state_dict,
                     save=lambda: {"loss_scaled": scaler.loss_scaled, "state": scaler.state_dict()},
                     check=check, restore=restore)


def _counters(counters: Counters) -> Component:
    def read() -> dict:
        return {"global_steps": counters.global_steps, "skipped_steps": counters.skipped_steps,
                "micro_steps": counters.micro_steps, "last_grad_norm": counters.last_grad_norm}

    def save() -> dict:
        norm = counters.last_grad_norm  # inf after an overflow: JSON holds it as text
        # the state at the last optimizer step: micro-steps accumulated since are not part of a checkpoint
        return {**read(), "micro_steps": counters.micro_steps - counters.pending_micro_steps,
                "last_grad_norm": norm if norm is None or math.isfinite(norm) else str(norm)}

    def check(saved) -> None:
        _fields(saved, {"global_steps": int, "skipped_steps": int, "micro_steps": int,
                        "last_grad_norm": (int, float, str, type(None))})
        if isinstance(saved["last_grad_norm"], str) and saved["last_grad_norm"] not in NON_FINITE:
            raise ValueError(f"'last_grad_norm' is {saved['last_grad_norm'][:20]!r}: a number, null or one of "
                             f"{sorted(NON_FINITE)}")

    def restore(saved) -> None:
        counters.global_steps, counters.skipped_steps = saved["global_steps"], saved["skipped_steps"]
        counters.micro_steps = saved["micro_steps"]
        norm = saved["last_grad_norm"]
        counters.last_grad_norm = None if norm is None else float(norm)

    return Component("counters", "training", reset=counters.reset_training, snapshot=read, save=save, check=check,
                     restore=restore)


NON_FINITE = {"inf", "-inf", "nan"}  # str(float) of what a grad norm can be besides a number


def _generators(device: torch.device) -> Component:
    """This rank's generators (Python, NumPy, torch CPU and CUDA), saved per rank in core/generators.py's form. A
    fresh engine's generators are the process's own, so a reset leaves them alone: only a load that restores them
    moves them."""
    def snapshot() -> dict:
        out = {"cpu": torch.get_rng_state()}
        if device.type == "cuda":
            out["cuda"] = torch.cuda.get_rng_state(device)
        return out

    def check(saved) -> None:
        check_rng_state(saved, "the saved generator state")

    return Component("generators", "training", reset=lambda: None, snapshot=snapshot, save=rng_state, check=check,
                     restore=set_rng_state, per_rank=True)


def dataloader_component(sampler) -> Component:
    """The epoch of the DistributedSampler zkern.initialize made (saved with the checkpoint's counters)."""
    def reset() -> None:
        sampler.set_epoch(0)

    def read() -> dict:
        return {"epoch": sampler.epoch}

    return Component("dataloader", "training", reset=reset, snapshot=read, save=read,
                     check=lambda saved: _fields(saved, {"epoch": int}),
                     restore=lambda saved: sampler.set_epoch(saved["epoch"]))


def _fields(saved, kinds: dict) -> None:
    """saved is an object with these keys, each of its kind (a bool is no number)."""
    if not isinstance(saved, dict):
        raise TypeError(f"a {type(saved).__name__}, not an object")
    for key, kind in kinds.items():
        value = saved.get(key, _MISSING)
        if value is _MISSING or not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ValueError(f"{key!r} is {'missing' if value is _MISSING else repr(value)[:40]}, not "
                             f"{getattr(kind, '__name__', ' or '.join(k.__name__ for k in kind))}")


_MISSING = object()
