"""ZeRO stage 3: parameters partitioned at rest, gathered per fetch unit while needed, prefetched ahead.

    python -m pytest tests/test_stage3.py tests/test_stage3_checkpointing.py tests/test_stage3_moe.py -q

At rest every parameter's .data is an empty tensor; each rank holds its chunk of every fetch unit (units.py)
in `param_shard` (working dtype; on the host with offload_param, in a file with offload_param "nvme"), `master`
(fp32: mixed precision, or on the host with offload_optimizer, in files with its device "nvme") and
`grad_shard`. A shard in files is a meta stand-in here (nvme.py): values(t) and write_values(t, v) reach it.
The layout is partition.plan_unit_layout: one bucket per unit, padded to the world size, rank r owning chunk r.
With zero_quantized_nontrainable_weights the units with nothing to train are laid out last and rest as int8 in
`frozen` (zeropp.FrozenStore): the three dense buffers stop before their chunks.

The pieces, one job each:
  lifecycle.py      the unit's states and the only transitions between them; invariants at each pass's end
  gatherer.py       gather, release, prefetch along the recorded order, versions, counts, the gather signature
  stage3_hooks.py   module frames, backward holds, external reads, agreement across ranks and merges
  stage3_reduce.py  gradient buckets reduced in one fixed order on a process group of their own
  gathered.py       zkern.GatheredParameters
This file builds them, lays the shards out, and answers the engine's runtime interface (see Stage12Runtime).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from zkern import ops
from zkern.comm.collectives import Comm, CommError
from zkern.comm.divergence import MAX_SIGNATURE_WORLD, TagKind, describe_mismatch, exchange_tags
from zkern.comm.whole import WholeBucket, gather_whole
from zkern.comm.zeropp import FrozenStore, QuantizedReduce, Secondary
from zkern.core.owners import register_owner
from zkern.core.partition import plan_unit_layout
from zkern.core.runtime import ShardMap
from zkern.core.state import Component, host_copy
from zkern.offload import nvme as nvme_files
from zkern.offload.host import host_tensor
from zkern.optim.shard_adam import Chunk, ShardGroup
from zkern.stage3.gatherer import Gatherer
from zkern.stage3.hooks import Stage3Hooks
from zkern.stage3.lifecycle import DataState, InvariantError, Unit, check_pass_end
from zkern.stage3.reduce import GradReducer
from zkern.stage3.sharded_init import forget_sharding, full_shape, gather_built, is_sharded, release_freed_memory
from zkern.stage3.units import plan_units

log = logging.getLogger("zkern")


class Stage3Runtime:
    """Stage 3 behind the engine's runtime interface (see Stage12Runtime)."""

    def __init__(self, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], *, comm: Comm,
                 dtype: torch.dtype, mixed: bool, zero, overlap: bool, reduce_scatter: bool, bucket_numel: int,
                 comm_dtype: torch.dtype | None = None, accum_dtype: torch.dtype | None = None,
                 device: torch.device | None = None, nvme=None, param_files=None):
        """nvme: an engine.nvme.NvmeShard when offload_optimizer.device is "nvme" (the master shard is then one
        region of its files, self.master its meta stand-in). param_files(numel, dtype, units) -> an
        nvme_params.NvmeParams when offload_param.device is "nvme" (self.param_shard its meta stand-in)."""
        if comm.world > MAX_SIGNATURE_WORLD:
            raise ValueError(f"stage 3 checks its gathers across at most {MAX_SIGNATURE_WORLD} ranks, got {comm.world}")
        self.params_on_host = zero.offload_param_device in ("cpu", "nvme")  # gathers start from host values
        self.comm, self.dtype, self.mixed = comm, dtype, mixed
        self.merge_divergent = zero.stage3_merge_divergent_modules
        self.root = model
        plans, needs = plan_units(model, tuple(zero.stage3_fetch_units), zero.stage3_param_persistence_threshold)
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g}
        frozen = len(groups)
        for plan in plans:  # within a unit: parameters of group 0, group 1, ..., then frozen ones
            order = sorted(range(len(plan.params)), key=lambda i: group_of.get(id(plan.params[i]), frozen))
            plan.params = [plan.params[i] for i in order]
            plan.names = [plan.names[i] for i in order]
        if zero.zero_quantized_nontrainable_weights:
            plans, needs = _frozen_last(plans, needs)
        self.layout = plan_unit_layout([[full_shape(p).numel() for p in u.params] for u in plans], comm.world)
        paths = {id(m): name for name, m in model.named_modules()}
        readers: dict[int, list[str]] = {}
        for module, wanted in needs.items():
            for ui in wanted:
                readers.setdefault(ui, []).append(paths[id(module)] or "<root>")
        self.units = [Unit(i, plan, b, sum(p.requires_grad for p in plan.params), readers=tuple(readers.get(i, ())))
                      for i, (plan, b) in enumerate(zip(plans, self.layout.buckets))]
        self.all_params = [p for u in plans for p in u.params]
        self.all_names = [n for u in plans for n in u.names]
        self.params = [p for p in self.all_params if p.requires_grad]
        self.names = [n for p, n in zip(self.all_params, self.all_names) if p.requires_grad]
        self._trainable_index = {id(p): i for i, p in enumerate(self.params)}
        self._frozen_ids = {id(p) for p in self.all_params if not p.requires_grad}
        self._unit_of = {id(p): u for u in self.units for p in u.plan.params}
        # Shapes and in-unit offsets, recorded while parameters are still whole (at rest .data is empty; a model
        # built under init_sharded arrives with its parameters already at rest).
        self._full_shape = {id(p): full_shape(p) for p in self.all_params}
        self._offset: dict[int, int] = {}
        for u in self.units:
            off = 0
            for p in u.plan.params:
                self._offset[id(p)] = off
                off += self._full_shape[id(p)].numel()

        device = torch.device(device) if device is not None else self.all_params[0].device
        # zero_quantized_nontrainable_weights: units with nothing to train come last in the shard (_frozen_last) and
        # rest in `frozen` as int8; the dense buffers end where they begin.
        frozen_units = [u for u in self.units if _nothing_to_train(u.plan)] \
            if zero.zero_quantized_nontrainable_weights else []
        shard = frozen_units[0].bucket.shard_offset if frozen_units else self.layout.shard_numel
        cuda = device.type == "cuda"  # page-locked host memory only helps (and only exists) with a GPU
        self.param_store = None
        if param_files is not None:  # offload_param "nvme": the working shard rests in a file, read per gather
            self.param_store = param_files(shard, dtype, {u.index: (u.bucket.shard_offset, u.bucket.chunk)
                                                          for u in self.units if u.bucket.shard_offset < shard})
            self.param_shard = self.param_store.stand_in
        elif self.params_on_host:  # offload_param: the working shard rests on the host, copied up per gather
            self.param_shard = host_tensor(shard, dtype, pin=zero.offload_param_pin_memory and cuda)
        else:
            self.param_shard = torch.zeros(shard, dtype=dtype, device=device)
        # offload_optimizer: the fp32 master shard lives on the host, in fp32 runs too (the optimizer's copy).
        self.master = None
        self.nvme = nvme
        if nvme is not None:  # offload_optimizer.device "nvme": the master is a region of the shard's files
            self.master = nvme.add_region(shard)
        elif zero.offload_optimizer_device == "cpu":
            self.master = host_tensor(shard, torch.float32, pin=zero.offload_optimizer_pin_memory and cuda)
        elif mixed or self.params_on_host:
            # offload_param without offload_optimizer keeps the optimizer on the device: an fp32 master there (in fp32
            # runs too), whose step writes each updated chunk to the host shard
            self.master = torch.zeros(shard, dtype=torch.float32, device=device)
        self.grad_shard = torch.zeros(shard, dtype=accum_dtype or dtype, device=device)  # data_types.grad_accum_dtype
        self._empty = torch.empty(0, dtype=dtype, device=device)
        self.frozen = None
        if frozen_units:
            self.frozen = FrozenStore({u.index: u.bucket.chunk for u in frozen_units}, zero.zeropp_weight_group_size,
                                      torch.device("cpu") if self.param_store is not None else self.param_shard.device,
                                      pin=self.param_shard.is_pinned())
        self._partition()

        where = {id(p): (self._full_shape[id(p)], self._offset[id(p)]) for p in self.all_params}
        # hpZ: a secondary copy of every unit that is gathered and freed (persistent ones stay whole anyway).
        self.secondary = None
        if zero.zero_hpz_partition_size > 1:
            self.secondary = Secondary(comm, zero.zero_hpz_partition_size,
                                       {u.index: u.bucket.padded for u in self.units if not u.persistent}, dtype,
                                       device)
        self.gatherer = Gatherer(self.units, comm, param_shard=self.param_shard, dtype=dtype, device=device,
                                 layout=where,
                                 params_on_host=self.params_on_host, param_store=self.param_store,
                                 prefetch_numel=zero.stage3_prefetch_bucket_size,
                                 max_live=zero.stage3_max_live_parameters,
                                 quantize_weights=zero.zeropp_weight_group_size if zero.zero_quantized_weights else 0,
                                 secondary=self.secondary, frozen=self.frozen)
        for u in self.units:
            if u.persistent:
                self.gatherer.gather(u, async_op=False)
        self.hooks = Stage3Hooks(model, self.units, needs, self.gatherer, merge_divergent=self.merge_divergent)
        self._child_handles = _watch_optional_children(model, self.units, needs)
        reduce_comm = comm.sibling()
        self.quantized_reduce = QuantizedReduce.from_config(reduce_comm, zero)
        self.reducer = GradReducer(self.units, reduce_comm, grad_shard=self.grad_shard,
                                   comm_dtype=comm_dtype or dtype, bucket_numel=bucket_numel,
                                   overlap=overlap, reduce_scatter=reduce_scatter, offsets=self._offset,
                                   params=self.params,
                                   names={id(p): n for p, n in zip(self.all_params, self.all_names)},
                                   quantized=self.quantized_reduce)
        self.reducer.on_complete = self.hooks.on_complete
        self._handles = [p.register_post_accumulate_grad_hook(self.reducer.on_grad) for p in self.params]
        self._unguarded = False
        for module in model.modules():
            if any(id(p) in self._unit_of for p in module.parameters(recurse=False)):
                self._handles.append(module.register_state_dict_pre_hook(self._state_dict_guard))
                self._handles.append(module.register_load_state_dict_pre_hook(self._load_guard))
        self.shard_groups = self._make_shard_groups(groups)
        register_owner(self.all_params, self)

    # -- layout -----------------------------------------------------------------------------------------------
    def _partition(self) -> None:
        """Keep this rank's chunk of every unit (fp32 master and working copy); parameters go to rest. One unit
        is whole at a time, on the device (the parameters may be on the host: the model is never whole on the
        device): rank 0's values are broadcast for it, and parameters partitioned by init_sharded (equal on every
        rank already) are gathered for it and dropped again."""
        rank = self.comm.rank
        device = self._empty.device
        with torch.no_grad():
            for u in self.units:
                b = u.bucket
                built = [is_sharded(p) for p in u.plan.params]
                values = [gather_built(p, self.comm, "a parameter built under init_sharded, for the stage-3 layout")
                          if sharded else p.detach() for p, sharded in zip(u.plan.params, built)]
                full = ops.flatten(values, torch.float32, pad_to=self.comm.world).to(device)  # (b.padded,)
                del values
                if not all(built):
                    self.comm.broadcast(full, f"initial values of unit '{u.plan.name}' from rank 0")
                mine = full[rank * b.chunk:(rank + 1) * b.chunk]
                if self.frozen is not None and u.index in self.frozen:
                    self.frozen.put(u.index, mine)  # from the fp32 values, not a 16-bit rounding of them
                else:
                    self.write_values(self.param_shard[b.shard_offset:b.shard_offset + b.chunk], mine)
                    if self.nvme is not None:
                        self.nvme.write("master", self.master[b.shard_offset:b.shard_offset + b.chunk], mine)
                    elif self.master is not None:
                        self.master[b.shard_offset:b.shard_offset + b.chunk].copy_(mine)
                for p in u.plan.params:
                    p.data = self._empty
                    if is_sharded(p):
                        forget_sharding(p)
                del full, mine
                release_freed_memory()  # the unit's whole values go back to the OS now, not when building ends

    def _make_shard_groups(self, groups: list[list[torch.nn.Parameter]]) -> list[ShardGroup]:
        """Per optimizer group: its pieces, and per unit the contiguous sub-range of its pieces."""
        base = self.master if self.master is not None else self.param_shard
        out_base = self.param_shard if self.master is not None else None
        group_of = {id(p): gi for gi, g in enumerate(groups) for p in g}
        pieces: list[list[torch.Tensor]] = [[] for _ in groups]
        spans: dict[tuple[int, int], list[tuple[int, int, int]]] = {}  # (group, unit) -> (piece, shard, numel)
        self._pieces_param: list[list[int]] = [[] for _ in groups]  # trainable index of each piece
        self._pieces_start: list[list[int]] = [[] for _ in groups]  # first element of the parameter it holds
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
            self._pieces_start[gi].append(piece.param_start)
        result = []
        for gi in range(len(groups)):
            chunks = []
            for u in self.units:
                span = spans.get((gi, u.index))
                if not span:
                    continue
                lo, hi = span[0][1], span[-1][1] + span[-1][2]
                chunks.append(Chunk(param=base[lo:hi], grad=self.grad_shard[lo:hi],
                                    out=None if out_base is None else out_base[lo:hi],
                                    pieces=[(index, start - lo, numel) for index, start, numel in span]))
            result.append(ShardGroup(pieces=pieces[gi], chunks=chunks))
        return result

    # -- the pass ---------------------------------------------------------------------------------------------
    @property
    def used(self) -> list[bool]:
        """Per trainable parameter: got a gradient on this rank since the last step."""
        return self.reducer.used

    def abort_pass(self, error: BaseException) -> None:
        """The model raised inside forward: drop what the pass held, so the next call starts clean, and tell the
        user the likely stage-3 cause of a shape error."""
        if isinstance(error, RuntimeError) and not isinstance(error, CommError) and not self.hooks.recording:
            error.add_note("zkern stage 3: parameters of modules that are not running are empty at rest. If this "
                           "forward read another module's parameter in a way the first step did not (a branch "
                           "taken only now), declare it before creating the engine: "
                           "zkern.register_external_parameter(reading_module, parameter)")
        self.hooks.abort_pass()

    def begin_backward(self, boundary: bool) -> None:
        self.reducer.begin_backward()
        self.hooks.begin_backward()

    def end_backward(self) -> None:
        self.hooks.agree_end_backward()  # before waiting for reductions: a rank may still need this one's gathers
        self.reducer.end_backward()
        self.hooks.end_backward()
        check_pass_end(self.units, "backward")

    def abort_backward(self) -> None:
        """loss.backward() raised: release what backward held and close its gradients without reducing them."""
        self.hooks.abort_pass()
        self.reducer.abort()
        self.hooks.release_backward()
        self.hooks.phase = "forward"

    # -- step -------------------------------------------------------------------------------------------------
    def active(self, flags: list[bool]) -> list[list[bool]]:
        return [[flags[i] for i in per_group] for per_group in self._pieces_param]

    def grad_segments(self) -> list[torch.Tensor]:
        return [self.grad_shard]

    def gather_signature(self) -> int:
        """The signature of the all-gathers issued since the last step (divergence.py)."""
        return self.gatherer.signature

    def diverged_step(self) -> None:
        """The step's control all-reduce saw the ranks' gather signatures differ: this step's gathers paired units
        of different ranks, so its gradients are not to be applied (the engine skips it). From here on every pass
        verifies its gathers before issuing them, until a merge lines the ranks up."""
        self.gatherer.verify_all = True
        self.gatherer.order.forget()
        message = ("zkern stage 3: the ranks gathered different units in this step (their gather signatures "
                   "differ), so some all-gathers paired different units; the step is discarded, no rank applied "
                   "it")
        if not self.merge_divergent:
            raise CommError(f"zkern rank {self.comm.rank} of {self.comm.world}: {message}. "
                            f"zero_optimization.stage3_merge_divergent_modules is false: list the class of the "
                            f"module whose children are chosen per rank in zero_optimization.stage3_fetch_units")
        if self.comm.rank == 0:
            log.error("%s; every pass now checks its gathers across ranks until the divergence is found and merged",
                      message)

    def chunk_stepped(self, group: int, chunk: int) -> None:
        """Stage 3 gathers nothing chunk by chunk: the next forward gathers each unit as it needs it."""

    def skipped_step(self) -> None:
        """The step was skipped: LoCo's errors from its micro-steps are dropped (zeropp.QuantizedReduce)."""
        if self.quantized_reduce is not None:
            self.quantized_reduce.skipped_step()

    def loss_scale_changed(self, factor: float) -> None:
        """The fp16 loss scale was multiplied by factor: LoCo's errors (in loss-scaled units) follow."""
        if self.quantized_reduce is not None:
            self.quantized_reduce.rescale_errors(factor)

    def after_step(self) -> None:
        self.refresh()
        if self.quantized_reduce is not None:
            self.quantized_reduce.after_step()

    def refresh(self) -> None:
        """The shards were written (a step, a load): a new version, and the copies kept whole follow it."""
        self.gatherer.after_step()

    def shard_map(self) -> ShardMap:
        pieces = [[(i, s, True) for i, s in zip(idx, starts)]
                  for idx, starts in zip(self._pieces_param, self._pieces_start)]
        resting, masters = [], {}
        staged: dict[int, torch.Tensor] = {}  # int8-resting units: their chunk dequantized, to save or load into
        for piece in self.layout.pieces(self.comm.rank):
            p = self.all_params[piece.param]
            if p.requires_grad:
                continue
            u = self.units[piece.bucket]
            if self.frozen is not None and u.index in self.frozen:
                # fp32, code x scale exactly: quantizing these again gives the same codes and scales (a load into a
                # model initialised otherwise gets the saved weights bit for bit; a 16-bit copy would move them)
                if u.index not in staged:
                    staged[u.index] = self.frozen.get(u.index, torch.float32)
                lo = piece.shard_start - u.bucket.shard_offset
                view = staged[u.index][lo:lo + piece.numel]
            else:
                view = self.param_shard[piece.shard_start:piece.shard_start + piece.numel]
                if self.master is not None:
                    masters[(id(p), piece.param_start)] = self.master[piece.shard_start:piece.shard_start + piece.numel]
            resting.append((p, self._full_shape[id(p)], piece.param_start, view))
        listed = {id(p) for p, _, _, _ in resting}
        for p in self.all_params:  # a frozen parameter wholly in other ranks' chunks is at rest here too
            if not p.requires_grad and id(p) not in listed:
                listed.add(id(p))
                resting.append((p, self._full_shape[id(p)], 0, self._empty))

        def commit() -> None:  # a load wrote into the staged chunks: store what changed
            for ui, values in staged.items():
                if self.frozen.write(ui, values) and self.secondary is not None:
                    self.secondary.forget(ui)

        return ShardMap(pieces=pieces, shapes=[self._full_shape[id(p)] for p in self.params], resting=resting,
                        commit=commit if staged else None, resting_masters=masters)

    def zero_grad(self) -> None:
        self.reducer.zero_grad()
        self.gatherer.signature = 0

    # -- GatheredParameters -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def hooks_suspended(self):
        """While every unit is pinned whole and gradients are off (gathered_for_generation), a forward has nothing
        to gather, free or record: the module hooks step aside, and the passes do not enter the order trace."""
        if self.hooks.frames or any(u.pins == 0 and not u.plan.persistent for u in self.units):
            raise InvariantError("zkern stage 3: hooks_suspended needs every unit pinned and no forward running")
        self.hooks.suspended = True
        try:
            yield
        finally:
            self.hooks.suspended = False

    def generation_params(self) -> tuple[list[torch.nn.Parameter], int, int]:
        """The parameters of the units that fit stage3_max_live_parameters together, in unit order (all of them
        unless the user set a bound below the model), with the elements they hold and the model's total."""
        chosen, held = [], 0
        for u in self.units:
            if held + u.bucket.padded > self.gatherer.max_live:
                continue  # too big for what is left of the bound: it stays gathered and freed per use
            held += u.bucket.padded
            chosen.extend(u.plan.params)
        return chosen, held, sum(u.bucket.padded for u in self.units)

    def pin(self, params: list[torch.nn.Parameter], modifier_rank: int | None) -> list[Unit]:
        """Make the units of params whole and keep them so (a collective, checked across ranks)."""
        units = sorted({id(self._unit_of[id(p)]): self._unit_of[id(p)] for p in params}.values(), key=lambda u: u.index)
        if modifier_rank is not None and modifier_rank >= self.comm.world:
            raise ValueError(f"GatheredParameters: modifier_rank {modifier_rank} is not a rank of this world of "
                             f"{self.comm.world}")
        pinned = []
        try:
            for u in units:
                self._agree_pin(u, modifier_rank)
                if u.data is DataState.REST:
                    self.gatherer.gather(u, async_op=False, exact=True)
                self.gatherer.finish(u)
                u.check_fresh(self.gatherer.version)
                u.pins += 1
                u.touched = True
                pinned.append(u)
        except BaseException:
            self.unpin(pinned, None)
            raise
        return units

    def _agree_pin(self, u: Unit, modifier_rank: int | None) -> None:
        tag = (TagKind.PIN, u.index, -1 if modifier_rank is None else modifier_rank)
        tags = exchange_tags(self.comm, tag, self.gatherer.device)
        if any(t != tags[0] for t in tags):
            what = describe_mismatch(tags, [v.name for v in self.units], [])
            raise CommError(f"zkern rank {self.comm.rank} of {self.comm.world}: GatheredParameters was entered with "
                            f"different parameters or modifier ranks on different ranks ({what}); every rank must "
                            f"pass the same parameters in the same order")

    def unpin(self, units: list[Unit], modifier_rank: int | None) -> None:
        """Leave a GatheredParameters context; with modifier_rank, write that rank's values into every shard (the
        working copy, and the fp32 master where a value changed)."""
        if modifier_rank is not None:
            with torch.no_grad():
                for u in units:
                    self.comm.broadcast(u.buffer, f"GatheredParameters: unit '{u.name}' modified on rank "
                                                  f"{modifier_rank}", src=modifier_rank)
                    b = u.bucket
                    mine = u.buffer[self.comm.rank * b.chunk:(self.comm.rank + 1) * b.chunk]
                    if self.secondary is not None:  # every rank writes, so every rank forgets alike
                        self.secondary.forget(u.index)
                    if self.frozen is not None and u.index in self.frozen:
                        self.frozen.write(u.index, mine)
                        continue
                    resting = self.param_shard[b.shard_offset:b.shard_offset + b.chunk]
                    working = self.values(resting)
                    if self.master is not None:
                        # Only the elements that changed take the 16-bit value: the others keep their fp32 master
                        # value, which the 16-bit copy had only rounded.
                        region = self.master[b.shard_offset:b.shard_offset + b.chunk]
                        master = self.nvme.read("master", region) if self.nvme is not None else region
                        changed = (mine.to(working.device) != working).to(master.device)
                        merged = torch.where(changed, mine.to(master.device, torch.float32), master)
                        if self.nvme is not None:
                            self.nvme.write("master", region, merged)
                        else:
                            master.copy_(merged)
                    self.write_values(resting, mine)
        for u in units:
            u.unpin()
            self.gatherer.release(u)

    def add_external_reader(self, module: torch.nn.Module, p: torch.nn.Parameter) -> None:
        u = self._unit_of[id(p)]
        wanted = self.hooks.needs.setdefault(module, [])
        if not u.persistent and u.index not in wanted:
            wanted.append(u.index)
            self.hooks.hook_module(module)
            self.gatherer.order.forget()

    def _state_dict_guard(self, module: torch.nn.Module, prefix: str, keep_vars: bool) -> None:
        self._guard(module, "state_dict()")

    def _load_guard(self, module, state_dict, prefix, *args) -> None:
        self._guard(module, "load_state_dict()")

    def _guard(self, module: torch.nn.Module, what: str) -> None:
        if self._unguarded:
            return
        at_rest = [n for n, p in module._parameters.items() if p is not None and id(p) in self._unit_of
                   and self._unit_of[id(p)].data is DataState.REST]
        if at_rest:
            path = self.hooks.paths.get(id(module), type(module).__name__) or "<root>"
            raise RuntimeError(
                f"zkern stage 3: {what} of module '{path}' would see its parameters {at_rest} empty: at stage 3 "
                f"they are partitioned across ranks. Read or load them inside `with zkern.GatheredParameters("
                f"model.parameters(), modifier_rank=0):` (a collective: every rank enters it), or take the fp32 "
                f"weights with engine.full_state_dict()")

    @contextlib.contextmanager
    def unguarded(self):
        """The engine's own walks over model.state_dict(keep_vars=True), which only read names and ids."""
        self._unguarded = True
        try:
            yield
        finally:
            self._unguarded = False

    # -- values of stand-ins (ZeRO-Infinity) ------------------------------------------------------------------
    def values(self, t: torch.Tensor) -> torch.Tensor:
        """The values of a slice of the master or the working shard: t itself, or (a meta stand-in of a shard on
        NVMe) read from its file."""
        return nvme_files.read_stand_in(t, self.nvme, self.param_store) if t.is_meta else t

    def write_values(self, t: torch.Tensor, values: torch.Tensor) -> None:
        """t <- values, into the file where t is a meta stand-in's slice."""
        if t.is_meta:
            nvme_files.write_stand_in(t, values, self.nvme, self.param_store)
        else:
            t.copy_(values)

    # -- whole weights ----------------------------------------------------------------------------------------
    def full_fp32(self, rank0_only: bool) -> dict[int, torch.Tensor] | None:
        """id(parameter) -> fp32 value (collective; None off rank 0 with rank0_only). Trained parameters come from the
        fp32 master; frozen ones from the working shard they live in (the master's copy of them is never stepped, and
        a checkpoint keeps them in the working dtype: reading the master would give a value that differs with where
        the run was loaded from)."""
        source = self.master if self.master is not None else self.param_shard
        keep = not rank0_only or self.comm.rank == 0
        values = self._whole(source, torch.float32, "fp32 weights for full_state_dict", keep)
        if self.master is not None and any(not p.requires_grad for p in self.all_params):
            frozen = self._whole(self.param_shard, torch.float32, "frozen weights for full_state_dict", keep,
                                 frozen_only=True)
            if keep:
                values.update({k: v for k, v in frozen.items() if k in self._frozen_ids})
        return values if keep else None

    def full_working(self, rank0_only: bool = False) -> dict[int, torch.Tensor] | None:
        """id(parameter) -> value in the working dtype (collective; None off rank 0 with rank0_only, which then
        holds one unit at a time), for saving 16-bit weights."""
        keep = not rank0_only or self.comm.rank == 0
        values = self._whole(self.param_shard, self.dtype, "weights in the working dtype", keep)
        return values if keep else None

    def full_grads(self) -> dict[int, torch.Tensor]:
        """id(trainable parameter) -> the reduced gradient as the optimizer reads it (see Stage12Runtime)."""
        grads = self._whole(self.grad_shard, self.grad_shard.dtype, "reduced gradients", True, trainable_only=True)
        return {k: v for k, v in grads.items() if k in {id(p) for p in self.params}}

    def _whole(self, source: torch.Tensor, dtype: torch.dtype, purpose: str, keep: bool,
               trainable_only: bool = False, frozen_only: bool = False) -> dict:
        """Every unit whole from `source` shards (int8-resting units from their codes), one unit at a time
        (offloaded sources are copied up); only units with trainable (or frozen) parameters where asked."""
        units = [u for u in self.units if (u.trainable or not trainable_only)
                 and (not frozen_only or u.trainable < len(u.plan.params))]
        buckets = [WholeBucket(u.bucket.chunk, tuple((id(p), self._offset[id(p)], self._full_shape[id(p)])
                                                     for p in u.plan.params)) for u in units]

        def chunk_of(i: int) -> torch.Tensor:
            u = units[i]
            if self.frozen is not None and u.index in self.frozen:
                return self.frozen.get(u.index, dtype)
            return self.values(source[u.bucket.shard_offset:u.bucket.shard_offset + u.bucket.chunk])

        return gather_whole(self.comm, self.comm.world, buckets, chunk_of, dtype, self._empty.device, purpose, keep)

    # -- state (engine/state.py) ------------------------------------------------------------------------------
    def state_components(self) -> list[Component]:
        """This runtime's state for the engine's registry: the shards (weights), the gradient shard and reduction
        buffers (transient), the gathered copies and hpZ's slices (derived from the shards), LoCo's errors."""

        def weights() -> dict:
            return host_copy({"param_shard": self.values(self.param_shard),
                              "master": None if self.master is None else self.values(self.master),
                              "frozen_int8": None if self.frozen is None else self.frozen.store})

        def gradients() -> dict:
            r = self.reducer
            shard = self.grad_shard if r.micro_since_step else torch.zeros_like(self.grad_shard)
            return host_copy({"grad_shard": shard, "used": list(r.used)})

        def derived() -> list[torch.Tensor]:
            out = [u.buffer for u in self.units if u.buffer is not None]
            if self.secondary is not None:
                out.append(self.secondary.store)
            if self.param_store is not None:
                out += self.param_store.cached_tensors()
            return out

        out = [
            Component("stage3.weights", "weights", snapshot=weights,
                      tensors=lambda: [t for t in (self.param_shard, self.master, self._empty,
                                                   self.frozen.store if self.frozen is not None else None)
                                       if t is not None] + list(self.all_params)),
            Component("stage3.gradients", "transient", reset=self.zero_grad, snapshot=gradients,
                      tensors=lambda: [self.grad_shard,
                                       *(g.buffer for g in self.reducer.groups if g.buffer is not None),
                                       *(p.grad for p in self.params if p.grad is not None)]),
            Component("stage3.gathered", "derived", reset=self._forget_derived, tensors=derived),
        ]
        if self.quantized_reduce is not None:
            out += self.quantized_reduce.state_components()
        return out

    def _forget_derived(self) -> None:
        """hpZ's secondary slices no longer stand for the shards (a load wrote them)."""
        if self.secondary is not None:
            self.secondary.versions.clear()

    # -- accounting -------------------------------------------------------------------------------------------
    @property
    def peak_live(self) -> int:
        """Largest number of gathered elements seen (bookkeeping for tests and reports)."""
        return self.gatherer.peak_live

    def live_elements(self) -> int:
        """Elements gathered or in flight now."""
        return self.gatherer.live

    def gathered_units(self) -> list[str]:
        """Names of the non-persistent units gathered (or in flight) now."""
        return self.gatherer.gathered_names()

    def gather_counts(self) -> dict[str, int]:
        """All-gathers issued per unit since the engine was built (the persistent unit: construction and one per
        optimizer step)."""
        return {u.name: self.gatherer.counts[u.index] for u in self.units}

    def memory(self) -> dict[str, int]:
        def nbytes(t: torch.Tensor | None) -> int:  # a meta stand-in (states on NVMe) holds no memory
            return 0 if t is None or t.is_meta else t.numel() * t.element_size()

        persistent = sum(nbytes(u.buffer) for u in self.units if u.persistent)
        live = sum(nbytes(u.buffer) for u in self.units if not u.persistent)
        frozen = self.frozen.memory() if self.frozen is not None else {}
        if self.params_on_host:  # the int8 shards rest where the others do
            frozen = {f"host_{k}": v for k, v in frozen.items()}
        shard, disk = nbytes(self.param_shard), {}
        if self.param_store is not None:  # the file, and the chunks cached in host memory
            shard, disk = self.param_store.cache_bytes(), {"disk_params": self.param_store.nbytes}
        return {"params": shard + persistent, "grads": nbytes(self.grad_shard),
                "master": nbytes(self.master), "comm_buffers": live + self.reducer.buffer_bytes(),
                "host_params": shard if self.params_on_host else 0, **disk,
                **frozen, **(self.secondary.memory() if self.secondary is not None else {}),
                **(self.quantized_reduce.memory() if self.quantized_reduce is not None else {})}

    def describe(self) -> list[str]:
        persistent = sum(u.plan.numel for u in self.units if u.persistent)
        lines = []
        if self.frozen is not None:
            int8 = sum(u.plan.numel for u in self.units if u.index in self.frozen)
            mixed = sum(self._full_shape[id(p)].numel() for p in self.all_params if not p.requires_grad) - int8
            lines.append(f"zero_quantized_nontrainable_weights: {int8} elements of {len(self.frozen.chunks)} units "
                         f"with nothing to train rest as int8 ({self.frozen.memory()['frozen_int8']} bytes per rank)"
                         + (f"; {mixed} frozen elements share a unit with trainable parameters or are in the "
                            f"persistent unit and stay in {self.dtype}" if mixed else ""))
        return lines + [f"stage 3: {len(self.units)} fetch units over {len(self.all_params)} parameters "
                        f"({self.layout.numel} elements), padded with {self.layout.padding} zero elements to a shard "
                        f"of {self.layout.shard_numel} per rank; {persistent} elements in small units stay whole on "
                        f"every rank"]

    def warnings(self, reduce_bucket_size: int) -> list[str]:
        groups = self.reducer.groups
        if self.comm.world > 1 and len(groups) == 1 and len(groups[0].units) > 1:
            n = groups[0].section * self.comm.world
            return [f"stage 3 with one gradient bucket: reduce_bucket_size ({reduce_bucket_size}) covers all {n} "
                    f"trainable elements, so gradients are reduced only when backward ends, from a buffer as large "
                    f"as the whole gradient. Set zero_optimization.reduce_bucket_size well below {n} (\"auto\" = "
                    f"hidden_size**2) to reduce during backward and keep memory at the shard."]
        return []


