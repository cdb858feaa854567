"""Collectives with byte counters, timeouts and errors that name the rank and the collective.

    python -m pytest tests/comm/test_comm.py -q

Every collective the engine issues goes through a Comm, so that (1) comm_stats() can report exactly what this
rank sent, (2) a failure or timeout raises CommError naming the rank, the collective and what it was for, and
(3) world size 1 needs no process group at all (collectives become local copies).

Bytes are counted as a ring algorithm sends them per rank: reduce-scatter and all-gather (W-1)/W of the full
buffer, all-reduce twice that, all-to-all (W-1)/W of the input (the rank's own part stays). These are the volumes
the ZeRO paper's communication analysis uses.

Topology: ranks are grouped into nodes of `node_size` consecutive ranks. A collective whose group lies inside one
node counts its bytes as "intra", one whose group spans nodes as "inter" (its ring crosses the slow links: the
ZeRO++ paper's accounting). ZeRO++ talks on subgroups (Comm.node_group: the ranks of one node or hpZ group;
Comm.peer_group: the ranks with the same local index on every node).
"""

from __future__ import annotations

import atexit
import datetime
import gc
import logging
import os
import sys
import time
import types
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zkern.errors import CommError

# torch.distributed.nn.functional binds the default group as its functions' default argument when first imported,
# which torch does lazily (with torch._dynamo, for one): imported after the default group exists, it keeps that group
# and its threads alive into interpreter finalization (see _close_groups_at_exit). Imported with zkern, before a
# script or zkern creates the group, its defaults are None; imported later, _unbind_destroyed_default lets go.
if dist.is_available():
    import torch.distributed.nn  # noqa: F401

log = logging.getLogger("zkern")

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "broadcast", "control", "muon")

# torch 2.13 renamed the tensor collectives; older torch has only the former names.
_all_gather_single = getattr(dist, "all_gather_single", None) or getattr(dist, "all_gather_into_tensor", None)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or getattr(dist, "reduce_scatter_tensor", None)


# Host tensors (gloo): all-gathers go through the list form over views of the same buffer (gloo's tensor form copies
# through a staging buffer: 14.4 against 11.1 ms for 4M fp32 elements at world 2). A reduce-scatter is an exchange
# of sections (all_to_all_single: every rank sends section j to rank j, (W-1)/W of the buffer, a reduce-scatter's
# bytes) and a local sum of the W sections that arrived: gloo's own reduce-scatter is slower than its all-reduce of
# the whole buffer. Measured here (world 2, fp32, median of 35): 1M elements 1.7 ms against 3.3-4.7 (reduce-scatter,
# list form) and 3.3-4.8 (all-reduce); 256K 0.6 against 2.1-3.0; at world 4, 1M 4.4 against 21.6.
def _reduce_scatter_exchange(received: torch.Tensor, inp: torch.Tensor, *, group=None, async_op: bool = False):
    return dist.all_to_all_single(received, inp, group=group, async_op=async_op)


