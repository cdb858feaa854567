"""ZeRO-Offload: the optimizer step on the host, fed through host staging buffers.

    python -m pytest tests/offload/test_offload.py -q

With zero_optimization.offload_optimizer.device = "cpu", the stage runtimes keep the fp32 master shard on the
host (host_tensor) and the optimizer's moments follow it there. Each step, HostStep copies this rank's
gradient shard from the device into a host buffer in its own dtype (the CPU Adam upcasts inside its pass),
steps chunk by chunk on the host, writing the updated parameter straight into a host buffer in the working
dtype, and copies that back into the device's parameter shard. On CUDA the copies run on a side stream:
chunk i+1's gradient comes down while chunk i steps, and chunk i's parameters go up while chunk i+1 steps.
With offload_param (stage 3) the parameter shard itself lives on the host, so nothing goes back (with the delayed
update or the speculative step the new values are staged, and copied into it once they stand); with its device
"nvme" the updated chunks go to the parameter file instead (nvme_params.py). Only the pieces that stepped are
sent: the others' values may have been written since the staging copy was filled (GatheredParameters, a load).
With offload_optimizer "nvme" the optimizer (nvme.NvmeAdam) streams master and moments from files and calls the
same per-chunk hooks.

Gradients leave during backward (offload_optimizer.copy_grads_during_backward, on by default, as DeepSpeed's
ZeRO-Offload copies them): in the boundary's backward the runtime reports each region of its gradient shard as its
reduction lands (grad_final), and a chunk whose whole gradient has landed is copied down at once, on the side stream
after an event on the compute stream, while backward goes on; step() copies only the chunks not yet down. Anything
that writes the device gradients between backward and step (safe_set_full_grad and the local views, zero_grad's
drop) calls invalidate(), and step() copies every chunk again.

The delayed update (offload_optimizer.delayed_update, ZeRO-Offload's DPU; off by default): step i's host Adam runs
in a background thread while the loop goes on to step i+1's forward and backward, and its parameters go up at step
i+1's step(), before that step's own Adam starts. So the forward of step i+1 still computes with the weights before
update i, and update i+1 applies a gradient taken at those weights: the arithmetic of
zkern.testing.reference_run with the same delay. Only the host master, moments and staging are touched in the
background; what else reads or writes them waits for it (ShardStore's read and write), and a write through the
store, or a checkpoint save, lands the update first (so a resumed run continues exactly as the run that saved). The
background Adam steps the chunks in the order their gradients landed in the backward before it, and the next
backward's copy of a chunk waits only for that chunk's Adam: the backward lands its chunks in the same order again,
so it waits only where the Adam falls behind it.

On a CPU-only run host and device are the same memory; the staging copies still run, so the path a GPU
takes is the path CPU tests check.
"""

from __future__ import annotations

import bisect
import threading
import time

import torch

from zkern.core.buffers import aligned_zeros, allocated_bytes
from zkern.core.pinned import pinned_zeros
from zkern.core.shard_groups import Chunk, ShardGroup, shares_staging
from zkern.offload.delayed import DelayedUpdate
from zkern.offload.partial import host_share
from zkern.offload.speculative import SpeculativeStep
from zkern.optim.shard_adam import ShardAdam, step_torch_optimizer