def _watch_optional_children(model: torch.nn.Module, units: list[Unit], needs: dict) -> list:
    """For units whose modules hold a ModuleList/ModuleDict (an MoE layer declared as one fetch unit: its experts),
    note which of those children ran forward, so that the parameters of the others count as complete when backward
    begins (Unit.optional). A child whose subtree holds every module that gathers the unit is left out: the unit's
    own `touched` already says whether it ran."""
    unit_of = {id(p): (u, i) for u in units for i, p in enumerate(u.plan.params)}
    readers: dict[int, set[int]] = {}  # unit index -> ids of the modules that gather it
    for m, wanted in needs.items():
        for ui in wanted:
            readers.setdefault(ui, set()).add(id(m))
    watched: dict[int, tuple[torch.nn.Module, list[Unit]]] = {}
    for container in model.modules():
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            continue
        for child in container.children():
            subtree = {id(m) for m in child.modules()}
            for p in {id(p): p for p in child.parameters()}.values():
                if not p.requires_grad or id(p) not in unit_of:
                    continue
                u, position = unit_of[id(p)]
                if readers.get(u.index, set()) <= subtree:
                    continue
                u.optional.setdefault(id(child), []).append(position)
                entry = watched.setdefault(id(child), (child, []))
                if u not in entry[1]:
                    entry[1].append(u)
    handles = []
    for child, owners in watched.values():
        def ran(module, args, owners=owners) -> None:
            if torch.is_grad_enabled():  # a no_grad forward (generation, evaluation) gives no gradient
                for u in owners:
                    u.ran.add(id(module))
        handles.append(child.register_forward_pre_hook(ran))
    return handles


def _frozen_last(plans: list, needs: dict) -> tuple[list, dict]:
    """The units with nothing to train (and not persistent) moved to the end, so that their chunks end every
    rank's shard and the dense buffers stop before them; `needs` renumbered to match."""
    frozen = [i for i, plan in enumerate(plans) if _nothing_to_train(plan)]
    order = [i for i in range(len(plans)) if i not in frozen] + frozen
    new_index = {old: new for new, old in enumerate(order)}
    return [plans[i] for i in order], {m: sorted(new_index[i] for i in wanted) for m, wanted in needs.items()}


def _nothing_to_train(plan) -> bool:
    """A unit that rests as int8 under zero_quantized_nontrainable_weights (persistent units stay whole anyway)."""
    return not plan.persistent and not any(p.requires_grad for p in plan.params)
