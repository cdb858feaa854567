"""ZeRO stage 3: parameters partitioned at rest, gathered per fetch unit while needed, prefetched ahead.

    python -m pytest tests/test_stage3.py -q

At rest every parameter's .data is an empty tensor; each rank holds its chunk of every fetch unit (units.py)
in `param_shard` (working dtype; on the host with offload_param), `master` (fp32: mixed precision, or on the
host with offload_optimizer) and `grad_shard`. The layout is partition.plan_unit_layout: one bucket per
unit, padded to the world size, rank r owning chunk r.

  forward   pre-hook of a module: gather the units it needs (or finish their prefetch) -> run -> post-hook:
            release; the last user frees the unit. Outputs get a tensor hook that gathers again in backward.
  backward  a unit's parameters' gradients are copied into the unit's bucket as they arrive; when all have
            arrived the bucket is reduce-scattered into the rank's gradient shard and the unit is freed.
            Units that never complete (frozen or unused parameters) are flushed, in unit order, at the end.
  prefetch  each pass records the order of its gathers; the next pass gathers up to
            stage3_prefetch_bucket_size elements ahead (and never past stage3_max_live_parameters live). A
            pass that departs from the record stops prefetching, re-records, and says so once.
  external  the first pass (and every re-recording pass) watches torch calls for parameters at rest: a module
            that reads a parameter of another unit (a tied head, self.head.weight used elsewhere) is given
            that unit to gather from then on.

Ranks must run the same modules in the same order (as in every stage-3 implementation); a rank that takes
another path issues different collectives and the job ends with a CommError naming rank and collective.
"""

from __future__ import annotations

import logging
from collections import deque

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from zkern import ops
from zkern.engine.comm import Comm, Work
from zkern.engine.offload import host_tensor
from zkern.engine.optimizer import Chunk, ShardGroup
from zkern.engine.order import OrderRecord
from zkern.engine.partition import plan_unit_layout
from zkern.engine.sharded_init import full_shape, gather_built, is_sharded
from zkern.engine.units import ReduceGroup, Unit, plan_reduce_groups, plan_units

log = logging.getLogger("zkern")


# Attribute reads an at-rest parameter answers correctly (its empty stand-in has the right dtype and device).
_METADATA = frozenset({"dtype", "device", "requires_grad", "is_leaf", "layout", "is_cuda", "grad_fn"})


class _WatchAtRest(TorchFunctionMode):
    """Recording passes only: a torch call that reads a parameter at rest gathers its unit for the running
    module (and remembers that the module needs it)."""

    def __init__(self, runtime: Stage3Runtime):
        super().__init__()
        self.runtime = runtime

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.runtime._in_hook:  # the runtime's own work (gathering sets p.data) is not the model reading
            return func(*args, **kwargs)
        if getattr(getattr(func, "__self__", None), "__name__", None) in _METADATA:
            return func(*args, **kwargs)
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.nn.Parameter):
                self.runtime._adopt_if_at_rest(leaf)
        return func(*args, **kwargs)