def host_tensor(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A zeroed host buffer; page-locked when pin (only meaningful, and only asked, with CUDA present), at exactly its
    size (core/pinned.py: torch's pinned allocator would round it up to a power of two)."""
    return pinned_zeros(numel, dtype) if pin else aligned_zeros(numel, dtype, "cpu")


class HostStep(DelayedUpdate, SpeculativeStep):
    """Staging buffers and the copy/step pipeline of an offloaded optimizer step."""

    background_threads: int | None = None  # the CPU Adam's threads beside the training thread (cpuadam_cores_perc)

    def __init__(self, device_groups: list[ShardGroup], *, pin: bool, out_on_host: bool, store=None,
                 during_backward: bool = True, delayed: bool = False, staging_chunks: int = 0,
                 per_chunk: bool = False, speculative: bool = False):
        """device_groups: the runtime's shard groups (param = host master chunk, grad = device gradient chunk,
        out = device parameter chunk, or a host one when out_on_host). An out that is a meta stand-in (the
        parameter shard on NVMe) is staged on the host and sent with write(out, values); read(out) gives its
        starting values. delayed: the delayed update (the module docstring); a host out is staged too, since the
        forward reads it while the update is computed.

        Where the parameters live on the device in the gradient's dtype and the update is not delayed, one host
        buffer per chunk stages both ways: the Adam reads each element's gradient before it writes the element's
        new value in the same place (every optimizer zkern steps is element-wise, and a torch optimizer's copy-out
        runs after its whole step), and the uploads leave on the side stream before the next backward's copies
        come down it. Host staging is then one copy of the shard in the working dtype, not two. Nothing else
        writes such a buffer (shares_staging).

        staging_chunks > 0 (offload_optimizer.staging_chunks), where every chunk stages both ways and the optimizer
        steps chunk by chunk (per_chunk: zkern's Adam on host masters): the staging is a ring of that many
        chunk-sized buffers instead of the whole shard. The chunk at position p of a step's order stages in buffer
        p mod staging_chunks; the chunk staging_chunks later comes down only after that one's parameters went up
        (the same side stream, in order). In a boundary's backward the first staging_chunks chunks to land come
        down; the rest at step(), each behind the Adam of the one before. speculative: offload/speculative.py's
        step (new parameters wait in staging for the decision: a buffer per chunk, never the ring)."""
        self.device_groups = device_groups
        self.store = store
        self._active: list[list[bool]] | None = None
        cuda = any(c.grad.is_cuda for g in device_groups for c in g.chunks)
        self.stream = torch.cuda.Stream() if cuda else None
        # the host copies of the shard groups, and the ring of staging buffers they share (else None)
        self.host_groups, self.ring = _staged_groups(device_groups, store, pin=pin, out_on_host=out_on_host,
                                                     delayed=delayed, staging_chunks=staging_chunks,
                                                     per_chunk=per_chunk, speculative=speculative)
        self._position: dict[tuple[int, int], int] = {}  # ring: each chunk's place in this step's order
        # the host part of the shard, once a step (all of it but partial offload's device part)
        self.grad_bytes = sum(c.grad.nbytes for g in self.host_groups for c in g.chunks if not c.on_device)
        # partial offload: the chunks stepped on the device, first in each step (their kernels run while the host
        # steps the rest), and the elements of each part
        self.device_keys = [(gi, ci) for gi, g in enumerate(self.host_groups) for ci, c in enumerate(g.chunks)
                            if c.on_device]
        self.device_numel, self.host_numel = host_share([c for g in self.host_groups for c in g.chunks])
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}
        self.during_backward = during_backward
        self._sent: set[tuple[int, int]] | None = None  # chunks copied down in this boundary backward (None: none)
        self._spans: list[tuple[int, int, tuple[int, int]]] | None = None  # device gradient byte ranges, sorted
        self._missing: dict[tuple[int, int], int] = {}  # bytes of each chunk's gradient not yet landed
        self._backward_copy_s = 0.0  # host time copying (on CUDA: issuing copies of) gradients during backward
        self._wait_s = self._device_s = self._chunk_began = 0.0
        self.last_step: dict = {}  # the last applied step's accounting (see step())
        self.delayed = delayed
        self._flight: threading.Thread | None = None  # the delayed update's host Adam, while it runs
        self._flight_error: BaseException | None = None
        self._flight_done: set[tuple[int, int]] = set()  # chunks the background Adam has finished
        self._flight_over = True  # it has finished them all (or failed)
        self._flight_news = threading.Condition()
        self._landed: list[tuple[int, int]] = []  # chunks in the order their gradients landed in this backward
        # the runtime's refresh (a collective): the whole copies follow the landed weights (stage 3's persistent
        # units, stages 1-2's gather of every rank's chunk); set by the engine's build
        self.on_landed = None
        self._to_land: list[list[bool]] | None = None  # the delayed update's active pieces, until its parameters go up
        self._init_speculation(speculative)

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the staging buffers, from their allocations (a buffer that stages both ways counts once)."""
        return allocated_bytes(self.staging_tensors())

    def staging_tensors(self) -> list[torch.Tensor]:
        """The host staging buffers: gradient copies (scratch within a step) and, where the parameters live on the
        device, the working copy the host step writes (derived from the master; refreshed piece by piece)."""
        if self.ring is not None:
            return list(self.ring)
        out = []
        for host, device in zip(self.host_groups, self.device_groups):
            for h, d in zip(host.chunks, device.chunks):
                if h.on_device:
                    continue
                out.append(h.grad)
                if h.out is not None and h.out is not d.out and not shares_staging(h):
                    out.append(h.out)
        return out

    # -- copies -----------------------------------------------------------------------------------------------
    def _down(self, gi: int, ci: int) -> None:
        """Device gradient chunk -> host staging (async on CUDA; the event marks its arrival)."""
        src, dst = self.device_groups[gi].chunks[ci].grad, self.host_groups[gi].chunks[ci].grad
        if self.stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events[(gi, ci)] = event

    def _up(self, gi: int, ci: int) -> None:
        """Host parameter chunk -> device parameter shard (async on CUDA), or its file. Only the pieces that
        stepped go: the others' device values may have changed since the staging copy was last written (a
        GatheredParameters write, a checkpoint load) and must not be overwritten with it."""
        dev, host = self.device_groups[gi].chunks[ci].out, self.host_groups[gi].chunks[ci].out
        if host is None or host is dev:
            return
        for lo, hi in self._stepped(gi, ci):
            if self.store.in_files(dev):
                self.store.write(dev[lo:hi], host[lo:hi])
            elif self.stream is None:
                dev[lo:hi].copy_(host[lo:hi])
            else:
                with torch.cuda.stream(self.stream):
                    dev[lo:hi].copy_(host[lo:hi], non_blocking=True)

    def _timed_down(self, key: tuple[int, int]) -> None:
        """_down at step(); on a CPU the copy itself is the step's wait for the gradient."""
        start = time.perf_counter()
        self._down(*key)
        self._wait_s += time.perf_counter() - start if self.stream is None else 0.0

    def _place(self, key: tuple[int, int], position: int) -> None:
        """Ring: the chunk at `position` of this step's order stages (both ways) in buffer position mod its size."""
        chunk = self.host_groups[key[0]].chunks[key[1]]
        chunk.grad = chunk.out = self.ring[position % len(self.ring)][:chunk.grad.numel()]
        self._position[key] = position

    def _up_and_next(self, gi: int, ci: int) -> None:
        """Ring: this chunk's parameters go up, then the chunk that takes its buffer next comes down behind them
        (on the same stream, so the copy engine has read the buffer before the Adam writes it again)."""
        if (gi, ci) not in self._position:  # partial offload's device part: stepped in place, outside the ring
            return
        self._up(gi, ci)
        later = self._position[(gi, ci)] + len(self.ring)
        if later < len(self._order):
            self._timed_down(self._order[later])

    def _stepped(self, gi: int, ci: int) -> list[tuple[int, int]]:
        return stepped_ranges(self.host_groups[gi].chunks[ci], self._active[gi])

    def _before_chunk(self, gi: int, ci: int) -> None:
        self._chunk_began = time.perf_counter()
        self._wait_down(gi, ci)

    def _after_chunk(self, then):
        """then(gi, ci) after a chunk's Adam, which adds a device chunk's host time (on a GPU: its launches) to the
        step's device_step_s (partial offload's device part)."""
        def after(gi: int, ci: int) -> None:
            if self.host_groups[gi].chunks[ci].on_device:
                self._device_s += time.perf_counter() - self._chunk_began
            then(gi, ci)
        return after

    def _wait_down(self, gi: int, ci: int) -> None:
        event = self._events.pop((gi, ci), None)
        if event is not None:
            start = time.perf_counter()
            event.synchronize()
            self._wait_s += time.perf_counter() - start

    # -- gradients leaving during backward --------------------------------------------------------------------
    def begin_pass(self, boundary: bool) -> None:
        """A backward begins: at the boundary, the gradients that land in it are copied down as they land; any other
        pass changes gradients already copied, so the step copies them all."""
        self.withdraw("another backward")  # gradients a guess stepped with change in this pass
        self._sent = set() if boundary and self.during_backward else None
        self._spans, self._backward_copy_s, self._landed = None, 0.0, []

    def invalidate(self) -> None:
        """The device gradients were written after they landed: the step copies every chunk again."""
        self.withdraw("gradients written")
        self._sent = None

    def settle(self) -> None:
        """Nothing runs on the host state in the background and no guess is in it: it is the state before the step."""
        self.withdraw("host state read or written")
        DelayedUpdate.settle(self)

    def grad_final(self, region: torch.Tensor) -> None:
        """region (a view of the device gradient) holds its final values for this step: copy down every chunk whose
        whole gradient has now landed."""
        if self._sent is None or region.numel() == 0:
            return
        if self._spans is None:  # the gradient buffers exist from the pass's start (their addresses may change
            self._spans = []     # between steps), so the chunks' byte ranges are read at the pass's first landing
            self._missing = {}
            for gi, g in enumerate(self.device_groups):
                for ci, c in enumerate(g.chunks):
                    if c.on_device:
                        continue
                    lo = c.grad.data_ptr()
                    size = c.grad.numel() * c.grad.element_size()
                    if size:
                        self._spans.append((lo, lo + size, (gi, ci)))
                        self._missing[(gi, ci)] = size
            self._spans.sort()
        lo = region.data_ptr()
        hi = lo + region.numel() * region.element_size()
        at = max(0, bisect.bisect_right(self._spans, (lo, float("inf"))) - 1)
        while at < len(self._spans) and self._spans[at][0] < hi:
            start, end, key = self._spans[at]
            overlap = min(hi, end) - max(lo, start)
            if overlap > 0 and key not in self._sent:
                self._missing[key] -= overlap
                # with the ring full, a chunk that lands now comes down at step() (the ring only fills in backward)
                if self._missing[key] <= 0 and (self.ring is None or len(self._landed) < len(self.ring)):
                    if self.ring is not None:
                        self._place(key, len(self._landed))
                    self._wait_chunk(key)  # the delayed update may still read its host buffer
                    start = time.perf_counter()
                    if self.stream is not None:  # the fold that made it final ran on the compute stream
                        self.stream.wait_stream(torch.cuda.current_stream())
                    self._down(*key)
                    self._sent.add(key)
                    self._landed.append(key)
                    self._backward_copy_s += time.perf_counter() - start
                    self._speculated_landing(key)
            at += 1

    # -- the step ---------------------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, *, grad_scale: float, active: list[list[bool]]) -> None:
        """The offloaded step; last_step then holds its accounting (host clock): how many chunks and bytes of the
        gradient went down during backward and at the step, the host time copying them during backward (on CUDA:
        issuing the copies), the step's host time, and within it the time the step waited for gradients (on a CPU:
        copied them). Delayed: the Adam starts in the background and step() returns (land() sends its parameters);
        last_step's "adam_s" is then the previous delayed Adam's time and "landing_wait_s" how long step() waited
        for it. Speculative: "speculation" (the guess's verdict), "speculated_chunks" (kept), "speculative_adam_s"
        (their Adam's host time), "speculation_wait_s" (step()'s wait for the last of them).
        "background_adam_threads": the threads of an Adam run beside the training thread (None: all)."""
        start = time.perf_counter()
        self._wait_s = self._device_s = 0.0
        if self.delayed:
            self.land()  # the engine's step() landed it already (a skipped step lands it too): then a no-op
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())  # gradients are final on the compute stream
        self._active = active
        began = time.perf_counter()
        kept, fate = self.verdict(grad_scale, active, optimizer)  # a withdrawn guess's chunks come down again
        verdict_s = time.perf_counter() - began
        device = set(self.device_keys)
        order = [(gi, ci) for gi, g in enumerate(self.host_groups) for ci in range(len(g.chunks))
                 if (gi, ci) not in device]
        sent = self._sent or set()
        if self.ring is not None:  # those down already first, in the order they came; then backward's order
            order = [k for k in self._landed if k in sent] + [k for k in reversed(order) if k not in sent]
            for p, key in enumerate(order):
                self._place(key, p)
        self._order = order
        for key in order:
            if key not in sent and (self.ring is None or self._position[key] < len(self.ring)):
                self._timed_down(key)
        moved = sum(self.host_groups[gi].chunks[ci].grad.nbytes for gi, ci in sent)
        self.last_step = {"grad_chunks_in_backward": len(sent), "grad_chunks_at_step": len(order) - len(sent),
                          "device_chunks": len(self.device_keys), "device_numel": self.device_numel,
                          "grad_bytes_in_backward": moved, "grad_bytes_at_step": self.grad_bytes - moved,
                          "backward_copy_s": self._backward_copy_s if sent else 0.0, "speculation": fate,
                          "speculated_chunks": len(kept), "speculative_adam_s": self._spec_adam_s if kept else 0.0,
                          "speculation_wait_s": verdict_s, "background_adam_threads": self.background_threads}
        order = self.device_keys + order  # partial offload: the device part steps first, in place
        self._sent, self._backward_copy_s = None, 0.0
        if self.delayed:
            if self.stream is not None:  # the device gradients may be zeroed once the copies have read them
                torch.cuda.current_stream().wait_stream(self.stream)
            landed = set(self._landed)
            self._launch(optimizer, grad_scale, active, order=self._landed + [k for k in order if k not in landed])
            self.last_step.update(step_s=time.perf_counter() - start, grad_wait_s=self._wait_s,
                                  landing_wait_s=self.landing_wait_s, adam_s=self._adam_s)
            return
        if self.ring is not None:  # zkern's Adam, in the order the ring's buffers were given out
            if type(optimizer) is not ShardAdam:
                raise RuntimeError(f"zkern: offload's staging ring steps chunk by chunk, and the optimizer is "
                                   f"{type(optimizer).__name__}; set offload_optimizer.staging_chunks to 0")
            optimizer.step(grad_scale=grad_scale, active=active, before_chunk=self._before_chunk,
                           after_chunk=self._after_chunk(self._up_and_next), order=order)
        elif isinstance(optimizer, ShardAdam):
            optimizer.step(grad_scale=grad_scale, active=active, before_chunk=self._before_chunk,
                           after_chunk=self._after_chunk(self._up),
                           **({"order": order} if self.device_keys else {}) | self._send_kept(kept, order))
        else:  # a torch optimizer (or Muon) steps every piece at once
            for gi, ci in order:
                self._wait_down(gi, ci)
            step_torch_optimizer(optimizer, self.host_groups, grad_scale=grad_scale, active=active)
            for gi, ci in order:
                self._up(gi, ci)
        if self.stream is not None:
            # The next forward reads the parameters on the compute stream: it waits for the uploads. The host
            # buffers are not rewritten before the next step's control all-reduce synchronises the host.
            torch.cuda.current_stream().wait_stream(self.stream)
        self.last_step.update(step_s=time.perf_counter() - start, grad_wait_s=self._wait_s,
                              device_step_s=self._device_s)


