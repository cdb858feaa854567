"""ZeRO stages 0, 1 and 2: flat parameter buffers, bucketed gradient reduction, shard bookkeeping.

    python -m pytest tests/test_engine.py -q -k "stage0 or stage1 or stage2"

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
from collections import deque

import torch

from zkern import ops
from zkern.comm.collectives import Comm, CommError, Work
from zkern.comm.divergence import TagKind, exchange_tags
from zkern.comm.schedule import ReduceSchedule, fold_reduced
from zkern.comm.whole import WholeBucket, gather_whole
from zkern.comm.zeropp import QuantizedReduce
from zkern.core.owners import register_owner
from zkern.core.partition import Bucket, Layout, plan_layout
from zkern.core.runtime import ShardMap
from zkern.core.state import Component, host_copy
from zkern.offload.host import host_tensor
from zkern.optim.shard_adam import Chunk, ShardGroup

log = logging.getLogger("zkern")


class FlatGroup:
    """One group of trainable parameters packed into flat buffers, for ZeRO stages 0, 1 and 2."""

    def __init__(self, params: list[torch.nn.Parameter], names: list[str], *, stage: int, comm: Comm,
                 dtype: torch.dtype, mixed: bool, bucket_numel: int, overlap: bool, reduce_scatter: bool,
                 offload: bool = False, pin_memory: bool = False, comm_dtype: torch.dtype | None = None,
                 accum_dtype: torch.dtype | None = None, device: torch.device | None = None, nvme=None):
        """comm_dtype: the dtype gradients are reduced in (communication_data_type); accum_dtype: the dtype they
        accumulate in across micro-steps (data_types.grad_accum_dtype); both default to the working dtype. device:
        where the buffers live (default: where the parameters are). nvme: an engine.nvme.NvmeShard when
        offload_optimizer.device is "nvme": the master shard is a region of its files (self.master is then the
        region's meta stand-in)."""
        self.params, self.names, self.stage, self.comm = params, names, stage, comm
        self.dtype, self.mixed, self.overlap, self.reduce_scatter = dtype, mixed, overlap, reduce_scatter
        self.comm_dtype, self.accum_dtype = comm_dtype or dtype, accum_dtype or dtype
        self.quantized: QuantizedReduce | None = None  # qgZ at stage 2 (Stage12Runtime sets it)
        self.quantized_key = 0
        self.shard_world = 1 if stage == 0 else comm.world
        self.shard_rank = 0 if stage == 0 else comm.rank
        self.layout: Layout = plan_layout([p.numel() for p in params], self.shard_world, bucket_numel)
        layout = self.layout
        device = torch.device(device) if device is not None else params[0].device

        # The flat working-dtype parameters and the fp32 master shard (mixed precision, or offloaded: then on the
        # host even in fp32), written one bucket at a time from the parameters' own values (fp32, before any
        # rounding to 16 bits; on the host or the device): each bucket's parameters become views into the flat
        # buffer as soon as it is written, so their old storage goes at once and building holds one bucket of fp32
        # beside the model. torch.empty commits pages only as they are written.
        self.param_flat = torch.empty(layout.total, dtype=dtype, device=device)
        self.nvme = nvme
        self.master = None
        if nvme is not None:
            self.master = nvme.add_region(layout.shard_numel)
        elif mixed or offload:
            self.master = host_tensor(layout.shard_numel, torch.float32, pin=pin_memory) if offload else \
                torch.empty(layout.shard_numel, dtype=torch.float32, device=device)
        for b in layout.buckets:
            values = ops.flatten([p.detach() for p in params[b.first:b.last]], torch.float32).to(device)
            bucket = self.param_flat[b.offset:b.offset + b.padded]
            bucket[:b.numel].copy_(values)
            bucket[b.numel:].zero_()  # padding stays zero
            if self.master is not None:
                lo, size = layout.chunk_range(b, self.shard_rank)
                start = lo - b.offset
                real = max(0, min(size, b.numel - start))  # the rest of the chunk is padding
                mine = self.master[b.shard_offset:b.shard_offset + size]
                if nvme is not None:
                    nvme.write("master", mine, torch.cat([values[start:start + real].cpu(),
                                                          torch.zeros(size - real)]))
                else:
                    mine[:real].copy_(values[start:start + real])
                    mine[real:].zero_()
            del values
            for i in range(b.first, b.last):
                params[i].data = self._param_view(self.param_flat, i)

        # Gradients: stages 0-1 a full flat buffer, stage 2 a shard, in the accumulation dtype. Where that is the
        # working dtype, the flat buffer's views are the parameters' .grad and autograd accumulates into them;
        # otherwise each gradient is added into the buffer as it arrives and freed.
        self.grad_flat = self.grad_shard = None
        self._grad_views = None
        if stage < 2:
            self.grad_flat = torch.zeros(layout.total, dtype=self.accum_dtype, device=device)
            if self.accum_dtype == dtype:
                self._attach_grad_views()
        else:
            self.grad_shard = torch.zeros(layout.shard_numel, dtype=self.accum_dtype, device=device)
        self._bucket_capacity = max(b.padded for b in layout.buckets)  # every stage-2 bucket buffer's size
        self._free_buffers: list[torch.Tensor] = []  # stage 2 bucket buffers not in use
        self._buffer_count = 0
        self._open: dict[int, torch.Tensor] = {}  # stage 2: bucket index -> buffer being filled
        # (bucket, work, stage-2 buffer, (reduced copy, where it goes) when reduced in another dtype)
        self._in_flight: deque[tuple[Bucket, Work, torch.Tensor | None, tuple | None]] = deque()

        self.bucket_of = [b for b in layout.buckets for _ in range(b.first, b.last)]
        self.fired = [False] * len(params)  # got a gradient in this backward
        self.counted = [False] * len(params)  # counted toward its bucket's completion in this backward
        self.touched = [False] * len(params)  # a module that owns or declares it ran forward in this micro-step
        self.used = [False] * len(params)  # got a gradient in any micro-step since the last optimizer step
        self._micro_since_step = 0  # stage 2: reduced micro-steps accumulated into grad_shard
        self._gathers: list[Work] = []  # post-step all-gathers in flight
        self._gathered = [False] * len(layout.buckets)
        self.pieces = layout.pieces(self.shard_rank)
        self.shard_group = self._make_shard_group()

    # -- views ------------------------------------------------------------------------------------------------
    def _param_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        off, n = self.layout.offsets[i], self.layout.numels[i]
        return flat[off:off + n].view(self.params[i].shape)

    def _attach_grad_views(self) -> None:
        self._grad_views = [self._param_view(self.grad_flat, i) for i in range(len(self.params))]
        for p, view in zip(self.params, self._grad_views):
            p.grad = view

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
        splits the work: rank r takes every world-th bucket."""
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
        return ShardGroup(pieces=pieces, chunks=chunks)

    def active_pieces(self, used: list[bool]) -> list[bool]:
        """For each shard piece: did its parameter get a gradient on any rank (used: global flags)?"""
        return [used[piece.param] for piece in self.pieces]

    # -- backward ---------------------------------------------------------------------------------------------
    def begin_backward(self) -> None:
        self.fired = [False] * len(self.params)
        self.counted = [False] * len(self.params)
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
        if self.stage == 2:
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
        if self.stage == 2:
            buf = self._open.pop(b.index, None)
            if buf is None:
                buf = self._take_buffer(b)
            self._zero_unfilled(buf, b)
            data = buf[:b.padded]
            if self.reduce_scatter:  # qgZ has reduce-scatter's contract (refused without reduce_scatter)
                out = data[self.shard_rank * b.chunk:(self.shard_rank + 1) * b.chunk]
                via = self.comm if self.quantized is None else self.quantized.bucket((self.quantized_key, b.index))
                work = via.reduce_scatter(out, data, purpose, async_op=self.overlap)
            else:  # reduce_scatter=false: all-reduce the bucket, then keep this rank's chunk of it
                work = self.comm.all_reduce(data, purpose, async_op=self.overlap)
            self._in_flight.append((b, work, buf, None))
        else:
            data = self.grad_flat[b.offset:b.offset + b.padded]
            # Reduced in place, or, in another communication dtype, through a copy cast back on arrival.
            wire = data if data.dtype == self.comm_dtype else data.to(self.comm_dtype)
            scatter = self.stage == 1 and self.reduce_scatter
            if scatter:
                out = wire[self.shard_rank * b.chunk:(self.shard_rank + 1) * b.chunk]
                work = self.comm.reduce_scatter(out, wire, purpose, async_op=self.overlap)
            else:
                work = self.comm.all_reduce(wire, purpose, async_op=self.overlap)
            back = None
            if wire is not data:
                back = (out, self._own_chunk(self.grad_flat, b)) if scatter else (wire, data)
            self._in_flight.append((b, work, None, back))
        if not self.overlap:
            self._retire_oldest()

    def _zero_unfilled(self, buf: torch.Tensor, b: Bucket) -> None:
        """Zero the slots of parameters that got no gradient in this backward, and the padding."""
        for i in range(b.first, b.last):
            if not self.fired[i]:
                off = self.layout.offsets[i] - b.offset
                buf[off:off + self.layout.numels[i]].zero_()
        buf[b.numel:b.padded].zero_()

    def _take_buffer(self, b: Bucket) -> torch.Tensor:
        """A stage-2 bucket buffer; reuses one whose collective has finished before allocating another."""
        if not self._free_buffers and self._in_flight:
            self._retire_oldest()
        if self._free_buffers:
            return self._free_buffers.pop()
        self._buffer_count += 1
        return torch.empty(self._bucket_capacity, dtype=self.comm_dtype, device=self.param_flat.device)

    def _retire_oldest(self) -> None:
        b, work, buf, back = self._in_flight.popleft()
        work.wait()
        if back is not None:
            back[1].copy_(back[0])
        if buf is not None:  # stage 2: fold this micro-step's reduced chunk into the gradient shard
            fold_reduced(self.grad_shard[b.shard_offset:b.shard_offset + b.chunk],
                         buf[self.shard_rank * b.chunk:(self.shard_rank + 1) * b.chunk], self._micro_since_step == 0)
            self._free_buffers.append(buf)

    def end_backward(self) -> None:
        """Wait for every collective of this backward (the runtime launched the rest)."""
        while self._in_flight:
            self._retire_oldest()
        if self.stage == 2:
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
        if self.grad_flat is not None:
            self.grad_flat.zero_()
        self._micro_since_step = 0  # stage 2: the next reduced chunk overwrites the shard
        self.used = [False] * len(self.params)

    def whole(self, what: str, keep: bool) -> dict[int, torch.Tensor]:
        """id(parameter) -> whole value (collective where shards must be gathered): "fp32" weights, "working"
        weights, or the reduced "grads" as the optimizer reads them (loss-scaled, summed over ranks). Parameters
        are whole on every rank at stages 0-2, so only the fp32 master and the gradient shards are gathered."""
        device = self.param_flat.device
        match what:
            case "fp32" if self.master is not None:
                return gather_whole(self.comm, self.shard_world, self._whole_buckets(False),
                                    self._master_chunk, torch.float32, device,
                                    "fp32 weights", keep)
            case "fp32" | "working":
                dtype = torch.float32 if what == "fp32" else self.dtype
                return gather_whole(self.comm, 1, self._whole_buckets(True), lambda i: self._bucket(self.param_flat, i),
                                    dtype, device, f"{what} weights", keep)
            case "grads" if self.stage == 0:
                return gather_whole(self.comm, 1, self._whole_buckets(True), lambda i: self._bucket(self.grad_flat, i),
                                    self.accum_dtype, device, "gradients", keep)
            case "grads":
                return gather_whole(self.comm, self.shard_world, self._whole_buckets(False),
                                    lambda i: self.grad_chunk(self.layout.buckets[i]), self.accum_dtype, device,
                                    "reduced gradients", keep)
            case _:
                raise ValueError(f"whole() takes 'fp32', 'working' or 'grads', got {what!r}")

    def _whole_buckets(self, whole: bool) -> list[WholeBucket]:
        """Each bucket's tensors and where they lie in it; chunk: what each rank contributes (the whole padded
        bucket where nothing needs gathering)."""
        return [WholeBucket(b.padded if whole else b.chunk,
                            tuple((id(self.params[i]), self.layout.offsets[i] - b.offset, self.params[i].shape)
                                  for i in range(b.first, b.last))) for b in self.layout.buckets]

    def _bucket(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        b = self.layout.buckets[i]
        return flat[b.offset:b.offset + b.padded]

    def _master_chunk(self, i: int) -> torch.Tensor:
        """Bucket i's chunk of the fp32 master (read from disk when it is there)."""
        chunk = self.master[self._shard_slice(i)]
        return self.nvme.read("master", chunk) if chunk.is_meta else chunk

    def _shard_slice(self, i: int) -> slice:
        b = self.layout.buckets[i]
        return slice(b.shard_offset, b.shard_offset + b.chunk)

    def write_master(self, i: int, before: torch.Tensor) -> None:
        """Parameter i's working values were written (GatheredParameters with a modifier rank; `before`: its values
        when the context began): the elements that changed take the new value in this rank's fp32 master pieces."""
        if self.master is None:  # fp32 without offload: the flat parameter buffer is the master
            return
        new = self.params[i].detach().reshape(-1)
        changed = new != before.reshape(-1)
        for piece in self.pieces:
            if piece.param != i:
                continue
            lo, hi = piece.param_start, piece.param_start + piece.numel
            region = self.master[piece.shard_start:piece.shard_start + piece.numel]
            master = self.nvme.read("master", region) if region.is_meta else region
            merged = torch.where(changed[lo:hi].to(master.device), new[lo:hi].to(master.device, torch.float32),
                                 master)
            if region.is_meta:
                self.nvme.write("master", region, merged)
            else:
                region.copy_(merged)

    # -- state (engine/state.py) ------------------------------------------------------------------------------
    def master_values(self) -> torch.Tensor | None:
        """The fp32 master shard's values (read from its files when on NVMe), or None in fp32 without offload."""
        if self.master is None:
            return None
        return self.nvme.read("master", self.master) if self.master.is_meta else self.master

    def grad_values(self) -> dict:
        """The accumulated gradient as the next step would read it (stage 2's shard only counts once a
        micro-step has been folded into it since the last step)."""
        if self.grad_shard is not None:
            shard = self.grad_shard if self._micro_since_step else torch.zeros_like(self.grad_shard)
            return {"grad_shard": shard, "used": list(self.used)}
        return {"grad_flat": self.grad_flat, "used": list(self.used)}

    def weight_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.param_flat, self.master) if t is not None] + list(self.params)

    def grad_tensors(self) -> list[torch.Tensor]:
        grads = [t for t in (self.grad_flat, self.grad_shard) if t is not None]
        return grads + list(self._grad_views or ()) + [p.grad for p in self.params if p.grad is not None]

    def scratch_tensors(self) -> list[torch.Tensor]:
        """Stage 2's bucket buffers: filled and reduced within one backward."""
        in_flight = [buf for _, _, buf, _ in self._in_flight if buf is not None]
        return [*self._free_buffers, *self._open.values(), *in_flight]

    # -- accounting -------------------------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor | None) -> int:  # a meta stand-in (states on NVMe) holds no memory
            return 0 if t is None or t.is_meta else t.numel() * t.element_size()

        grads = nbytes(self.grad_flat) + nbytes(self.grad_shard)
        buffers = self._buffer_count * self._bucket_capacity * self.comm_dtype.itemsize
        return {"params": nbytes(self.param_flat), "grads": grads, "master": nbytes(self.master),
                "comm_buffers": buffers}


