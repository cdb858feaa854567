"""zkern.Engine: the thin orchestrator of forward, backward and the optimizer step.

    engine = zkern.Engine(model, "ds_config.json")
    loss = engine(batch).loss; engine.backward(loss); engine.step()

The stage runtime (stage12/runtime.py, stage3/runtime.py) owns buffers and gradient communication, the optimizer
(optim/shard_adam.py) the update, the ShardStore (offload/store.py) where shard bytes live; this file sequences them
and keeps the counters users read. stepping.py holds the step, weights.py and saving.py the whole-weight and
checkpoint calls, build.py the construction steps (ARCHITECTURE.md has the map).
"""

from __future__ import annotations

import logging
import os

import torch
from torch.utils._pytree import tree_map

from zkern import activation_checkpointing
from zkern.checkpoint.checkpointer import Checkpointer
from zkern.checkpoint.holdings import Holdings
from zkern.checkpoint.save import checked_tag
from zkern.comm.collectives import Comm, backend_for, init_distributed
from zkern.config import Config
from zkern.config.model import node_size
from zkern.core.runtime import Runtime
from zkern.core.spec import RuntimeSpec
from zkern.engine import build, muon_groups, param_views, precision, reporting, saving, stepping, streaming, weights
from zkern.engine.counters import Count, Counters
from zkern.engine.ds_surface import DeepSpeedSurface
from zkern.engine.engine_state import build_registry
from zkern.engine.parts import EngineParts
from zkern.engine.precision import LossScaler
from zkern.engine.replicated import ReplicatedRuntime
from zkern.engine.reporting import Reporter
from zkern.engine.resident import Residency
from zkern.engine.user_backward import UserBackward
from zkern.offload import nvme
from zkern.offload.store import ShardStore
from zkern.stage3.sharded_init import release_freed_memory
from zkern.stage3.units import declare_known_readers

log = logging.getLogger("zkern")


