"""ZeRO stage 3: parameters partitioned at rest, gathered per fetch unit while needed, prefetched ahead.

    python -m pytest tests/stage3/ -q

At rest every parameter's .data is an empty tensor; each rank holds its chunk of every fetch unit (units.py)
in `param_shard` (working dtype; on the host with offload_param, in a file with offload_param "nvme"; none in
mixed precision with the master on the device, whose gathers cast from the master: RuntimeSpec.casts_from_master),
`master`
(fp32: mixed precision, or on the host with offload_optimizer, in files with its device "nvme") and
`grad_shard`, all in self.shards (shards.py). A shard in files is a stand-in there: shards.store
(offload/store.py) reads and writes every range. The layout is partition.plan_unit_layout: one bucket per unit,
padded to whole 64-element chunks, rank r owning chunk r. With zero_quantized_nontrainable_weights the units with
nothing to train are laid out last and rest as int8 in the store's `int8` (zeropp.FrozenStore): the three dense
buffers stop before their chunks.

The pieces, one job each:
  units.py          fetch units and reduce groups planned from the model
  shards.py         this rank's chunks of every unit and where each parameter lies in them (the helpers' parts)
  lifecycle.py      the unit's states and the only transitions between them; invariants at each pass's end
  layout.py         the units laid out, this rank's shards allocated and written, the shard groups, the shard map
  gatherer.py       gather, release, prefetch along order.py's record, versions, counts, the gather signature
  hooks.py          module frames and backward holds; external.py finds reads of parameters at rest, agreement.py
                    lines ranks up when they would gather different units and merges them (both over modules.py)
  reduce.py         gradient buckets reduced in one fixed order on a process group of their own
  gathered.py       zkern.GatheredParameters over pinning.py (pin, unpin, a modifier rank's writes)
  full.py, report.py  whole tensors; state components, memory and start-up lines
This file builds them and answers the engine's runtime interface (core/runtime.py).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from zkern.comm.collectives import Comm, CommError
from zkern.comm.divergence import MAX_SIGNATURE_WORLD
from zkern.comm.zeropp import QuantizedReduce, Secondary
from zkern.core.owners import register_owner, weak_grad_hook
from zkern.core.runtime import ShardMap
from zkern.core.spec import RuntimeSpec
from zkern.core.state import Component
from zkern.offload.store import ShardStore
from zkern.stage3 import full, layout, pinning, report
from zkern.stage3.gatherer import Gatherer
from zkern.stage3.hooks import Stage3Hooks
from zkern.stage3.lifecycle import DataState, Unit, check_pass_end
from zkern.stage3.reduce import GradReducer
from zkern.stage3.shards import Shards
from zkern.stage3.uploads import Uploads

log = logging.getLogger("zkern")


class Stage3Runtime:
    """Stage 3 behind the engine's runtime interface (see Stage12Runtime)."""

    def __init__(self, model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], spec: RuntimeSpec, *,
                 comm: Comm, store: ShardStore, param_files=None):
        """spec: dtypes, buckets and offload as resolved from the config (core/spec.py); spec.zero's stage-3 keys.
        store: where the shards live (offload/store.py); with its optimizer files (offload_optimizer.device "nvme")
        the master shard is one region of them, shards.master its stand-in. param_files(numel, dtype, units) -> an
        nvme_params.NvmeParams when offload_param.device is "nvme" (shards.param_shard its stand-in)."""
        if comm.world > MAX_SIGNATURE_WORLD:
            raise ValueError(f"stage 3 checks its gathers across at most {MAX_SIGNATURE_WORLD} ranks, got {comm.world}")
        zero, dtype, device = spec.zero, spec.dtype, spec.device
        self.comm, self.dtype, self.mixed = comm, dtype, spec.mixed
        self.merge_divergent = zero.stage3_merge_divergent_modules
        self.root = model
        # gathers start from host values with offload_param
        self.shards = s = Shards(comm, dtype, params_on_host=spec.offload_param in ("cpu", "nvme"))
        needs = layout.plan(s, model, groups, zero)  # units, their buckets, parameter shapes and offsets
        layout.allocate(s, spec, store, param_files)  # param_shard, master, grad_shard, the int8 units
        layout.partition(s)  # every rank's chunk of every unit written; parameters to rest
        # What the engine's runtime interface and the tests read.
        self.units, self.params, self.names, self.param_store = s.units, s.params, s.names, s.param_store

        where = {id(p): (s.full_shapes[id(p)], s.offsets[id(p)]) for p in s.all_params}
        # hpZ: a secondary copy of every unit that is gathered and freed (persistent ones stay whole anyway).
        if zero.zero_hpz_partition_size > 1:
            s.secondary = Secondary(comm, zero.zero_hpz_partition_size,
                                    {u.index: u.bucket.padded for u in s.units if not u.persistent}, dtype, device)
        self.gatherer = Gatherer(s.units, comm, param_shard=s.source, dtype=dtype, device=device,
                                 layout=where,
                                 params_on_host=s.params_on_host, param_store=s.param_store,
                                 prefetch_numel=zero.stage3_prefetch_bucket_size,
                                 max_live=zero.stage3_max_live_parameters,
                                 quantize_weights=zero.zeropp_weight_group_size if zero.zero_quantized_weights else 0,
                                 secondary=s.secondary, frozen=s.store.int8, uploads=self._uploads(s, comm, device))
        for u in self.units:
            if u.persistent:
                self.gatherer.gather(u, async_op=False)
        self.hooks = Stage3Hooks(model, s.units, needs, self.gatherer, unit_of=s.unit_of,
                                 merge_divergent=self.merge_divergent)
        self._child_handles = layout.watch_optional_children(model, self.units, needs)
        self._views: list = []  # open GatheredParameters contexts' trained views (store.trained_view), innermost last
        reduce_comm = comm.sibling()
        self.quantized = QuantizedReduce.from_config(reduce_comm, zero)
        self.reducer = GradReducer(s.units, reduce_comm, grad_shard=s.grad_shard,
                                   comm_dtype=spec.comm_dtype, bucket_numel=spec.bucket_numel,
                                   overlap=spec.overlap, reduce_scatter=spec.reduce_scatter, offsets=s.offsets,
                                   params=s.params,
                                   names={id(p): n for p, n in zip(s.all_params, s.all_names)},
                                   quantized=self.quantized, keep_grads=zero.keep_gradient_buffers)
        self.reducer.on_complete = self.hooks.on_complete
        self.on_final_grads = None  # callback(region): a region of the gradient shard final for the step
        self._handles = [p.register_post_accumulate_grad_hook(weak_grad_hook(self.reducer.on_grad))
                         for p in self.params]
        self._unguarded = False
        for module in model.modules():
            if any(id(p) in s.unit_of for p in module.parameters(recurse=False)):
                self._handles.append(module.register_state_dict_pre_hook(self._state_dict_guard))
                self._handles.append(module.register_load_state_dict_pre_hook(self._load_guard))
        self.shard_groups = layout.make_shard_groups(s, groups)
        # ds_id, ds_shape, ds_numel, ds_tensor, ds_status: what frameworks read
        layout.attach_ds_attributes(s, {u.index for u in s.units if u.data is DataState.GATHERED})
        if not zero.keep_gradient_buffers:  # until the first backward (its chunk views exist now)
            self.reducer.free_grads()
        register_owner(s.all_params, self)

    @staticmethod
    def _uploads(s: Shards, comm: Comm, device: torch.device) -> Uploads | None:
        """offload_param "cpu": prefetched units come up off the compute stream, from page-locked memory only (a copy
        from pageable memory blocks the host until the side stream, and so the compute queued before it, is done).
        A CPU run defers the copies instead (uploads.py), so its tests check the order of copy and use."""
        if not s.params_on_host or s.param_store is not None:
            return None
        if device.type != "cpu" and not s.param_shard.is_pinned():
            return None
        return Uploads(device, world=comm.world)

    # -- the pass ---------------------------------------------------------------------------------------------
    @property
    def used(self) -> list[bool]:
        """Per trainable parameter: got a gradient on this rank since the last step."""
        return self.reducer.used

    def abort_pass(self, error: BaseException) -> None:
        """The model raised inside forward: drop what the pass held, so the next call starts clean, and tell the
        user the likely stage-3 cause of a shape error."""
        if isinstance(error, RuntimeError) and not isinstance(error, CommError) and not self.hooks.state.recording:
            error.add_note("zkern stage 3: parameters of modules that are not running are empty at rest. If this "
                           "forward read another module's parameter in a way the first step did not (a branch "
                           "taken only now), declare it before creating the engine: "
                           "zkern.register_external_parameter(reading_module, parameter)")
        self.hooks.abort_pass()

    def begin_backward(self, boundary: bool) -> None:
        self.reducer.on_final, self.reducer.final_pass = self.on_final_grads, boundary
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
        self.hooks.state.phase = "forward"

    # -- step -------------------------------------------------------------------------------------------------
    def active(self, flags: list[bool]) -> list[list[bool]]:
        return [[flags[i] for i in per_group] for per_group in self.shards.pieces_param]

    def grad_segments(self) -> list[torch.Tensor]:
        self.reducer.ensure_grads()  # a step with no backward since the last finds zeros
        return [self.shards.grad_shard]

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
        if self.quantized is not None:
            self.quantized.skipped_step()

    def loss_scale_changed(self, factor: float) -> None:
        """The fp16 loss scale was multiplied by factor: LoCo's errors (in loss-scaled units) follow."""
        if self.quantized is not None:
            self.quantized.rescale_errors(factor)

    def after_step(self) -> None:
        self.refresh()
        if self.quantized is not None:
            self.quantized.after_step()

    def refresh(self) -> None:
        """The shards were written (a step, a load): a new version, and the copies kept whole follow it."""
        self.gatherer.after_step()

    def full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        return self.shards.full_shapes.get(id(p), p.shape)

    def shard_map(self) -> ShardMap:
        return layout.shard_map(self.shards)

    def zero_grad(self) -> None:
        self.reducer.zero_grad()
        self.gatherer.signature = 0

    # -- GatheredParameters -----------------------------------------------------------------------------------
    def hooks_suspended(self):
        """Module hooks step aside while every unit is pinned (pinning.py)."""
        return pinning.hooks_suspended(self.hooks, self.units)

    def generation_params(self) -> tuple[list[torch.nn.Parameter], int, int]:
        return pinning.generation_params(self.units, self.gatherer.max_live)

    def pin(self, params: list[torch.nn.Parameter], modifier_rank: int | None) -> list[Unit]:
        # a delayed update in flight stays so, and lands only where a rank changed something (pinning.unpin); a
        # context that may write shows it landed in view (store.trained_view), its writes compared with that
        view = self.shards.store.trained_view(modifier_rank)
        try:
            units = pinning.pin(self.shards, self.gatherer, params, modifier_rank)
        except BaseException:
            view.close()
            raise
        self._views.append(view)
        return units

    def unpin(self, units: list[Unit], modifier_rank: int | None) -> None:
        view = self._views.pop()
        try:
            pinning.unpin(self.shards, self.gatherer, units, modifier_rank, before_landing=view.close)
        finally:
            view.close()

    def add_external_reader(self, module: torch.nn.Module, p: torch.nn.Parameter) -> None:
        u = self.shards.unit_of[id(p)]
        wanted = self.hooks.modules.needs.setdefault(module, [])
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
        unit_of = self.shards.unit_of
        at_rest = [n for n, p in module._parameters.items() if p is not None and id(p) in unit_of
                   and unit_of[id(p)].data is DataState.REST]
        if at_rest:
            path = self.hooks.modules.paths.get(id(module), type(module).__name__) or "<root>"
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

    # -- whole weights ----------------------------------------------------------------------------------------
    def full_fp32(self, rank0_only: bool, only: set[int] | None = None) -> dict[int, torch.Tensor] | None:
        return full.full_fp32(self.shards, rank0_only, only)

    def full_working(self, rank0_only: bool = False) -> dict[int, torch.Tensor] | None:
        return full.full_working(self.shards, rank0_only)

    def full_grads(self, only: set[int] | None = None) -> dict[int, torch.Tensor]:
        return full.full_grads(self.shards, self.reducer, only)

    # -- state (core/state.py) ------------------------------------------------------------------------------
    def state_components(self) -> list[Component]:
        return report.state_components(self.shards, self.reducer, self.quantized, self.zero_grad)

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
        return report.memory(self.shards, self.reducer, self.quantized)

    def describe(self) -> list[str]:
        return report.describe(self.shards)

    def warnings(self, reduce_bucket_size: int) -> list[str]:
        return report.warnings(self.comm, self.reducer, reduce_bucket_size)
