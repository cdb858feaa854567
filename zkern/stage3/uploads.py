"""Stage 3's offload_param uploads ahead of use: a prefetched unit's resting chunk goes up from page-locked host
memory on a side stream, so the copy runs beside the compute queued before it, instead of in line on the compute
stream where every kernel after it waits for the host link.

    python -m pytest tests/stage3/test_uploads.py -q

The gatherer opens `ahead(unit)` around a prefetch's launch. Inside it the current stream is the side stream,
which first waits for the compute stream: the gather slot was allocated there, and memory the compute stream just
freed may still be read by kernels it has queued. The chunk's copy (`copy`) and, at world > 1, the all-gather are
queued on the side stream, and an event marks where they end. `wait(unit)` makes the compute stream wait for that
event; the gatherer calls it before the unit's buffer is read, released or gathered again. So every upload is
ordered before the compute stream's later work, the step's host synchronisation (stepping.py's control
.tolist()) included, and the host writes that follow it (the host Adam, a delayed update landing) cannot race a
copy still queued.

On a CPU there is no stream. At world 1 the copy is deferred instead: queued, and done only at `wait`, so a
gatherer that read a unit without waiting for its upload would read whatever its slot held before (the GPU's race,
made deterministic for the CPU tests and the fuzzer). At world > 1 a CPU all-gather reads the slot as it is
launched, so the copy is done at once there.
"""

from __future__ import annotations

import contextlib

import torch


class Uploads:
    """The side stream (or the CPU's deferred copies) of one stage-3 runtime's prefetched uploads."""

    def __init__(self, device: torch.device, *, world: int):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.defer = self.stream is None and world == 1
        self.pending: dict[int, object] = {}  # unit -> its upload's event (CUDA) or its deferred copies (CPU)
        self._unit: int | None = None  # the unit whose launch is inside ahead()
        self.launched = 0  # uploads queued ahead of use since construction (tests and reports)

    @contextlib.contextmanager
    def ahead(self, unit: int):
        """Inside: the launch of `unit`'s prefetched gather, its copy off the compute stream."""
        if self._unit is not None:
            raise RuntimeError(f"zkern stage 3: the upload of unit {unit} began inside the upload of unit {self._unit}")
        self.launched += 1
        if self.stream is None:
            self._unit = unit
            try:
                yield
            finally:
                self._unit = None
            return
        compute = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(compute)
        try:
            with torch.cuda.stream(self.stream):
                self._unit = unit
                yield
        finally:
            self._unit = None
            event = torch.cuda.Event()
            event.record(self.stream)  # recorded even when the launch failed: a copy may be queued before it
            self.pending[unit] = event

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
        """dst <- src: inside ahead() on the side stream (or deferred on a CPU at world 1), else at once on the
        current stream. Returns dst."""
        if self._unit is not None and self.defer:
            self.pending.setdefault(self._unit, []).append((dst, src))
            return dst
        return dst.copy_(src, non_blocking=src.is_pinned())

    def wait(self, unit: int) -> None:
        """The compute stream waits for unit's upload, if one is pending (a CPU does the deferred copies now)."""
        pending = self.pending.pop(unit, None)
        if pending is None:
            return
        if self.stream is None:
            for dst, src in pending:
                dst.copy_(src)
        else:
            torch.cuda.current_stream(self.stream.device).wait_event(pending)
