"""Stage 3's gathering: bring fetch units from rest to whole and back, prefetch along the recorded order, and keep
the counts (live elements, gathers per unit, the step's gather signature, the shard version).

    python -m pytest tests/stage3/test_stage3.py -q

Every all-gather of a unit goes through Gatherer.gather (or regather, for a unit already whole), and every
release through Gatherer.release, which moves the unit's lifecycle (lifecycle.Unit) and the parameters' .data
together: a parameter is a view into its unit's buffer exactly while the unit is gathered, an empty tensor at
rest.

Prefetch: each pass records the order of the gathers it needed (order.OrderRecord); the next pass of the same
kind issues up to stage3_prefetch_bucket_size elements ahead along that record, asynchronously, and at least the
next unit whatever its size (0 turns prefetch off). The budget is
counted so that every rank reaches the same decision (the ranks must issue the same all-gathers): in forward
it also keeps the gathered elements under stage3_max_live_parameters; in backward, where a unit is freed when
this rank's gradients for it arrive, only the prefetched elements count against it. A pass that departs from
the record stops prefetching and is recorded afresh; verifying passes (divergence.py) prefetch nothing. With
offload_param "cpu" a prefetched unit's host chunk goes up on a side stream (uploads.py), waited for where the unit
is first used or let go.
"""

from __future__ import annotations

import logging

import torch

from zkern.comm.collectives import Comm
from zkern.comm.divergence import fold_signature
from zkern.comm.zeropp import FrozenStore, Secondary
from zkern.core.buffers import aligned_empty, release, restore
from zkern.errors import InvariantError
from zkern.stage3.escapes import held_elsewhere, holders
from zkern.stage3.lifecycle import DataState, GradState, Unit
from zkern.stage3.order import OrderRecord
from zkern.stage3.sources import UnitSources
from zkern.stage3.uploads import Uploads

log = logging.getLogger("zkern")


