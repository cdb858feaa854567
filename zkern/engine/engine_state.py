"""The engine's own state components (optimizer, LR scheduler, loss scaler, counters, generators, offload
staging), registered beside the stage runtime's in one StateRegistry (state.py).

    python -m pytest tests/test_state.py -q
"""

from __future__ import annotations

import copy

import torch

from zkern.core.state import Component, StateRegistry, host_copy, hyper_parameters, restore_hyper_parameters
from zkern.engine.precision import LossScaler
from zkern.optim.shard_adam import ShardAdam


def build_registry(engine) -> StateRegistry:
    """Every stateful piece of a built engine, runtime first (its gradients reset before the engine's counts)."""
    registry = StateRegistry()
    for component in engine.runtime.state_components():
        registry.add(component)
    registry.add(_module(engine))
    if engine.optimizer is not None:  # an engine without one runs forward only
        registry.add(_optimizer(engine.optimizer, engine.store))
    if engine.lr_scheduler is not None:
        registry.add(_scheduler(engine.lr_scheduler))
    registry.add(_scaler(engine))
    registry.add(_counters(engine))
    registry.add(Component("accumulation", "transient", reset=engine._reset_accumulation,
                           snapshot=lambda: {"pending_micro_steps": engine.pending_micro_steps,
                                             "boundary": engine._boundary,
                                             "backward_unstepped": engine.backward_unstepped}))
    registry.add(_generators(engine))
    registry.add(Component("reporter.losses", "transient", reset=lambda: engine.reporter.losses.clear(),
                           tensors=lambda: list(engine.reporter.losses)))
    if engine.host_step is not None:
        registry.add(Component("offload.staging", "derived", tensors=engine.host_step.staging_tensors))
    registry.add(Component("comm.scratch", "scratch", tensors=engine.comm.scratch.tensors))  # reduce-scatters' receive
    if engine.nvme is not None:
        registry.add(Component("nvme.tiles", "scratch",
                               tensors=lambda: [t for b in engine.nvme._buffers or () for t in b.values()]))
    return registry


def _module(engine) -> Component:
    """What the runtime does not partition: the model's buffers, and frozen parameters that stay whole (stages
    0-2; at stage 3 frozen parameters rest in the runtime's shards)."""
    def own() -> dict[str, torch.Tensor]:
        partitioned = {id(t) for c in engine.runtime.state_components() if c.kind == "weights" for t in c.tensors()}
        with engine.runtime.unguarded():
            named = engine.module.state_dict(keep_vars=True)
        return {name: t for name, t in named.items() if id(t) not in partitioned}

    return Component("module", "weights", snapshot=lambda: host_copy(own()), tensors=lambda: list(own().values()))


def _optimizer(optimizer: torch.optim.Optimizer, store) -> Component:
    """Moments and step counts per shard piece, and the param groups' hyper-parameters (an LR scheduler moves lr).
    Fresh: the state a just-built optimizer has (none) and the hyper-parameters it was built with (after the
    scheduler's construction set the first lr). store: the engine's ShardStore (moments on NVMe are read from it)."""
    initial = hyper_parameters(optimizer)

    def reset() -> None:
        if isinstance(optimizer, ShardAdam):
            optimizer.reset_state()
        else:
            optimizer.state.clear()
        restore_hyper_parameters(optimizer, initial)

    def snapshot() -> dict:
        pieces = []
        for gi, group in enumerate(optimizer.param_groups):
            for i, piece in enumerate(group["params"]):
                if isinstance(optimizer, ShardAdam):
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
    initial = copy.deepcopy(scheduler.state_dict())
    return Component("lr_scheduler", "lr_scheduler", reset=lambda: scheduler.load_state_dict(copy.deepcopy(initial)),
                     snapshot=lambda: host_copy(scheduler.state_dict()))


def _scaler(engine) -> Component:
    def reset() -> None:
        vars(engine.scaler).update(vars(LossScaler.from_config(engine.config, engine.autocast_dtype)))

    return Component("loss_scaler", "training", reset=reset, snapshot=lambda: engine.scaler.state_dict())


def _counters(engine) -> Component:
    def reset() -> None:
        engine.global_steps = engine.skipped_steps = engine.micro_steps = 0
        engine.last_grad_norm = None

    return Component("counters", "training", reset=reset,
                     snapshot=lambda: {"global_steps": engine.global_steps, "skipped_steps": engine.skipped_steps,
                                       "micro_steps": engine.micro_steps, "last_grad_norm": engine.last_grad_norm})


def _generators(engine) -> Component:
    """This rank's torch generators (saved per rank). A fresh engine's generators are the process's own, so a
    reset leaves them alone: only a load that restores them moves them."""
    def snapshot() -> dict:
        out = {"cpu": torch.get_rng_state()}
        if engine.device.type == "cuda":
            out["cuda"] = torch.cuda.get_rng_state(engine.device)
        return out

    return Component("generators", "training", reset=lambda: None, snapshot=snapshot)


def dataloader_component(sampler) -> Component:
    """The epoch of the DistributedSampler zkern.initialize made (saved with the checkpoint's counters)."""
    def reset() -> None:
        sampler.set_epoch(0)

    return Component("dataloader", "training", reset=reset, snapshot=lambda: {"epoch": sampler.epoch},
                     restore=lambda saved: sampler.set_epoch(saved["epoch"]))
