"""FlatGroup: one optimizer group's trainable parameters packed into flat buffers, for ZeRO stages 0, 1 and 2.

    python -m pytest tests/engine/test_engine.py -q -k "stage0 or stage1 or stage2"

Its parameters become views into one flat working-dtype buffer laid out by partition.plan_layout; its gradients
views into a flat buffer (stages 0-1) or are folded bucket by bucket into a shard (stage 2, and stage 1 where each
step has one backward: `sharded_grads`); this rank steps its chunk of every bucket. runtime.py drives the groups
through one reduce schedule; group_state.py reads them whole, writes their masters and accounts for them.
"""

from __future__ import annotations

import functools

import torch

from zkern import ops
from zkern.comm.collectives import Comm, Work
from zkern.comm.reducer import BucketReducer
from zkern.comm.schedule import fold_reduced
from zkern.core.buffers import aligned_empty, aligned_zeros, release, restore
from zkern.core.partition import ALIGN, Bucket, Layout, plan_layout
from zkern.core.shard_groups import Chunk, ShardGroup
from zkern.core.spec import RuntimeSpec
from zkern.offload.partial import place_chunks, split_point
from zkern.offload.store import ShardStore


class FlatGroup:
    """One group of trainable parameters packed into flat buffers, for ZeRO stages 0, 1 and 2."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], spec: RuntimeSpec, *, comm: Comm,
                 store: ShardStore, sharded_grads: bool):
        """spec: the stage, dtypes, bucket size and offload as resolved from the config (core/spec.py). store:
        where the shards live (offload/store.py); with its optimizer files (offload_optimizer.device "nvme") the
        master shard is a region of them (self.master is then the region's stand-in). sharded_grads: gradients go
        into bucket buffers reduced into this rank's shard as backward produces them (stage 2, and stage 1 where
        runtime.sharded_grads says so)."""
        stage, dtype, mixed, device = spec.stage, spec.dtype, spec.mixed, spec.device
        self.params, self.names, self.stage, self.comm = params, names, stage, comm
        self.sharded_grads = sharded_grads
        self.dtype, self.mixed, self.overlap, self.reduce_scatter = dtype, mixed, spec.overlap, spec.reduce_scatter
        self.comm_dtype, self.accum_dtype = spec.comm_dtype, spec.accum_dtype
        # Every bucket's collective goes through it; qgZ (stage 2) is its `quantized`, which Stage12Runtime sets.
        self.reducer = BucketReducer(comm)
        self.quantized_key = 0  # this group's part of qgZ's per-bucket keys (LoCo's error buffers)
        # Told each region of this rank's reduced gradient once it is final for the step (the offloaded step copies
        # it to the host while backward goes on); the runtime sets both for each pass.
        self.on_final, self.final_pass = None, False
        self.shard_world = 1 if stage == 0 else comm.world
        self.shard_rank = 0 if stage == 0 else comm.rank
        self.layout: Layout = plan_layout([p.numel() for p in params], self.shard_world, spec.bucket_numel)
        layout = self.layout

        # The flat working-dtype parameters and the fp32 master shard (mixed precision, or offloaded: then on the
        # host even in fp32), written one bucket at a time from the parameters' own values (fp32, before any
        # rounding to 16 bits; on the host or the device): each bucket's parameters become views into the flat
        # buffer as soon as it is written, so their old storage goes at once and building holds one bucket of fp32
        # beside the model. torch.empty commits pages only as they are written.
        self.param_flat = aligned_empty(layout.total, dtype, device)
        self.store = store
        self.master = _allocate_master(spec, store, layout, self.shard_rank)
        for b in layout.buckets:
            _write_bucket(b, params, self.param_flat, self.master, layout.chunk_range(b, self.shard_rank), store)
            for i in range(b.first, b.last):
                params[i].data = self._param_view(self.param_flat, i)

        # Gradients: a full flat buffer (stages 0-1), or a shard (sharded_grads), in the accumulation dtype. Where
        # that is the working dtype, the flat buffer's views are the parameters' .grad and autograd accumulates into
        # them; otherwise each gradient is added into the buffer as it arrives and freed.
        # They exist from a step's first backward to the step (ensure_grads, free_grads), under stable views.
        self.grad_flat = self.grad_shard = None
        self._grad_views = None
        self.keep_grads = spec.zero.keep_gradient_buffers
        alloc = aligned_zeros if self.keep_grads else aligned_empty  # empty: no page is touched before it goes
        if not self.sharded_grads:
            self.grad_flat = alloc(layout.total, self.accum_dtype, device)
            if self.accum_dtype == dtype:
                self._grad_views = [self._param_view(self.grad_flat, i) for i in range(len(self.params))]
        else:
            self.grad_shard = alloc(layout.shard_numel, self.accum_dtype, device)
        self.grads_live = True
        if self.keep_grads:
            self._attach_grad_views()
        self._bucket_capacity = max(b.padded for b in layout.buckets)  # every stage-2 bucket buffer's size
        self._free_buffers: list[torch.Tensor] = []  # stage 2 bucket buffers not in use
        self._buffer_count = 0
        self._open: dict[int, torch.Tensor] = {}  # stage 2: bucket index -> buffer being filled

        self.bucket_of = [b for b in layout.buckets for _ in range(b.first, b.last)]
        self.fired = [False] * len(params)  # got a gradient in this backward
        self.counted = [False] * len(params)  # counted toward its bucket's completion in this backward
        self.touched = [False] * len(params)  # a module that owns or declares it ran forward in this micro-step
        self.used = [False] * len(params)  # got a gradient in any micro-step since the last optimizer step
        self._micro_since_step = 0  # stage 2: reduced micro-steps accumulated into grad_shard
        self._gathers: list[Work] = []  # post-step all-gathers in flight
        self._gathered = [False] * len(layout.buckets)
        self.pieces = layout.pieces(self.shard_rank)
        self.shard_group = self._make_shard_group()  # its chunks view the gradient buffer: made before it goes
        if not self.keep_grads:
            self.free_grads()

    # -- views ------------------------------------------------------------------------------------------------
    def _param_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        off, n = self.layout.offsets[i], self.layout.numels[i]
        return flat[off:off + n].view(self.params[i].shape)

    def _attach_grad_views(self) -> None:
        for p, view in zip(self.params, self._grad_views or ()):
            p.grad = view

    def ensure_grads(self) -> None:
        """Bring the gradient buffer back, zeroed, with the parameters' .grad its views again (stages 0-1 in the
        working dtype, where autograd accumulates into them)."""
        if self.grads_live:
            return
        for t in (self.grad_flat, self.grad_shard):
            if t is not None:
                restore(t, zero=True)
        self._attach_grad_views()
        self.grads_live = True

    def free_grads(self) -> None:  # at the step, or zero_grad: .grad is None, as torch leaves it
        for p in self.params:
            p.grad = None
        for t in (self.grad_flat, self.grad_shard):
            if t is not None:
                release(t)
        self.grads_live = False

    def _own_chunk(self, flat: torch.Tensor, b: Bucket) -> torch.Tensor:
        lo, size = self.layout.chunk_range(b, self.shard_rank)
        return flat[lo:lo + size]

    def grad_chunk(self, b: Bucket) -> torch.Tensor:
        """This rank's reduced gradient for bucket b (valid after backward at the boundary)."""
        if self.grad_shard is not None:
            return self.grad_shard[b.shard_offset:b.shard_offset + b.chunk]
        return self._own_chunk(self.grad_flat, b)

    def grad_segments(self) -> list[torch.Tensor]:
        """Contiguous buffers of the reduced gradient this rank accounts for (overflow check, norm): its shard,
        so that summed over ranks every element counts once. Stage 0 holds the whole gradient on every rank and
        splits the work: rank r takes every world-th bucket. A step with no backward since the last finds zeros."""
        self.ensure_grads()
        if self.grad_shard is not None:
            return [self.grad_shard]
        if self.stage == 0:
            comm = self.comm
            return [self.grad_flat[b.offset:b.offset + b.padded] for b in self.layout.buckets
                    if b.index % comm.world == comm.rank]
        return [self.grad_chunk(b) for b in self.layout.buckets]

    def _make_shard_group(self) -> ShardGroup:
        """The shard as the optimizer sees it: fp32 pieces and per-bucket chunks."""
        base = self.master  # fp32 shard layout
        pieces, chunks = [], []
        by_bucket: dict[int, list[tuple[int, int, int]]] = {b.index: [] for b in self.layout.buckets}
        for piece in self.pieces:
            if base is not None:
                t = base[piece.shard_start:piece.shard_start + piece.numel]
            else:  # fp32: the rank's chunk of the flat parameter buffer is the master copy
                b = self.layout.buckets[piece.bucket]
                t = self._own_chunk(self.param_flat, b)[piece.chunk_start:piece.chunk_start + piece.numel]
            if piece.numel == self.params[piece.param].numel():
                t = t.view(self.params[piece.param].shape)
            by_bucket[piece.bucket].append((len(pieces), piece.chunk_start, piece.numel))
            pieces.append(t)
        for b in self.layout.buckets:
            own = self._own_chunk(self.param_flat, b)
            param = own if base is None else base[b.shard_offset:b.shard_offset + b.chunk]
            chunks.append(Chunk(param=param, grad=self.grad_chunk(b), out=own if base is not None else None,
                                pieces=by_bucket[b.index]))
        if base is not None and self.store.split_of(base) is not None:  # partial offload: real slices of each part
            pieces = [self.store.resident(t) for t in pieces]
            chunks = place_chunks(chunks, self.store)
        return ShardGroup(pieces=pieces, chunks=chunks)

    def active_pieces(self, used: list[bool]) -> list[bool]:
        """For each shard piece: did its parameter get a gradient on any rank (used: global flags)?"""
        return [used[piece.param] for piece in self.pieces]

    # -- backward ---------------------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self.fired = [False] * len(self.params)
        self.counted = [False] * len(self.params)
        self.ensure_grads()
        if self._grad_views is not None:  # autograd accumulates into p.grad in place, keeping the view object
            for i, p in enumerate(self.params):
                if p.grad is not self._grad_views[i]:
                    raise RuntimeError(
                        f"zkern: the gradient of '{self.names[i]}' was replaced or set to None outside the engine "
                        f"(e.g. model.zero_grad() or optimizer.zero_grad()); the engine zeroes gradients itself "
                        f"after each step, so remove that call")

    def take_grad(self, i: int, p: torch.Tensor) -> bool:
        """Parameter i's gradient arrived; stage 2 moves it into its bucket's buffer. Returns whether it is the
        first this backward."""
        again = self.fired[i]
        self.fired[i] = self.used[i] = True
        if self.sharded_grads:
            b = self.bucket_of[i]
            buf = self._open.get(b.index)
            if buf is None:
                buf = self._open[b.index] = self._take_buffer(b)
            off = self.layout.offsets[i] - b.offset
            slot = buf[off:off + self.layout.numels[i]]
            if again:
                slot.add_(p.grad.reshape(-1))
            else:
                slot.copy_(p.grad.reshape(-1))
            p.grad = None  # stage 2 keeps only the shard: this parameter's full gradient is freed here
        elif self._grad_views is None:  # stages 0-1 accumulating in another dtype than the working one
            self._param_view(self.grad_flat, i).add_(p.grad)
            p.grad = None
        return not again

    def launch(self, b: Bucket) -> None:
        """Issue bucket b's gradient collective (in the schedule's order, the same on every rank)."""
        purpose = f"gradients of bucket {b.index}, parameters {self.names[b.first]}..{self.names[b.last - 1]}"
        if self.sharded_grads:
            buf = self._open.pop(b.index, None)
            if buf is None:
                buf = self._take_buffer(b)
            self._zero_unfilled(buf, b)
            data = buf[:b.padded]
            mine = data[self.shard_rank * b.chunk:(self.shard_rank + 1) * b.chunk]
            shard = self.grad_shard[b.shard_offset:b.shard_offset + b.chunk]

            def fold(buf=buf, mine=mine, shard=shard) -> None:  # this micro-step's reduced chunk into the shard
                fold_reduced(shard, mine, self._micro_since_step == 0)
                self._free_buffers.append(buf)

            # qgZ has reduce-scatter's contract; reduce_scatter=false all-reduces the bucket and keeps this rank's chunk
            self.reducer.launch(data, purpose, out=mine if self.reduce_scatter else None, async_op=self.overlap,
                                key=(self.quantized_key, b.index), then=_in_order(fold, self._final(shard)), holds=buf)
        else:
            data = self.grad_flat[b.offset:b.offset + b.padded]
            # Reduced in place, or, in another communication dtype, through a copy cast back on arrival.
            wire = data if data.dtype == self.comm_dtype else data.to(self.comm_dtype)
            out = wire[self.shard_rank * b.chunk:(self.shard_rank + 1) * b.chunk] \
                if self.stage == 1 and self.reduce_scatter else None
            own = self._own_chunk(self.grad_flat, b)
            cast = None
            if wire is not data:  # cast what arrived back into the accumulation buffer
                src, dst = (out, own) if out is not None else (wire, data)
                cast = functools.partial(dst.copy_, src)
            then = _in_order(cast, self._final(own) if self.stage == 1 else None)
            self.reducer.launch(wire, purpose, out=out, async_op=self.overlap, then=then)
        if not self.overlap:
            self.reducer.retire_oldest()

    def _final(self, region: torch.Tensor):
        """The call that reports region final for the step once its reduction arrived (boundary passes only)."""
        return functools.partial(self.on_final, region) if self.final_pass and self.on_final is not None else None

    def _zero_unfilled(self, buf: torch.Tensor, b: Bucket) -> None:
        """Zero the slots of parameters that got no gradient in this backward, and the padding."""
        end = 0  # the gaps between parameters (their slots are ALIGN-rounded) are padding too
        for i in range(b.first, b.last):
            off = self.layout.offsets[i] - b.offset
            if not self.fired[i]:
                off = end  # its slot and the gap before it in one call
            if off > end:
                buf[end:off].zero_()
            end = self.layout.offsets[i] - b.offset + self.layout.numels[i]
            if not self.fired[i]:
                buf[off:end].zero_()
        if b.padded > end:
            buf[end:b.padded].zero_()

    def _take_buffer(self, b: Bucket) -> torch.Tensor:
        """A stage-2 bucket buffer; reuses one whose collective has finished before allocating another."""
        if not self._free_buffers and len(self.reducer):
            self.reducer.retire_oldest()
        if self._free_buffers:
            return self._free_buffers.pop()
        self._buffer_count += 1
        return aligned_empty(self._bucket_capacity, self.comm_dtype, self.param_flat.device)

    def abort_backward(self) -> None:
        """loss.backward() raised: forget this pass's reductions (a later drain would have folded them in), keep the
        bucket buffers not yet launched; a buffer an abandoned reduction still reads is dropped."""
        dropped = self.reducer.held_count()
        self.reducer.clear()
        self._free_buffers += self._open.values()
        self._open.clear()
        self._buffer_count -= dropped

    def end_backward(self) -> None:
        """Wait for every collective of this backward (the runtime launched the rest)."""
        self.reducer.drain()
        if self.sharded_grads:
            self._micro_since_step += 1
        self.touched = [False] * len(self.params)

    # -- step -------------------------------------------------------------------------------------------------
    def gather_bucket(self, index: int) -> None:
        """Bucket `index`'s chunk is stepped: all-gather every rank's updated chunk into the flat parameter
        buffer, asynchronously (gather_params waits), while the optimizer steps the next chunk."""
        if self.stage == 0 or self._gathered[index]:
            return
        self._gathered[index] = True
        b = self.layout.buckets[index]
        data = self.param_flat[b.offset:b.offset + b.padded]
        self._gathers.append(self.comm.all_gather(data, self._own_chunk(self.param_flat, b),
                                                  f"updated parameters of bucket {b.index}", async_op=True))

    def gather_params(self) -> None:
        """After the step: every bucket gathered (those the optimizer did not hand over chunk by chunk now), and
        waited for."""
        for index in range(len(self.layout.buckets)):
            self.gather_bucket(index)
        for w in self._gathers:
            w.wait()
        self._gathers.clear()
        self._gathered = [False] * len(self.layout.buckets)

    def zero_grad(self) -> None:
        if self.keep_grads:
            if self.grad_flat is not None:
                self.grad_flat.zero_()
        else:
            self.free_grads()
        self._buffer_count -= len(self._free_buffers)  # stage 2's buckets: reduction memory, none kept to the next
        self._free_buffers.clear()  # step (at DeepSpeed's default bucket size one is the whole 16-bit gradient)
        self._micro_since_step = 0  # stage 2: the next reduced chunk overwrites the shard
        self.used = [False] * len(self.params)