class Stage3Runtime:
    """Stage 3 behind the engine's runtime interface (see Stage12Runtime)."""

    def __init__(self, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], *, comm: Comm,
                 dtype: torch.dtype, mixed: bool, zero, overlap: bool, reduce_scatter: bool, bucket_numel: int):
        offload = zero.offload_optimizer_device == "cpu"
        self.params_on_host = zero.offload_param_device == "cpu"
        self.comm, self.dtype, self.mixed, self.overlap = comm, dtype, mixed, overlap
        self.root = model
        self.prefetch_numel = zero.stage3_prefetch_bucket_size
        self.max_live = zero.stage3_max_live_parameters
        plans, needs = plan_units(model, tuple(zero.stage3_fetch_units), zero.stage3_param_persistence_threshold)
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g}
        frozen = len(groups)
        for plan in plans:  # within a unit: parameters of group 0, group 1, ..., then frozen ones
            order = sorted(range(len(plan.params)), key=lambda i: group_of.get(id(plan.params[i]), frozen))
            plan.params = [plan.params[i] for i in order]
            plan.names = [plan.names[i] for i in order]
        self.layout = plan_unit_layout([[full_shape(p).numel() for p in u.params] for u in plans], comm.world)
        self.units = [Unit(i, plan, b, sum(p.requires_grad for p in plan.params))
                      for i, (plan, b) in enumerate(zip(plans, self.layout.buckets))]
        self.reduce_scatter = reduce_scatter
        self.groups = self._plan_reduce_groups(bucket_numel)
        self.needs = needs
        self.all_params = [p for u in plans for p in u.params]
        self.all_names = [n for u in plans for n in u.names]
        self._unit_of = {id(p): u for u in self.units for p in u.plan.params}
        self._position = {id(p): i for u in self.units for i, p in enumerate(u.plan.params)}
        self.params = [p for p in self.all_params if p.requires_grad]
        self.names = [n for p, n in zip(self.all_params, self.all_names) if p.requires_grad]
        self._trainable_index = {id(p): i for i, p in enumerate(self.params)}
        self.used = [False] * len(self.params)
        # Shapes and in-unit offsets, recorded while parameters are still whole (at rest .data is empty;
        # a model built under init_sharded arrives with its parameters already at rest).
        self._full_shape = {id(p): full_shape(p) for p in self.all_params}
        self._name = {id(p): n for p, n in zip(self.all_params, self.all_names)}
        self._offset: dict[int, int] = {}
        for u in self.units:
            off = 0
            for p in u.plan.params:
                self._offset[id(p)] = off
                off += self._full_shape[id(p)].numel()

        device = self.all_params[0].device
        self._empty = torch.empty(0, dtype=dtype, device=device)
        shard = self.layout.shard_numel
        # offload_param: the working-dtype shard rests on the host and is copied up for each gather.
        cuda = device.type == "cuda"  # page-locked host memory only helps (and only exists) with a GPU
        if self.params_on_host:
            self.param_shard = host_tensor(shard, dtype, pin=zero.offload_param_pin_memory and cuda)
        else:
            self.param_shard = torch.zeros(shard, dtype=dtype, device=device)
        # offload_optimizer: the fp32 master shard lives on the host, in fp32 runs too (the optimizer's copy).
        self.master = None
        if offload:
            self.master = host_tensor(shard, torch.float32,
                                      pin=zero.offload_optimizer_pin_memory and cuda)
        elif mixed:
            self.master = torch.zeros(shard, dtype=torch.float32, device=device)
        self.grad_shard = torch.zeros(shard, dtype=dtype, device=device)
        self.peak_live = 0  # largest number of gathered elements seen (bookkeeping for tests and reports)
        self._live = 0  # elements gathered or in flight
        self._ahead = 0  # of which prefetched and not used yet
        self._prefetched: set[int] = set()
        self._partition()
        for u in self.units:
            if u.plan.persistent:
                self._gather(u, async_op=False)

        self._phase = "forward"
        self.order = OrderRecord()
        self._said_reorder = False
        self._stack: list[torch.nn.Module] = []
        self._watch: _WatchAtRest | None = None
        self._in_hook = False
        self._needs_changed = False
        self._pending: deque[tuple[ReduceGroup, Work]] = deque()
        self._micro_since_step = 0
        self._hooks = []
        self._hooked: set[int] = set()
        for module in [model, *needs]:
            self._hook_module(module)
        for p in self.params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.shard_groups = self._make_shard_groups(groups)

    # -- layout -----------------------------------------------------------------------------------------------
    def _partition(self) -> None:
        """Keep this rank's chunk of every unit (fp32 master and working copy); parameters go to rest. One unit
        is whole at a time: parameters partitioned by init_sharded are gathered for it and dropped again."""
        rank = self.comm.rank
        device = self._empty.device
        with torch.no_grad():
            for u in self.units:
                b = u.bucket
                full = torch.zeros(b.padded, dtype=torch.float32, device=device)
                values = [gather_built(p, self.comm, "a parameter built under init_sharded, for the stage-3 layout")
                          .to(device) if is_sharded(p) else p.detach() for p in u.plan.params]
                full[:b.numel].copy_(ops.flatten(values, torch.float32))
                del values
                mine = full[rank * b.chunk:(rank + 1) * b.chunk]
                self.param_shard[b.shard_offset:b.shard_offset + b.chunk].copy_(mine)
                if self.master is not None:
                    self.master[b.shard_offset:b.shard_offset + b.chunk].copy_(mine)
                for p in u.plan.params:
                    p.data = self._empty
                    if is_sharded(p):
                        del p._zkern_shard, p._zkern_shape

    def _make_shard_groups(self, groups: list[list[torch.nn.Parameter]]) -> list[ShardGroup]:
        """Per optimizer group: its pieces, and per unit the contiguous sub-range of its pieces."""
        base = self.master if self.master is not None else self.param_shard
        out_base = self.param_shard if self.master is not None else None
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g}
        pieces: list[list[torch.Tensor]] = [[] for _ in groups]
        spans: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (group, unit) -> (piece, shard, numel)
        self._pieces_param: list[list[int]] = [[] for _ in groups]  # trainable index of each piece
        for piece in self.layout.pieces(self.comm.rank):
            p = self.all_params[piece.param]
            gi = group_of.get(id(p))
            if gi is None:
                continue  # frozen
            t = base[piece.shard_start:piece.shard_start + piece.numel]
            if piece.numel == self._full_shape[id(p)].numel():
                t = t.view(self._full_shape[id(p)])
            spans.setdefault((gi, piece.bucket), []).append((len(pieces[gi]), piece.shard_start, piece.numel))
            pieces[gi].append(t)
            self._pieces_param[gi].append(self._trainable_index[id(p)])
        result = []
        for gi in range(len(groups)):
            chunks = []
            for u in self.units:
                span = spans.get((gi, u.index))
                if not span:
                    continue
                lo, hi = span[0][1], span[-1][1] + span[-1][2]
                chunks.append(Chunk(param=base[lo:hi], grad=self.grad_shard[lo:hi],
                                    out=None if out_base is None else out_base[lo:hi], shard_start=lo,
                                    pieces=[(index, start - lo, numel) for index, start, numel in span]))
            result.append(ShardGroup(pieces=pieces[gi], chunks=chunks, shard_numel=self.layout.shard_numel))
        return result

    # -- gather / free ----------------------------------------------------------------------------------------
    def live_elements(self) -> int:
        """Elements gathered or in flight now (kept as a running count: scanning every unit on every gather
        would cost O(units^2) per pass, about 640k visits for an 800-unit model)."""
        return self._live

    def gathered_units(self) -> list[str]:
        """Names of the non-persistent units gathered (or in flight) now."""
        return [u.plan.name for u in self.units if u.state != "rest" and not u.plan.persistent]

    def _gather(self, u: Unit, async_op: bool) -> None:
        b = u.bucket
        u.buffer = torch.empty(b.padded, dtype=self.dtype, device=self._empty.device)
        own = self.param_shard[b.shard_offset:b.shard_offset + b.chunk]
        if self.params_on_host:
            # Copied up into this rank's own slot of the gather buffer, then gathered in place: no extra buffer.
            slot = u.buffer[self.comm.rank * b.chunk:(self.comm.rank + 1) * b.chunk]
            own = slot.copy_(own, non_blocking=own.is_pinned())
        u.work = self.comm.all_gather(u.buffer, own, f"parameters of unit '{u.plan.name}'", async_op=async_op)
        u.state = "inflight"
        self._live += b.padded
        self.peak_live = max(self.peak_live, self._live)
        if not async_op:
            self._finish(u)

    def _finish(self, u: Unit) -> None:
        if u.state != "inflight":
            return
        u.work.wait()
        u.work = None
        for p in u.plan.params:
            shape, off = self._full_shape[id(p)], self._offset[id(p)]
            p.data = u.buffer[off:off + shape.numel()].view(shape)
        u.state = "gathered"

    def _free(self, u: Unit) -> None:
        if u.plan.persistent or u.state == "rest":
            return
        if u.state == "inflight":
            u.work.wait()
            u.work = None
        for p in u.plan.params:
            p.data = self._empty
        u.buffer = None
        u.state = "rest"
        self._live -= u.bucket.padded
        self._consume_prefetch(u)

    # -- order recording and prefetch -------------------------------------------------------------------------
    def _event(self, u: Unit) -> None:
        """u is needed now and nobody holds it: record it, and stop prefetching if the pass left the record."""
        expected = self.order.see(self._phase, u.index)
        if expected is None:
            return
        self._drop_prefetched()
        if not self._said_reorder and self.comm.rank == 0:
            self._said_reorder = True
            log.warning("zkern stage 3: the %s pass gathered unit '%s' where the recorded order expected '%s'; "
                        "prefetch stops for this pass and the order is re-recorded (said once)", self._phase,
                        u.plan.name, self.units[expected].plan.name if expected >= 0 else "nothing")

    def _prefetch(self) -> None:
        for ui in self.order.upcoming(self._phase):
            u = self.units[ui]
            if u.state != "rest":
                continue
            size = u.bucket.padded
            if self._ahead + size > self.prefetch_numel or self._live + size > self.max_live:
                break
            self._gather(u, async_op=True)
            u.prefetched = True
            self._ahead += size
            self._prefetched.add(u.index)

    def _consume_prefetch(self, u: Unit) -> None:
        if u.prefetched:
            u.prefetched = False
            self._ahead -= u.bucket.padded
            self._prefetched.discard(u.index)

    def _drop_prefetched(self) -> None:
        for ui in sorted(self._prefetched):
            self._free(self.units[ui])

    def _use(self, u: Unit) -> None:
        """Make u's parameters whole for the running module."""
        if u.plan.persistent:
            return
        if u.state == "rest" or u.prefetched:
            self._event(u)
        if u.state == "rest":
            self._gather(u, async_op=False)
        self._finish(u)
        self._consume_prefetch(u)
        self._prefetch()

    def _end_pass(self) -> None:
        self._drop_prefetched()
        self.order.end(self._phase)
        if self._needs_changed:  # a module adopted a unit: the next passes gather in another order
            self.order.forget()
            self._needs_changed = False

    # -- forward hooks ----------------------------------------------------------------------------------------
    def _hook_module(self, module: torch.nn.Module) -> None:
        if id(module) in self._hooked:
            return
        self._hooked.add(id(module))
        self._hooks.append(module.register_forward_pre_hook(self._pre_forward))
        self._hooks.append(module.register_forward_hook(self._post_forward))

    def _pre_forward(self, module: torch.nn.Module, args) -> None:
        if module is self.root and not self._stack:
            self._begin_forward()
        self._stack.append(module)
        self._in_hook = True
        try:
            for ui in self.needs.get(module, ()):
                u = self.units[ui]
                if u.refs == 0:
                    self._use(u)
                u.refs += 1
        finally:
            self._in_hook = False

    def _post_forward(self, module: torch.nn.Module, args, output):
        self._in_hook = True
        try:
            return self._release_after_forward(module, output)
        finally:
            self._in_hook = False

    def _release_after_forward(self, module: torch.nn.Module, output):
        if self._stack and self._stack[-1] is module:
            self._stack.pop()
        for ui in self.needs.get(module, ()):
            u = self.units[ui]
            u.refs -= 1
            if u.refs == 0 and not u.held_for_backward:
                self._free(u)
        if torch.is_grad_enabled() and module in self.needs:
            output = tree_map(lambda t: self._hook_output(t, module), output)
        if module is self.root and not self._stack:
            self._end_forward()
        return output

    def abort_pass(self, error: BaseException) -> None:
        """The model raised inside forward: drop what the pass held, so the next call starts clean, and tell the
        user the likely stage-3 cause of a shape error."""
        if isinstance(error, RuntimeError) and not self.order.recording_only("forward"):
            error.add_note("zkern stage 3: parameters of modules that are not running are empty at rest. If this "
                           "forward read another module's parameter in a way the first step did not (a branch "
                           "taken only now), declare it before creating the engine: "
                           "zkern.register_external_parameter(reading_module, parameter)")
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
            self._watch = None
        self._stack.clear()
        self._in_hook = False
        for u in self.units:
            u.refs = 0
            if not u.held_for_backward:
                self._free(u)
        self.order.abandon(self._phase)

    def _begin_forward(self) -> None:
        self._phase = "forward"
        self._stack.clear()
        if self.order.recording_only("forward"):
            self._watch = _WatchAtRest(self)
            self._watch.__enter__()

    def _end_forward(self) -> None:
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
            self._watch = None
        self._end_pass()

    def _adopt_if_at_rest(self, p: torch.nn.Parameter) -> None:
        u = self._unit_of.get(id(p))
        if u is None or u.plan.persistent or (u.state == "gathered" and not u.prefetched):
            return
        module = self._stack[-1] if self._stack else self.root
        wanted = self.needs.setdefault(module, [])
        if u.index not in wanted:
            wanted.append(u.index)
            self._hook_module(module)
            self._needs_changed = True  # the next pass gathers in a new order: record it afresh, silently
            if self.comm.rank == 0:
                log.info("zkern stage 3: %s reads '%s' of unit '%s' outside that unit's modules; it gathers that "
                         "unit from now on", type(module).__name__, self._name[id(p)], u.plan.name)
        if u.refs == 0:
            self._use(u)
        u.refs += 1

    def _hook_output(self, t, module):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda grad: self._pre_backward(module, grad))
        return t

    # -- backward ---------------------------------------------------------------------------------------------
    def _pre_backward(self, module: torch.nn.Module, grad):
        for ui in self.needs.get(module, ()):
            u = self.units[ui]
            if not u.held_for_backward:
                u.held_for_backward = True
                self._use(u)
        return grad

    def begin_backward(self, boundary: bool) -> None:
        self._phase = "backward"
        self.order.begin("backward")
        for u in self.units:
            u.fired = set()
            u.complete = False

    def _plan_reduce_groups(self, bucket_numel: int) -> list[ReduceGroup]:
        out = []
        spans = plan_reduce_groups([u.bucket.padded for u in self.units], [u.trainable > 0 for u in self.units],
                                   bucket_numel)
        for gi, indices in enumerate(spans):
            units = [self.units[i] for i in indices]
            offsets, section = {}, 0
            for u in units:
                offsets[u.index] = section
                section += u.bucket.chunk
            group = ReduceGroup(gi, units, section, offsets, units[0].bucket.shard_offset)
            for u in units:
                u.group = group
            out.append(group)
        return out

    def _on_grad(self, p: torch.nn.Parameter) -> None:
        u = self._unit_of[id(p)]
        pos = self._position[id(p)]
        self.used[self._trainable_index[id(p)]] = True
        if u.complete:
            raise RuntimeError(
                f"zkern stage 3: '{self._name[id(p)]}' received a second gradient in one backward after its unit "
                f"was reduced (reentrant activation checkpointing?); use "
                f"torch.utils.checkpoint(..., use_reentrant=False)")
        g = u.group
        self._ensure_buffer(g)
        self._scatter_into(g, u, p, p.grad.reshape(-1), add=pos in u.fired)
        u.fired.add(pos)
        p.grad = None  # only the shard is kept
        if len(u.fired) == u.trainable:
            self._complete(u)

    def _scatter_into(self, g: ReduceGroup, u: Unit, p: torch.nn.Parameter, grad: torch.Tensor, add: bool) -> None:
        """Copy p's flat gradient into the rank sections of g's buffer that its unit chunks map to."""
        off, n, c = self._offset[id(p)], grad.numel(), u.bucket.chunk
        for q in range(off // c, (off + n - 1) // c + 1):
            lo, hi = max(off, q * c), min(off + n, (q + 1) * c)
            start = q * g.section + g.section_offset[u.index] + lo - q * c
            dst, src = g.buffer[start:start + hi - lo], grad[lo - off:hi - off]
            if add:
                dst.add_(src)
            else:
                dst.copy_(src)

    def _complete(self, u: Unit) -> None:
        """All of u's gradients are in its group's buffer: free u, and reduce the group once it is whole."""
        u.complete = True
        if u.held_for_backward and u.refs == 0:
            u.held_for_backward = False
            self._free(u)
        g = u.group
        g.complete += 1
        if g.complete == len(g.units):
            self._launch(g)

    def _ensure_buffer(self, g: ReduceGroup) -> None:
        """The group's rank-major gradient buffer, made at its first gradient of the pass (or at launch, for a group
        that got none). Zeros: padding and parameters without a gradient reduce as zero."""
        if g.buffer is None:
            g.buffer = torch.zeros(g.section * self.comm.world, dtype=self.dtype, device=self._empty.device)

    def _launch(self, g: ReduceGroup) -> None:
        self._ensure_buffer(g)
        rank = self.comm.rank
        names = f"'{g.units[0].plan.name}'" + (f"..'{g.units[-1].plan.name}'" if len(g.units) > 1 else "")
        purpose = f"gradients of units {names}"
        if self.reduce_scatter:
            out = g.buffer[rank * g.section:(rank + 1) * g.section]
            work = self.comm.reduce_scatter(out, g.buffer, purpose, async_op=self.overlap)
        else:  # reduce_scatter=false: all-reduce, then keep this rank's section
            work = self.comm.all_reduce(g.buffer, purpose, async_op=self.overlap)
        self._pending.append((g, work))
        # Overlap keeps at most two reductions in flight, so gradient buffers never pile up during backward.
        while self._pending and (not self.overlap or len(self._pending) > 2):
            self._retire()

    def _retire(self) -> None:
        g, work = self._pending.popleft()
        work.wait()
        rank = self.comm.rank
        section = g.buffer[rank * g.section:(rank + 1) * g.section]
        shard = self.grad_shard[g.shard_offset:g.shard_offset + g.section]
        if self._micro_since_step == 0:
            shard.copy_(section)
        else:
            shard.add_(section)
        g.buffer = None

    def end_backward(self) -> None:
        for u in self.units:  # unit order on every rank: units some parameters of which got no gradient
            if u.trainable and not u.complete:
                self._complete(u)
        while self._pending:
            self._retire()
        for u in self.units:
            if u.held_for_backward:
                u.held_for_backward = False
                if u.refs == 0:
                    self._free(u)
        for g in self.groups:
            g.complete = 0
        self._end_pass()
        self._phase = "forward"
        self._micro_since_step += 1

    # -- step -------------------------------------------------------------------------------------------------
    def active(self, flags: list[bool]) -> list[list[bool]]:
        return [[flags[i] for i in per_group] for per_group in self._pieces_param]

    def grad_segments(self) -> list[torch.Tensor]:
        return [self.grad_shard]

    def after_step(self) -> None:
        """Refresh what stays whole (the persistent unit) from the updated shards."""
        for u in self.units:
            if u.plan.persistent:
                b = u.bucket
                own = self.param_shard[b.shard_offset:b.shard_offset + b.chunk].to(u.buffer.device)
                self.comm.all_gather(u.buffer, own, "updated persistent parameters")

    def zero_grad(self) -> None:
        self._micro_since_step = 0
        self.used = [False] * len(self.params)

    def full_fp32(self, rank0_only: bool) -> dict[int, torch.Tensor] | None:
        """id(parameter) -> fp32 value (collective; None off rank 0 with rank0_only)."""
        source = self.master if self.master is not None else self.param_shard
        values = self._gather_all(source, torch.float32, "fp32 weights for full_state_dict",
                                  keep=not rank0_only or self.comm.rank == 0)
        return values if not rank0_only or self.comm.rank == 0 else None

    def full_working(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> value in the working dtype (collective), for saving 16-bit weights."""
        return self._gather_all(self.param_shard, self.dtype, "16-bit weights for save_16bit_model", keep=True)

    def _gather_all(self, source: torch.Tensor, dtype: torch.dtype, purpose: str, keep: bool) -> dict:
        """Every unit whole from `source` shards, one unit at a time; keep=False drops them (other ranks)."""
        values = {}
        for u in self.units:
            b = u.bucket
            data = torch.empty(b.padded, dtype=dtype, device=self._empty.device)  # offloaded sources: copied up
            self.comm.all_gather(data, source[b.shard_offset:b.shard_offset + b.chunk].to(data.device, dtype),
                                 f"{purpose}, unit '{u.plan.name}'")
            if keep:
                for p in u.plan.params:
                    shape, off = self._full_shape[id(p)], self._offset[id(p)]
                    values[id(p)] = data[off:off + shape.numel()].clone().view(shape)
        return values

    # -- accounting -------------------------------------------------------------------------------------------
    def memory(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()

        persistent = sum(nbytes(u.buffer) for u in self.units if u.plan.persistent)
        live = sum(nbytes(u.buffer) for u in self.units if not u.plan.persistent)
        grads = sum(nbytes(g.buffer) for g in self.groups)
        return {"params": nbytes(self.param_shard) + persistent, "grads": nbytes(self.grad_shard),
                "master": nbytes(self.master), "comm_buffers": live + grads}

    def describe(self) -> list[str]:
        persistent = sum(u.plan.numel for u in self.units if u.plan.persistent)
        return [f"stage 3: {len(self.units)} fetch units over {len(self.all_params)} parameters ({self.layout.numel} "
                f"elements), padded with {self.layout.padding} zero elements to a shard of {self.layout.shard_numel} "
                f"per rank; {persistent} elements in small units stay whole on every rank"]

    def warnings(self, reduce_bucket_size: int) -> list[str]:
        if self.comm.world > 1 and len(self.groups) == 1 and len(self.groups[0].units) > 1:
            n = self.groups[0].section * self.comm.world
            return [f"stage 3 with one gradient bucket: reduce_bucket_size ({reduce_bucket_size}) covers all {n} "
                    f"trainable elements, so gradients are reduced only when backward ends, from a buffer as large "
                    f"as the whole gradient. Set zero_optimization.reduce_bucket_size well below {n} (\"auto\" = "
                    f"hidden_size**2) to reduce during backward and keep memory at the shard."]
        return []
