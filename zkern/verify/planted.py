"""The planted bugs themselves: each mutant breaks one thing zkern must get right, the way a real bug would (an
optimizer that never updates, a reduction that forgets a rank, a checkpoint that drops the moments). mutants.py
plants each in turn and runs draws until one fails; this file is only the catalogue and the planting (offload's
mutants are in planted_offload.py, stage 3's in planted_stage3.py), so the runner (which plants the one ZKERN_MUTANT
names) does not depend on the driver.

    python -c "from zkern.verify.planted import MUTANTS; print(len(MUTANTS))"

A mutant is planted in a rank by the environment variable ZKERN_MUTANT (runner.run_phases reads it; the
single-process reference never does): a name from MUTANTS, nothing else is ever executed from it. Planting
patches module attributes and returns what undoes it, so a rank that runs in the calling process (world 1) leaves
the process as it found it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable

import torch

from zkern.verify.planted_offload import (
    delay_lands_at_once,
    device_part_unstepped,
    export_one_behind,
    nvme_last_tile_skipped,
    nvme_muon_momentum_unwritten,
    offload_not_uploaded,
    ring_reused_early,
    save_lands_update,
    speculation_guess_in_place,
    speculation_kept_when_clipped,
    staging_takes_working_copies,
    upload_unwaited,
    write_compared_with_stale,
)
from zkern.verify.planted_stage3 import (
    first_unit_grads_dropped,
    gather_source_cached,
    shard_offset,
    stale_after_step,
    views_freed,
)

ENV = "ZKERN_MUTANT"


class _Patches:
    def __init__(self):
        self.undo: list[Callable[[], None]] = []

    def set(self, owner, name: str, value) -> None:
        old = getattr(owner, name)
        setattr(owner, name, value)
        self.undo.append(lambda: setattr(owner, name, old))

    def wrap(self, owner, name: str, make: Callable) -> None:
        """owner.name <- make(the original)."""
        self.set(owner, name, make(getattr(owner, name)))


# -- the optimizer ---------------------------------------------------------------------------------------------------
def _adam(p: _Patches, change: Callable[[dict], dict | None]) -> None:
    from zkern import ops

    def make(original):
        def adam_step_(param, grad, exp_avg, exp_avg_sq, **kw):
            kw = change(dict(kw))
            if kw is not None:
                return original(param, grad, exp_avg, exp_avg_sq, **kw)
        return adam_step_
    p.wrap(ops, "adam_step_", make)


def _scaled_lr(factor: float):
    def change(kw):
        kw["lr"] = kw["lr"] * factor
        return kw
    return change


def _set_kw(**values):
    def change(kw):
        kw.update(values)
        return kw
    return change


# -- the step ------------------------------------------------------------------------------------------------------
def _clip_ignored(p: _Patches) -> None:
    """The step computes no clipping coefficient (the config's gradient_clipping read as 0)."""
    from zkern.engine import stepping

    def make(original):
        def optimizer_step(engine):
            clip = engine.config.gradient_clipping
            object.__setattr__(engine.config, "gradient_clipping", 0.0)
            try:
                return original(engine)
            finally:
                object.__setattr__(engine.config, "gradient_clipping", clip)
        return optimizer_step
    p.wrap(stepping, "optimizer_step", make)


def _control_not_reduced(p: _Patches) -> None:
    """The step's control vector (overflow, squared norm, who got gradients) stays this rank's own."""
    from zkern.comm.collectives import Comm

    def make(original):
        def all_reduce(self, t, purpose, **kw):
            if kw.get("kind") == "control" and purpose.startswith("step control"):
                return self._local(t, t)
            return original(self, t, purpose, **kw)
        return all_reduce
    p.wrap(Comm, "all_reduce", make)


def _overflow_applied(p: _Patches) -> None:
    """A step whose gradients overflowed is applied anyway (the found-inf flag read as 0)."""
    from zkern import ops

    def make(original):
        def unscale_and_check_(segment, inv_scale):
            found, sq = original(segment, inv_scale)
            return torch.zeros_like(found), torch.nan_to_num(sq, nan=0.0, posinf=0.0)
        return unscale_and_check_
    p.wrap(ops, "unscale_and_check_", make)


def _scale_frozen(p: _Patches) -> None:
    from zkern.engine.precision import LossScaler

    p.set(LossScaler, "update", lambda self, overflow: None)


def _scheduler_frozen(p: _Patches) -> None:
    from zkern.optim import lr_schedules

    p.set(lr_schedules._Schedule, "step", lambda self, *a, **k: None)


# -- reductions ----------------------------------------------------------------------------------------------------
def _bucket_not_reduced(p: _Patches) -> None:
    """Every third bucket's reduction is skipped: the rank keeps its own gradient as if it were the sum."""
    from zkern.comm.reducer import BucketReducer

    count = [0]

    def make(original):
        def launch(self, data, purpose, **kw):
            count[0] += 1
            if count[0] % 3 == 1 and self.comm.world > 1:  # the collective still runs (no rank waits), on a copy
                return original(self, data.clone(), purpose, **{**kw, "out": None, "key": None})
            return original(self, data, purpose, **kw)
        return launch
    p.wrap(BucketReducer, "launch", make)


def _rank0_twice(p: _Patches) -> None:
    """Rank 0's gradients enter every reduction twice."""
    from zkern.comm.reducer import BucketReducer

    def make(original):
        def launch(self, data, purpose, **kw):
            if self.comm.rank == 0 and self.comm.world > 1:
                data.mul_(2)
            return original(self, data, purpose, **kw)
        return launch
    p.wrap(BucketReducer, "launch", make)


def _no_predivide(p: _Patches) -> None:
    """Gradients are summed over ranks and never divided by the world size."""
    from zkern.engine import stepping

    def make(original):
        def optimizer_step(engine):
            factor = engine.config.gradient_predivide_factor
            object.__setattr__(engine.config, "gradient_predivide_factor", factor * engine.world_size)
            try:
                return original(engine)
            finally:
                object.__setattr__(engine.config, "gradient_predivide_factor", factor)
        return optimizer_step
    p.wrap(stepping, "optimizer_step", make)


def _params_not_gathered(p: _Patches) -> None:
    """Stages 1-2: after the step, other ranks' updated chunks are never gathered."""
    from zkern.stage12.flat_group import FlatGroup

    p.set(FlatGroup, "gather_bucket", lambda self, index: None)


# -- checkpoints ---------------------------------------------------------------------------------------------------
def _moments_not_restored(p: _Patches) -> None:
    from zkern.checkpoint import load

    p.set(load, "_set_optimizer_state", lambda *a, **k: None)


def _step_count_plus_one(p: _Patches) -> None:
    from zkern.checkpoint import load

    def make(original):
        def set_state(opt, gi, k, piece, state):
            if isinstance(state, dict) and "step" in state:
                state = {**state, "step": state["step"] + 1}
            return original(opt, gi, k, piece, state)
        return set_state
    p.wrap(load, "_set_optimizer_state", make)


def _scheduler_not_restored(p: _Patches) -> None:
    from zkern.optim import lr_schedules

    p.set(lr_schedules._Schedule, "load_state_dict", lambda self, state: None)


def _load_flags_ignored(p: _Patches) -> None:
    """load_checkpoint restores the optimizer and the scheduler whatever its flags say."""
    from zkern.checkpoint import load

    def make(original):
        def load_all(*args, **kw):
            kw.update(load_optimizer_states=True, load_lr_scheduler_states=True, load_module_only=False)
            return original(*args, **kw)
        return load_all
    p.wrap(load, "load", make)


# -- the other optimizers (torch's and zkern's Lamb and Lion over the shard pieces) ---------------------------------
def _torch_grad_scale_dropped(p: _Patches) -> None:
    """A torch optimizer (or Muon) stepping the shard pieces gets the gradients without the unscale/clip/average
    factor."""
    from zkern.engine import stepping
    from zkern.offload import host

    for module in (stepping, host):
        def make(original):
            def step(optimizer, groups, *, grad_scale, **kw):
                return original(optimizer, groups, grad_scale=1.0, **kw)
            return step
        p.wrap(module, "step_torch_optimizer", make)


def _lamb_norms_local(p: _Patches) -> None:
    """Lamb's per-parameter norms are each rank's own pieces' (never summed over the ranks)."""
    from zkern.optim.lamb_lion import Lamb

    def make(original):
        def set_layout(self, owner, count, reduce):
            return original(self, owner, count, None)
        return set_layout
    p.wrap(Lamb, "set_layout", make)


def _muon_spans_not_assembled(p: _Patches) -> None:
    """Muon's spanning matrices never leave their ranks: what the all-to-alls would bring from the other ranks arrives
    as zeros (each owner orthogonalizes its own part of a matrix alone; the other holders get no update back)."""
    from zkern.optim.muon import ShardMuon

    def make(original):
        def set_layout(self, pieces, shapes, muon, ranks):
            original(self, pieces, shapes, muon, ranks)
            if ranks is None:
                return

            def own_chunk_only(out, inp, out_splits, inp_splits):
                out.zero_()
                at_out, at_inp = sum(out_splits[:ranks.rank]), sum(inp_splits[:ranks.rank])
                out[at_out:at_out + out_splits[ranks.rank]].copy_(inp[at_inp:at_inp + inp_splits[ranks.rank]])
            self.ranks = dataclasses.replace(ranks, exchange=own_chunk_only)
        return set_layout
    p.wrap(ShardMuon, "set_layout", make)


def _muon_aspect_scale_dropped(p: _Patches) -> None:
    """Muon's step without its sqrt(max(1, rows / cols)) factor."""
    from zkern.optim.muon import ShardMuon

    p.set(ShardMuon, "lr_factor", staticmethod(lambda shape: 1.0))


# -- ZeRO++ ----------------------------------------------------------------------------------------------------------
def _loco_no_feedback(p: _Patches) -> None:
    """LoCo keeps its errors but never adds them back."""
    from zkern.comm.zeropp import QuantizedReduce

    def make(original):
        def quantize(self, h, err):
            if err is None:
                return original(self, h, err)
            kept = err.clone()
            codes, scales = original(self, h, torch.zeros_like(err))
            err.copy_(kept)
            return codes, scales
        return quantize
    p.wrap(QuantizedReduce, "_quantize", make)


def _qgz_one_hop_dropped(p: _Patches) -> None:
    """qgZ's node-local hop adds only this rank's own section (the others' are dropped)."""
    from zkern import ops

    def make(original):
        def dequant_sum(q, s, bits, group, n):
            return original(q[:1], s[:1], bits, group, n)
        return dequant_sum
    p.wrap(ops, "dequant_sum", make)


def _qwz_scales_dropped(p: _Patches) -> None:
    """qwZ dequantizes every group with scale 1."""
    from zkern import ops

    def make(original):
        def dequantize(q, scales, bits, group, n, dtype=torch.float32):
            return original(q, torch.ones_like(scales), bits, group, n, dtype)
        return dequantize
    p.wrap(ops, "dequantize", make)


def _hpz_always_fresh(p: _Patches) -> None:
    """hpZ's secondary copy is taken as current after every step (never refreshed)."""
    from zkern.comm.zeropp import Secondary

    def make(original):
        def fresh(self, ui, version):
            return ui in self.versions
        return fresh
    p.wrap(Secondary, "fresh", make)


# -- zkern.hf.Accelerator ------------------------------------------------------------------------------------------
def _accelerate_boundary_ignored(p: _Patches) -> None:
    """accelerator.backward takes every micro-step as the end of an accumulation (steps each one)."""
    from zkern.hf.accelerate_glue import EngineWrapper

    def make(original):
        def backward(self, loss, sync_gradients: bool = True, **kwargs):
            return original(self, loss, True, **kwargs)
        return backward
    p.wrap(EngineWrapper, "backward", make)


def _accelerate_load_kwargs_dropped(p: _Patches) -> None:
    """accelerator.load_state loads the engine checkpoint without the caller's flags (load_optimizer_states=...)."""
    from zkern.hf import accelerate_state

    def make(original):
        def load(acc, input_dir, kwargs):
            return original(acc, input_dir, {})
        return load
    p.wrap(accelerate_state, "load", make)


def _trainer_accumulation_unscaled(p: _Patches) -> None:
    """zkern.hf.Trainer hands the Trainer's loss (already divided by the accumulation) to engine.backward, which
    divides it again."""
    from zkern.hf.trainer import Trainer

    def make(original):
        def backward(self, loss, **kwargs):
            return original(self, loss / self.engine.gradient_accumulation_steps, **kwargs)
        return backward
    p.wrap(Trainer, "_engine_backward", make)


def _hooks_hold_runtime(p: _Patches) -> None:
    """The gradient hooks a runtime leaves on the parameters hold it strongly (a dropped engine is never freed)."""
    from zkern.stage3 import runtime as stage3
    from zkern.stage12 import runtime as stage12

    def strong(method, *args):
        return lambda param: method(*args, param)
    p.set(stage12, "weak_grad_hook", strong)
    p.set(stage3, "weak_grad_hook", strong)


MUTANTS: dict[str, tuple[str, Callable[[_Patches], None]]] = {
    "adam.no_update": ("the optimizer never updates", lambda p: _adam(p, lambda kw: None)),
    "adam.lr_x1.5": ("the learning rate 1.5 times the scheduler's", lambda p: _adam(p, _scaled_lr(1.5))),
    "adam.uphill": ("the update goes up the gradient", lambda p: _adam(p, _scaled_lr(-1.0))),
    "adam.step_stuck": ("the step count stays 1 (bias correction of the first step forever)",
                        lambda p: _adam(p, _set_kw(step=1))),
    "adam.no_bias_correction": ("no bias correction", lambda p: _adam(p, _set_kw(step=10**6))),
    "adam.no_weight_decay": ("weight decay dropped", lambda p: _adam(p, _set_kw(weight_decay=0.0))),
    "adam.grad_scale_dropped": ("the unscale/clip/average factor is not applied",
                                lambda p: _adam(p, _set_kw(grad_scale=1.0))),
    "adam.betas_swapped": ("beta1 and beta2 swapped", lambda p: _adam(
        p, lambda kw: {**kw, "betas": (kw["betas"][1], kw["betas"][0])})),
    "step.clip_ignored": ("gradient clipping never applied", _clip_ignored),
    "step.control_not_reduced": ("the step's overflow flag and norm are each rank's own", _control_not_reduced),
    "step.overflow_applied": ("a step whose gradients overflowed is applied", _overflow_applied),
    "scaler.frozen": ("the fp16 loss scale never moves", _scale_frozen),
    "scheduler.frozen": ("the LR schedule never advances", _scheduler_frozen),
    "reduce.bucket_skipped": ("every third bucket is not reduced across ranks", _bucket_not_reduced),
    "reduce.rank0_twice": ("rank 0's gradient counted twice", _rank0_twice),
    "reduce.no_predivide": ("the sum over ranks never divided by the world size", _no_predivide),
    "stage12.params_not_gathered": ("stages 1-2 never gather the updated chunks", _params_not_gathered),
    "stage3.shard_offset": ("stage 3 gathers from one element off", shard_offset),
    "stage3.unit_grads_dropped": ("stage 3 drops the first unit's gradients", first_unit_grads_dropped),
    "stage3.stale_after_step": ("stage 3's persistent units stale after the step", stale_after_step),
    "ckpt.moments_not_restored": ("a load keeps the optimizer's moments as they were", _moments_not_restored),
    "ckpt.step_count_plus_one": ("a load sets each piece's step count one too high", _step_count_plus_one),
    "ckpt.scheduler_not_restored": ("a load leaves the LR schedule where it was", _scheduler_not_restored),
    "ckpt.load_flags_ignored": ("a load restores the optimizer and scheduler whatever its flags", _load_flags_ignored),
    "torch_optimizer.grad_scale_dropped": ("a torch optimizer's gradients miss the unscale/clip/average factor",
                                           _torch_grad_scale_dropped),
    "lamb.norms_local": ("Lamb's trust ratio from each rank's own pieces", _lamb_norms_local),
    "muon.spans_not_assembled": ("Muon's spanning matrices never reach their owners (each orthogonalizes its "
                                 "part alone)", _muon_spans_not_assembled),
    "muon.aspect_scale_dropped": ("Muon's step without sqrt(rows / cols)", _muon_aspect_scale_dropped),
    "loco.no_feedback": ("LoCo never adds its error back", _loco_no_feedback),
    "qgz.hop_drops_ranks": ("qgZ's hop sums only the rank's own section", _qgz_one_hop_dropped),
    "qwz.scales_dropped": ("qwZ dequantizes with scale 1", _qwz_scales_dropped),
    "hpz.always_fresh": ("hpZ's secondary copy never refreshed after a step", _hpz_always_fresh),
    "offload.not_uploaded": ("ZeRO-Offload never copies the updated parameters back", offload_not_uploaded),
    "offload.ring_reused_early": ("offload's staging ring takes the next chunk's gradient before the last chunk's "
                                  "parameters went up", ring_reused_early),
    "offload.upload_unwaited": ("stage 3 uses a prefetched unit before its host chunk's upload arrived",
                                upload_unwaited),
    "offload.speculation_kept_when_clipped": ("the speculative offloaded step keeps its unclipped guess where "
                                              "clipping bit", speculation_kept_when_clipped),
    "offload.speculation_in_place": ("the speculative step writes its guessed parameters where the model reads "
                                     "them, not to staging", speculation_guess_in_place),
    "nvme.last_tile_skipped": ("the NVMe optimizer skips the last piece of each tile", nvme_last_tile_skipped),
    "offload.delay_lands_at_once": ("the delayed update's weights go up before the next forward", delay_lands_at_once),
    "offload.staging_overwritten": ("a weight set between backward and step() overwrites the host's gradient copies",
                                    staging_takes_working_copies),
    "stage3.views_freed": ("stage 3 frees a unit under the views of it a module handed out", views_freed),
    "nvme.muon_momentum_unwritten": ("Muon on NVMe never writes the stepped momentum back to its file",
                                     nvme_muon_momentum_unwritten),
    "stage3.gather_source_cached": ("stage 3's gathers send each chunk as first cast from the master, never the "
                                    "stepped values", gather_source_cached),
    "engine.hooks_hold_runtime": ("a dropped engine's runtime is kept alive by its gradient hooks",
                                  _hooks_hold_runtime),
    "offload.export_one_behind": ("the exports miss the delayed update in flight", export_one_behind),
    "offload.save_lands_update": ("a save lands the delayed update early, changing the run", save_lands_update),
    "offload.write_compared_with_stale": ("a write under the delayed update is compared with the weights before it",
                                          write_compared_with_stale),
    "offload.device_part_unstepped": ("partial offload's device part never steps", device_part_unstepped),
    "accelerate.boundary_ignored": ("zkern.hf.Accelerator's backward steps at every micro-step",
                                    _accelerate_boundary_ignored),
    "accelerate.load_flags_dropped": ("zkern.hf.Accelerator's load_state drops its load flags",
                                      _accelerate_load_kwargs_dropped),
    "trainer.accumulation_divided_twice": ("zkern.hf.Trainer divides the loss by the accumulation twice",
                                           _trainer_accumulation_unscaled),
}


@contextlib.contextmanager
def planted(name: str | None = None):
    """Inside: the mutant named (or the one ZKERN_MUTANT names; none when unset) is planted in this process."""
    name = name if name is not None else os.environ.get(ENV) or None
    if name is None:
        yield
        return
    if name not in MUTANTS:
        raise ValueError(f"{ENV}={name!r} names no mutant; the mutants are {', '.join(MUTANTS)}")
    patches = _Patches()
    MUTANTS[name][1](patches)
    try:
        yield
    finally:
        for undo in reversed(patches.undo):
            undo()
