"""The sections of a zkern.Config: one frozen dataclass per DeepSpeed config section, DeepSpeed's code defaults.

    python -c "from zkern.config.sections import ZeroConfig; help(ZeroConfig)"

parse.py fills them from a DeepSpeed JSON; Config (model.py) holds one of each; the engine only reads them. A
field's default is read from its key in keys.py (`_default`), the one place a key's kind, range and default are
written; the few literal defaults below belong to fields no single key defines, and say so.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zkern.config import keys as K


def _default(table: dict, name: str):
    """The default keys.py gives `name` in `table` (a Key's default, or a DefaultOnly's)."""
    return table[name].default

# ----------------------------------------------------------------------------------------------------------------
# The dataclasses (what the engine reads)


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "adamw"  # the section's type, lower case: adam, adamw, lamb, lion, sgd, adagrad (no default in JSON)
    lr: float = _default(K.ADAM_PARAMS, "lr")
    betas: tuple[float, float] = _default(K.ADAM_PARAMS, "betas")
    eps: float = _default(K.ADAM_PARAMS, "eps")
    weight_decay: float = _default(K.ADAM_PARAMS, "weight_decay")
    # DeepSpeed's "Adam" is decoupled-weight-decay Adam unless params.adam_w_mode is false.
    adamw: bool = _default(K.ADAM_PARAMS, "adam_w_mode")
    # Run torch.optim.Adam/AdamW on the shard instead of zkern's fused step (same math, slower).
    torch_adam: bool = _default(K.ADAM_PARAMS, "torch_adam")
    params: dict = field(default_factory=dict)  # every checked param of the section (the other optimizers' options)


@dataclass(frozen=True)
class SchedulerConfig:
    type: str  # WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle or LRRangeTest
    params: dict = field(default_factory=dict)  # checked, DeepSpeed's defaults filled in

    def __getattr__(self, name: str):  # cfg.scheduler.warmup_max_lr reads the params
        try:
            return self.__dict__["params"][name]
        except KeyError:
            raise AttributeError(name) from None


@dataclass(frozen=True)
class FP16Config:
    enabled: bool = _default(K.FP16, "enabled")
    loss_scale: float = _default(K.FP16, "loss_scale")  # 0 = dynamic; > 0 = static scale
    initial_scale_power: int = _default(K.FP16, "initial_scale_power")
    loss_scale_window: int = _default(K.FP16, "loss_scale_window")
    hysteresis: int = _default(K.FP16, "hysteresis")
    consecutive_hysteresis: bool = _default(K.FP16, "consecutive_hysteresis")
    min_loss_scale: float = _default(K.FP16, "min_loss_scale")
    auto_cast: bool = _default(K.FP16, "auto_cast")  # cast floating-point inputs of the engine's forward to fp16


@dataclass(frozen=True)
class BF16Config:
    enabled: bool = _default(K.BF16, "enabled")
    # the optimizer's master shard in bf16 (no fp32 copy)
    bf16_master_weights_and_grads: bool = _default(K.BF16, "bf16_master_weights_and_grads")
    bf16_optimizer_states: bool = _default(K.BF16, "bf16_optimizer_states")  # exp_avg / exp_avg_sq in bf16
    auto_cast: bool = _default(K.BF16, "auto_cast")  # the forward's float inputs cast to bf16 (older DeepSpeed's key)

@dataclass(frozen=True)
class TorchAutocastConfig:
    """DeepSpeed's torch_autocast: the engine's forward runs under torch.autocast; weights, gradients and the
    optimizer stay fp32 (fp16: the loss is scaled as torch's GradScaler scales it)."""
    enabled: bool = _default(K.TORCH_AUTOCAST, "enabled")
    dtype: str | None = None  # "fp16" | "bf16"; None: torch's autocast default for the device (CUDA fp16, CPU bf16)
    # the module classes whose gradients DeepSpeed reduces in the autocast dtype; zkern reduces them in fp32 (said)
    lower_precision_safe_modules: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = _default(K.ZERO, "stage")
    # None until resolve(): DeepSpeed's code default is stage == 3
    overlap_comm: bool | None = _default(K.ZERO, "overlap_comm")
    contiguous_gradients: bool = True  # not a key zkern reads (Inert in keys.py): its buckets are always contiguous
    reduce_scatter: bool = _default(K.ZERO, "reduce_scatter")
    reduce_bucket_size: int = _default(K.ZERO, "reduce_bucket_size")
    allgather_bucket_size: int = _default(K.ZERO, "allgather_bucket_size")
    ignore_unused_parameters: bool = _default(K.ZERO, "ignore_unused_parameters")
    # Stage 3 (DeepSpeed's code defaults; its docs say 5e8 for the prefetch bucket)
    stage3_prefetch_bucket_size: int = _default(K.ZERO, "stage3_prefetch_bucket_size")  # elements gathered ahead of use
    # fetch units smaller than this stay whole on every rank
    stage3_param_persistence_threshold: int = _default(K.ZERO, "stage3_param_persistence_threshold")
    # bound on gathered elements (prefetch stops at it)
    stage3_max_live_parameters: int = _default(K.ZERO, "stage3_max_live_parameters")
    stage3_gather_16bit_weights_on_model_save: bool = _default(K.ZERO, "stage3_gather_16bit_weights_on_model_save")
    # module class names: each instance is one fetch unit
    stage3_fetch_units: tuple[str, ...] = _default(K.ZERO, "stage3_fetch_units")
    # ranks gathering different units: gather their container whole
    # DeepSpeed's leaf_module.names / name_suffixes (module paths, path endings): units like stage3_fetch_units'
    # classes. No key of their own: the leaf_module section fills them.
    leaf_module_names: tuple[str, ...] = ()
    leaf_module_name_suffixes: tuple[str, ...] = ()
    stage3_merge_divergent_modules: bool = _default(K.ZERO, "stage3_merge_divergent_modules")
    # The gradient buffers (stages 0-1: the whole 16-bit gradient; 2-3: the shard) exist from a step's first backward
    # to the step, as torch's gradients do (zero_grad(set_to_none=True)); true keeps them for the engine's life.
    keep_gradient_buffers: bool = _default(K.ZERO, "keep_gradient_buffers")
    # Stage 3 in mixed precision with the master on the device: the gathers cast each rank's chunk from the fp32
    # master (as FSDP2 does); true keeps a 16-bit working shard beside it (2 bytes a parameter over N) to gather from.
    stage3_keep_working_shard: bool = _default(K.ZERO, "stage3_keep_working_shard")
    save_muon_momentum_buffer_in_memory: bool = _default(K.ZERO, "save_muon_momentum_buffer_in_memory")
    # ZeRO-Offload: "none" or "cpu" (fp32 master and Adam moments on the host; stages 1-3), and for stage 3 the
    # parameter shards at rest on the host. pin_memory: page-locked host buffers (CUDA only).
    offload_optimizer_device: str = _default(K.OFFLOAD["offload_optimizer"], "device")
    # DeepSpeed 0.19's default (page-locking is done on CUDA only)
    offload_optimizer_pin_memory: bool = _default(K.OFFLOAD["offload_optimizer"], "pin_memory")
    # zkern's own: the offloaded step's gradient chunks go to the host during the boundary's backward, as their
    # reductions land (offload/host.py); false: all of them when step() is called
    offload_optimizer_copy_grads_during_backward: bool = _default(K.OFFLOAD["offload_optimizer"],
                                                                  "copy_grads_during_backward")
    # zkern's own: ZeRO-Offload's delayed parameter update; each step's host Adam overlaps the next step's forward
    # and backward, and the working weights trail the master by one update (offload/host.py)
    offload_optimizer_delayed_update: bool = _default(K.OFFLOAD["offload_optimizer"], "delayed_update")
    # zkern's own (DeepSpeed's super_offload turns it on): the host Adam of each gradient chunk runs in the boundary's
    # backward as the chunk lands, guessing an unclipped step; step() keeps or undoes it (offload/speculative.py)
    offload_optimizer_speculative_step: bool = _default(K.OFFLOAD["offload_optimizer"], "speculative_step")
    offload_optimizer_super_offload: bool = _default(K.OFFLOAD["offload_optimizer"], "super_offload")
    # DeepSpeed's: the share (0-1] of the CPU Adam's threads (zkern.cpu._ext.cpu_threads) the background host Adam
    # uses (speculative step, delayed update), leaving the rest to the training thread
    offload_optimizer_cpuadam_cores_perc: float = _default(K.OFFLOAD["offload_optimizer"], "cpuadam_cores_perc")
    # zkern's own: the host staging is a ring of this many chunk buffers (offload/host.py); 0: the whole shard
    offload_optimizer_staging_chunks: int = _default(K.OFFLOAD["offload_optimizer"], "staging_chunks")
    # DeepSpeed's partial offload: this share of each rank's optimizer shard (fp32 master, moments, their step) on the
    # host, the rest on the device, split where a parameter's piece ends (offload/store.py SplitShard)
    offload_optimizer_ratio: float = _default(K.OFFLOAD["offload_optimizer"], "ratio")
    offload_param_device: str = _default(K.OFFLOAD["offload_param"], "device")
    offload_param_pin_memory: bool = _default(K.OFFLOAD["offload_param"], "pin_memory")
    # offload_optimizer.device "nvme" (ZeRO-Infinity, offload/nvme.py): fp32 master and moments in files under
    # nvme_path, stepped in tiles of sub_group_size elements through buffer_count host buffer sets.
    offload_optimizer_nvme_path: str | None = _default(K.OFFLOAD["offload_optimizer"], "nvme_path")
    offload_optimizer_buffer_count: int = _default(K.OFFLOAD["offload_optimizer"], "buffer_count")
    offload_optimizer_fast_init: bool = _default(K.OFFLOAD["offload_optimizer"], "fast_init")
    sub_group_size: int = _default(K.ZERO, "sub_group_size")
    # offload_param.device "nvme" (stage 3, offload/nvme_params.py): the parameter shard in a file under nvme_path,
    # read ahead by at most buffer_count reads / buffer_size elements, up to max_in_cpu elements cached on the host.
    offload_param_nvme_path: str | None = _default(K.OFFLOAD["offload_param"], "nvme_path")
    offload_param_buffer_count: int = _default(K.OFFLOAD["offload_param"], "buffer_count")
    offload_param_buffer_size: int = _default(K.OFFLOAD["offload_param"], "buffer_size")
    offload_param_max_in_cpu: int = _default(K.OFFLOAD["offload_param"], "max_in_cpu")
    # ZeRO++ (comm/zeropp.py)
    # qwZ: stage 3's all-gathers send int8 codes + an fp32 scale per group
    zero_quantized_weights: bool = _default(K.ZERO, "zero_quantized_weights")
    # stage 3: units with nothing to train rest as int8 codes
    zero_quantized_nontrainable_weights: bool = _default(K.ZERO, "zero_quantized_nontrainable_weights")
    # hpZ: a secondary copy over groups of k ranks serves backward's gathers
    zero_hpz_partition_size: int = _default(K.ZERO, "zero_hpz_partition_size")
    # qgZ: gradients reduced by two int4 all-to-all hops (stages 2, 3)
    zero_quantized_gradients: bool = _default(K.ZERO, "zero_quantized_gradients")
    # LoCo error feedback: None = off; a zeropp_loco_param section sets it (its err_beta defaults in keys.LOCO)
    loco_err_beta: float | None = None
    loco_reset_t: int = _default(K.LOCO, "reset_T")
    # zkern's own: int8 weight elements per scale
    zeropp_weight_group_size: int = _default(K.ZERO, "zeropp_weight_group_size")
    # zkern's own: int4 gradient elements per scale
    zeropp_grad_group_size: int = _default(K.ZERO, "zeropp_grad_group_size")


@dataclass(frozen=True)
class AioConfig:
    """DeepSpeed's aio section: the NVMe reader's blocks, queue and threads (cpu/aio.py)."""

    block_size: int = _default(K.AIO, "block_size")
    queue_depth: int = _default(K.AIO, "queue_depth")
    thread_count: int = _default(K.AIO, "thread_count")  # intra_op_parallelism in newer DeepSpeed; either key sets it
    single_submit: bool = _default(K.AIO, "single_submit")
    overlap_events: bool = _default(K.AIO, "overlap_events")


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """DeepSpeed's activation_checkpointing section (zkern.checkpointing reads it)."""

    partition_activations: bool = _default(K.ACTIVATION_CHECKPOINTING, "partition_activations")
    cpu_checkpointing: bool = _default(K.ACTIVATION_CHECKPOINTING, "cpu_checkpointing")
    contiguous_memory_optimization: bool = _default(K.ACTIVATION_CHECKPOINTING, "contiguous_memory_optimization")
    number_checkpoints: int | None = _default(K.ACTIVATION_CHECKPOINTING, "number_checkpoints")
    synchronize_checkpoint_boundary: bool = _default(K.ACTIVATION_CHECKPOINTING, "synchronize_checkpoint_boundary")
    profile: bool = _default(K.ACTIVATION_CHECKPOINTING, "profile")


@dataclass(frozen=True)
class MonitorConfig:
    """DeepSpeed's tensorboard, csv_monitor, wandb and comet sections (zkern/monitor.py writes them)."""

    tensorboard: dict = field(default_factory=dict)  # {} when off, else the checked section
    csv_monitor: dict = field(default_factory=dict)
    wandb: dict = field(default_factory=dict)
    comet: dict = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return bool(self.tensorboard or self.csv_monitor or self.wandb or self.comet)


@dataclass(frozen=True)
class FlopsProfilerConfig:
    enabled: bool = _default(K.FLOPS_PROFILER, "enabled")
    profile_step: int = _default(K.FLOPS_PROFILER, "profile_step")
    module_depth: int = _default(K.FLOPS_PROFILER, "module_depth")
    top_modules: int = _default(K.FLOPS_PROFILER, "top_modules")
    detailed: bool = _default(K.FLOPS_PROFILER, "detailed")
    output_file: str | None = _default(K.FLOPS_PROFILER, "output_file")
    recompute_fwd_factor: float = _default(K.FLOPS_PROFILER, "recompute_fwd_factor")


@dataclass(frozen=True)
class CommsLoggerConfig:
    enabled: bool = _default(K.COMMS_LOGGER, "enabled")
    prof_all: bool = _default(K.COMMS_LOGGER, "prof_all")
    prof_ops: tuple[str, ...] = _default(K.COMMS_LOGGER, "prof_ops")
    verbose: bool = _default(K.COMMS_LOGGER, "verbose")
    debug: bool = _default(K.COMMS_LOGGER, "debug")


@dataclass(frozen=True)
class CheckpointConfig:
    # IGNORE | WARN | FAIL: what save_checkpoint does when ranks pass different tags (parse upper-cases the value)
    tag_validation: str = _default(K.CHECKPOINT, "tag_validation").upper()
    # each node writes and reads its own ranks' files
    use_node_local_storage: bool = _default(K.CHECKPOINT, "use_node_local_storage")


@dataclass(frozen=True)
class ConfigNotes:
    """What zkern made of a config file (the start-up block; python -m zkern.config check)."""

    inert: tuple[tuple[str, str], ...] = ()  # (key path, why it changes nothing in zkern)
    warned: tuple[tuple[str, str], ...] = ()  # (key path, message): keys that are not DeepSpeed's, ignored values
    renamed: tuple[tuple[str, str], ...] = ()  # (spelling used, key it stands for): aliases, deprecated spellings
    filled: tuple[tuple[str, str], ...] = ()  # (key path, value): "auto" resolved, or DeepSpeed's default taken

    def lines(self) -> list[str]:
        out = [f"accepted, changes nothing in zkern: {p} ({why})" for p, why in self.inert]
        out += [f"warning: {p}: {msg}" for p, msg in self.warned]
        out += [f"read as {new}: {old}" for old, new in self.renamed]
        out += [f"filled: {p} = {value}" for p, value in self.filled]
        return out