def _all_gather_list(out: torch.Tensor, inp: torch.Tensor, *, group=None, async_op: bool = False):
    return dist.all_gather(list(out.chunk(out.numel() // inp.numel())), inp, group=group, async_op=async_op)


def device_from_config(want: str) -> torch.device:
    """Config key 'device' for a model still on the host (or not built yet, as under init_sharded): "cpu", or
    cuda:LOCAL_RANK for "cuda", and for "auto" where CUDA is available."""
    local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    match want:
        case "cpu":
            return torch.device("cpu")
        case "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError("config 'device' is \"cuda\" but torch sees no CUDA device; use \"cpu\" or "
                                   "\"auto\"")
            return local
        case "auto":
            return local if torch.cuda.is_available() else torch.device("cpu")
        case other:
            raise ValueError(f"device must be auto, cpu or cuda, got {other!r}")


def backend_for(device: torch.device) -> str:
    """The process-group backends for a rank training on `device`: on a GPU, nccl for device tensors and gloo for
    host ones (init_sharded broadcasts parameters as modules build them on the host); on a CPU, gloo."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def init_distributed(device: torch.device, timeout_s: float) -> tuple[object | None, int, int]:
    """(group, rank, world) for the engine's collectives, creating the process group when needed. A CUDA device
    becomes this process's current device first, whoever made the group, so streams and kernels land on it.

    - A process group exists (the user's, or init_sharded's): the engine gets its own group over the same ranks,
      with comm_timeout_s and the backends its device needs (backend_for), whatever the user's group uses.
    - No group, torchrun environment with WORLD_SIZE > 1: init one with backend_for(device).
    - Otherwise: world size 1, no group.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
        if world == 1:
            return None, 0, 1
        return dist.new_group(timeout=timeout, backend=backend_for(device)), dist.get_rank(), world
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return None, 0, 1
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise CommError(f"WORLD_SIZE={world} but {', '.join(missing)} not set; launch with torchrun, or call "
                        f"torch.distributed.init_process_group() before creating the zkern.Engine")
    dist.init_process_group(backend=backend_for(device), timeout=timeout)
    global _made_default
    _made_default = True
    return dist.group.WORLD, dist.get_rank(), dist.get_world_size()


# -- closing the groups before the interpreter does --------------------------------------------------------------
# A gloo worker thread ends each collective by dropping its references to the collective's tensors, which takes the
# GIL. If that happens after interpreter finalization began (the last collective returned, the script ended, the
# worker was descheduled for a moment), the thread cannot take the GIL, is unwound, and the process aborts with
# "terminate called without an active exception": a rank that did all its work reported as failed by torchrun
# (seen in CI under load). A group's threads are joined when its last reference goes, and torch drops that reference
# with the GIL released, so the cure is to let every group zkern made or uses go while the interpreter still runs:
# at exit, each Comm forgets its group and each group is destroyed (the default group only when zkern made it).
_live_comms: weakref.WeakSet = weakref.WeakSet()  # every Comm with a group (Comm.__init__ adds it)
_made_default = False


@atexit.register
def _close_groups_at_exit() -> None:
    groups = []
    for comm in list(_live_comms):
        if comm.group is not None and all(g is not comm.group for g in groups):
            groups.append(comm.group)
        comm.group = None
    if not dist.is_available():
        return
    if dist.is_initialized():
        for g in groups:
            if g is not dist.group.WORLD:
                try:
                    dist.destroy_process_group(g)
                except ValueError:  # "Invalid process group": the script destroyed it already
                    pass
        if _made_default:
            dist.destroy_process_group()
    if not dist.is_initialized():
        _unbind_destroyed_default()
    groups.clear()  # the last references: each group's threads finish their collectives' cleanup and are joined
    gc.collect()  # and any that a reference cycle still held


def _unbind_destroyed_default() -> None:
    """Every group is destroyed (the script's, or zkern's) but torch.distributed.nn.functional, imported after the
    default group was made, still holds it as its functions' default argument: that binding alone would keep the
    group's threads alive into finalization. Point those defaults at nothing, as they were before any group."""
    functional = sys.modules.get("torch.distributed.nn.functional")
    for f in vars(functional).values() if functional is not None else ():
        if isinstance(f, types.FunctionType) and f.__defaults__:
            f.__defaults__ = tuple(None if isinstance(d, dist.ProcessGroup) else d for d in f.__defaults__)


class CommTimes:
    """Per collective kind: calls, bytes and seconds from issue to completion as this rank saw them (host clock; a
    GPU collective's time includes the queue before it). Shared by a Comm and its siblings; off unless `on`."""

    def __init__(self):
        self.on = False
        self.totals: dict[str, list] = defaultdict(lambda: [0, 0, 0.0])

    def record(self, kind: str, nbytes: int, start: float) -> None:
        entry = self.totals[kind]
        entry[0] += 1
        entry[1] += nbytes
        entry[2] += time.perf_counter() - start

    def take(self) -> dict[str, tuple[int, int, float]]:
        """The totals since the last take, and start afresh."""
        out = {k: tuple(v) for k, v in self.totals.items()}
        self.totals.clear()
        return out


class ScratchPool:
    """Receive buffers of host reduce-scatters (Comm.reduce_scatter), kept for the next one: a fresh bucket-sized
    allocation per reduction would fault its pages in every time. Shared by a Comm and its siblings; it holds no more
    buffers than were in flight at once, each as large as the largest reduction it served. memory_report counts it
    under comm_buffers; the state registry claims it as scratch. A reduction forgotten without a wait (a backward
    that raised) gives its buffer back once its transfer is over, which the next take checks: before, such buffers
    stayed lent for good, and a loop that caught a failed backward and tried again grew the pool every time."""

    def __init__(self):
        self.free: list[torch.Tensor] = []
        self.lent: list[torch.Tensor] = []
        self.orphaned: list[tuple[torch.Tensor, object]] = []  # (buffer, the abandoned transfer's handle)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.free += [buf for buf, handle in self.orphaned if handle.is_completed()]
        self.orphaned = [(buf, handle) for buf, handle in self.orphaned if not handle.is_completed()]
        fits = [i for i, t in enumerate(self.free) if t.dtype == dtype and t.device == device and t.numel() >= numel]
        if fits:
            buf = self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        else:
            if self.free:  # none fits: the largest spare makes way for one that does (the count stays bounded)
                self.free.pop(max(range(len(self.free)), key=lambda i: self.free[i].nbytes))
            buf = torch.empty(numel, dtype=dtype, device=device)
        self.lent.append(buf)
        return buf[:numel]

    def give(self, view: torch.Tensor) -> None:
        i = next(i for i, t in enumerate(self.lent) if t.data_ptr() == view.data_ptr())
        self.free.append(self.lent.pop(i))

    def abandon(self, view: torch.Tensor, handle) -> None:
        """The transfer into view was forgotten: its buffer is free again once handle says it completed."""
        i = next(i for i, t in enumerate(self.lent) if t.data_ptr() == view.data_ptr())
        self.orphaned.append((self.lent.pop(i), handle))

    def release(self) -> None:
        """The spare buffers go (between steps nothing is in flight: the pool's memory is reduction memory, held only
        while reductions run)."""
        self.free.clear()

    def tensors(self) -> list[torch.Tensor]:
        return [*self.free, *self.lent, *(buf for buf, _ in self.orphaned)]

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors())


@dataclass
class Work:
    """An in-flight collective; wait() re-raises any failure as a CommError."""

    comm: Comm
    handle: object | None
    what: str

    timing: tuple | None = None  # (kind, bytes, start) while timed (the comms logger, wall_clock_breakdown)
    finish: Callable[[], None] | None = None  # this rank's part once the transfer arrived (a reduce-scatter's sum)
    scratch: torch.Tensor | None = None  # the pool's receive buffer the transfer writes into (host reduce-scatter)

    def done(self) -> bool:
        """Has it completed (without waiting)?"""
        return self.handle is None or self.handle.is_completed()

    def abandon(self) -> None:
        """Forget this collective without using what it delivers (a backward that raised): nothing of finish runs,
        and its receive buffer goes back to the pool when the transfer is over (now, or at a later take)."""
        if self.scratch is not None:
            if self.handle is None:
                self.comm.scratch.give(self.scratch)
            else:
                self.comm.scratch.abandon(self.scratch, self.handle)
        self.handle = self.finish = self.timing = self.scratch = None

    def wait(self) -> None:
        if self.handle is None:
            return
        try:
            self.handle.wait()
        except Exception as e:  # gloo and nccl raise RuntimeError subclasses with transport details
            self.finish = self.timing = None
            raise self.comm.error(self.what, e) from e
        finally:
            self.handle = None
        finish, self.finish = self.finish, None
        if finish is not None:
            finish()
        if self.timing is not None:
            self.comm.times.record(*self.timing)
            self.timing = None


class Comm:
    """The engine's collectives over one process group (or none, at world size 1)."""

    def __init__(self, group: object | None, rank: int, world: int, timeout_s: float, backend: str | None = None,
                 *, node_size: int | None = None, inter: bool | None = None):
        """backend: what sibling() groups are made with (backend_for(device)); None: the default group's.
        node_size: consecutive ranks per node (default: all in one); inter: whether this group spans nodes
        (default: from node_size, for a group of every rank)."""
        self.group, self.rank, self.world, self.timeout_s, self.backend = group, rank, world, timeout_s, backend
        self.node_size = node_size or world
        if world % self.node_size:
            raise ValueError(f"{self.node_size} ranks per node do not divide the world size {world}")
        self.inter = self.node_size < world if inter is None else inter
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.split: dict[str, dict[str, int]] = {"intra": defaultdict(int), "inter": defaultdict(int)}
        self.times = CommTimes()  # off until the engine turns it on (comms_logger, wall_clock_breakdown)
        self.scratch = ScratchPool()
        self._counted: tuple[str, int] | None = None
        if group is not None:
            _live_comms.add(self)  # its group is closed at exit (_close_groups_at_exit)
            self._connect_now()

    def _connect_now(self) -> None:
        """Set an NCCL communicator up while every rank is here. NCCL does it at a group's first collective, and
        that set-up waits for every member with no timeout: a rank that died before a group's first collective (the
        reduce group's first backward) left the others blocked there for good (an H100, two ranks, 2026-11-26: 110 s
        in reduce_scatter_tensor, where gloo ended with a CommError in 4 s). One element all-reduced at construction
        moves the set-up to where all ranks are building. Gloo connects when the group is made: nothing to do."""
        if "nccl" not in (self.backend or "") or not torch.cuda.is_available():
            return
        probe = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        try:
            dist.all_reduce(probe, group=self.group)
        except Exception as e:
            raise self.error("setting up the NCCL communicator", e) from e

    def sibling(self, *, backend: str | None = None, share_counters: bool = True) -> Comm:
        """A Comm over a new process group of the same ranks (a collective: every rank calls it), by default with
        this one's backends and byte counters. Stage 3 reduces gradients on a group of their own, so the order of
        reductions never has to interleave with the order of parameter gathers: each group's sequence is the same
        on every rank even when backward reaches a reduction at a different moment on each. Checkpoints talk on a
        gloo group with counters apart (checkpoint/control.py)."""
        backend = backend or self.backend
        group = None
        if self.world > 1:
            group = dist.new_group(timeout=datetime.timedelta(seconds=self.timeout_s), backend=backend)
        twin = Comm(group, self.rank, self.world, self.timeout_s, backend, node_size=self.node_size, inter=self.inter)
        twin.scratch = self.scratch
        if share_counters:
            twin.bytes, twin.calls, twin.split, twin.times = self.bytes, self.calls, self.split, self.times
        return twin

    def _subgroup(self, members: list[list[int]]) -> Comm:
        """A Comm over this rank's list in `members` (a partition of the ranks), sharing the counters; inter when
        its ranks sit on more than one node. Every rank creates every group, in the same order (torch.distributed's
        rule for new_group)."""
        mine = next(m for m in members if self.rank in m)
        inter = len({r // self.node_size for r in mine}) > 1
        group = None
        if self.world > 1:
            for m in members:
                g = dist.new_group(m, timeout=datetime.timedelta(seconds=self.timeout_s), backend=self.backend)
                if m is mine:
                    group = g
        if len(mine) == 1:
            group = None
        sub = Comm(group, mine.index(self.rank), len(mine), self.timeout_s, self.backend, inter=inter)
        sub.bytes, sub.calls, sub.split, sub.times = self.bytes, self.calls, self.split, self.times
        sub.scratch = self.scratch
        return sub

    def node_group(self, size: int) -> Comm:
        """This rank's group of `size` consecutive ranks (a node, or an hpZ group inside one: intra when it fits in
        a node). A collective: every rank calls it."""
        if self.world % size:
            raise ValueError(f"groups of {size} ranks do not divide the world size {self.world}")
        return self._subgroup([list(range(s, s + size)) for s in range(0, self.world, size)])

    def peer_group(self, size: int) -> Comm:
        """The ranks with this rank's index inside its group of `size` consecutive ranks, one per group: the
        cross-node hop of qgZ when size is the node size. A collective: every rank calls it."""
        if self.world % size:
            raise ValueError(f"groups of {size} ranks do not divide the world size {self.world}")
        return self._subgroup([list(range(j, self.world, size)) for j in range(size)])

    def error(self, what: str, cause: BaseException) -> CommError:
        return CommError(
            f"zkern rank {self.rank} of {self.world}: {what} failed or did not complete within "
            f"comm_timeout_s={self.timeout_s:g}s. A peer rank died, or the ranks issued different collectives "
            f"(one rank took another code path or skipped a step). Cause: {cause}")

    def _count(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1
        self.split["inter" if self.inter else "intra"][kind] += nbytes
        self._counted = (kind, nbytes)

    def _run(self, fn, what: str, async_op: bool, *args, **kwargs) -> Work:
        counted, self._counted = self._counted, None
        start = time.perf_counter() if self.times.on and counted is not None else None
        try:
            handle = fn(*args, group=self.group, async_op=async_op, **kwargs)
        except Exception as e:
            raise self.error(what, e) from e
        work = Work(self, handle, what)
        if start is not None:  # from issue to completion as this rank sees it (a wait, or the call itself)
            work.timing = (*counted, start)
        if not async_op:
            work.handle = None
            if start is not None:
                self.times.record(*counted, start)
                work.timing = None
        return work

    def _local(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """A collective of one rank: out is inp (copied unless they share memory)."""
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return Work(self, None, "")

    def all_reduce(self, t: torch.Tensor, purpose: str, *, op=dist.ReduceOp.SUM, kind: str = "all_reduce",
                   async_op: bool = False) -> Work:
        """In-place all-reduce of t. kind "control" counts step-control scalars apart from gradient traffic."""
        if self.world == 1:
            return Work(self, None, "")
        self._count(kind, 2 * (self.world - 1) * t.numel() * t.element_size() // self.world)
        what = f"all_reduce of {t.numel()} {t.dtype} elements ({purpose})"
        return self._run(dist.all_reduce, what, async_op, t, op=op)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, purpose: str, *, async_op: bool = False) -> Work:
        """out (n,) <- sum over ranks of inp (world * n,)'s chunk [rank]."""
        if inp.numel() != out.numel() * self.world:
            raise ValueError(f"reduce_scatter: input has {inp.numel()} elements, output {out.numel()} x world "
                             f"{self.world} expected")
        if self.world == 1:
            return self._local(out, inp)
        self._count("reduce_scatter", (self.world - 1) * inp.numel() * inp.element_size() // self.world)
        what = f"reduce_scatter of {inp.numel()} {inp.dtype} elements ({purpose})"
        if inp.is_cuda:
            return self._run(_reduce_scatter_single, what, async_op, out, inp)
        received = self.scratch.take(inp.numel(), inp.dtype, inp.device)
        try:
            work = self._run(_reduce_scatter_exchange, what, async_op, received, inp)
        except CommError:  # nothing was launched
            self.scratch.give(received)
            raise

        def finish() -> None:  # section [rank] of every rank, summed in rank order (out may be inp's own section)
            torch.sum(received.view(self.world, -1), dim=0, out=out)
            self.scratch.give(received)
            work.scratch = None

        if async_op:
            work.finish, work.scratch = finish, received
        else:
            finish()
        return work

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, purpose: str, *, kind: str = "all_gather",
                   async_op: bool = False) -> Work:
        """out (world * n,) <- every rank's inp (n,), in rank order. kind "control" counts stage 3's agreement
        tags apart from parameter traffic."""
        if out.numel() != inp.numel() * self.world:
            raise ValueError(f"all_gather: output has {out.numel()} elements, input {inp.numel()} x world "
                             f"{self.world} expected")
        if self.world == 1:
            return self._local(out, inp)
        self._count(kind, (self.world - 1) * out.numel() * out.element_size() // self.world)
        what = f"all_gather of {out.numel()} {out.dtype} elements ({purpose})"
        return self._run(_all_gather_single if out.is_cuda else _all_gather_list, what, async_op, out, inp)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, purpose: str, *, out_splits: list[int] | None = None,
                   inp_splits: list[int] | None = None, kind: str = "all_to_all", async_op: bool = False) -> Work:
        """out (world * n,) <- [rank q's inp chunk [self.rank] for q in ranks]: inp's chunk j goes to rank j. With
        splits the chunks are uneven: inp's consecutive inp_splits[j] elements go to rank j, and out takes
        out_splits[q] elements from each rank q, in rank order (each rank's inp_splits[r] must be rank r's
        out_splits[its rank])."""
        if (out_splits is None) != (inp_splits is None):
            raise ValueError("all_to_all: give both out_splits and inp_splits, or neither")
        if out_splits is None:
            if out.numel() != inp.numel() or inp.numel() % self.world:
                raise ValueError(f"all_to_all: input of {inp.numel()} and output of {out.numel()} elements must be "
                                 f"equal and divisible by the world size {self.world}")
            sent = (self.world - 1) * inp.numel() // self.world
        else:
            if (len(out_splits), len(inp_splits)) != (self.world, self.world) or \
                    (sum(out_splits), sum(inp_splits)) != (out.numel(), inp.numel()):
                raise ValueError(f"all_to_all: splits {out_splits} / {inp_splits} must have one entry per rank "
                                 f"({self.world}) and sum to the output's {out.numel()} / input's {inp.numel()} "
                                 f"elements")
            sent = inp.numel() - inp_splits[self.rank]
        if self.world == 1:
            return self._local(out, inp)
        self._count(kind, sent * inp.element_size())
        what = f"all_to_all of {inp.numel()} {inp.dtype} elements ({purpose})"
        if out_splits is None:
            return self._run(dist.all_to_all_single, what, async_op, out, inp)
        return self._run(dist.all_to_all_single, what, async_op, out, inp, output_split_sizes=out_splits,
                         input_split_sizes=inp_splits)

    def broadcast(self, t: torch.Tensor, purpose: str, *, src: int = 0) -> None:
        """In-place broadcast of t from rank src (used once, at construction, so every rank starts equal)."""
        if self.world == 1:
            return
        self._count("broadcast", t.numel() * t.element_size() if self.rank == src else 0)
        self._run(dist.broadcast, f"broadcast of {t.numel()} {t.dtype} elements ({purpose})", False, t, src=src)

    def stats(self) -> dict[str, int]:
        """Bytes this rank sent per collective kind since the start, plus call counts under 'calls' and the same
        bytes split by whether their group spans nodes under 'intra' and 'inter'."""
        out: dict = {kind: self.bytes.get(kind, 0) for kind in KINDS}
        out["calls"] = {kind: self.calls.get(kind, 0) for kind in KINDS}
        for where in ("intra", "inter"):
            out[where] = {kind: self.split[where].get(kind, 0) for kind in KINDS}
        return out