def _allocate_master(spec: RuntimeSpec, store: ShardStore, layout: Layout, rank: int) -> torch.Tensor | None:
    """The fp32 master shard in its home: the optimizer's files, split between the device and the host (partial
    offload, offload/partial.py: where a piece ends), the host, or the device in mixed precision; None in fp32
    without offload (the flat parameter buffer is the master)."""
    numel = layout.shard_numel
    if spec.offload_optimizer == "nvme":
        return store.allocate(numel, spec.master_dtype, "nvme")
    if spec.partial:
        pieces = [(q.shard_start, q.shard_start + q.numel) for q in layout.pieces(rank)]
        return store.allocate_split(numel, split_point(numel, spec.offload_ratio, pieces), spec.master_dtype,
                                    pin=spec.pin_optimizer)
    if spec.offloaded:
        return store.allocate(numel, spec.master_dtype, "host", pin=spec.pin_optimizer)
    if spec.mixed:
        return aligned_empty(numel, spec.master_dtype, spec.device)
    return None


def _write_bucket(b: Bucket, params: list[torch.nn.Parameter], param_flat: torch.Tensor, master: torch.Tensor | None,
                  chunk: tuple[int, int], store: ShardStore) -> None:
    """Bucket b of the flat working-dtype buffer from its parameters' own values (fp32, before any rounding to 16
    bits), and this rank's chunk of it into the fp32 master shard (chunk: its (start, size) in the flat buffer)."""
    values = ops.flatten([p.detach() for p in params[b.first:b.last]], torch.float32, align=ALIGN).to(param_flat.device)
    bucket = param_flat[b.offset:b.offset + b.padded]
    bucket[:b.numel].copy_(values)
    bucket[b.numel:].zero_()  # padding stays zero
    if master is not None:
        lo, size = chunk
        start = lo - b.offset
        real = max(0, min(size, b.numel - start))  # the rest of the chunk is padding
        mine = master[b.shard_offset:b.shard_offset + size]
        if store.in_files(mine):
            store.write(mine, torch.cat([values[start:start + real].cpu(), torch.zeros(size - real)]))
        else:
            mine[:real].copy_(values[start:start + real])
            mine[real:].zero_()


def _in_order(*calls):
    """One callable running the given calls in order (None ones skipped), or None when there are none."""
    calls = [c for c in calls if c is not None]
    if not calls:
        return None

    def run() -> None:
        for call in calls:
            call()
    return run
