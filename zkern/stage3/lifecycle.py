"""Stage 3's fetch-unit lifecycle: the states a unit passes through in a step, the only transitions between them,
and the invariants checked at the end of every forward and backward pass.

    python -m pytest tests/stage3/test_lifecycle.py -q

Two state machines per unit, each changed only through Unit's methods (an illegal transition raises):

  data   REST --issue--> INFLIGHT --arrive--> GATHERED --rest--> REST   (a unit is put to rest only when idle)
  grads  IDLE --open--> PENDING --complete--> COMPLETE --close--> IDLE  (once per backward pass)

Who keeps a unit gathered is counted, never guessed: `refs` (forward frames of modules running with it), `held`
(backward needs it until its gradients are in), `pins` (open GatheredParameters contexts). A gathered copy
carries the shard version it was gathered from; every optimizer step advances the version, so a copy older
than the shard is recognised and never used (Unit.check_fresh).

Pure bookkeeping: no torch calls besides holding the buffer, no communication. Each data transition also sets the
parameters' `ds_status` (DeepSpeed's attribute, ds_attributes.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from zkern.comm.collectives import Work
from zkern.core.partition import Bucket
from zkern.errors import InvariantError
from zkern.stage3.ds_attributes import mark
from zkern.stage3.units import UnitPlan


class DataState(enum.Enum):
    REST = "rest"  # only this rank's chunk exists; the parameters' .data are empty
    INFLIGHT = "inflight"  # an all-gather into `buffer` was issued and not yet waited for
    GATHERED = "gathered"  # `buffer` holds the whole unit; the parameters are views into it


class GradState(enum.Enum):
    IDLE = "idle"  # outside backward
    PENDING = "pending"  # backward is running and gradients may still arrive
    COMPLETE = "complete"  # every trainable parameter's gradient is in (or none can come any more)


@dataclass(eq=False)
class Unit:
    index: int
    plan: UnitPlan
    bucket: Bucket
    trainable: int  # parameters that get gradients
    readers: tuple[str, ...] = ()  # modules that gather this unit (for messages)
    data: DataState = DataState.REST
    buffer: torch.Tensor | None = None  # (bucket.padded,) working dtype while not at rest
    # The one tensor every gather of this unit fills (Gatherer._slot). At rest its storage is resized to zero bytes:
    # a view of it that autograd saved in forward then holds nothing, and sees the regathered values in backward.
    slot: torch.Tensor | None = None
    # A view of the gathered storage left a module's call (returned, or kept on the module: escapes.py): the release
    # leaves that storage to its holders instead of freeing it, and the next gather fills a fresh one.
    escaped: bool = False
    holders: int = 0  # tensors sharing the slot's storage when its gather arrived (escapes.holders)
    work: Work | None = None  # the in-flight all-gather
    version: int = -1  # shard version the buffer was gathered from
    refs: int = 0
    held: bool = False
    pins: int = 0
    prefetched: bool = False  # gathered ahead of use and not used yet
    grads: GradState = GradState.IDLE
    fired: set[int] = field(default_factory=set)  # positions of parameters whose gradient arrived this pass
    arrived: bool = False  # a gradient came for it in this pass (not only positions counted as arrived)
    touched: bool = False  # a module that reads it ran forward since the last backward
    group: object = None  # its reduce.ReduceGroup
    # Units whose readers differ between ranks (merged by hooks.py after a divergence). Their backward hold is
    # released at a point every rank shares, not when this rank's gradients arrive: `holder` is the module whose
    # gather started the hold, and a unit released while this rank still waits for its gradients `lingers`
    # (stays whole here) until they arrive, without counting as gathered for the ranks' common decisions.
    divergent: bool = False
    holder: object = None
    lingering: bool = False
    # Parameters of the unit that only some calls use: the children of a ModuleList/ModuleDict inside the unit's
    # modules (an MoE layer declared as one fetch unit: its experts). id(child) -> positions of its trainable
    # parameters; `ran` holds the children that ran forward since the last backward. A child that did not run
    # gives no gradient, so its positions count as arrived when backward begins.
    optional: dict = field(default_factory=dict)
    ran: set = field(default_factory=set)

    # -- names ------------------------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def persistent(self) -> bool:
        return self.plan.persistent

    def describe(self) -> str:
        readers = ", ".join(f"'{m}'" for m in self.readers) or "no module"
        return f"unit '{self.name or '<root>'}' (gathered for {readers})"

    def _fail(self, what: str) -> InvariantError:
        return InvariantError(f"zkern stage 3: {self.describe()}: {what} (data {self.data.value}, refs {self.refs}, "
                              f"held {self.held}, pins {self.pins}, gradients {self.grads.value})")

    # -- data transitions -------------------------------------------------------------------------------------
    @property
    def idle(self) -> bool:
        """Nobody keeps it gathered."""
        return self.refs == 0 and not self.held and self.pins == 0

    @property
    def live(self) -> bool:
        """Gathered as far as every rank is concerned (a lingering copy is not: the next use gathers again)."""
        return self.data is not DataState.REST and not self.lingering

    def issue(self, buffer: torch.Tensor, work: Work, version: int) -> None:
        if self.data is not DataState.REST:
            raise self._fail("an all-gather was issued for a unit that is not at rest")
        self.data, self.buffer, self.work, self.version = DataState.INFLIGHT, buffer, work, version
        mark(self.plan.params, "INFLIGHT")

    def arrive(self) -> None:
        if self.data is not DataState.INFLIGHT or self.work is not None:
            raise self._fail("marked gathered before its all-gather was waited for")
        self.data = DataState.GATHERED
        mark(self.plan.params, "AVAILABLE")

    def rest(self) -> None:
        if self.data is DataState.REST or self.persistent or not self.idle or self.work is not None:
            raise self._fail("put to rest while held, persistent, in flight or already at rest")
        self.data, self.buffer, self.prefetched, self.lingering = DataState.REST, None, False, False
        mark(self.plan.params, "NOT_AVAILABLE")

    def check_fresh(self, version: int) -> None:
        """A gathered copy from before the last optimizer step must never be used."""
        if self.data is DataState.GATHERED and self.version != version:
            raise self._fail(f"a gathered copy of shard version {self.version} was about to be used after the "
                             f"shards moved to version {version} (a stale copy)")

    # -- reference counts -------------------------------------------------------------------------------------
    def ref(self) -> None:
        self.refs += 1

    def unref(self) -> None:
        if self.refs <= 0:
            raise self._fail("released by a module that did not hold it")
        self.refs -= 1

    def unpin(self) -> None:
        if self.pins <= 0:
            raise self._fail("unpinned more often than pinned")
        self.pins -= 1

    # -- gradient transitions ---------------------------------------------------------------------------------
    def open_grads(self) -> None:
        if self.grads is not GradState.IDLE:
            raise self._fail("a backward pass began while the last one's gradients were not closed")
        self.grads = GradState.PENDING
        self.fired = set()
        self.arrived = False

    def complete_grads(self) -> None:
        if self.grads is not GradState.PENDING:
            raise self._fail("completed twice in one backward pass")
        self.grads = GradState.COMPLETE

    def skipped_positions(self) -> set[int]:
        """Positions of trainable parameters whose optional child did not run (they get no gradient)."""
        return {pos for child, positions in self.optional.items() if child not in self.ran for pos in positions}

    def abandon_grads(self) -> None:
        """The backward pass raised: its gradients are dropped, not reduced."""
        self.grads, self.fired, self.touched, self.arrived = GradState.IDLE, set(), False, False
        self.ran = set()

    def close_grads(self) -> None:
        if self.grads is not GradState.COMPLETE:
            raise self._fail("the backward pass ended before its gradients were complete")
        self.grads = GradState.IDLE
        self.touched = False
        self.ran = set()


def pass_end_violations(units: list[Unit], phase: str) -> list[str]:
    """What is wrong with the units at the end of a forward or backward pass: every non-persistent unit that no
    GatheredParameters context pins is at rest with no references, no backward hold and no prefetch left; after
    backward, every unit's gradients are closed."""
    out = []
    for u in units:
        if phase == "backward" and u.grads is not GradState.IDLE:
            out.append(f"{u.describe()}: gradients still {u.grads.value}")
        if u.persistent or u.pins:
            continue
        if u.data is not DataState.REST or u.refs or u.held or u.prefetched or u.lingering:
            out.append(f"{u.describe()}: data {u.data.value}, refs {u.refs}, held {u.held}, prefetched {u.prefetched}, "
                       f"lingering {u.lingering}")
    return out


def check_pass_end(units: list[Unit], phase: str) -> None:
    bad = pass_end_violations(units, phase)
    if bad:
        raise InvariantError(
            f"zkern stage 3: at the end of the {phase} pass {len(bad)} unit(s) are not where the lifecycle requires: "
            + "; ".join(bad[:5]) + ("; ..." if len(bad) > 5 else "")
            + ". A module's forward hook did not run (a BaseException such as KeyboardInterrupt raised inside a "
              "module and caught by its caller skips torch's hooks), or the model changed its modules after "
              "zkern.Engine was built.")
