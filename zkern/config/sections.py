"""The sections of a zkern.Config: one frozen dataclass per DeepSpeed config section, DeepSpeed's code defaults.

    python -c "from zkern.config.sections import ZeroConfig; help(ZeroConfig)"

parse.py fills them from a DeepSpeed JSON; Config (model.py) holds one of each; the engine only reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# ----------------------------------------------------------------------------------------------------------------
# The dataclasses (what the engine reads)


@dataclass(frozen=True)
class OptimizerConfig:
    type: str = "adamw"  # lower case: adam, adamw, lamb, lion, sgd, adagrad
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    # DeepSpeed's "Adam" is decoupled-weight-decay Adam unless params.adam_w_mode is false.
    adamw: bool = True
    # Run torch.optim.Adam/AdamW on the shard instead of zkern's fused step (same math, slower).
    torch_adam: bool = False
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
    enabled: bool = False
    loss_scale: float = 0.0  # 0 = dynamic; > 0 = static scale
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1.0
    auto_cast: bool = False  # cast floating-point inputs of the engine's forward to fp16


@dataclass(frozen=True)
class BF16Config:
    enabled: bool = False
    bf16_master_weights_and_grads: bool = False  # the optimizer's master shard in bf16 (no fp32 copy)
    bf16_optimizer_states: bool = False  # exp_avg / exp_avg_sq in bf16
    auto_cast: bool = False  # the forward's float inputs cast to bf16 (older DeepSpeed's key)

@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 0
    overlap_comm: bool | None = None  # None until resolve(): DeepSpeed's code default is stage == 3
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    ignore_unused_parameters: bool = True
    # Stage 3 (DeepSpeed's code defaults; its docs say 5e8 for the prefetch bucket)
    stage3_prefetch_bucket_size: int = 50_000_000  # elements gathered ahead of use
    stage3_param_persistence_threshold: int = 100_000  # fetch units smaller than this stay whole on every rank
    stage3_max_live_parameters: int = 1_000_000_000  # bound on gathered elements (prefetch stops at it)
    stage3_gather_16bit_weights_on_model_save: bool = False
    stage3_fetch_units: tuple[str, ...] = ()  # module class names: each instance is one fetch unit
    stage3_merge_divergent_modules: bool = True  # ranks gathering different units: gather their container whole
    # The gradient buffers (stages 0-1: the whole 16-bit gradient; 2-3: the shard) exist from a step's first backward
    # to the step, as torch's gradients do (zero_grad(set_to_none=True)); true keeps them for the engine's life.
    keep_gradient_buffers: bool = False
    # ZeRO-Offload: "none" or "cpu" (fp32 master and Adam moments on the host; stages 1-3), and for stage 3 the
    # parameter shards at rest on the host. pin_memory: page-locked host buffers (CUDA only).
    offload_optimizer_device: str = "none"
    offload_optimizer_pin_memory: bool = True  # DeepSpeed 0.19's default (page-locking is done on CUDA only)
    offload_param_device: str = "none"
    offload_param_pin_memory: bool = True
    # offload_optimizer.device "nvme" (ZeRO-Infinity, offload/nvme.py): fp32 master and moments in files under
    # nvme_path, stepped in tiles of sub_group_size elements through buffer_count host buffer sets.
    offload_optimizer_nvme_path: str | None = None
    offload_optimizer_buffer_count: int = 4
    offload_optimizer_fast_init: bool = False
    sub_group_size: int = 1_000_000_000
    # offload_param.device "nvme" (stage 3, offload/nvme_params.py): the parameter shard in a file under nvme_path,
    # read ahead by at most buffer_count reads / buffer_size elements, up to max_in_cpu elements cached on the host.
    offload_param_nvme_path: str | None = None
    offload_param_buffer_count: int = 5
    offload_param_buffer_size: int = 100_000_000
    offload_param_max_in_cpu: int = 1_000_000_000
    # ZeRO++ (comm/zeropp.py)
    zero_quantized_weights: bool = False  # qwZ: stage 3's all-gathers send int8 codes + an fp32 scale per group
    zero_quantized_nontrainable_weights: bool = False  # stage 3: units with nothing to train rest as int8 codes
    zero_hpz_partition_size: int = 1  # hpZ: a secondary copy over groups of k ranks serves backward's gathers
    zero_quantized_gradients: bool = False  # qgZ: gradients reduced by two int4 all-to-all hops (stages 2, 3)
    loco_err_beta: float | None = None  # LoCo error feedback (zeropp_loco_param): None = off
    loco_reset_t: int = 1024
    zeropp_weight_group_size: int = 2048  # zkern's own: int8 weight elements per scale
    zeropp_grad_group_size: int = 64  # zkern's own: int4 gradient elements per scale


@dataclass(frozen=True)
class AioConfig:
    """DeepSpeed's aio section: the NVMe reader's blocks, queue and threads (cpu/aio.py)."""

    block_size: int = 1_048_576
    queue_depth: int = 8
    thread_count: int = 1  # intra_op_parallelism in newer DeepSpeed; either key sets it
    single_submit: bool = False
    overlap_events: bool = True


@dataclass(frozen=True)
class ActivationCheckpointingConfig:
    """DeepSpeed's activation_checkpointing section (zkern.checkpointing reads it)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False


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
    enabled: bool = False
    profile_step: int = 1
    module_depth: int = -1
    top_modules: int = 1
    detailed: bool = True
    output_file: str | None = None
    recompute_fwd_factor: float = 0.0


@dataclass(frozen=True)
class CommsLoggerConfig:
    enabled: bool = False
    prof_all: bool = True
    prof_ops: tuple[str, ...] = ()
    verbose: bool = False
    debug: bool = False


@dataclass(frozen=True)
class CheckpointConfig:
    tag_validation: str = "WARN"  # IGNORE | WARN | FAIL: what save_checkpoint does when ranks pass different tags
    use_node_local_storage: bool = False  # each node writes and reads its own ranks' files


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
