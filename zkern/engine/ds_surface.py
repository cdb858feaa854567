"""The accessors of DeepSpeed's engine that the frameworks built on it call (HF Trainer, Accelerate, TRL,
OpenRLHF, LLaMA-Factory, Lightning): batch sizes, learning rates, the last norm, which precision and offload, the
16-bit consolidation Accelerate saves with, no_sync, the partition cache and the offload of states between
rollouts. Each answers what zkern does, under DeepSpeed's name and calling convention (methods where DeepSpeed has
methods); docs/frameworks.md lists them with what is not provided.

    python -m pytest tests/engine/test_engine_frameworks.py -q -k surface
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from zkern.engine import weights
from zkern.engine.counters import Count

log = logging.getLogger("zkern")


class DeepSpeedSurface:
    """Mixed into zkern.Engine: DeepSpeed's engine methods frameworks call, answered from the engine's config and
    counters, and the module's attributes for what the engine lacks. Only no_sync, empty_partition_cache and
    offload_states/reload_states act, and none changes what training computes."""

    def __getattr__(self, name: str):
        """What the engine lacks, the wrapped module's (engine.generate, a model method), as DeepSpeed forwards it."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None:
                raise
            return getattr(module, name)

    # -- batch and step counters (engine.counters: counters.py) -------------------------------------------------
    @property
    def gradient_accumulation_steps(self) -> Count:
        """Micro-steps per optimizer step: an int, and a method as DeepSpeed's (`gradient_accumulation_steps()`)."""
        return self.counters.accumulation_steps

    @property
    def global_steps(self) -> int:
        """Optimizer steps taken (skipped ones included, as DeepSpeed counts them)."""
        return self.counters.global_steps

    @property
    def skipped_steps(self) -> int:
        return self.counters.skipped_steps

    @property
    def micro_steps(self) -> int:
        """step() calls, boundary or not."""
        return self.counters.micro_steps

    @property
    def pending_micro_steps(self) -> int:
        """Micro-steps accumulated since the last optimizer step."""
        return self.counters.pending_micro_steps

    @property
    def backward_unstepped(self) -> bool:
        """A backward ran whose step() has not (its gradients are held)."""
        return self.counters.backward_unstepped

    @property
    def last_grad_norm(self) -> float | None:
        return self.counters.last_grad_norm

    def zero_optimization_stage(self) -> int:
        """DeepSpeed's accessor: the ZeRO stage this engine runs."""
        return self.config.zero_optimization.stage

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def get_gradient_accumulation_steps(self) -> int:
        return int(self.gradient_accumulation_steps)

    def set_train_batch_size(self, train_batch_size: int) -> None:
        """DeepSpeed's: a new global batch by a new number of micro-steps per optimizer step, the micro-batch
        unchanged (train_batch_size = micro-batch x accumulation steps x world size). Between optimizer steps only:
        the gradients of an accumulation under way were scaled for its old length."""
        micro = self.config.train_micro_batch_size_per_gpu
        self._resize_batch("set_train_batch_size", train_batch_size, micro * self.world_size,
                           f"train_micro_batch_size_per_gpu ({micro}) x world size ({self.world_size})")
        self._set_batch(micro, train_batch_size // (micro * self.world_size))

    def set_train_micro_batch_size(self, micro_batch_size: int) -> None:
        """DeepSpeed's: a new micro-batch per rank, the accumulation steps unchanged (the global batch follows). The
        engine does not split batches itself: the loop feeds micro-batches of the new size (a loader built by
        zkern.initialize keeps its own). Between optimizer steps only."""
        self._resize_batch("set_train_micro_batch_size", micro_batch_size, 1, "1")
        self._set_batch(micro_batch_size, int(self.gradient_accumulation_steps))

    def _resize_batch(self, what: str, value, multiple: int, of: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % multiple:
            raise ValueError(f"{what}({value!r}): give a positive int, a multiple of {of}")
        if self.pending_micro_steps or self.backward_unstepped:
            raise RuntimeError(f"{what}() with gradients accumulated (micro-step {self.pending_micro_steps + 1} of "
                               f"{int(self.gradient_accumulation_steps)} has run its backward): they were scaled for "
                               f"this accumulation's length; call it after the boundary's step()")

    def _set_batch(self, micro: int, accumulation: int) -> None:
        import dataclasses

        self.parts.config = dataclasses.replace(self.config, train_micro_batch_size_per_gpu=micro,
                                                gradient_accumulation_steps=accumulation,
                                                train_batch_size=micro * accumulation * self.world_size)
        self.counters.accumulation_steps = Count(accumulation)
        if self.rank == 0:
            log.info("zkern: train_batch_size %d = micro-batch %d x %d accumulation steps x %d ranks",
                     self.config.train_batch_size, micro, accumulation, self.world_size)

    @property
    def global_samples(self) -> int:
        """Samples trained: train_batch_size per optimizer step taken (skipped steps included, as DeepSpeed), every
        step counted at the current size (after set_train_batch_size, the earlier steps too)."""
        return self.global_steps * self.config.train_batch_size

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the parameters (False between boundaries and after a skipped step)."""
        return self.counters.step_applied

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last boundary step, before clipping (inf after an overflow; None before any)."""
        return self.last_grad_norm

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    # -- the optimizer's hyper-parameters ------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self._groups("get_lr")]

    def get_mom(self) -> list:
        """Per group: Adam's betas, or the momentum of optimizers that have one (DeepSpeed's get_mom)."""
        return [g["betas"] if "betas" in g else g.get("momentum") for g in self._groups("get_mom")]

    def _groups(self, what: str) -> list[dict]:
        if self.optimizer is None:
            raise RuntimeError(f"engine.{what}(): this engine has no optimizer (built without one, it runs forward "
                               f"only)")
        return self.optimizer.param_groups

    # -- what the config chose -------------------------------------------------------------------------------------
    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bf16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the working dtype, the dtype gradients accumulate in), as DeepSpeed returns them."""
        return self.spec.dtype, self.spec.accum_dtype

    def zero_optimization_partition_gradients(self) -> bool:
        return self.config.zero_optimization.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.config.zero_optimization.stage == 3

    def zero_offload_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer_device != "none"

    def zero_offload_param(self) -> bool:
        return self.config.zero_optimization.offload_param_device != "none"

    def zero_cpu_offload(self) -> bool:
        return self.config.zero_optimization.offload_optimizer_device == "cpu"

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        return self.config.zero_optimization.stage3_gather_16bit_weights_on_model_save

    @property
    def local_rank(self) -> int:
        """The rank within its node: the CUDA device index the engine trains on, else torchrun's LOCAL_RANK."""
        if self.device.type == "cuda" and self.device.index is not None:
            return self.device.index
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    @property
    def mp_world_size(self) -> int:
        return 1  # zkern has no tensor or pipeline parallelism: every rank is a data-parallel rank

    # -- calls with effects ----------------------------------------------------------------------------------------
    def no_sync(self):
        """A context for micro-steps that should not synchronise gradients (DDP's and DeepSpeed's name; Accelerate
        calls it on every micro-step before the boundary). Stages 0-1 reduce at the accumulation boundary only, so
        such micro-steps already do not: it changes nothing. Stages 2-3 reduce each micro-step's gradients into their
        partitions as backward produces them (what partitioning gradients means); DeepSpeed refuses no_sync there,
        which breaks Accelerate loops that call it, so zkern goes on, reducing as before, and says so once: the
        accumulated gradients, and so training, are the same; only the communication is not saved."""
        stage = self.config.zero_optimization.stage
        if stage >= 2 and not getattr(self, "_said_no_sync", False):
            self._said_no_sync = True
            if self.rank == 0:
                log.info("zkern: engine.no_sync() at ZeRO stage %d still reduces each micro-step's gradients into "
                         "their partitions during backward (the accumulated result is the same; said once)", stage)
        return contextlib.nullcontext()

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False):
        """DeepSpeed's 16-bit consolidation at stage 3, as Accelerate's get_state_dict calls it: the working-dtype
        weights under the model's names on rank 0 (None on the others), one unit at a time (a collective)."""
        if self.config.zero_optimization.stage != 3:
            raise ValueError("_zero3_consolidated_16bit_state_dict is ZeRO stage 3's; below it call "
                             "engine.full_working_state_dict()")
        values = weights.full_working_state_dict(self.parts, rank0_only=True)
        if values is not None and exclude_frozen_parameters:
            frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
            values = {k: v for k, v in values.items() if k not in frozen}
        return values

    def empty_partition_cache(self) -> None:
        """Give back the memory zkern keeps between steps for reuse: the receive buffers of host reduce-scatters.
        Gathered stage-3 units are already released at the end of every pass (persistent ones stay whole, as in
        DeepSpeed); the next step allocates what it needs again."""
        self.comm.scratch.release()

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False):
        """Move the training state on the device to host memory, freeing the device for something else (an RL
        rollout) until reload_states(); the engine refuses to train or save meanwhile. include: DeepSpeed's
        OffloadStateTypeEnum members or their names ("optim_states", "hp_params", "lp_params", "lp_grads",
        "contiguous_grad_buffer"); None moves all."""
        if self.host_step is not None:
            self.host_step.settle()  # a delayed update's Adam must not write what moves
        self.residency.offload(self.state, include, device, pin_memory, non_blocking)

    def reload_states(self, non_blocking: bool = False) -> None:
        """Bring back what offload_states moved; training continues bit for bit."""
        self.residency.reload(non_blocking)
