"""The order of gradient reductions: one plan for every rank, whatever order backward produces gradients in.

    python -m pytest tests/comm/test_schedule.py -q

Collectives pair up by order, so every rank must reduce its gradient buckets in the same sequence. Backward does
not produce gradients in the same order on every rank (two parameter groups, a parameter one rank does not use,
a routed expert), so a bucket is never launched "when it fills": it is launched when it and every bucket before
it in the plan are complete. The plan is the same on every rank: first a static guess (the caller's, roughly the
order backward completes buckets), then, from the second pass on, the order rank 0 observed its buckets complete
in its first pass, broadcast once (as DDP rebuilds its buckets after its first iteration). Later passes never
change it. Stages 0-2 (a bucket per flat bucket of each parameter group) and 3 (a bucket per reduce group) share
this class; it only says which buckets to launch when, the stage runtimes do the launching.
"""

from __future__ import annotations

import torch

from zkern.comm.collectives import Comm


class ReduceSchedule:
    def __init__(self, sizes: list[int], static_order: list[int], comm: Comm, device: torch.device):
        """sizes[b]: how many contributions complete bucket b (parameters, units); static_order: the first plan."""
        if sorted(static_order) != list(range(len(sizes))):
            raise ValueError(f"the static order must name each of the {len(sizes)} buckets once, got {static_order}")
        self.sizes, self.comm, self.device = sizes, comm, device
        self.plan = list(static_order)
        self.observed = False  # the plan is rank 0's observed order
        self.begin()

    def begin(self, deferred: frozenset[int] = frozenset()) -> None:
        """A new pass. deferred: buckets that launch only at flush() (the same set on every rank), the others keep
        their place in the plan without waiting for them."""
        self._done = [0] * len(self.sizes)
        self._launched = [False] * len(self.sizes)
        self._next = 0  # position in the plan of the next bucket to launch
        self._deferred = deferred
        self._completed: list[int] = []  # order of completion in this pass (the first pass is observed)

    def add(self, bucket: int, count: int = 1) -> list[int]:
        """`count` more contributions of `bucket` are in. Returns the buckets to launch now, in plan order."""
        self._done[bucket] += count
        if self._done[bucket] > self.sizes[bucket]:
            raise RuntimeError(f"bucket {bucket} received {self._done[bucket]} contributions, it has "
                               f"{self.sizes[bucket]}")
        if self._done[bucket] == self.sizes[bucket]:
            self._completed.append(bucket)
        return self._ready()

    def launched(self, bucket: int) -> bool:
        return self._launched[bucket]

    def _ready(self) -> list[int]:
        out = []
        while self._next < len(self.plan):
            b = self.plan[self._next]
            if b not in self._deferred:
                if self._done[b] < self.sizes[b]:
                    break
                out.append(b)
                self._launched[b] = True
            self._next += 1
        return out

    def flush(self) -> list[int]:
        """Backward ended: every bucket not launched yet, in plan order (what it lacks reduces as zero)."""
        out = [b for b in self.plan if not self._launched[b]]
        for b in out:
            if self._done[b] < self.sizes[b] and b not in self._completed:
                self._completed.append(b)
            self._launched[b] = True
        self._next = len(self.plan)
        return out

    def end(self) -> None:
        """After the first pass: adopt rank 0's completion order on every rank (one broadcast, once)."""
        if self.observed:
            return
        order = torch.tensor(self._completed if len(self._completed) == len(self.sizes) else self.plan,
                             dtype=torch.int64, device=self.device)
        self.comm.broadcast(order, "the gradient reduction order rank 0 observed in its first backward")
        self.plan = order.tolist()
        self.observed = True


def fold_reduced(shard: torch.Tensor, reduced: torch.Tensor, first_micro_step: bool) -> None:
    """This rank's part of a reduced bucket into its gradient shard: the first micro-step since the optimizer step
    overwrites it, later ones accumulate (stages 2 and 3 reduce every micro-step). Casts to the shard's dtype
    (data_types.grad_accum_dtype)."""
    if first_micro_step:
        shard.copy_(reduced)
    else:
        shard.add_(reduced)