def _staged_groups(device_groups: list[ShardGroup], store, *, pin: bool, out_on_host: bool, delayed: bool,
                   staging_chunks: int, per_chunk: bool, speculative: bool
                   ) -> tuple[list[ShardGroup], list[torch.Tensor] | None]:
    """HostStep's host copies of the shard groups (its docstring says which staging each chunk gets) and the ring
    of staging buffers, when there is one. Partial offload's device chunks (on_device) pass through unstaged."""

    def on_device(c: Chunk) -> bool:  # the chunk's working parameters live on the device
        return c.out is not None and not out_on_host and not store.in_files(c.out)

    def both_ways(c: Chunk) -> bool:  # the chunk's parameters may stage in its gradient's buffer
        return on_device(c) and not delayed and (c.out.dtype, c.out.numel()) == (c.grad.dtype, c.grad.numel())

    staged = [c for g in device_groups for c in g.chunks if not c.on_device]
    ring = None
    if (staging_chunks and per_chunk and not speculative and len(staged) > staging_chunks
            and all(map(both_ways, staged)) and len({c.grad.dtype for c in staged}) == 1):
        numel = max(c.grad.numel() for c in staged)
        ring = [host_tensor(numel, staged[0].grad.dtype, pin=pin) for _ in range(staging_chunks)]
    host_groups = []
    for g in device_groups:
        chunks = []
        for c in g.chunks:
            if c.on_device:  # partial offload's device part: stepped where it lies, never staged
                chunks.append(c)
                continue
            if ring is not None:  # placed in a buffer of the ring before each use (HostStep._place)
                grad = ring[0][:c.grad.numel()]
            else:
                grad = host_tensor(c.grad.numel(), c.grad.dtype, pin=pin)
            out = c.out
            if both_ways(c):
                out = grad  # the gradient's staging takes the chunk's new values once the Adam has read it
            elif c.out is not None and (on_device(c) or delayed or speculative or store.in_files(c.out)):
                out = host_tensor(c.out.numel(), c.out.dtype, pin=pin)
                out.copy_(store.read(c.out))
            chunks.append(Chunk(param=c.param, grad=grad, out=out, pieces=c.pieces))
        host_groups.append(ShardGroup(pieces=g.pieces, chunks=chunks))
    return host_groups, ring


def stepped_ranges(chunk: Chunk, on: list[bool]) -> list[tuple[int, int]]:
    """Element ranges of the chunk that a step updated (on: its group's active pieces): the whole chunk (padding
    included) when every piece stepped, else the runs of adjacent pieces that did."""
    if all(on[i] for i, _, _ in chunk.pieces):
        return [(0, chunk.out.numel())]
    runs: list[list[int]] = []
    for index, start, numel in chunk.pieces:
        if not on[index]:
            continue
        if runs and runs[-1][1] == start:
            runs[-1][1] = start + numel
        else:
            runs.append([start, start + numel])
    return [tuple(r) for r in runs]