class Engine(DeepSpeedSurface, torch.nn.Module):
    """Train `model` with ZeRO stage 0, 1, 2 or 3 as the DeepSpeed-style `config` says.

    Engine(model, config, optimizer=None, lr_scheduler=None, model_parameters=None): config is a dict, a JSON path
    or a zkern.Config. optimizer: a torch optimizer over model.parameters() when the config has no 'optimizer'
    section. lr_scheduler: a scheduler bound to that optimizer, or a callable optimizer -> scheduler.
    model_parameters: parameters or param-group dicts (per-group lr, weight_decay, betas, eps) for the config's
    optimizer, as deepspeed.initialize takes them.

    The engine is a torch.nn.Module wrapping the model as DDP does: engine.module is the model, parameters() and
    named_parameters() are its parameters ("module." prefixed names; at stage 3 the resting, empty stand-ins),
    engine(...) runs its forward, train()/eval() switch its mode. state_dict()/load_state_dict() are errors that
    name what to call instead (full_state_dict, save_checkpoint, load_checkpoint): a dict of the module's
    tensors would be partial at stage 3 and in the working dtype rather than the fp32 masters.
    """

    def __init__(self, model: torch.nn.Module, config: Config | dict | str | os.PathLike,
                 optimizer: torch.optim.Optimizer | None = None, lr_scheduler=None, model_parameters=None):
        super().__init__()
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"zkern.Engine trains a torch.nn.Module, got {type(model).__name__}")
        cfg = Config.load(config)
        if cfg.activation_checkpointing is not None:
            activation_checkpointing.configure(None, deepspeed_config=cfg)
        declare_known_readers(model)
        self.device = device = build.pick_device(model, cfg.device)
        group, rank, world = init_distributed(device, cfg.comm_timeout_s)
        cfg = cfg.resolve(world, model)
        self.comm = comm = Comm(group, rank, world, cfg.comm_timeout_s, backend_for(device),
                                node_size=node_size(cfg, world))
        self.rank, self.world_size = rank, world
        self.module = model
        zero = cfg.zero_optimization
        bucket = min(zero.reduce_bucket_size, zero.allgather_bucket_size)
        # Rank 0's values everywhere, a bucket at a time; stage 3 broadcasts parameters unit by unit as it
        # partitions them, so only buffers go here.
        build.broadcast_state(model, comm, bucket, params=zero.stage != 3)

        self.spec = spec = RuntimeSpec.resolve(cfg, device)
        self.dtype = spec.dtype
        # No optimizer anywhere: a reference, teacher or eval model (TRL, OpenRLHF, Accelerate's eval models). Its
        # parameters are frozen; at stage 3 they stay partitioned and are gathered per forward, below it whole.
        self.inference = inference = optimizer is None and cfg.optimizer is None
        groups, requested = build.checked_groups(model, optimizer, model_parameters, spec, lr_scheduler=lr_scheduler,
                                                 inference=inference, muon=muon_groups.wanted(cfg))
        self.offload = spec.offloaded and not inference
        # ZeRO-Infinity: the fp32 master and moments in files of this rank's own (offload/nvme.py), made before the
        # runtime, which writes the initial masters into them as it partitions.
        self.nvme = nvme.shard_from_config(cfg, rank, master_dtype=spec.master_dtype, state_dtype=spec.state_dtype) \
            if zero.offload_optimizer_device == "nvme" else None
        self.store = ShardStore(device, nvme=self.nvme)  # where every shard lives (offload/store.py)
        # The runtimes build their buffers on the device from the parameters where they are (the host, typically), a
        # bucket or unit at a time; then what is still whole moves. The model is never whole on the device first.
        self.runtime: Runtime = ReplicatedRuntime(model) if inference and zero.stage < 3 else \
            build.make_runtime(model, groups, spec, cfg, comm=comm, store=self.store)
        model.to(device).to(self.dtype)
        release_freed_memory()
        reporting.log_layout(cfg, self.runtime, rank)
        # The optimizer over the shard groups (with offload: the host staging's), none for an inference engine.
        self.host_step, self.optimizer, self.lr_scheduler = build.optimizer_side(
            cfg, spec, self.runtime, comm, self.store, self.nvme, optimizer, lr_scheduler, requested,
            inference=inference)
        self.autocast_dtype = precision.autocast_dtype(cfg, device)  # torch_autocast's, else None
        self.scaler = LossScaler.from_config(cfg, self.autocast_dtype)
        # The training counters (counters.py): global_steps, micro_steps and the rest read from them.
        self.counters = Counters(Count(cfg.gradient_accumulation_steps))
        self.residency = Residency(device, mixed=spec.dtype != torch.float32 and not spec.casts_from_master)
        # What the helpers acting for the engine are given (parts.py): never the engine itself.
        self.parts = parts = EngineParts(
            config=cfg, device=device, spec=spec, comm=comm, module=model, runtime=self.runtime, store=self.store,
            nvme=self.nvme, optimizer=self.optimizer, host_step=self.host_step, lr_scheduler=self.lr_scheduler,
            scaler=self.scaler, counters=self.counters, residency=self.residency)
        reporting.log_offload(parts)
        # What the config asks to report beside training (timers, monitors, profiler, comms logger): no cost when off.
        self.reporter = Reporter(parts)
        # loss.backward() on the engine's outputs runs the pass engine.backward(loss) would (user_backward.py)
        self.user_backward = UserBackward(self._begin_backward, lambda: stepping.close_backward(parts),
                                          lambda: stepping.abort_backward(parts),
                                          active=lambda: self.optimizer is not None and torch.is_grad_enabled())
        self._handles = [self.module.register_forward_hook(self.user_backward.forward_hook, prepend=True)]
        # Every stateful piece, with how it resets: loads, zero_grad and the tests walk this (core/state.py).
        self.state = build_registry(parts, self.reporter)
        # Saves and loads go through the registry and the shards (zkern/checkpoint/), never through the engine.
        self.checkpointer = Checkpointer(Holdings(
            registry=self.state, runtime=self.runtime, optimizer=self.optimizer, module=model, store=self.store,
            comm=comm, device=device, config=cfg,
            host_groups=tuple(self.host_step.host_groups) if self.host_step is not None else ()))
        param_views.register(parts)  # zkern.safe_get_full_grad(p) finds p's engine

    @property
    def config(self) -> Config:
        """The resolved config (set_train_batch_size replaces it with one of the new batch size)."""
        return self.parts.config

    # -- the training loop ------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        self.residency.require("forward", reads=("lp_params",))
        self.user_backward.before_forward()
        cast = _input_cast(self.config)  # fp16 or bf16 auto_cast: the float inputs in the training dtype
        if cast is not None:
            args, kwargs = tree_map(cast, (args, kwargs))
        try:
            with self.reporter.phase("forward"), precision.forward_autocast(self.autocast_dtype, self.device):
                return self.reporter.forward(self.module, args, kwargs)
        except BaseException as e:
            self.runtime.abort_pass(e)  # stage 3: release what the failed pass gathered
            raise

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next step() will update the parameters."""
        return self.counters.at_boundary()

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the coming micro-step ends an accumulation (DeepSpeed's method), for loops whose
        accumulations are not all gradient_accumulation_steps long (the short last one of an epoch); None returns
        to counting. backward() still divides the loss by gradient_accumulation_steps: scale a short
        accumulation's losses yourself if you want its mean."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary takes True, False or None, got {is_boundary!r}")
        self.counters.boundary = is_boundary

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients held since the last step, as torch's zero_grad does; the accumulation keeps counting,
        as DeepSpeed's does (stepping.drop_gradients)."""
        if stepping.drop_gradients(self.parts):
            self.reporter.losses.clear()

    def gathered_for_generation(self):
        """Stage 3: every unit gathered once and whole until the block ends (a collective on entry and exit; within
        stage3_max_live_parameters), under torch.no_grad(): generate()'s many short forwards gather nothing.
        `with engine.gathered_for_generation(): engine.module.generate(ids)`."""
        self.residency.require("gathered_for_generation", reads=("lp_params",))
        return weights.gathered_for_generation(self.parts, self)

    def stream_full_weights(self, bucket_bytes: int = 256 << 20, dtype: torch.dtype | None = None,
                            rank0_only: bool = False, on=None):
        """The whole parameters in buckets of at most bucket_bytes, gathered a unit at a time (a collective: every
        rank iterates to the end): a generator of [(name, tensor)], or with on=callback each bucket handed to it."""
        self.residency.require("stream_full_weights", reads=("lp_params",))
        return streaming.stream_full_weights(self.parts, bucket_bytes, dtype, rank0_only, on)

    def state_dict(self, *args, **kwargs):
        raise RuntimeError(
            "engine.state_dict() is not provided: the module's own tensors are partial at ZeRO stage 3 and in the "
            "working dtype. Call engine.full_state_dict() on every rank for the fp32 weights under the model's own "
            "names (rank0_only=True to gather onto rank 0), or engine.save_checkpoint(dir) for the training state")

    def load_state_dict(self, *args, **kwargs):
        raise RuntimeError(
            "engine.load_state_dict() is not provided: load weights into the model before building the engine "
            "(zkern.hf.from_pretrained at stage 3), or resume with engine.load_checkpoint(dir)")

    def _apply(self, fn, recurse=True):
        raise RuntimeError("the engine placed and cast the model itself (config keys 'device', 'bf16', 'fp16'); "
                           "moving or casting it afterwards (.to, .cuda, .half, ...) would detach it from the "
                           "engine's buffers: move the model before building the engine")

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate loss (scaled for fp16, divided by the accumulation steps); reduce gradients as the
        stage prescribes (at the boundary for stages 0/1, every micro-step for stage 2)."""
        _trainable(self, "backward")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got "
                             f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
        if not loss.requires_grad:
            raise ValueError("engine.backward: the loss does not require grad (computed under torch.no_grad(), or "
                             "no trainable parameter took part in it)")
        self.reporter.loss(loss)
        factor = self._begin_backward()
        with self.reporter.phase("backward"):
            self.user_backward.engine_backward = True  # the outputs' hooks pass the scaled gradient on
            try:
                # a factor of 1 (world 1, no accumulation, no loss scale) multiplies nothing: no op torch would not run
                (loss * factor if factor != 1.0 else loss).backward()
            except BaseException:
                stepping.abort_backward(self.parts)
                raise
            finally:
                self.user_backward.engine_backward = False
            stepping.close_backward(self.parts)

    def _begin_backward(self) -> float:
        """A backward pass opens (engine.backward, or the user's loss.backward() reaching an output: user_backward.py);
        returns the gradients' factor (stepping.open_backward)."""
        _trainable(self, "backward")
        self.residency.require("backward")
        return stepping.open_backward(self.parts)

    def step(self) -> None:
        """At the accumulation boundary: overflow check, clipping, optimizer, loss-scale and LR update.
        Between boundaries: a no-op (gradients keep accumulating)."""
        _trainable(self, "step")
        self.residency.require("step")
        if not self.counters.micro_step():  # between boundaries: gradients keep accumulating
            return
        with self.reporter.phase("step"):
            stepping.optimizer_step(self.parts)
        self.comm.scratch.release()  # the reductions' receive buffers: reduction memory, gone between steps
        self.counters.global_steps += 1
        self.reporter.stepped()
        if self.config.steps_per_print and self.global_steps % self.config.steps_per_print == 0 and self.rank == 0:
            lrs = [g["lr"] for g in self.optimizer.param_groups]
            log.info("zkern: step=%d skipped=%d lr=%s grad_norm=%s loss_scale=%g", self.global_steps,
                     self.skipped_steps, lrs, self.last_grad_norm, self.scaler.scale)

    # -- reports ----------------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds, by where they live: params, grads, optimizer (states), master (fp32 weights),
        comm_buffers (gradient buckets, gathered stage-3 units, host reduce-scatters' receive buffers),
        offload_buffers (host staging), total; with ZeRO++ also hpz_secondary (hpZ's secondary partition),
        loco_error (LoCo's error buffers) and frozen_int8 (the int8 codes and scales of frozen units under
        zero_quantized_nontrainable_weights, not in params).
        With offload the master, the optimizer states and the staging buffers are under "host" (and the
        stage-3 parameter shards too with offload_param); on a CPU-only run both places are one memory, but
        they are still reported apart."""
        return reporting.memory_report(self.parts)

    def comm_stats(self) -> dict:
        """Bytes this rank sent per collective kind since the start (ring-algorithm volumes), with call counts
        under "calls" and the bytes split under "intra" and "inter" by whether the group spans nodes."""
        return self.comm.stats()

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin") -> str:
        """Save the weights in the training dtype with model.state_dict()'s names, as DeepSpeed's method does (a
        collective; rank 0 writes). Stage 3 gathers them only when the config allows it."""
        self.residency.require("save_16bit_model", reads=("lp_params",))
        return weights.save_16bit_model(self.parts, save_dir, save_filename)

    def full_working_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The weights in the training dtype (bf16/fp16 when mixed precision, else fp32) with model.state_dict()'s
        names, on the host: what DeepSpeed's 16-bit consolidation gives (a collective: call it on every rank). With
        rank0_only, other ranks return None and, at stage 3, hold one unit at a time. Tensors one parameter shares
        under two names (tied embeddings) stay one tensor."""
        self.residency.require("full_working_state_dict", reads=("lp_params",))
        return weights.full_working_state_dict(self.parts, rank0_only)

    # -- checkpoints (zkern/checkpoint/) ----------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: bool = False) -> str | None:
        """Save the whole training state under save_dir/tag (a collective: every rank calls it, after step() at an
        accumulation boundary). tag defaults to global_step<N>; client_state is plain JSON data returned by
        load_checkpoint. The checkpoint loads at any world size, stage and offload setting. async_save: copy the
        state to host buffers and write in a background thread (returns None; wait_checkpoint() gives the path,
        the next save or load waits for it, and its error surfaces there). Returns the tag's directory."""
        saving.check_save(self.counters, self.inference)
        self.residency.require("save_checkpoint")
        self.checkpointer.wait()  # before the tag is named: an earlier asynchronous save's error surfaces first
        return self.checkpointer.save(save_dir, checked_tag(tag, self.global_steps), client_state,
                                      save_latest=save_latest, exclude_frozen_parameters=exclude_frozen_parameters,
                                      async_save=async_save)

    def wait_checkpoint(self) -> str | None:
        """Wait for the asynchronous save in flight, if any; returns its directory, or raises its error."""
        return self.checkpointer.wait()

    def destroy(self) -> None:
        """Release what the engine holds outside this process (DeepSpeed's method): wait for an asynchronous save,
        then remove this rank's NVMe files (offload_optimizer / offload_param device "nvme"; they also go at
        interpreter exit). The engine cannot step after it."""
        try:
            self.wait_checkpoint()
        finally:
            if self.host_step is not None:
                self.host_step.settle()  # a delayed update's Adam in the background ends before its state goes
            self.reporter.close()
            for files in (self.nvme, self.runtime.param_store):
                if files is not None:
                    files.close()

    @property
    def checkpoint_in_flight(self) -> bool:
        """Whether an asynchronous save is still writing on any rank: one answer on every rank (a collective: a rank
        asking only its own writer could branch apart from the others)."""
        return self.checkpointer.in_flight()

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """Load a checkpoint saved at any world size, stage or offload setting (a collective). tag None: the one
        `latest` names. Returns (its directory, client_state), or (None, None) with a warning when there is nothing
        to load. Everything is verified (checksums, names, shapes) before the engine changes; on any error no
        rank's state changes. What a load does not restore is first reset to a fresh engine's value (load_module_only:
        weights only; load_optimizer_states=False: fresh optimizer state), as docs/checkpoints.md says."""
        saving.check_load(self.inference, load_module_only)
        self.residency.require("load_checkpoint")
        return self.checkpointer.load(load_dir, tag, strict=load_module_strict,
                                      load_optimizer_states=load_optimizer_states,
                                      load_lr_scheduler_states=load_lr_scheduler_states,
                                      load_module_only=load_module_only)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """fp32 weights with model.state_dict()'s names, on the host (a collective: call it on every rank). The
        device holds one bucket at a time; with rank0_only, other ranks return None."""
        self.residency.require("full_state_dict")
        return weights.full_state_dict(self.parts, rank0_only)


def _input_cast(cfg: Config):
    """DeepSpeed's fp16.auto_cast (and older DeepSpeed's bf16.auto_cast): the forward's float inputs cast."""
    dtype = torch.float16 if cfg.fp16.enabled and cfg.fp16.auto_cast else \
        torch.bfloat16 if cfg.bf16.enabled and cfg.bf16.auto_cast else None
    if dtype is None:
        return None
    return lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def _trainable(engine: Engine, call: str) -> None:
    if engine.inference:
        raise RuntimeError(f"zkern: {call}() on an engine built without an optimizer (no 'optimizer' section, no "
                           f"optimizer= argument): it runs forward only, for a reference, teacher or eval model; give "
                           f"it an optimizer to train it")