class Gatherer:
    def __init__(self, units: list[Unit], comm: Comm, *, param_shard: torch.Tensor, dtype: torch.dtype,
                 device: torch.device, layout: dict[int, tuple[torch.Size, int]], params_on_host: bool,
                 prefetch_numel: int, max_live: int, quantize_weights: int = 0,
                 secondary: Secondary | None = None, frozen: FrozenStore | None = None, param_store=None,
                 uploads: Uploads | None = None):
        """layout: id(parameter) -> (full shape, offset inside its unit's buffer). quantize_weights: qwZ;
        secondary: hpZ's secondary partition; frozen: the units resting as int8 (zeropp.py); param_store: the
        parameter file (offload_param "nvme", nvme_params.py), read ahead along the recorded order; uploads: where
        prefetched units' host chunks go up off the compute stream (offload_param "cpu", uploads.py)."""
        self.units, self.comm, self.dtype, self.device, self.layout = units, comm, dtype, device, layout
        self.prefetch_numel, self.max_live = prefetch_numel, max_live
        self.empty = torch.empty(0, dtype=dtype, device=device)
        self.version = 0  # advanced by every optimizer step and every write into the shards
        self.live = self.peak_live = 0  # elements gathered or in flight (a running count: O(units) a gather)
        self.ahead = 0  # of which prefetched and not used yet
        self._prefetched: set[int] = set()
        self.counts = [0] * len(units)  # all-gathers issued per unit since construction
        self.signature = 0  # of the gathers issued since the last optimizer step (divergence.fold_signature)
        self.order = OrderRecord()
        self.verify_all = False  # verify every pass (after a signature mismatch, until a merge)
        self.verify = self._said_reorder = False  # verify: this pass verifies (begin_pass)
        self.param_store = param_store
        self.sources = UnitSources(units, comm, param_shard=param_shard, params_on_host=params_on_host,
                                   quantize_weights=quantize_weights, secondary=secondary, frozen=frozen,
                                   param_store=param_store, uploads=uploads)

    @property
    def quantize_weights(self) -> int:
        return self.sources.quantize_weights

    @property
    def uploads(self) -> Uploads | None:
        return self.sources.uploads

    # -- one unit ---------------------------------------------------------------------------------------------
    def _count(self, u: Unit) -> None:
        self.counts[u.index] += 1
        self.signature = fold_signature(self.signature, u.index)

    def _slot(self, u: Unit) -> torch.Tensor:
        """u's gather buffer, its storage brought back to full size. Every gather of u fills this one storage, so a
        view of it that autograd saved in forward (F.linear saves the weight's transpose, a convolution the weight)
        reads the regathered values in backward instead of keeping the released copy alive beside a second one."""
        if u.slot is None:
            u.slot = aligned_empty(u.bucket.padded, self.dtype, self.device)
        else:
            restore(u.slot, zero=False)  # every element is written by the all-gather
        return u.slot

    def gather(self, u: Unit, *, async_op: bool, exact: bool = False) -> None:
        """REST -> INFLIGHT, and on to GATHERED unless async_op. exact: never quantized nor from the secondary
        copy (GatheredParameters)."""
        buffer = self._slot(u)  # allocated on the compute stream, before any side stream writes it
        work = self.sources.launch(u, buffer, f"parameters of unit '{u.name}'", async_op=async_op, exact=exact,
                                   version=self.version, ahead=async_op)
        u.issue(buffer, work, self.version)
        self._count(u)
        self.live += u.bucket.padded
        self.peak_live = max(self.peak_live, self.live)
        if not async_op:
            self.finish(u)

    def regather(self, u: Unit, purpose: str, *, async_op: bool = False) -> None:
        """A unit that is whole on this rank joins an all-gather of itself, into its own buffer: the other ranks
        gather it now (a divergent unit lingering here, a merge lining ranks up), or the shards moved and the copy
        must follow (after a step). Where the values did not move, the bytes written are the bytes there."""
        if u.data is DataState.REST:
            raise u._fail("re-gathered while at rest")
        self.finish(u)
        u.work = self.sources.launch(u, u.buffer, f"{purpose}, unit '{u.name}'", async_op=async_op, exact=False,
                                     version=self.version)
        u.version = self.version
        self._count(u)
        if not async_op:
            self.finish(u)

    def _wait(self, u: Unit) -> None:
        """Wait for u's all-gather, if one is in flight; a gather from the primary partition refreshes hpZ's
        secondary slice of u."""
        self.sources.arriving(u)
        if u.work is None:
            return
        u.work.wait()
        u.work = None
        self.sources.gathered(u)
        u.holders = holders(u.slot, u.plan.params)  # what shares its storage now is the gather's, not a user's

    def finish(self, u: Unit) -> None:
        """Wait for u's all-gather, if one is in flight, and point its parameters into the buffer."""
        self._wait(u)
        if u.data is not DataState.INFLIGHT:
            return
        u.arrive()
        for p in u.plan.params:
            shape, off = self.layout[id(p)]
            p.data = u.buffer[off:off + shape.numel()].view(shape)

    def release(self, u: Unit, *, outside_autograd: bool = False) -> bool:
        """Put u to rest if nobody holds it (persistent units stay). A divergent unit whose gradients this rank still
        waits for lingers instead (GradReducer's completion puts it to rest). Returns whether it went to rest.
        outside_autograd: no forward saved views of u since it was gathered (a GatheredParameters context ends), so
        any tensor still sharing its storage is a user's view, like one taken while gradients are off."""
        if u.persistent or u.data is DataState.REST or not u.idle:
            return False
        if u.divergent and u.grads is GradState.PENDING:
            u.lingering = True
            return False
        self._wait(u)
        for p in u.plan.params:
            p.data = self.empty
        if u.escaped or ((outside_autograd or not torch.is_grad_enabled()) and held_elsewhere(u.slot, u.holders)):
            # A view of it left a module's call (escapes.py): its holders keep these bytes, which are freed when they
            # let go; the next gather fills a fresh storage.
            u.slot, u.escaped = None, False
        else:
            # Free the bytes themselves, not just this reference: views autograd saved keep the storage object, which
            # now holds nothing until the next gather of u refills it (the released copy is gone, as FSDP2 frees it).
            release(u.slot)
        self.live -= u.bucket.padded
        self._unmark_prefetched(u)
        u.rest()
        return True

    def use(self, u: Unit, phase: str) -> bool:
        """u is needed now: make it whole and check it is fresh. Returns whether this was an event, a use that
        every rank makes at the same point: u was not live (so every rank gathers it now) or was prefetched for
        this use. Only events move along the recorded order and prefetch: a use of a unit already live may come
        from a module that runs on some ranks only (a routed expert inside its merged container)."""
        if u.persistent:
            return False
        event = not u.live or u.prefetched
        if event:
            self._see(u, phase)
        if u.lingering:
            u.lingering = False
            self.regather(u, "parameters gathered again")  # whole here still; the other ranks gather it now
        elif u.data is DataState.REST:
            self.gather(u, async_op=False)
        self.finish(u)
        u.check_fresh(self.version)
        self._unmark_prefetched(u)
        if event:
            self._prefetch(phase, u.bucket.padded)
        return event

    # -- following the record --------------------------------------------------------------------------------
    def catch_up(self, u: Unit, phase: str) -> bool:
        """A pass that follows its record needs u now. Every rank issues the record's all-gathers in its order, each
        exactly once, whatever it needs itself: the entries before u's next one that this rank passes over (an
        expert it did not choose this time) are joined now, so its next all-gather is the one the others issue
        next. Returns False when the rest of the record does not hold u (a departure: the hooks agree on it)."""
        ahead = self.order.find(phase, u.index)
        if ahead is None:
            return False
        self._pass_over(self.order.skip(phase, ahead), phase)
        return True

    def drain(self, phase: str) -> None:
        """The pass ends (or leaves its record): join the all-gathers the rest of the record holds."""
        self._pass_over(self.order.skip(phase, self.order.remaining(phase)), phase)

    def _pass_over(self, entries: list[int], phase: str) -> None:
        for ui in entries:
            v = self.units[ui]
            if v.persistent:
                continue
            if v.prefetched:  # gathered ahead by every rank, not needed here: it goes
                self._unmark_prefetched(v)
                self.release(v)
            elif v.live:  # whole here still (a longer backward hold than the record's): join into its own buffer
                self.regather(v, "parameters gathered to keep the ranks' order")
            else:
                self.join(v, "parameters another rank needs")

    def join(self, u: Unit, purpose: str) -> None:
        """Take part in an all-gather of u that other ranks need and this one does not: gather, then let it go
        (a lingering copy is regathered into its own buffer)."""
        if u.lingering:
            u.lingering = False
            self.regather(u, purpose)
            self.release(u)
            return
        if u.live:
            self.regather(u, purpose)
            return
        self.gather(u, async_op=False)
        self.release(u)

    # -- prefetch along the record ----------------------------------------------------------------------------
    def begin_pass(self, phase: str) -> bool:
        """A forward or backward pass begins. Returns whether it verifies (exchanges a tag before every gather,
        divergence.py): decided here, once per pass, from state every rank shares, so that no rank starts
        exchanging tags while another sends data. Verifying passes prefetch nothing."""
        self.order.begin(phase)
        self.verify = self.comm.world > 1 and (self.verify_all or self.order.recording_only(phase))
        return self.verify

    def _see(self, u: Unit, phase: str) -> None:
        expected = self.order.see(phase, u.index)
        if expected is None:
            return
        self.drop_prefetched()
        if not self._said_reorder and self.comm.rank == 0:
            self._said_reorder = True
            log.warning("zkern stage 3: the %s pass gathered unit '%s' where the recorded order expected '%s'; "
                        "prefetch stops for this pass and the order is re-recorded (said once)", phase, u.name,
                        self.units[expected].name if expected >= 0 else "nothing")

    def _prefetch(self, phase: str, in_use: int) -> None:
        if self.verify or self.prefetch_numel <= 0:  # stage3_prefetch_bucket_size 0: no prefetch
            return
        for ui in self.order.upcoming(phase):
            u = self.units[ui]
            if u.live:
                continue
            size = u.bucket.padded
            # At least the next unit goes ahead, whatever its size (as DeepSpeed does): with the budget alone, a unit
            # larger than stage3_prefetch_bucket_size (every block of a 1B model at DeepSpeed's 5e7) was never
            # prefetched, and every gather of such a model waited in line.
            if self.ahead + size > self.prefetch_numel and self.ahead > 0:
                break
            # Forward frees at each module's end, alike on every rank; backward frees as this rank's gradients
            # arrive, which differs between ranks that route differently: there only the prefetch counts.
            resident = self.live if phase == "forward" else self.ahead + in_use
            if resident + size > self.max_live:
                break
            if u.lingering:  # whole here, not on the other ranks: join their gather
                u.lingering = False
                self.regather(u, "parameters gathered ahead", async_op=True)
            else:
                self.gather(u, async_op=True)
            u.prefetched = True
            self.ahead += size
            self._prefetched.add(u.index)
        if self.param_store is not None:  # the chunks of the units after those, read from disk meanwhile
            for ui in self.order.upcoming(phase):
                if not self.units[ui].live and not self.param_store.read_ahead(ui):
                    break

    def _unmark_prefetched(self, u: Unit) -> None:
        if u.prefetched:
            u.prefetched = False
            self.ahead -= u.bucket.padded
            self._prefetched.discard(u.index)

    def drop_prefetched(self) -> None:
        for ui in sorted(self._prefetched):
            self.release(self.units[ui])

    def end_pass(self, phase: str) -> None:
        self.drop_prefetched()
        self.order.end(phase)

    # -- after the optimizer step -----------------------------------------------------------------------------
    def after_step(self) -> None:
        """The shards changed: advance the version and bring every copy that must stay whole up to date (the
        persistent unit, and units an open GatheredParameters context pins). Any other gathered copy would now
        be stale: that is an invariant violation, not something to use."""
        self.version += 1
        for u in self.units:
            if u.data is DataState.REST:
                continue
            if u.persistent or u.pins:
                self.regather(u, "updated parameters")
            else:
                raise InvariantError(f"zkern stage 3: {u.describe()} is still gathered after the optimizer step "
                                     f"(refs {u.refs}, held {u.held}); its copy is stale")

    def gathered_names(self) -> list[str]:
        return [u.name for u in self.units if u.data is not DataState.REST and not u.persistent]
