"""ZeRO stages 0, 1 and 2: flat parameter buffers, bucketed gradient reduction, shard bookkeeping.

    python -m pytest tests/engine/test_engine.py -q -k "stage0 or stage1 or stage2"

One FlatGroup per (optimizer param group, dtype). Its trainable parameters become views into one flat buffer
laid out by partition.plan_layout (reverse registration order, so buckets fill roughly as backward runs).

  stage 0: every rank steps everything; gradients are views into a full flat buffer, all-reduced per bucket
           at the accumulation boundary.
  stage 1: gradients as in stage 0, reduce-scattered per bucket at the boundary (in place: each rank keeps
           its chunk); each rank steps its shard; updated parameters are all-gathered per bucket.
  stage 2: a gradient is copied into its bucket as backward produces it and freed; a full bucket is
           reduce-scattered at once (every micro-step) and its chunk added into the rank's gradient shard.
  reduce_scatter=false (stages 1, 2): all-reduce the bucket instead and keep this rank's chunk.

Buckets of every group launch in one plan shared by all ranks (schedule.ReduceSchedule), each once it and every
bucket before it in the plan is complete, so ranks issue the same collectives in the same order however their
backward passes order the gradients. A parameter no module of which ran forward on this rank in this micro-step
cannot get a gradient: it counts as complete when backward begins (its part of the sum is zero, or at stages 0-1
what earlier micro-steps accumulated), so it never holds back the buckets after it. With overlap_comm,
collectives run async while backward continues; without it, each runs to completion when launched.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from zkern.comm.collectives import Comm, CommError
from zkern.comm.divergence import TagKind, exchange_tags
from zkern.comm.schedule import ReduceSchedule
from zkern.comm.zeropp import QuantizedReduce
from zkern.core.owners import register_owner, weak_grad_hook
from zkern.core.runtime import ShardMap
from zkern.core.shard_groups import ShardGroup
from zkern.core.spec import RuntimeSpec
from zkern.core.state import Component, host_copy
from zkern.offload.store import ShardStore
from zkern.stage12 import group_state
from zkern.stage12.flat_group import FlatGroup

log = logging.getLogger("zkern")


class Stage12Runtime:
    """The stage 0/1/2 runtime the engine drives: one FlatGroup per non-empty optimizer param group, their buckets
    reduced in one ReduceSchedule."""

    def __init__(self, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], names: dict[int, str],
                 spec: RuntimeSpec, *, comm: Comm, store: ShardStore, quantized: QuantizedReduce | None = None):
        """quantized: qgZ's two-hop int4 reduction (zeropp.py), stage 2 only."""
        # Reverse registration order: backward produces gradients roughly last layer first, so buckets fill in
        # order. Empty optimizer groups get no FlatGroup and stay empty in the optimizer.
        self.sharded_grads = sharded_grads(spec, sum(p.numel() for g in groups for p in g))
        self.flat = [FlatGroup(g[::-1], [names[id(p)] for p in g[::-1]], spec, comm=comm, store=store,
                               sharded_grads=self.sharded_grads) if g else None
                     for g in groups]
        self.groups = [g for g in self.flat if g is not None]
        # parameters are whole on every rank (never in files); on_final_grads: see core/runtime.py
        self.quantized, self.param_store, self.on_final_grads = quantized, None, None
        if quantized is not None and spec.stage != 2:
            raise ValueError(f"quantized gradients (qgZ) replace stage 2's reduce-scatter, not stage {spec.stage}'s")
        for gi, g in enumerate(self.groups):
            g.reducer.quantized, g.quantized_key = quantized, gi
        self.shard_groups = [g.shard_group if g is not None else ShardGroup([], []) for g in self.flat]
        self.params, self.names = [p for g in self.groups for p in g.params], [n for g in self.groups for n in g.names]
        self.stage = spec.stage
        # Every bucket of every group is one slot of the schedule. The first plan: latest-registered parameter
        # first, across groups (backward's rough order); from the second pass, rank 0's observed order.
        position = {pid: k for k, pid in enumerate(names)}
        self._slots = [(g, b) for g in self.groups for b in g.layout.buckets]
        self._slot0: dict[int, int] = {}  # id(group) -> its first slot
        for k, (g, _) in enumerate(self._slots):
            self._slot0.setdefault(id(g), k)
        latest = [max(position[id(p)] for p in g.params[b.first:b.last]) for g, b in self._slots]
        comm = self.groups[0].comm
        self.schedule = ReduceSchedule([b.last - b.first for _, b in self._slots],
                                       sorted(range(len(self._slots)), key=lambda k: -latest[k]), comm,
                                       self.groups[0].param_flat.device)
        self._reducing = False
        self._in_pass = False  # inside engine.backward (begin_backward to end_backward)
        self._handles = []
        self._views: list = []  # open GatheredParameters contexts' trained views (store.trained_view), innermost last
        for gi, g in enumerate(self.groups):
            for i, p in enumerate(g.params):
                self._handles.append(p.register_post_accumulate_grad_hook(weak_grad_hook(self._on_grad_at, gi, i)))
        # Which modules' forward makes a parameter able to get a gradient: its owners and declared readers.
        index = self._index = {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}
        register_owner(model.parameters(), self)  # zkern.GatheredParameters writes through pin/unpin
        for module in model.modules():
            own = [*module.parameters(recurse=False), *module.__dict__.get("_zkern_external_params", ())]
            mine = [index[id(p)] for p in own if id(p) in index]
            if mine:
                self._handles.append(module.register_forward_pre_hook(self._touch_hook(mine)))

    @staticmethod
    def _touch_hook(entries: list[tuple[FlatGroup, int]]):
        def hook(module, args) -> None:
            for g, i in entries:
                g.touched[i] = True
        return hook

    def _on_grad_at(self, gi: int, i: int, p: torch.Tensor) -> None:
        self._on_grad(self.groups[gi], i, p)

    def _on_grad(self, g: FlatGroup, i: int, p: torch.Tensor) -> None:
        if not self._in_pass:  # a backward no output of the engine opened (engine/user_backward.py)
            raise RuntimeError(f"zkern stage {self.stage}: '{g.names[i]}' received a gradient in a backward the "
                               f"engine did not open: its loss reached the parameter without passing the engine's "
                               f"outputs (a term on the parameters themselves?); compute the loss from engine(...)'s "
                               f"outputs, or call engine.backward(loss), so the gradient is scaled and reduced across "
                               f"ranks")
        slot = self._slot0[id(g)] + g.bucket_of[i].index
        if self._reducing and self.schedule.launched(slot):
            if g.fired[i]:
                why = ("received a second gradient in one backward after its bucket was sent for reduction "
                       "(reentrant activation checkpointing?); use torch.utils.checkpoint(..., use_reentrant=False)")
            else:
                why = ("received a gradient after its bucket was sent for reduction, although no module that owns "
                       "it ran forward in this micro-step; declare the module that reads it with "
                       "zkern.register_external_parameter(module, parameter) before creating the engine")
            raise RuntimeError(f"zkern stage {self.stage}: '{g.names[i]}' {why}")
        g.take_grad(i, p)
        if self._reducing and not g.counted[i]:
            g.counted[i] = True
            self._launch(self.schedule.add(slot))

    def _launch(self, slots: list[int]) -> None:
        for k in slots:
            g, b = self._slots[k]
            g.launch(b)

    def begin_backward(self, boundary: bool) -> None:
        """Stage 2 (and stage 1 with sharded_grads) reduces every micro-step, stages 0-1 at the boundary. Parameters
        no module of which ran forward count as complete now: their gradient is zero in this backward."""
        self._reducing = self.sharded_grads or boundary
        self._in_pass = True
        for g in self.groups:
            g.on_final, g.final_pass = self.on_final_grads, boundary
            g.begin_backward()
        if not self._reducing:
            return
        self.schedule.begin()
        ready = []
        for g in self.groups:
            for i in range(len(g.params)):
                if not g.touched[i]:
                    g.counted[i] = True
                    ready += self.schedule.add(self._slot0[id(g)] + g.bucket_of[i].index)
        self._launch(ready)

    def end_backward(self) -> None:
        if self._reducing:
            self._launch(self.schedule.flush())
        for g in self.groups:
            g.end_backward()
        if self._reducing:
            self.schedule.end()  # once, after the first reducing pass: every rank adopts rank 0's order
        self._reducing = self._in_pass = False

    @property
    def used(self) -> list[bool]:
        """Per parameter (self.params order): got a gradient on this rank since the last step."""
        return [u for g in self.groups for u in g.used]

    def active(self, flags: list[bool]) -> list[list[bool]]:
        """Per shard group, per piece: did its parameter get a gradient on any rank (flags: global)?"""
        out, start = [], 0
        for g in self.flat:
            if g is None:
                out.append([])
                continue
            out.append(g.active_pieces(flags[start:start + len(g.params)]))
            start += len(g.params)
        return out

    def abort_pass(self, error: BaseException) -> None:
        """The model raised inside forward: stages 0-2 hold nothing per pass."""

    def abort_backward(self) -> None:
        """loss.backward() raised: its reductions are forgotten; the next backward starts over."""
        for g in self.groups:
            g.abort_backward()
        self._reducing = self._in_pass = False

    def gather_signature(self) -> int:
        """Stages 0-2 gather no parameters during the passes: nothing for the step's control to compare."""
        return 0

    def diverged_step(self) -> None:
        raise AssertionError("stages 0-2 report no gather signature, so the ranks' cannot differ")

    def unguarded(self) -> contextlib.AbstractContextManager:
        """Stages 0-2 keep parameters whole: model.state_dict() needs no guard."""
        return contextlib.nullcontext()

    def grad_segments(self) -> list[torch.Tensor]:
        return [s for g in self.groups for s in g.grad_segments()]

    def chunk_stepped(self, group: int, chunk: int) -> None:
        """The optimizer finished chunk `chunk` (a bucket) of group `group`: gather it while the rest steps."""
        if self.flat[group] is not None:
            self.flat[group].gather_bucket(chunk)

    def skipped_step(self) -> None:
        """The step was skipped: LoCo's errors from its micro-steps are dropped (zeropp.QuantizedReduce)."""
        if self.quantized is not None:
            self.quantized.skipped_step()

    def loss_scale_changed(self, factor: float) -> None:
        """The fp16 loss scale was multiplied by factor: LoCo's errors (in loss-scaled units) follow."""
        if self.quantized is not None:
            self.quantized.rescale_errors(factor)

    def after_step(self) -> None:
        self.refresh()
        if self.quantized is not None:
            self.quantized.after_step()

    def refresh(self) -> None:
        """The shards were written (a step, a load): bring every whole copy up to date."""
        for g in self.groups:
            g.gather_params()

    def full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        return p.shape  # whole on every rank at stages 0-2

    def shard_map(self) -> ShardMap:
        """Stage 0 keeps every piece on every rank: bucket k (counted across groups) is written by rank k % world."""
        comm, pieces, first, bucket = self.groups[0].comm, [], 0, 0
        for g in self.flat:
            if g is None:
                pieces.append([])
                continue
            writer = {b.index: (bucket + b.index) % comm.world for b in g.layout.buckets}
            mine = [writer[p.bucket] == comm.rank if self.stage == 0 else True for p in g.pieces]
            pieces.append([(first + p.param, p.param_start, m) for p, m in zip(g.pieces, mine)])
            first += len(g.params)
            bucket += len(g.layout.buckets)
        return ShardMap(pieces=pieces, shapes=[p.shape for p in self.params], resting=[])

    def zero_grad(self) -> None:
        for g in self.groups:
            g.zero_grad()

    def full_fp32(self, rank0_only: bool, only: set[int] | None = None) -> dict[int, torch.Tensor] | None:
        """id(parameter) -> its fp32 value (collective; None off rank 0 with rank0_only; only: these ids alone)."""
        keep = not rank0_only or self.groups[0].comm.rank == 0
        values = {k: v for g in self.groups for k, v in group_state.whole(g, "fp32", keep, only).items()}
        return values if keep else None

    def full_working(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> value in the working dtype, for saving 16-bit weights."""
        return {k: v for g in self.groups for k, v in group_state.whole(g, "working", True).items()}

    def full_grads(self, only: set[int] | None = None) -> dict[int, torch.Tensor]:
        """id(parameter) -> the reduced gradient as the optimizer reads it: the sum over ranks of loss_scale /
        gradient_predivide_factor times each rank's gradient, in the accumulation dtype (a collective; for tests
        and debugging, between the last backward and step())."""
        return {k: v for g in self.groups for k, v in group_state.whole(g, "grads", True, only).items()}

    # -- GatheredParameters (gathered.py) ---------------------------------------------------------------------
    def pin(self, params: list[torch.nn.Parameter], modifier_rank: int | None) -> list:
        """Parameters are whole at stages 0-2: nothing to gather. With a modifier rank, each one's values are kept,
        so that unpin can tell which elements the modifier changed (a collective: the ranks check they agree)."""
        _agree_on_pin(self.groups[0].comm, len(params), modifier_rank, self.groups[0].param_flat.device)
        # a delayed update in flight stays so (unpin lands it only where a rank changed something); a context that
        # may write shows it landed in view (store.trained_view), so its writes are compared with the trained model
        store = self.groups[0].store
        store.settle()
        self._views.append(store.trained_view(modifier_rank))
        return [(p, p.detach().clone() if modifier_rank is not None else None) for p in params]

    def unpin(self, pinned: list, modifier_rank: int | None) -> None:
        """Leave a GatheredParameters context. With modifier_rank, that rank's values reach every rank's copy, and
        the elements it changed the fp32 master shard (which the next step would otherwise write back over them;
        the others keep their fp32 master value, which the 16-bit copy had only rounded). The optimizer's moments
        are kept. Without one, the parameters are the training copies as they are: a change made in the context
        on one rank is not written into the masters, and the next optimizer step writes over it."""
        view = self._views.pop()
        try:
            if modifier_rank is not None:
                group_state.write_modified(self.groups[0].comm, self.groups[0].store, self._index, pinned,
                                           modifier_rank, before_landing=view.close)
        finally:
            view.close()

    def add_external_reader(self, module: torch.nn.Module, p: torch.nn.Parameter) -> None:
        """`module` reads p in its forward (GatheredParameters' fwd_module): its forward now marks p as able to get
        a gradient in that micro-step."""
        if id(p) in self._index:
            self._handles.append(module.register_forward_pre_hook(self._touch_hook([self._index[id(p)]])))

    def state_components(self) -> list[Component]:
        """This runtime's state for the engine's registry (core/state.py)."""
        out = [
            Component("stage12.weights", "weights",
                      snapshot=lambda: host_copy([{"param_flat": g.param_flat, "master": group_state.master_values(g)}
                                                  for g in self.groups]),
                      tensors=lambda: [t for g in self.groups for t in group_state.weight_tensors(g)]),
            Component("stage12.gradients", "transient", reset=self.zero_grad,
                      snapshot=lambda: host_copy([group_state.grad_values(g) for g in self.groups]),
                      tensors=lambda: [t for g in self.groups for t in group_state.grad_tensors(g)]),
            Component("stage12.buckets", "scratch",
                      tensors=lambda: [t for g in self.groups for t in group_state.scratch_tensors(g)]),
        ]
        if self.quantized is not None:
            out += self.quantized.state_components()
        return out

    def memory(self) -> dict[str, int]:
        report: dict[str, int] = {"host_params": 0}
        for g in self.groups:
            for key, value in group_state.memory(g).items():
                report[key] = report.get(key, 0) + value
        if self.quantized is not None:
            report.update(self.quantized.memory())
        return report

    def describe(self) -> list[str]:
        """One line per group for the start-up log; warns where stage 2's one bucket holds a full gradient."""
        lines = []
        for i, g in enumerate(self.groups):
            layout = g.layout
            lines.append(f"group {i}: {len(g.params)} parameters, {layout.numel} elements in {len(layout.buckets)} "
                         f"buckets, padded with {layout.padding} zero elements to a shard of {layout.shard_numel} per "
                         f"rank (padding never enters the math)")
        return lines + ([STAGE1_GRADIENTS[self.sharded_grads]] if self.stage == 1 else [])

    def warnings(self, reduce_bucket_size: int) -> list[str]:
        """Stage 2 whose every group is one bucket: the whole gradient is held at once. (A small group alone in one
        bucket, biases and norms beside many-bucket weights, holds little and is no reason to warn.)"""
        sharded = [g for g in self.groups if g.stage == 2 and g.comm.world > 1]
        if not sharded or any(len(g.layout.buckets) > 1 for g in sharded):
            return []
        n = sum(g.layout.numel for g in sharded)
        return [f"stage 2 with one gradient bucket per group: reduce_bucket_size ({reduce_bucket_size}) >= each "
                f"group's elements ({n} trainable in all), so backward fills buckets as large as the whole gradient "
                f"and stage 2 holds as much gradient memory as stage 1. Set zero_optimization.reduce_bucket_size "
                f"well below {max(g.layout.numel for g in sharded)} (\"auto\" = hidden_size**2) to keep the saving."]


STAGE1_GRADIENTS = {  # the start-up line: where stage 1's gradients go (sharded_grads)
    True: "stage 1: each bucket is reduced into this rank's gradient shard during backward (one backward a step, "
          "several buckets)",
    False: "stage 1: the whole gradient is kept and reduced at the accumulation's boundary (with "
           "gradient_accumulation_steps 1 and reduce_bucket_size under a third of the model, backward would reduce "
           "into the shard instead)"}


def sharded_grads(spec: RuntimeSpec, numel: int) -> bool:
    """Whether gradients go into bucket buffers reduced into each rank's shard as backward produces them: at stage 2
    always; at stage 1 where every step has one backward (gradient_accumulation_steps 1), so no gradient is
    accumulated before the reduction, and the buckets in flight (about three) stay well under the whole gradient
    (numel elements; DeepSpeed's 5e8 default is one bucket as large as a smaller model's gradient, which would save
    nothing). Stage 1 then holds its shard of the gradient, not the whole 16-bit one, as DeepSpeed's stage 1
    reduces into its partition in backward; with several micro-steps it accumulates whole and reduces at the
    boundary. A step with more backwards than configured (set_gradient_accumulation_boundary) reduces each one and
    sums the shards, as stage 2 does."""
    return spec.stage == 2 or (spec.stage == 1 and spec.accumulation == 1 and 3 * spec.bucket_numel <= numel)


def _agree_on_pin(comm, count: int, modifier_rank: int | None, device: torch.device) -> None:
    """Entering GatheredParameters is a collective: every rank names as many parameters and the same modifier rank,
    a rank of this world."""
    if modifier_rank is not None and modifier_rank >= comm.world:
        raise ValueError(f"GatheredParameters: modifier_rank {modifier_rank} is not a rank of this world of "
                         f"{comm.world}")
    tags = exchange_tags(comm, (TagKind.PIN, count, -1 if modifier_rank is None else modifier_rank), device)
    if any(t != tags[0] for t in tags):
        raise CommError(f"zkern rank {comm.rank} of {comm.world}: GatheredParameters was entered with different "
                        f"parameters or modifier ranks on different ranks ({tags}); every rank must pass the same "
                        f"parameters in the same order")
