"""BucketReducer: the one path every stage's gradient buckets are reduced through.

    python -m pytest tests/comm/test_schedule.py tests/comm/test_zeropp.py -q

A bucket is a flat gradient buffer of `world` equal sections. Launching it issues one collective: a reduce-scatter
into this rank's section (qgZ's two-hop int4 reduction in its place when the config asks for quantized gradients),
or an all-reduce of the whole buffer (stage 0, and reduce_scatter=false). Each launch carries what to do once the
reduction has arrived (fold the section into a gradient shard, cast it back, free the buffer) and the buffer it
holds until then; retiring runs that in launch order. Which buckets launch when is the schedule's business
(schedule.ReduceSchedule); how many may be in flight is the caller's (stage 2 and 3 bound it differently).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from zkern.comm.collectives import Comm, Work
from zkern.comm.zeropp import QuantizedReduce


class BucketReducer:
    def __init__(self, comm: Comm, quantized: QuantizedReduce | None = None):
        """quantized: qgZ's two-hop int4 reduction (zeropp.py), used by launches that name a key."""
        self.comm = comm
        self.quantized = quantized
        self._in_flight: deque[tuple[Work, Callable[[], None] | None, torch.Tensor | None]] = deque()

    def launch(self, data: torch.Tensor, purpose: str, *, out: torch.Tensor | None, async_op: bool,
               key: object = None, then: Callable[[], None] | None = None, holds: torch.Tensor | None = None) -> None:
        """Reduce `data` (world sections): reduce-scatter into `out` (this rank's section), quantized under `key`
        when qgZ is on, or all-reduce the whole of it when out is None. then(): run at retirement, after the
        reduction arrived; holds: the buffer the reduction keeps alive until then (counted by held())."""
        if out is not None:
            via = self.comm if self.quantized is None or key is None else self.quantized.bucket(key)
            work = via.reduce_scatter(out, data, purpose, async_op=async_op)
        else:
            work = self.comm.all_reduce(data, purpose, async_op=async_op)
        self._in_flight.append((work, then, holds))

    def __len__(self) -> int:
        """Reductions launched and not retired."""
        return len(self._in_flight)

    def retire_oldest(self) -> None:
        work, then, _ = self._in_flight.popleft()
        work.wait()
        if then is not None:
            then()

    def retire_finished(self) -> None:
        """Retire, in launch order, the reductions that have already arrived (never waits)."""
        while self._in_flight and self._in_flight[0][0].done():
            self.retire_oldest()

    def drain(self) -> None:
        """Wait for every reduction in flight and retire it."""
        while self._in_flight:
            self.retire_oldest()

    def clear(self) -> None:
        """Forget every reduction in flight without retiring it (backward raised: nothing of it is used); their
        receive buffers go back to the pool as their transfers end."""
        for work, _, _ in self._in_flight:
            work.abandon()
        self._in_flight.clear()

    def held_count(self) -> int:
        """Reductions in flight that keep a buffer alive."""
        return sum(1 for _, _, buf in self._in_flight if buf is not None)

    def held(self) -> list[torch.Tensor]:
        """The buffers reductions in flight keep alive."""
        return [buf for _, _, buf in self._in_flight if buf is not None]
