"""zkern.Engine: the thin orchestrator of forward, backward and the optimizer step.

    engine = zkern.Engine(model, "ds_config.json")
    loss = engine(batch).loss; engine.backward(loss); engine.step()

The stage runtime (stage12.Stage12Runtime, stage3.Stage3Runtime) owns buffers and gradient communication; the optimizer
(optimizer.py) owns the update; this file sequences them and keeps the counters users read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os

import torch
from torch.utils._pytree import tree_map

from zkern import checkpointing, ops
from zkern.comm.collectives import Comm, backend_for, init_distributed
from zkern.comm.divergence import signatures_differ
from zkern.comm.zeropp import QuantizedReduce
from zkern.config import Config
from zkern.config.report import startup_block
from zkern.config.resolve import node_size
from zkern.core.runtime import Runtime
from zkern.engine import build
from zkern.engine.engine_state import build_registry
from zkern.engine.precision import LossScaler, gradient_dtypes, working_dtype
from zkern.engine.reporting import Reporter
from zkern.offload import nvme
from zkern.offload.host import HostStep
from zkern.optim.shard_adam import ShardAdam, step_torch_optimizer
from zkern.stage3.runtime import Stage3Runtime
from zkern.stage3.sharded_init import is_sharded, release_freed_memory
from zkern.stage3.units import declare_known_readers
from zkern.stage12.runtime import Stage12Runtime

log = logging.getLogger("zkern")


class Engine(torch.nn.Module):
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
            checkpointing.configure(None, deepspeed_config=cfg)
        declare_known_readers(model)
        self.device = build.pick_device(model, cfg.device)
        group, rank, world = init_distributed(self.device, cfg.comm_timeout_s)
        self.config = cfg = cfg.resolve(world, model)
        self.comm = Comm(group, rank, world, cfg.comm_timeout_s, backend_for(self.device),
                         node_size=node_size(cfg, world))
        self.rank, self.world_size = rank, world
        self.module = model
        zero = cfg.zero_optimization
        bucket = min(zero.reduce_bucket_size, zero.allgather_bucket_size)
        # Rank 0's values everywhere, a bucket at a time; stage 3 broadcasts parameters unit by unit as it
        # partitions them, so only buffers go here.
        build.broadcast_state(model, self.comm, bucket, params=zero.stage != 3)

        if model_parameters is not None and optimizer is not None:
            raise ValueError("model_parameters and optimizer are both given; model_parameters are the param groups "
                             "of the config's optimizer: pass the groups to your torch optimizer instead")
        requested = build.requested_groups(model_parameters) if model_parameters is not None else None
        groups = build.trainable_groups(model, optimizer, requested)
        if not any(groups):
            raise ValueError("the model has no trainable parameters (every parameter has requires_grad=False)")
        self.dtype = working_dtype(cfg)
        mixed = self.dtype != torch.float32
        comm_dtype, accum_dtype = gradient_dtypes(cfg, self.dtype)
        if not mixed:
            build.check_dtypes(groups, model)
        if not zero.contiguous_gradients:
            log.warning("zkern: zero_optimization.contiguous_gradients=false has no effect: zkern always reduces "
                        "gradients from contiguous buckets, which costs no extra memory")
        if zero.stage != 3 and any(is_sharded(p) for p in model.parameters()):
            raise ValueError("the model was built under zkern.init_sharded, which partitions it for ZeRO stage 3; "
                             f"the config says stage {zero.stage}: use stage 3, or build the model without it")
        self.offload = zero.offload_optimizer_device in ("cpu", "nvme")
        # ZeRO-Infinity: the fp32 master and moments in files of this rank's own (engine/nvme.py), made before the
        # runtime, which writes the initial masters into them as it partitions.
        self.nvme = nvme.shard_from_config(cfg, rank) if zero.offload_optimizer_device == "nvme" else None
        # Page-locked host buffers speed up the copies to and from a GPU; without CUDA there is nothing to pin for.
        pin = self.device.type == "cuda"
        # The runtimes build their buffers on the device from the parameters where they are (the host, typically),
        # a bucket or a unit at a time, from the fp32 values; then what is still whole (buffers, frozen parameters,
        # stage 3's empty stand-ins) moves to the device and the working dtype. The model is never whole on the
        # device first (at stage 3 it never is).
        self.runtime: Runtime
        if zero.stage == 3:
            self.runtime = Stage3Runtime(model, groups, comm=self.comm, dtype=self.dtype, mixed=mixed, zero=zero,
                                         overlap=zero.overlap_comm, reduce_scatter=zero.reduce_scatter,
                                         bucket_numel=zero.reduce_bucket_size, comm_dtype=comm_dtype,
                                         accum_dtype=accum_dtype, device=self.device, nvme=self.nvme,
                                         param_files=self._param_files(cfg, rank))
        else:
            self.runtime = Stage12Runtime(model, groups, build.param_names(model),
                                          quantized=QuantizedReduce.from_config(self.comm, zero),
                                          stage=zero.stage, comm=self.comm, dtype=self.dtype, mixed=mixed,
                                          bucket_numel=bucket,
                                          overlap=zero.overlap_comm, reduce_scatter=zero.reduce_scatter,
                                          offload=self.offload, pin_memory=pin and zero.offload_optimizer_pin_memory,
                                          comm_dtype=comm_dtype, accum_dtype=accum_dtype, device=self.device,
                                          nvme=self.nvme)
        model.to(self.device).to(self.dtype)
        release_freed_memory()
        self._log_layout()
        shard_groups = self.runtime.shard_groups
        self.host_step = None
        if self.offload:
            # The optimizer sees host shard groups: host master, host gradient and parameter staging buffers.
            self.host_step = HostStep(shard_groups, pin=pin and zero.offload_optimizer_pin_memory,
                                      out_on_host=zero.offload_param_device != "none", read=self._stand_in_read,
                                      write=self._stand_in_write)
            shard_groups = self.host_step.host_groups
        self.optimizer = build.build_optimizer(cfg, optimizer, shard_groups, requested, nvme=self.nvme)
        build.attach_layout(self.optimizer, self.runtime, self.comm, zero.stage)
        self._log_offload()
        self.lr_scheduler = build.build_scheduler_for(cfg, lr_scheduler, self.optimizer)
        self.scaler = LossScaler.from_config(cfg)
        self.gradient_accumulation_steps = cfg.gradient_accumulation_steps
        self.micro_steps = 0
        self.pending_micro_steps = 0  # micro-steps accumulated since the last optimizer step
        self._boundary: bool | None = None  # set_gradient_accumulation_boundary's word, else the count decides
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        self._checkpoint_comm = None  # the checkpoint's own process group, made by the first save or load
        self._pending_save = None  # an asynchronous save in flight
        # What the config asks to report beside training (timers, monitors, profiler, comms logger): no cost when off.
        self.reporter = Reporter(self)
        # Every stateful piece, with how it resets: loads, zero_grad and the tests walk this (engine/state.py).
        self.state = build_registry(self)

    def _log_layout(self) -> None:
        """Say once what zkern made of the config (a warning when a key was not DeepSpeed's), how the parameters were
        laid out (padding included), and warn about costly layouts."""
        if self.rank != 0:
            return
        log.log(logging.WARNING if self.config.notes.warned else logging.INFO, "%s", startup_block(self.config))
        for line in self.runtime.describe():
            log.info("zkern: %s", line)
        for line in self.runtime.warnings(self.config.zero_optimization.reduce_bucket_size):
            log.warning("zkern: %s", line)

    @staticmethod
    def _param_files(cfg, rank: int):
        """Stage 3's parameter file maker for offload_param.device "nvme", else None."""
        if cfg.zero_optimization.offload_param_device != "nvme":
            return None
        return lambda numel, dtype, units: nvme.params_from_config(cfg, rank, numel, dtype, units)

    def _stand_in_read(self, t: torch.Tensor, state: str = "master") -> torch.Tensor:
        """Values of a meta stand-in's slice (ZeRO-Infinity): the parameter file's or the optimizer's `state`."""
        return nvme.read_stand_in(t, self.nvme, getattr(self.runtime, "param_store", None), state)

    def _stand_in_write(self, t: torch.Tensor, values: torch.Tensor, state: str = "master") -> None:
        nvme.write_stand_in(t, values, self.nvme, getattr(self.runtime, "param_store", None), state)

    def _log_offload(self) -> None:
        """Say where the optimizer's states went, and what the offload keys that do nothing here would have done."""
        zero = self.config.zero_optimization
        if self.nvme is not None:
            self.nvme.buffers()  # the tile size is fixed now that every region exists
        store = getattr(self.runtime, "param_store", None)
        if self.rank != 0:
            return
        if store is not None:
            log.info("zkern NVMe: stage-3 parameter shard in %s (%.1f MB per rank), read ahead by up to %d reads / "
                     "%d elements, up to %d elements cached in host memory", store.directory, store.nbytes / 1e6,
                     store.buffer_count, store.buffer_size, store.max_in_cpu)
        if zero.offload_param_device != "nvme" and zero.offload_param_nvme_path is not None:
            log.warning("zkern: zero_optimization.offload_param.nvme_path is set but the device is %r: the "
                        "parameter shards are not on NVMe (set device \"nvme\" for that)", zero.offload_param_device)
        if self.nvme is not None:
            log.info("zkern NVMe: master and Adam moments in %s (%.1f MB per rank, %s I/O), stepped in tiles of %d "
                     "elements through %d buffer sets (%.1f MB of host memory)", self.nvme.directory,
                     self.nvme.nbytes() / 1e6, self.nvme.io_path, self.nvme.tile, self.nvme.buffer_count,
                     self.nvme.buffer_bytes() / 1e6)
            if self.nvme.buffer_bytes() > 1 << 30:
                log.warning("zkern NVMe: the tile buffers take %.1f GB of host memory (buffer_count x 3 states x "
                            "sub_group_size x 4 bytes); lower zero_optimization.sub_group_size (e.g. 1e7)",
                            self.nvme.buffer_bytes() / 1e9)
            return
        if zero.offload_optimizer_nvme_path is not None:
            log.warning("zkern: zero_optimization.offload_optimizer.nvme_path is set but the device is %r: the "
                        "optimizer states are not on NVMe (set device \"nvme\" for that)",
                        zero.offload_optimizer_device)
        if zero.sub_group_size != 1_000_000_000:
            log.info("zkern: zero_optimization.sub_group_size sets the tile of the NVMe optimizer step; with "
                     "offload_optimizer.device %r it changes nothing", zero.offload_optimizer_device)

    # -- the training loop ------------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.config.fp16.enabled and self.config.fp16.auto_cast:  # DeepSpeed's fp16.auto_cast: the inputs too
            args, kwargs = tree_map(_to_half, (args, kwargs))
        try:
            with self.reporter.phase("forward"):
                return self.reporter.forward(self.module, args, kwargs)
        except BaseException as e:
            self.runtime.abort_pass(e)  # stage 3: release what the failed pass gathered
            raise

    def is_gradient_accumulation_boundary(self) -> bool:
        """True when the next step() will update the parameters."""
        if self._boundary is not None:
            return self._boundary
        return self.pending_micro_steps + 1 == self.gradient_accumulation_steps

    def set_gradient_accumulation_boundary(self, is_boundary: bool | None) -> None:
        """Say whether the coming micro-step ends an accumulation (DeepSpeed's method), for loops whose
        accumulations are not all gradient_accumulation_steps long (the short last one of an epoch); None returns
        to counting. backward() still divides the loss by gradient_accumulation_steps: scale a short
        accumulation's losses yourself if you want its mean."""
        if is_boundary is not None and not isinstance(is_boundary, bool):
            raise TypeError(f"set_gradient_accumulation_boundary takes True, False or None, got {is_boundary!r}")
        self._boundary = is_boundary

    def zero_grad(self, set_to_none: bool = True) -> None:
        """step() clears the gradients it applied, so after a step this does nothing; mid-accumulation it drops
        the gradients accumulated since the last step, as torch's zero_grad does."""
        if self.pending_micro_steps:
            self.state.reset("transient")

    def _reset_accumulation(self) -> None:
        """No micro-step accumulated, and the accumulation boundary back to counting (the registry's reset)."""
        self.pending_micro_steps = 0
        self._boundary = None

    @contextlib.contextmanager
    def gathered_for_generation(self):
        """Stage 3: gather every unit once and keep it whole until the block ends (a collective on entry and exit),
        so that generate()'s many short forwards read whole weights instead of gathering and freeing each unit per
        token. Within stage3_max_live_parameters: units that do not fit keep their per-use gathers. For inference:
        the block runs under torch.no_grad(). Stages 0-2 hold whole parameters already; there it only disables
        gradients.

            with engine.gathered_for_generation():
                out = engine.module.generate(input_ids, max_new_tokens=32)
        """
        if self.config.zero_optimization.stage != 3:
            with torch.no_grad():
                yield self
            return
        from zkern.stage3.gathered import GatheredParameters

        params, held, total = self.runtime.generation_params()
        if held < total and self.rank == 0:
            log.warning("zkern: gathered_for_generation keeps %d of %d elements whole (stage3_max_live_parameters="
                        "%d); the other units are gathered at each use", held, total,
                        self.config.zero_optimization.stage3_max_live_parameters)
        # Nothing left to gather per use when every unit fits: the per-module hooks step aside.
        hooks = self.runtime.hooks_suspended() if held == total else contextlib.nullcontext()
        with torch.no_grad(), GatheredParameters(params), hooks:
            yield self

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
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"engine.backward expects a scalar loss tensor, got "
                             f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}")
        if not loss.requires_grad:
            raise ValueError("engine.backward: the loss does not require grad (computed under torch.no_grad(), or "
                             "no trainable parameter took part in it)")
        self.reporter.loss(loss)
        self.runtime.begin_backward(self.is_gradient_accumulation_boundary())
        # The loss scale, the mean over micro-steps and the division before the sum over ranks, in one factor
        # (gradient_predivide_factor, by default the world size: no sum of ranks' 16-bit gradients grows past the
        # largest of them).
        factor = self.scaler.scale / (self.gradient_accumulation_steps * self.config.gradient_predivide_factor)
        with self.reporter.phase("backward"):
            try:
                (loss * factor).backward()
            except BaseException:
                self.runtime.abort_backward()  # stage 3: release what the failed pass held; nothing is reduced
                raise
            self.runtime.end_backward()

    def step(self) -> None:
        """At the accumulation boundary: overflow check, clipping, optimizer, loss-scale and LR update.
        Between boundaries: a no-op (gradients keep accumulating)."""
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        self.pending_micro_steps += 1
        if not boundary:
            return
        self.pending_micro_steps = 0
        with self.reporter.phase("step"):
            self._optimizer_step()
        self.global_steps += 1
        self.reporter.stepped()
        if self.config.steps_per_print and self.global_steps % self.config.steps_per_print == 0 and self.rank == 0:
            lrs = [g["lr"] for g in self.optimizer.param_groups]
            log.info("zkern: step=%d skipped=%d lr=%s grad_norm=%s loss_scale=%g", self.global_steps,
                     self.skipped_steps, lrs, self.last_grad_norm, self.scaler.scale)

    def _optimizer_step(self) -> None:
        found = torch.zeros((), dtype=torch.float32, device=self.device)
        sq_norm = torch.zeros((), dtype=torch.float32, device=self.device)
        for segment in self.runtime.grad_segments():
            f, s = ops.unscale_and_check_(segment, 1.0)  # check and norm only; unscaling is folded into Adam
            found += f
            sq_norm += s
        # float64: the gather signature's sum and sum of squares must add up exactly (divergence.py).
        signature = self.runtime.gather_signature()
        host = torch.tensor([signature, signature * signature, *map(float, self.runtime.used)], dtype=torch.float64)
        control = torch.cat([found.view(1).double(), sq_norm.view(1).double(), host.to(self.device)])
        self.comm.all_reduce(control, "step control: overflow flag, squared gradient norm, gather signature, "
                                      "parameters with gradients", kind="control")
        values = control.tolist()  # the one host synchronisation of the step
        if signatures_differ(values[2], values[3], signature, self.world_size):
            self.runtime.diverged_step()  # stage 3: ranks paired different units; never apply this step
            self.skipped_steps += 1
            self.runtime.skipped_step()
            self.runtime.zero_grad()
            return
        sq = values[1]
        overflow = values[0] > 0 or not math.isfinite(sq)
        # Gradients hold the sum over ranks of loss_scale / predivide * (micro-batch mean gradient): fold the rest of
        # the average and the unscaling into one factor applied inside the Adam pass.
        inv = self.config.gradient_predivide_factor / (self.scaler.scale * self.world_size)
        norm = math.sqrt(sq) * inv if math.isfinite(sq) else float("inf")
        self.last_grad_norm = norm
        if overflow:
            self._skip(norm)
        else:
            clip = self.config.gradient_clipping
            coef = min(1.0, clip / (norm + 1e-6)) if clip > 0 else 1.0  # torch.nn.utils.clip_grad_norm_'s rule
            flags = [v > 0 for v in values[4:]]
            self._check_unused(flags)
            active = self.runtime.active(flags)
            if self.host_step is not None:
                self.host_step.step(self.optimizer, grad_scale=inv * coef, active=active)
            elif isinstance(self.optimizer, ShardAdam):
                self.optimizer.step(grad_scale=inv * coef, active=active, after_chunk=self.runtime.chunk_stepped)
            else:
                step_torch_optimizer(self.optimizer, self.runtime.shard_groups, grad_scale=inv * coef, active=active)
            scale = self.scaler.scale
            self.scaler.update(False)
            if self.scaler.scale != scale:  # LoCo's errors are kept in loss-scaled units: they follow the scale
                self.runtime.loss_scale_changed(self.scaler.scale / scale)
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.runtime.after_step()
        self.runtime.zero_grad()

    def _skip(self, norm: float) -> None:
        self.skipped_steps += 1
        self.runtime.skipped_step()
        before = self.scaler.scale
        if self.config.precision == "fp16":
            self.scaler.update(True)
            if self.rank == 0:
                log.warning("zkern: OVERFLOW! Skipping step %d. Attempted loss scale: %g, reducing to %g",
                            self.global_steps + 1, before, self.scaler.scale)
        elif self.rank == 0:
            log.warning("zkern: non-finite gradient (norm %s) at step %d; step skipped, parameters and optimizer "
                        "state unchanged", norm, self.global_steps + 1)

    def _check_unused(self, flags: list[bool]) -> None:
        if self.config.zero_optimization.ignore_unused_parameters:
            return
        unused = [n for n, f in zip(self.runtime.names, flags) if not f]
        if unused:
            raise RuntimeError(f"parameters {unused} got no gradient on any rank in this step and "
                               f"zero_optimization.ignore_unused_parameters is false; set it to true (the default) "
                               f"to let them skip the step")

    # -- reports ----------------------------------------------------------------------------------------------
    def memory_report(self) -> dict[str, dict[str, int]]:
        """Bytes this rank holds, by where they live: params, grads, optimizer (states), master (fp32 weights),
        comm_buffers (gradient buckets, gathered stage-3 units), offload_buffers (host staging), total; with
        ZeRO++ also hpz_secondary (hpZ's secondary partition), loco_error (LoCo's error buffers) and frozen_int8
        (the int8 codes and scales of frozen units under zero_quantized_nontrainable_weights, not in params).
        With offload the master, the optimizer states and the staging buffers are under "host" (and the
        stage-3 parameter shards too with offload_param); on a CPU-only run both places are one memory, but
        they are still reported apart."""
        device = {"params": 0, "grads": 0, "optimizer": 0, "master": 0, "comm_buffers": 0}
        host = {"params": 0, "optimizer": 0, "master": 0, "offload_buffers": 0}
        held = self.runtime.memory()
        on_host = held.pop("host_params")
        params_on_disk = held.pop("disk_params", 0)
        for key, value in held.items():  # ZeRO++ adds hpz_secondary, loco_error and frozen_int8 where they are on
            if key.startswith("host_"):  # resting on the host (offload_param)
                host[key[len("host_"):]] = host.get(key[len("host_"):], 0) + value
            else:
                device[key] = device.get(key, 0) + value
        trainable = {id(p) for p in self.runtime.params}
        device["params"] += sum(p.numel() * p.element_size() for p in self.module.parameters()
                                if id(p) not in trainable)
        optimizer = _optimizer_state_bytes(self.optimizer)
        if self.offload:
            host["master"], device["master"] = device["master"], 0
            host["optimizer"] = optimizer
            host["offload_buffers"] = self.host_step.staging_bytes
        else:
            device["optimizer"] = optimizer
        host["params"], device["params"] = on_host, device["params"] - on_host
        on_nvme = None
        if self.nvme is not None or params_on_disk:
            on_nvme = {"params": params_on_disk, "master": 0, "optimizer": 0}
        if self.nvme is not None:  # the three state files are the same size: master, then exp_avg + exp_avg_sq
            host["nvme_buffers"] = self.nvme.buffer_bytes()
            on_disk = self.nvme.nbytes()
            on_nvme.update(master=on_disk // 3, optimizer=on_disk - on_disk // 3)
        if on_nvme is not None:
            on_nvme["total"] = sum(on_nvme.values())
        device["total"], host["total"] = sum(device.values()), sum(host.values())
        # the host holds something with offload_optimizer, or with stage 3's parameters resting there (offload_param)
        report = {self.device.type: device, "host": host} if self.offload or on_host else {self.device.type: device}
        if on_nvme is not None:
            report["nvme"] = on_nvme
        return report

    def comm_stats(self) -> dict:
        """Bytes this rank sent per collective kind since the start (ring-algorithm volumes), with call counts
        under "calls" and the bytes split under "intra" and "inter" by whether the group spans nodes."""
        return self.comm.stats()

    def save_16bit_model(self, save_dir: str | os.PathLike, save_filename: str = "pytorch_model.bin") -> str:
        """Save the weights in the training dtype with model.state_dict()'s names, as DeepSpeed's method does (a
        collective; rank 0 writes). Stage 3 gathers them only when the config allows it."""
        zero = self.config.zero_optimization
        if zero.stage == 3:
            if not zero.stage3_gather_16bit_weights_on_model_save:
                raise RuntimeError("save_16bit_model at stage 3 gathers the whole model onto rank 0; set "
                                   "zero_optimization.stage3_gather_16bit_weights_on_model_save to true to allow it")
        state = self.full_working_state_dict(rank0_only=True)
        path = os.path.join(os.fspath(save_dir), save_filename)
        if self.rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, path)
        return path

    def full_working_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """The weights in the training dtype (bf16/fp16 when mixed precision, else fp32) with model.state_dict()'s
        names, on the host: what DeepSpeed's 16-bit consolidation gives (a collective: call it on every rank). With
        rank0_only, other ranks return None and, at stage 3, hold one unit at a time. Tensors one parameter shares
        under two names (tied embeddings) stay one tensor."""
        if self.config.zero_optimization.stage == 3:
            values = self.runtime.full_working(rank0_only)
        else:
            values = self.runtime.full_working()  # whole on every rank already: a read, not a gather
            values = None if rank0_only and self.rank != 0 else values
        if values is None:
            return None
        copies: dict[int, torch.Tensor] = {}
        out = {}
        for name, t in self._module_state().items():
            if id(t) not in copies:
                copies[id(t)] = values.get(id(t), t).detach().to("cpu", copy=True)
            out[name] = copies[id(t)]
        return out

    # -- checkpoints (zkern/checkpoint/) ----------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str | os.PathLike, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False,
                        async_save: bool = False) -> str | None:
        """Save the whole training state under save_dir/tag (a collective: every rank calls it, after step() at an
        accumulation boundary). tag defaults to global_step<N>; client_state is plain JSON data returned by
        load_checkpoint. The checkpoint loads at any world size, stage and offload setting. async_save: copy the
        state to host buffers and write in a background thread (returns None; wait_checkpoint() gives the path,
        the next save or load waits for it, and its error surfaces there). Returns the tag's directory."""
        from zkern.errors import CheckpointError

        if self.pending_micro_steps:
            raise CheckpointError(
                f"save_checkpoint at micro-step {self.pending_micro_steps} of an "
                f"accumulation of {self.gradient_accumulation_steps}: the gradients accumulated since the last "
                f"optimizer step are not part of a checkpoint; save after the engine.step() that ends an accumulation")
        return self._write_checkpoint(save_dir, tag, client_state, save_latest, exclude_frozen_parameters, async_save)

    def _write_checkpoint(self, save_dir, tag, client_state, save_latest: bool, exclude_frozen_parameters: bool,
                          async_save: bool = False) -> str | None:
        """save_checkpoint without its refusal mid-accumulation: zkern.hf.Accelerator saves there as DeepSpeed does
        (the pending gradients are not saved; it warns)."""
        from zkern.checkpoint.manifest import check_plain
        from zkern.checkpoint.save import AsyncSave, checked_tag, snapshot, write

        self.wait_checkpoint()
        tag = checked_tag(tag, self.global_steps)
        client_state = {} if client_state is None else client_state
        check_plain(client_state, "client_state")
        # A copy, taken now: an asynchronous save writes the manifest later, and the caller's dict may change by then
        # (the epoch counter of the loop that saved).
        client_state = json.loads(json.dumps(client_state))
        ctrl = self._checkpoint_group()
        snap = snapshot(self, client_state=client_state, exclude_frozen=exclude_frozen_parameters, copy=async_save)
        save_dir = os.fspath(save_dir)
        mode, local = self.config.checkpoint.tag_validation, self.config.checkpoint.use_node_local_storage
        if async_save:
            self._pending_save = AsyncSave(lambda: write(ctrl, snap, save_dir, tag, save_latest, mode, local),
                                           f"save_checkpoint of tag {tag!r} to {save_dir!r}")
            return None
        return write(ctrl, snap, save_dir, tag, save_latest, mode, local)

    def wait_checkpoint(self) -> str | None:
        """Wait for the asynchronous save in flight, if any; returns its directory, or raises its error."""
        pending, self._pending_save = self._pending_save, None
        return None if pending is None else pending.wait()

    def destroy(self) -> None:
        """Release what the engine holds outside this process (DeepSpeed's method): wait for an asynchronous save,
        then remove this rank's NVMe files (offload_optimizer / offload_param device "nvme"; they also go at
        interpreter exit). The engine cannot step after it."""
        try:
            self.wait_checkpoint()
        finally:
            self.reporter.close()
            for files in (self.nvme, getattr(self.runtime, "param_store", None)):
                if files is not None:
                    files.close()

    @property
    def checkpoint_in_flight(self) -> bool:
        """Whether an asynchronous save is still writing on any rank: the same answer on every rank (a collective,
        so every rank must ask it at the same point). A rank asking only its own writer may see it finish a step
        before another rank does, and ranks that branch on that take different numbers of steps."""
        mine = self._pending_save is not None and not self._pending_save.done()
        if self.world_size == 1:
            return mine
        flag = torch.tensor([1.0 if mine else 0.0], device=self.device)
        self.comm.all_reduce(flag, "checkpoint_in_flight: whether any rank's asynchronous save still writes",
                             kind="control", op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    def load_checkpoint(self, load_dir: str | os.PathLike, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False) -> tuple[str | None, dict | None]:
        """Load a checkpoint saved at any world size, stage or offload setting (a collective). tag None: the one
        `latest` names. Returns (its directory, client_state), or (None, None) with a warning when there is nothing
        to load. Everything is verified (checksums, names, shapes) before the engine changes; on any error no
        rank's state changes. load_module_only: weights only (optimizer, scaler, scheduler and counters as they
        are); load_optimizer_states=False: fresh optimizer state."""
        from zkern.checkpoint.load import load

        self.wait_checkpoint()
        return load(self, self._checkpoint_group(), load_dir, tag, strict=load_module_strict,
                    load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states,
                    load_module_only=load_module_only)

    def _checkpoint_group(self):
        if self._checkpoint_comm is None:
            from zkern.checkpoint.control import control_comm

            self._checkpoint_comm = control_comm(self.comm)
        return self._checkpoint_comm

    def _module_state(self) -> dict[str, torch.Tensor]:
        """model.state_dict(keep_vars=True): the names and the tensor objects (stage 3 parameters at rest are empty;
        the caller substitutes gathered values by id)."""
        with self.runtime.unguarded():
            return self.module.state_dict(keep_vars=True)

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor] | None:
        """fp32 weights with model.state_dict()'s names, on the host (a collective: call it on every rank). The
        device holds one bucket at a time; with rank0_only, other ranks return None."""
        values = self.runtime.full_fp32(rank0_only)
        if values is None:
            return None
        out = {}
        for name, t in self._module_state().items():
            if id(t) in values:
                out[name] = values[id(t)]
            else:
                t = t.detach()
                out[name] = t.to("cpu", torch.float32 if t.is_floating_point() else t.dtype, copy=True)
        return out


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    if isinstance(optimizer, ShardAdam):
        return optimizer.state_bytes()
    seen, total = set(), 0
    for state in optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.numel() > 1 and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def _to_half(x):
    return x.half() if isinstance(x, torch.Tensor) and x.is_floating_point() else x
