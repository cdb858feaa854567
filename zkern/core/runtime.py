"""What the engine asks of a stage runtime (stage12/runtime.py for stages 0-2, stage3/runtime.py for 3):
the engine calls these and reaches into neither runtime's fields.

    python -c "from zkern.core.runtime import Runtime; help(Runtime)"
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from zkern.core.shard_groups import ShardGroup


@dataclass
class ShardMap:
    """Where this rank's optimizer shard lies in the model's own tensors: what checkpoints save and load by."""

    pieces: list[list[tuple[int, int, bool]]]  # per shard group, per piece: (trainable index, first element of
    # that parameter (flattened) the piece holds, whether this rank writes it in a checkpoint: stage 0 holds every
    # piece on every rank, and each piece is written by one)
    shapes: list[torch.Size]  # per trainable parameter: its full shape (stage 3 parameters at rest are empty)
    resting: list[tuple[torch.nn.Parameter, torch.Size, int, torch.Tensor]]  # stage 3: frozen parameters' shards
    # at rest (parameter, full shape, first element held, the working-dtype view; an empty view for a parameter
    # wholly in other ranks' chunks); elsewhere frozen ones are whole
    commit: Callable[[], None] | None = None  # to call once a load has written into the resting views: views that
    # are staged copies (zero_quantized_nontrainable_weights' int8 shards) are stored then
    resting_masters: dict[tuple[int, int], torch.Tensor] = dataclasses.field(default_factory=dict)  # stage 3:
    # (id(parameter), first element) -> the fp32 master's slice of that frozen shard piece, where the runtime keeps
    # one (a load writes both; full_state_dict reads the master)
    resting_rounded: set[tuple[int, int]] = dataclasses.field(default_factory=set)  # stage 3 without a working
    # shard: (id(parameter), first element) of the resting views that are fp32 master slices holding values of the
    # parameter's dtype; a save writes them in that dtype, a load rounds to it


class Runtime(Protocol):
    params: list[torch.nn.Parameter]  # trainable parameters, in the order of `used` and `names`
    names: list[str]
    shard_groups: list[ShardGroup]  # per optimizer group, the shard pieces the optimizer steps
    quantized: object | None  # qgZ's reduction (comm/zeropp.QuantizedReduce) when configured, else None
    param_store: object | None  # stage 3 with offload_param nvme: the parameter files (offload/nvme_params), else None
    # Set by the engine when the offloaded step copies gradients during backward: called, in the boundary's backward,
    # with each region of this rank's reduced gradient as it becomes final for the step.
    on_final_grads: Callable[[torch.Tensor], None] | None

    def full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        """p's whole shape (stage-3 parameters at rest are empty)."""

    @property
    def used(self) -> list[bool]:
        """Per trainable parameter: got a gradient on this rank since the last step."""

    # -- a pass -------------------------------------------------------------------------------------------------
    def abort_pass(self, error: BaseException) -> None:
        """The model raised inside forward: release what the pass holds."""

    def begin_backward(self, boundary: bool) -> None:
        """A backward pass starts (boundary: the accumulation boundary, where stages 0-1 reduce)."""

    def end_backward(self) -> None:
        """loss.backward() returned: every reduction this pass owes is done."""

    def abort_backward(self) -> None:
        """loss.backward() raised: release what backward holds; nothing is reduced."""

    # -- the step -----------------------------------------------------------------------------------------------
    def grad_segments(self) -> list[torch.Tensor]:
        """The reduced gradient this rank accounts for (each element counted on exactly one rank)."""

    def gather_signature(self) -> int:
        """The signature of this step's parameter gathers (divergence.py); 0 where passes gather nothing."""

    def diverged_step(self) -> None:
        """The ranks' signatures differed: this step is discarded."""

    def active(self, flags: list[bool]) -> list[list[bool]]:
        """Per shard group and piece: did its parameter get a gradient on any rank (flags: per parameter)?"""

    def skipped_step(self) -> None:
        """The step was skipped (overflow, non-finite gradient, diverged gathers): drop what it left behind."""

    def loss_scale_changed(self, factor: float) -> None:
        """The fp16 loss scale was multiplied by factor (state kept in scaled units follows)."""

    def state_components(self) -> list:
        """This runtime's stateful pieces for the engine's registry (core/state.py)."""

    def chunk_stepped(self, group: int, chunk: int) -> None:
        """The optimizer finished one chunk of one group's shard."""

    def after_step(self) -> None:
        """The shards changed: bring every whole copy up to date."""

    def refresh(self) -> None:
        """The shards were written outside a step (a load): bring every whole copy up to date."""

    def shard_map(self) -> ShardMap:
        """This rank's shard in terms of the model's tensors (checkpoints)."""

    def zero_grad(self) -> None:
        """The step is over: the next micro-step's gradients start from zero."""

    # -- whole values and accounting ----------------------------------------------------------------------------
    def full_fp32(self, rank0_only: bool, only: set[int] | None = None) -> dict[int, torch.Tensor] | None:
        """id(parameter) -> fp32 weights (a collective; only: these parameters alone, gathering what holds them)."""

    def full_working(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> weights in the working dtype (a collective)."""

    def full_grads(self, only: set[int] | None = None) -> dict[int, torch.Tensor]:
        """id(parameter) -> reduced gradients as the optimizer reads them (a collective; only: as full_fp32's)."""

    def memory(self) -> dict[str, int]:
        """Bytes held: params, grads, master, comm_buffers, and host_params (parameter shards resting on the host;
        counted in params too); ZeRO++'s own keys (hpz_secondary, loco_error, frozen_int8), each prefixed "host_"
        where it rests on the host."""

    def unguarded(self) -> contextlib.AbstractContextManager:
        """A context in which model.state_dict(keep_vars=True) reads names and ids (stage 3 refuses it else)."""

    def describe(self) -> list[str]:
        """Lines for the start-up log."""

    def warnings(self, reduce_bucket_size: int) -> list[str]:
        """Costly layouts to warn about."""