class Stage12Runtime:
    """The stage 0/1/2 runtime the engine drives: one FlatGroup per non-empty optimizer param group, their buckets
    reduced in one ReduceSchedule."""

    def __init__(self, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], names: dict[int, str],
                 *, quantized: QuantizedReduce | None = None, **kwargs):
        """quantized: qgZ's two-hop int4 reduction (zeropp.py), stage 2 only; kwargs: FlatGroup's."""
        # Reverse registration order: backward produces gradients roughly last layer first, so buckets fill in
        # order. Empty optimizer groups get no FlatGroup and stay empty in the optimizer.
        self.flat = [FlatGroup(g[::-1], [names[id(p)] for p in g[::-1]], **kwargs) if g else None for g in groups]
        self.groups = [g for g in self.flat if g is not None]
        self.quantized = quantized
        if quantized is not None and kwargs["stage"] != 2:
            raise ValueError(f"quantized gradients (qgZ) replace stage 2's reduce-scatter, not stage "
                             f"{kwargs['stage']}'s")
        for gi, g in enumerate(self.groups):
            g.quantized, g.quantized_key = quantized, gi
        self.shard_groups = [g.shard_group if g is not None else ShardGroup([], []) for g in self.flat]
        self.params = [p for g in self.groups for p in g.params]
        self.names = [n for g in self.groups for n in g.names]
        self.stage = kwargs["stage"]
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
        self._handles = []
        for g in self.groups:
            for i, p in enumerate(g.params):
                self._handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(g, i)))
        # Which modules' forward makes a parameter able to get a gradient: its owners and declared readers.
        readers: dict[int, list[tuple[FlatGroup, int]]] = {}
        index = self._index = {id(p): (g, i) for g in self.groups for i, p in enumerate(g.params)}
        register_owner(model.parameters(), self)  # zkern.GatheredParameters writes through pin/unpin
        for module in model.modules():
            own = [*module.parameters(recurse=False), *module.__dict__.get("_zkern_external_params", ())]
            mine = [index[id(p)] for p in own if id(p) in index]
            if mine:
                readers[id(module)] = mine
                self._handles.append(module.register_forward_pre_hook(self._touch_hook(mine)))

    @staticmethod
    def _touch_hook(entries: list[tuple[FlatGroup, int]]):
        def hook(module, args) -> None:
            for g, i in entries:
                g.touched[i] = True
        return hook

    def _grad_hook(self, g: FlatGroup, i: int):
        def hook(p: torch.Tensor) -> None:
            self._on_grad(g, i, p)
        return hook

    def _on_grad(self, g: FlatGroup, i: int, p: torch.Tensor) -> None:
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
        """Stage 2 reduces every micro-step, stages 0-1 at the boundary. Parameters no module of which ran forward
        count as complete now: their gradient is zero in this backward."""
        self._reducing = self.stage == 2 or boundary
        for g in self.groups:
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
        self._reducing = False

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
        """loss.backward() raised: the next backward starts over (begin_backward resets the pass state)."""

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
        """The optimizer finished chunk `chunk` of optimizer group `group` (a bucket): start gathering it, so the
        all-gathers run while the optimizer steps the rest."""
        flat = self.flat[group]
        if flat is not None:
            flat.gather_bucket(chunk)

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

    def full_fp32(self, rank0_only: bool) -> dict[int, torch.Tensor] | None:
        """id(parameter) -> its fp32 value (collective; None off rank 0 with rank0_only)."""
        keep = not rank0_only or self.groups[0].comm.rank == 0
        values = {k: v for g in self.groups for k, v in g.whole("fp32", keep).items()}
        return values if keep else None

    def full_working(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> value in the working dtype, for saving 16-bit weights."""
        return {k: v for g in self.groups for k, v in g.whole("working", True).items()}

    def full_grads(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> the reduced gradient as the optimizer reads it: the sum over ranks of loss_scale /
        gradient_predivide_factor times each rank's gradient, in the accumulation dtype (a collective; for tests
        and debugging, between the last backward and step())."""
        return {k: v for g in self.groups for k, v in g.whole("grads", True).items()}

    # -- GatheredParameters (gathered.py) ---------------------------------------------------------------------
    def pin(self, params: list[torch.nn.Parameter], modifier_rank: int | None) -> list:
        """Parameters are whole at stages 0-2: nothing to gather. With a modifier rank, each one's values are kept,
        so that unpin can tell which elements the modifier changed (a collective: the ranks check they agree)."""
        comm = self.groups[0].comm
        if modifier_rank is not None and modifier_rank >= comm.world:
            raise ValueError(f"GatheredParameters: modifier_rank {modifier_rank} is not a rank of this world of "
                             f"{comm.world}")
        tags = exchange_tags(comm, (TagKind.PIN, len(params), -1 if modifier_rank is None else modifier_rank),
                             self.groups[0].param_flat.device)
        if any(t != tags[0] for t in tags):
            raise CommError(f"zkern rank {comm.rank} of {comm.world}: GatheredParameters was entered with different "
                            f"parameters or modifier ranks on different ranks ({tags}); every rank must pass the same "
                            f"parameters in the same order")
        return [(p, p.detach().clone() if modifier_rank is not None else None) for p in params]

    def unpin(self, pinned: list, modifier_rank: int | None) -> None:
        """Leave a GatheredParameters context. With modifier_rank, that rank's values reach every rank's copy, and
        the elements it changed the fp32 master shard (which the next step would otherwise write back over them;
        the others keep their fp32 master value, which the 16-bit copy had only rounded). The optimizer's moments
        are kept. Without one, the parameters are the training copies as they are: a change made in the context
        on one rank is not written into the masters, and the next optimizer step writes over it."""
        if modifier_rank is None:
            return
        comm = self.groups[0].comm
        with torch.no_grad():
            for p, before in pinned:
                comm.broadcast(p.data, f"GatheredParameters: a parameter modified on rank {modifier_rank}",
                               src=modifier_rank)
                if id(p) in self._index:
                    g, i = self._index[id(p)]
                    g.write_master(i, before)

    def add_external_reader(self, module: torch.nn.Module, p: torch.nn.Parameter) -> None:
        """`module` reads p in its forward (GatheredParameters' fwd_module): its forward now marks p as able to get
        a gradient in that micro-step."""
        if id(p) in self._index:
            self._handles.append(module.register_forward_pre_hook(self._touch_hook([self._index[id(p)]])))

    def state_components(self) -> list[Component]:
        """This runtime's state for the engine's registry (engine/state.py)."""
        out = [
            Component("stage12.weights", "weights",
                      snapshot=lambda: host_copy([{"param_flat": g.param_flat, "master": g.master_values()}
                                                  for g in self.groups]),
                      tensors=lambda: [t for g in self.groups for t in g.weight_tensors()]),
            Component("stage12.gradients", "transient", reset=self.zero_grad,
                      snapshot=lambda: host_copy([g.grad_values() for g in self.groups]),
                      tensors=lambda: [t for g in self.groups for t in g.grad_tensors()]),
            Component("stage12.buckets", "scratch",
                      tensors=lambda: [t for g in self.groups for t in g.scratch_tensors()]),
        ]
        if self.quantized is not None:
            out += self.quantized.state_components()
        return out

    def memory(self) -> dict[str, int]:
        report: dict[str, int] = {"host_params": 0}
        for g in self.groups:
            for key, value in g.memory().items():
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
        return lines

    def warnings(self, reduce_bucket_size: int) -> list[str]:
        out = []
        for g in self.groups:
            if g.stage == 2 and g.comm.world > 1 and len(g.layout.buckets) == 1:
                n = g.layout.numel
                out.append(f"stage 2 with one gradient bucket: reduce_bucket_size ({reduce_bucket_size}) >= the {n} "
                           f"trainable elements, so backward fills a bucket as large as the whole gradient and stage 2 "
                           f"holds as much gradient memory as stage 1. Set zero_optimization.reduce_bucket_size well "
                           f"below {n} (\"auto\" = hidden_size**2) to keep the saving.")
        return out
