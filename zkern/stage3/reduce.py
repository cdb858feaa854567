"""Stage 3's gradient reduction: gradients land in their reduce group's buffer as backward produces them; groups
are reduce-scattered into this rank's gradient shard in one fixed order, the same on every rank.

    python -m pytest tests/stage3/test_stage3_moe.py -q

A reduce group is a run of consecutive trainable units up to reduce_bucket_size elements (units.plan_reduce_groups),
with a rank-major buffer so that one reduce-scatter leaves each rank the contiguous shard range of the group:

    | rank 0: u1.chunk0 u2.chunk0 | rank 1: u1.chunk1 u2.chunk1 | ...

A unit's gradients are complete when each of its trainable parameters' gradient arrived, or at the start of
backward when no module that reads it ran forward on this rank (a routed expert this rank did not choose: its
part of the sum is zero), or at the end of backward (parameters without a gradient). Groups launch in one plan
(schedule.ReduceSchedule, shared with stages 0-2: last group first, then rank 0's observed order), each once it
and every group before it is complete: which rank completes what when may differ, the sequence of
reduce-scatters never does. They run on a process group of their own (Comm.sibling), so their order never has to
interleave with the gathers' for the pairing; for NCCL, whose collectives on one GPU must also interleave alike
across communicators, a group holding a divergent unit (completed at different points on different ranks) waits
for the end of backward, so the interleaving is the same on every rank too (tests/comm/test_collective_order.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zkern.comm.collectives import Comm
from zkern.comm.reducer import BucketReducer
from zkern.comm.schedule import ReduceSchedule, fold_reduced
from zkern.comm.zeropp import QuantizedReduce
from zkern.core.buffers import aligned_zeros, release, restore
from zkern.stage3.lifecycle import GradState, Unit
from zkern.stage3.units import plan_reduce_groups


@dataclass(eq=False)
class ReduceGroup:
    index: int
    units: list[Unit]
    section: int  # elements per rank section (sum of the units' chunks)
    section_offset: dict[int, int]  # unit index -> offset inside a section
    shard_offset: int
    buffer: torch.Tensor | None = None


class GradReducer:
    def __init__(self, units: list[Unit], comm: Comm, *, grad_shard: torch.Tensor, comm_dtype: torch.dtype,
                 bucket_numel: int, overlap: bool, reduce_scatter: bool, offsets: dict[int, int],
                 params: list[torch.nn.Parameter], names: dict[int, str], quantized: QuantizedReduce | None = None,
                 keep_grads: bool = False):
        """offsets: id(parameter) -> offset inside its unit; params: the trainable parameters, in the order of the
        `used` flags the engine's step control reduces; quantized: qgZ's two-hop int4 reduction (zeropp.py)."""
        self.units, self.comm, self.grad_shard, self.comm_dtype = units, comm, grad_shard, comm_dtype
        self.reducer = BucketReducer(comm, quantized)  # the collectives, as stages 0-2 issue theirs
        self.overlap, self.reduce_scatter = overlap, reduce_scatter
        self.offsets, self.names = offsets, names
        self.groups = self._plan(bucket_numel)
        # The first plan: last group first (roughly backward's order); then rank 0's observed order.
        self.schedule = ReduceSchedule([len(g.units) for g in self.groups], list(range(len(self.groups)))[::-1],
                                       comm, grad_shard.device)
        self._unit_of = {id(p): u for u in units for p in u.plan.params}
        self._position = {id(p): i for u in units for i, p in enumerate(u.plan.params)}
        self._trainable_index = {id(p): i for i, p in enumerate(params)}
        self.used = [False] * len(params)
        self.micro_since_step = 0
        # The fp32 gradient shard exists from the first backward after a step to the step (ensure_grads,
        # free_grads), unless zero_optimization.keep_gradient_buffers; its tensor stays for the optimizer's views.
        self.keep_grads = keep_grads
        self.grads_live = True  # the runtime frees it once the optimizer's views of it exist
        self._may_block = True
        self.on_complete = None  # callback(unit): its gradients are complete (the runtime frees its data)
        self.on_final = None  # callback(region): a region of the gradient shard final for the step
        self.final_pass = False  # this backward ends the accumulation

    def _plan(self, bucket_numel: int) -> list[ReduceGroup]:
        """Consecutive units reduced together, each group at most reduce_bucket_size elements and at most the largest
        unit's: a group's buffer lives from its first gradient to its reduction, so a bucket as large as the whole
        gradient (DeepSpeed's default of 5e8 holds any model under 500M parameters whole) would keep a full 16-bit
        gradient on every rank through backward, which is not ZeRO-3's memory. Bounded by the units, as FSDP2
        reduces unit by unit, small units still share a reduction."""
        out = []
        padded = [u.bucket.padded for u in self.units]
        trainable = [u.trainable > 0 for u in self.units]
        largest = max((n for n, t in zip(padded, trainable) if t), default=1)
        spans = plan_reduce_groups(padded, trainable, min(bucket_numel, largest))
        for gi, indices in enumerate(spans):
            units = [self.units[i] for i in indices]
            offsets, section = {}, 0
            for u in units:
                offsets[u.index] = section
                section += u.bucket.chunk
            group = ReduceGroup(gi, units, section, offsets, units[0].bucket.shard_offset)
            for u in units:
                u.group = group
            out.append(group)
        return out

    # -- backward ---------------------------------------------------------------------------------------------
    def ensure_grads(self) -> None:
        """The gradient shard back, zeroed (a backward begins, or a step or a read finds it freed)."""
        if not self.grads_live:
            restore(self.grad_shard, zero=True)
            self.grads_live = True

    def free_grads(self) -> None:
        release(self.grad_shard)
        self.grads_live = False

    def begin_backward(self) -> None:
        self.ensure_grads()
        # Waiting for a reduction inside backward is safe only while every rank runs the same modules: then each
        # rank completes a group at the same point of the (shared) sequence of all-gathers. Once ranks run different
        # modules (divergent units), a rank blocked on a reduction could be the one whose all-gather another rank
        # needs to reach that reduction: reductions then run asynchronously and are retired as they finish.
        # Likewise once this rank skipped a module the others may have run (an expert it did not choose): it
        # completes that unit's gradients now, possibly long before they do, and must not wait on a reduction they
        # reach only after all-gathers this rank has yet to join.
        skipped = [u for u in self.units if u.trainable and not (u.touched or u.persistent or u.pins)]
        partial = [(u, u.skipped_positions()) for u in self.units if u.optional]
        self._may_block = not any(u.divergent for u in self.units) and not skipped and not any(p for _, p in partial)
        # A group holding a divergent unit (ranks run different modules of it: routed experts) completes at a point
        # of backward that differs by rank: a rank that did not run the expert completes it now. Launched there, its
        # reduce-scatter would interleave with the all-gathers at different points on different ranks, which NCCL
        # (one stream of collectives per GPU) may deadlock on. Such groups launch at the end of backward, in plan
        # order, at the same point on every rank (the divergent flags are agreed by every rank).
        self.schedule.begin(frozenset(g.index for g in self.groups if any(u.divergent for u in g.units)))
        for u in self.units:
            u.open_grads()
        for u, positions in partial:  # the parameters of optional children that did not run: no gradient comes
            if u.trainable and (u.touched or u.persistent or u.pins):
                u.fired.update(positions)
        for u in self.units:  # nothing to wait for: frozen units, units no module read on this rank, and units
            # whose only parameters left are those of children that did not run
            if u.trainable == 0 or not (u.touched or u.persistent or u.pins) or len(u.fired) == u.trainable:
                self._complete(u)

    def on_grad(self, p: torch.nn.Parameter) -> None:
        u = self._unit_of[id(p)]
        name = self.names[id(p)]
        if u.grads is GradState.IDLE:
            raise RuntimeError(f"zkern stage 3: '{name}' received a gradient in a backward the engine did not open: "
                               f"its loss reached the parameter without passing the engine's outputs (a term on the "
                               f"parameters themselves?); compute the loss from engine(...)'s outputs, or call "
                               f"engine.backward(loss), so the gradient is scaled and reduced")
        g = u.group
        if self.schedule.launched(g.index):
            raise RuntimeError(
                f"zkern stage 3: '{name}' received a second gradient in one backward after its unit was reduced "
                f"(reentrant activation checkpointing of a block that also runs outside it?); use "
                f"torch.utils.checkpoint(..., use_reentrant=False)")
        self.used[self._trainable_index[id(p)]] = True
        pos = self._position[id(p)]
        self._ensure_buffer(g)
        self._scatter_into(g, u, p, p.grad.reshape(-1), add=pos in u.fired or u.grads is GradState.COMPLETE)
        p.grad = None  # only the shard is kept
        u.fired.add(pos)
        u.arrived = True
        if u.grads is GradState.PENDING and len(u.fired) == u.trainable:
            self._complete(u)

    def _scatter_into(self, g: ReduceGroup, u: Unit, p: torch.nn.Parameter, grad: torch.Tensor, add: bool) -> None:
        """Copy p's flat gradient into the rank sections of g's buffer that its unit chunks map to."""
        off, n, c = self.offsets[id(p)], grad.numel(), u.bucket.chunk
        for q in range(off // c, (off + n - 1) // c + 1):
            lo, hi = max(off, q * c), min(off + n, (q + 1) * c)
            start = q * g.section + g.section_offset[u.index] + lo - q * c
            dst, src = g.buffer[start:start + hi - lo], grad[lo - off:hi - off]
            if add:
                dst.add_(src)
            else:
                dst.copy_(src)

    def _complete(self, u: Unit) -> None:
        u.complete_grads()
        if self.on_complete is not None:
            self.on_complete(u)
        if u.group is not None:
            for gi in self.schedule.add(u.group.index):
                self._launch(self.groups[gi])

    def _ensure_buffer(self, g: ReduceGroup) -> None:
        """The group's rank-major gradient buffer, made at its first gradient of the pass (or at launch, for a group
        that got none). Zeros: padding and parameters without a gradient reduce as zero."""
        if g.buffer is None:
            g.buffer = aligned_zeros(g.section * self.comm.world, self.comm_dtype, self.grad_shard.device)

    def _launch(self, g: ReduceGroup) -> None:
        self._ensure_buffer(g)
        rank = self.comm.rank
        names = f"'{g.units[0].name}'" + (f"..'{g.units[-1].name}'" if len(g.units) > 1 else "")
        purpose = f"gradients of units {names}"
        async_op = self.overlap or not self._may_block
        mine = g.buffer[rank * g.section:(rank + 1) * g.section]

        final = self.on_final if self.final_pass else None

        def fold() -> None:  # this rank's section into its gradient shard; the group's buffer goes
            shard = self.grad_shard[g.shard_offset:g.shard_offset + g.section]
            fold_reduced(shard, mine, self.micro_since_step == 0)
            g.buffer = None
            if final is not None:
                final(shard)

        # qgZ has reduce-scatter's contract (the config refuses it without reduce_scatter); reduce_scatter=false
        # all-reduces the group's buffer and keeps this rank's section
        self.reducer.launch(g.buffer, purpose, out=mine if self.reduce_scatter else None, async_op=async_op,
                            key=g.index, then=fold, holds=g.buffer)
        self.reducer.retire_finished()
        # Overlap keeps at most two reductions in flight, so gradient buffers never pile up during backward.
        while self._may_block and len(self.reducer) and (not self.overlap or len(self.reducer) > 2):
            self.reducer.retire_oldest()

    def end_backward(self) -> None:
        """Complete what no gradient completed (parameters without one on this rank), launch the rest in plan
        order, wait for every reduction, and close the pass."""
        for u in self.units:
            if u.grads is GradState.PENDING:
                self._complete(u)
        for gi in self.schedule.flush():  # empty: every unit is complete now
            self._launch(self.groups[gi])
        self.reducer.drain()
        for u in self.units:
            u.close_grads()
        self.schedule.end()  # once, after the first pass: every rank adopts rank 0's order
        self.micro_since_step += 1

    def abort(self) -> None:
        """loss.backward() raised: forget this pass's gradients and reductions (the step must not use them)."""
        self.reducer.clear()
        for u in self.units:
            u.abandon_grads()
        for g in self.groups:
            g.buffer = None
        self.schedule.begin()

    def zero_grad(self) -> None:
        self.micro_since_step = 0
        self.used = [False] * len(self.used)
        if self.keep_grads:
            self.grad_shard.zero_()
        else:
            self.free_grads()

    def buffer_bytes(self) -> int:
        return sum(g.buffer.numel() * g.buffer.element_size() for g in self.groups if g.buffer is not None)
