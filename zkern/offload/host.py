"""ZeRO-Offload: the optimizer step on the host, fed through host staging buffers.

    python -m pytest tests/test_offload.py -q

With zero_optimization.offload_optimizer.device = "cpu", the stage runtimes keep the fp32 master shard on the
host (host_tensor) and the optimizer's moments follow it there. Each step, HostStep copies this rank's
gradient shard from the device into a host buffer in its own dtype (the CPU Adam upcasts inside its pass),
steps chunk by chunk on the host, writing the updated parameter straight into a host buffer in the working
dtype, and copies that back into the device's parameter shard. On CUDA the copies run on a side stream:
chunk i+1's gradient comes down while chunk i steps, and chunk i's parameters go up while chunk i+1 steps.
With offload_param (stage 3) the parameter shard itself lives on the host, so nothing goes back; with its device
"nvme" the updated chunks go to the parameter file instead (nvme_params.py). Only the pieces that stepped are
sent: the others' values may have been written since the staging copy was filled (GatheredParameters, a load).
With offload_optimizer "nvme" the optimizer (nvme.NvmeAdam) streams master and moments from files and calls the
same per-chunk hooks.

On a CPU-only run host and device are the same memory; the staging copies still run, so the path a GPU
takes is the path CPU tests check.
"""

from __future__ import annotations

import torch

from zkern.core.shard_groups import Chunk, ShardGroup
from zkern.optim.shard_adam import ShardAdam, step_torch_optimizer


def host_tensor(numel: int, dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A zeroed host buffer; page-locked when pin (only meaningful, and only asked, with CUDA present)."""
    return torch.zeros(numel, dtype=dtype, pin_memory=pin)


class HostStep:
    """Staging buffers and the copy/step pipeline of an offloaded optimizer step."""

    def __init__(self, device_groups: list[ShardGroup], *, pin: bool, out_on_host: bool, store=None):
        """device_groups: the runtime's shard groups (param = host master chunk, grad = device gradient chunk,
        out = device parameter chunk, or a host one when out_on_host). An out that is a meta stand-in (the
        parameter shard on NVMe) is staged on the host and sent with write(out, values); read(out) gives its
        starting values."""
        self.device_groups = device_groups
        self.store = store
        self._active: list[list[bool]] | None = None
        cuda = any(c.grad.is_cuda for g in device_groups for c in g.chunks)
        self.stream = torch.cuda.Stream() if cuda else None
        self.host_groups: list[ShardGroup] = []
        self.staging_bytes = 0
        for g in device_groups:
            chunks = []
            for c in g.chunks:
                grad = host_tensor(c.grad.numel(), c.grad.dtype, pin=pin)
                out = c.out
                if c.out is not None and (not out_on_host or store.in_files(c.out)):
                    out = host_tensor(c.out.numel(), c.out.dtype, pin=pin)
                    out.copy_(store.read(c.out))
                    self.staging_bytes += out.numel() * out.element_size()
                self.staging_bytes += grad.numel() * grad.element_size()
                chunks.append(Chunk(param=c.param, grad=grad, out=out, pieces=c.pieces))
            self.host_groups.append(ShardGroup(pieces=g.pieces, chunks=chunks))
        self._events: dict[tuple[int, int], torch.cuda.Event] = {}

    def staging_tensors(self) -> list[torch.Tensor]:
        """The host staging buffers: gradient copies (scratch within a step) and, where the parameters live on the
        device, the working copy the host step writes (derived from the master; refreshed piece by piece)."""
        out = []
        for host, device in zip(self.host_groups, self.device_groups):
            for h, d in zip(host.chunks, device.chunks):
                out.append(h.grad)
                if h.out is not None and h.out is not d.out:
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

    def _stepped(self, gi: int, ci: int) -> list[tuple[int, int]]:
        """Element ranges of chunk ci of group gi that this step updated: the whole chunk (padding included)
        when every piece stepped, else the runs of adjacent pieces that did."""
        chunk = self.host_groups[gi].chunks[ci]
        on = self._active[gi]
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

    def _wait_down(self, gi: int, ci: int) -> None:
        event = self._events.pop((gi, ci), None)
        if event is not None:
            event.synchronize()

    # -- the step ---------------------------------------------------------------------------------------------
    def step(self, optimizer: torch.optim.Optimizer, *, grad_scale: float, active: list[list[bool]]) -> None:
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())  # gradients are final on the compute stream
        self._active = active
        order = [(gi, ci) for gi, g in enumerate(self.host_groups) for ci in range(len(g.chunks))]
        for gi, ci in order:
            self._down(gi, ci)
        if isinstance(optimizer, ShardAdam):
            optimizer.step(grad_scale=grad_scale, active=active, before_chunk=self._wait_down, after_chunk=self._up)
        else:  # a torch optimizer steps every piece at once
            for gi, ci in order:
                self._wait_down(gi, ci)
            step_torch_optimizer(optimizer, self.host_groups, grad_scale=grad_scale, active=active)
            for gi, ci in order:
                self._up(gi, ci)
        if self.stream is not None:
            # The next forward reads the parameters on the compute stream: it waits for the uploads. The host
            # buffers are not rewritten before the next step's control all-reduce synchronises the host.
            torch.cuda.current_stream().wait_stream(self.stream)
