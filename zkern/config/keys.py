"""zkern's config key tables: every key of DeepSpeed 0.19's config, with DeepSpeed's default and what zkern does with
it, and zkern's own keys. zkern.config.parse walks a user's file against them.

    python -m zkern.config check ds_config.json     # what zkern makes of a file

A key is one of:
  Key(kind, default, lo, hi)   implemented: parsed into zkern.Config (lo/hi: the accepted range, inclusive)
  Inert(why)                   DeepSpeed's, any value accepted: it asks for nothing zkern would do differently (why)
  DefaultOnly(default, what)   DeepSpeed's, not implemented: accepted at values that ask for nothing, else an error
  Alias(canonical)             another spelling DeepSpeed accepts for the same key
A section is a dict of such keys; STRICT sections refuse keys they do not know (DeepSpeed's pydantic models do, so a
config DeepSpeed accepts never has them), the others warn. Kinds: int, float, bool, str, str_or_null, int_or_null,
str_list, betas, dtype_or_null, json (plain data, checked where used), section.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

AUTO = "auto"  # a value zkern fills in from the world size and the model (Config.resolve), or HF / Accelerate
INF = math.inf
# Removed from DeepSpeed itself in 2026-09 (its PR 8490): a config that asks for them trains on no current DeepSpeed
REMOVED_UPSTREAM = "removed from DeepSpeed in 2026-09 (its PR 8490)"


@dataclass(frozen=True)
class Key:
    kind: str
    default: Any = None
    lo: float = -INF
    hi: float = INF
    resolve_auto: bool = False  # "auto" is filled by Config.resolve (batch sizes, hidden-size rules)


@dataclass(frozen=True)
class Inert:
    why: str


@dataclass(frozen=True)
class DefaultOnly:
    default: Any
    what: str = ""  # the feature that is missing, for the error


@dataclass(frozen=True)
class Alias:
    canonical: str


# A section DeepSpeed lists but zkern does not implement: accepted when it asks for nothing (absent, empty, or every
# switch in it false/none), else an error naming it.
@dataclass(frozen=True)
class SectionOff:
    what: str


def _int(default, lo=-INF, hi=INF, auto=False):
    return Key("int", default, lo, hi, auto)


def _elements(default, lo=0, auto=False):
    """A count of elements (a bucket, a threshold): an int, and a fraction is taken rounded down (walk.py)."""
    return Key("elements", default, lo, INF, auto)


def _float(default, lo=-INF, hi=INF):
    return Key("float", default, lo, hi)


def _bool(default):
    return Key("bool", default)


TOP = {
    # Counts a run can reach (an int32): 1e+30 was taken as a count, and an engine waiting for that many micro-steps
    # before its first step never answered.
    "train_batch_size": _int(None, 1, 2**31 - 1, auto=True),
    "train_micro_batch_size_per_gpu": _int(None, 1, 2**31 - 1, auto=True),
    "gradient_accumulation_steps": _int(None, 1, 2**31 - 1, auto=True),
    "gradient_clipping": _float(1.0, 0.0),
    "optimizer": Key("section"),
    "scheduler": Key("section"),
    "fp16": Key("section"),
    "bf16": Key("section"),
    "bfloat16": Alias("bf16"),  # DeepSpeed's older name of the section
    "zero_optimization": Key("json"),  # a section, or DeepSpeed's oldest form true/false (config.parse._zero)
    # DeepSpeed 0.19's default: no progress line (before: every 10 steps); 0 is zkern's "never anything"
    "steps_per_print": Key("int_or_null", None, 0),
    "zero_allow_untested_optimizer": _bool(False),
    "activation_checkpointing": Key("section"),
    "gradient_predivide_factor": Key("float", None, 1e-30),
    "communication_data_type": Key("dtype_or_null", None),
    "data_types": Key("section"),
    "aio": Key("section"),
    "wall_clock_breakdown": _bool(False),
    "memory_breakdown": _bool(False),
    "flops_profiler": Key("section"),
    "comms_logger": Key("section"),
    "tensorboard": Key("section"),
    "wandb": Key("section"),
    "csv_monitor": Key("section"),
    "comet": Key("section"),
    "checkpoint": Key("section"),
    "dataloader_drop_last": _bool(False),
    # zkern's own
    "comm_timeout_s": _float(600.0, 1e-3),
    "bf16_stochastic_rounding": _bool(False),
    "device": Key("str", "auto"),
    "ranks_per_node": Key("int_or_null", None, 1),
    # DeepSpeed's, asking for nothing zkern does differently
    "prescale_gradients": Inert("zkern divides gradients before the sum already (gradient_predivide_factor, by "
                                "default the world size)"),
    "zero_force_ds_cpu_optimizer": Inert("zkern steps any optimizer with offload: its own CPU Adam, or a torch "
                                         "optimizer on the host shard"),
    "disable_allgather": Inert("a choice between DeepSpeed's collectives for the same result; zkern's schedule "
                               "is fixed"),
    "dump_state": Inert("zkern logs its layout at start-up (logging INFO)"),
    "disable_python_gc": Inert("zkern never runs the garbage collector in the step"),
    "seq_parallel_communication_data_type": Inert("zkern has no sequence parallelism"),
    "log_level": Inert("zkern logs through the 'zkern' logger; set its level with logging"),
    "timers": Inert("throughput timers: wall_clock_breakdown reports zkern's"),
    "vocabulary_size": Inert("only DeepSpeed's pipeline engine reads it"),
    "sparse_gradients": DefaultOnly(False, "sparse gradients"),
    "graph_harvesting": DefaultOnly(False, "CUDA graph harvesting"),
    "use_data_before_expert_parallelism": DefaultOnly(False, "expert parallelism"),
    "managed_gradient_accumulation": Inert("the engine manages gradient accumulation (step() at each boundary)"),
    "gradient_allreduce_op": Key("str", "mean"),  # "mean" | "sum" (any case): sum the ranks' gradients
    "torch_autocast": Key("section"),
    "amp": SectionOff("NVIDIA apex amp (use fp16 or bf16)"),
    "tensor_parallel": SectionOff("tensor parallelism (autotp_size > 1)"),
    "expert_parallel": SectionOff("expert parallelism"),
    "compile": SectionOff("DeepCompile"),
    "sparse_attention": SectionOff("sparse attention"),
    "data_efficiency": SectionOff("data efficiency (curriculum, random-LTD)"),
    "curriculum_learning": SectionOff("curriculum learning"),
    "elasticity": SectionOff("elastic training"),
    "autotuning": SectionOff("autotuning"),
    "nebula": SectionOff(f"Nebula checkpointing, {REMOVED_UPSTREAM}"),
    "eigenvalue": SectionOff("eigenvalue computation"),
    "progressive_layer_drop": SectionOff("progressive layer drop"),
    "hybrid_engine": SectionOff("the RLHF hybrid engine"),
    "compression_training": SectionOff(f"the compression library, {REMOVED_UPSTREAM}"),
    "pipeline": SectionOff("pipeline parallelism"),
    "quantize_training": SectionOff("quantization-aware training"),
    "weight_quantization": SectionOff("weight quantization"),
    "datastates": SectionOff("DataStates checkpointing"),
}

FP16 = {
    "enabled": _bool(False),
    "auto_cast": _bool(False),
    "loss_scale": _float(0.0, 0.0),
    "initial_scale_power": _int(16, 0, 63),
    "loss_scale_window": _int(1000, 1),
    "hysteresis": _int(2, 1),
    "consecutive_hysteresis": _bool(False),
    "min_loss_scale": _float(1.0, 1e-38),
    "fp16_master_weights_and_grads": DefaultOnly(False, "fp16 master weights"),
}
BF16 = {
    "enabled": _bool(False),
    "check_grad_overflow": Inert("zkern checks every step's gradients for inf/NaN in every precision (fused with the "
                                 "norm, free) and skips a non-finite step, whatever this says"),
    "immediate_grad_update": Inert("zkern folds each micro-step's gradients into the shard as they are reduced"),
    "bf16_master_weights_and_grads": _bool(False),
    "bf16_optimizer_states": _bool(False),
    # Older DeepSpeed took both in a bf16 section (configs in the wild have them): auto_cast casts the forward's
    # float inputs to bf16 as fp16.auto_cast does to fp16; a loss scale is meaningless in bf16, which never scales.
    "auto_cast": _bool(False),
    "loss_scale": Inert("bf16 needs no loss scaling; DeepSpeed's bf16 ignores it too"),
    # fp16's loss-scale keys left in a bf16 section (configs copied from fp16 ones have them): bf16 never scales
    **{key: Inert("a loss-scale key left over from an fp16 section: bf16 never scales its loss")
       for key in ("initial_scale_power", "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                   "min_loss_scale")},
}

# DeepSpeed's torch_autocast (a plain dict there, so not strict): the forward under torch.autocast, weights and
# gradients in fp32. dtype: DeepSpeed's dtype spellings of fp16 and bf16; absent, torch's default for the device.
TORCH_AUTOCAST = {
    "enabled": _bool(False),
    "dtype": Key("str_or_null", None),
    "lower_precision_safe_modules": Key("str_list", None),
}

ZERO = {
    "stage": _int(0, 0, 3),
    "overlap_comm": Key("bool", None),
    "reduce_scatter": _bool(True),
    "reduce_bucket_size": _elements(500_000_000, auto=True),
    "allgather_bucket_size": _elements(500_000_000),
    "ignore_unused_parameters": _bool(True),
    "stage3_prefetch_bucket_size": _elements(50_000_000, auto=True),
    "stage3_param_persistence_threshold": _elements(100_000, auto=True),
    "stage3_max_live_parameters": _elements(1_000_000_000),
    "stage3_gather_16bit_weights_on_model_save": _bool(False),
    "sub_group_size": _int(1_000_000_000, 0),
    "offload_optimizer": Key("section"),
    "offload_param": Key("section"),
    "zero_quantized_weights": _bool(False),
    "zero_quantized_nontrainable_weights": _bool(False),
    "zero_hpz_partition_size": _int(1, 0),
    "zero_quantized_gradients": _bool(False),
    "zeropp_loco_param": Key("section"),
    "leaf_module": Key("section"),  # DeepSpeed's ZeRO-3 leaf modules: zkern's stage3_fetch_units
    # zkern's own
    "stage3_fetch_units": Key("str_list", ()),
    "stage3_merge_divergent_modules": _bool(True),
    "keep_gradient_buffers": _bool(False),
    "stage3_keep_working_shard": _bool(False),
    "zeropp_weight_group_size": _int(2048, 2),
    "zeropp_grad_group_size": _int(64, 2),
    # DeepSpeed's short names (pydantic aliases, populate_by_name)
    "prefetch_bucket_size": Alias("stage3_prefetch_bucket_size"),
    "param_persistence_threshold": Alias("stage3_param_persistence_threshold"),
    "max_live_parameters": Alias("stage3_max_live_parameters"),
    "gather_16bit_weights_on_model_save": Alias("stage3_gather_16bit_weights_on_model_save"),
    "max_reuse_distance": Alias("stage3_max_reuse_distance"),
    "model_persistence_threshold": Alias("stage3_model_persistence_threshold"),
    "module_granularity_threshold": Alias("stage3_module_granularity_threshold"),
    "use_all_reduce_for_fetch_params": Alias("stage3_use_all_reduce_for_fetch_params"),
    "allgather_sequential": Alias("stage3_allgather_sequential"),
    # asking for nothing zkern does differently
    "contiguous_gradients": Inert("zkern always reduces from contiguous buckets, at no extra memory"),
    "round_robin_gradients": Inert("zkern's reduction schedule is already the same for every rank and balanced"),
    "stage3_max_reuse_distance": Inert("zkern frees a unit when no module holds it (its lifecycle), not by distance"),
    "stage3_model_persistence_threshold": Inert("zkern keeps whole the units below "
                                                "stage3_param_persistence_threshold and caps nothing else"),
    "stage3_module_granularity_threshold": Inert("zkern's fetch units are modules already; "
                                                 "stage3_param_persistence_threshold merges the small ones"),
    "stage3_use_all_reduce_for_fetch_params": Inert("another collective for the same gather"),
    "stage3_allgather_sequential": Inert("another ordering of the same gathers"),
    "use_multi_rank_bucket_allreduce": Inert("another collective for the same reduction"),
    "allgather_partitions": Inert("another collective (broadcast) for the same all-gather"),
    "compute_grad_norm": Inert("zkern computes the norm in the same pass as the overflow check, always"),
    "load_from_fp32_weights": Inert("zkern checkpoints keep fp32 masters and always load them"),
    "elastic_checkpoint": Inert("every zkern checkpoint loads at any world size, stage and offload"),
    "memory_efficient_linear": Inert("zkern gathers parameters per module; activations are the model's"),
    "pipeline_loading_checkpoint": Inert("only DeepSpeed's pipeline engine reads it"),
    "override_module_apply": Inert("zkern does not patch Module.apply"),
    "log_trace_cache_warnings": Inert("zkern says once when a pass departs from its recorded order"),
    "enable_sanity_checks": Inert("zkern checks its stage-3 invariants at the end of every pass, always"),
    "save_muon_momentum_buffer_in_memory": _bool(False),
    "parameter_alignment": Inert("zkern pads every chunk to 64 elements (16-byte aligned) itself"),
    "legacy_stage1": DefaultOnly(False, "DeepSpeed's legacy stage 1"),
    "mics_shard_size": DefaultOnly(-1, f"MiCS, {REMOVED_UPSTREAM}"),
    "mics_hierarchical_params_gather": DefaultOnly(False, f"MiCS, {REMOVED_UPSTREAM}"),
    "zenflow": SectionOff("ZenFlow"),
}
OFFLOAD = {
    "offload_optimizer": {
        "device": Key("str", "none"), "pin_memory": _bool(True), "nvme_path": Key("str_or_null", None),
        "buffer_count": _int(4, 0), "fast_init": _bool(False),
        "pipeline_read": Inert("zkern's NVMe step always reads the next tile while one steps"),
        "pipeline_write": Inert("zkern's NVMe step always writes the last tile while one steps"),
        "pipeline": Inert("zkern's NVMe step is always pipelined"),
        # DeepSpeed's (SuperOffload's): the share of the CPU Adam's threads the host Adam takes where it runs beside
        # the training thread (the speculative step, the delayed update); the step's own Adam takes them all
        "cpuadam_cores_perc": _float(0.8, 0.0, 1.0),
        # DeepSpeed's partial offload (Twin-Flow): the share of each rank's optimizer shard on the host, the rest
        # stepped on the device (offload/store.py SplitShard)
        "ratio": _float(1.0, 0.0, 1.0),
        # SuperOffload's speculative CPU step: zkern's speculative_step (below), which it turns on
        "super_offload": _bool(False),
        # zkern's own: each gradient chunk is copied to the host as its reduction lands in the boundary's backward
        # (false: all of them when step() is called)
        "copy_grads_during_backward": _bool(True),
        # zkern's own: ZeRO-Offload's delayed parameter update (DPU): step i's host Adam runs in the background
        # through step i+1's forward and backward, and its parameters reach the model at step i+1's step()
        "delayed_update": _bool(False),
        # zkern's own: each gradient chunk's host Adam runs in the boundary's backward as the chunk lands, guessing
        # the step applies unclipped; step() keeps it, or restores the chunks' saved state and steps them again
        "speculative_step": _bool(False),
        # zkern's own: host staging as a ring of this many chunk-sized buffers, not the whole shard (0: one buffer
        # per chunk); used where each chunk's buffer stages both ways and zkern's Adam steps chunk by chunk
        "staging_chunks": _int(4, 0),
    },
    "offload_param": {
        "device": Key("str", "none"), "pin_memory": _bool(True), "nvme_path": Key("str_or_null", None),
        "buffer_count": _int(5, 0), "buffer_size": _int(100_000_000, 0), "max_in_cpu": _int(1_000_000_000, 0),
    },
}
LOCO = {"err_beta": _float(0.8, 0.0, 1.0), "reset_T": _int(1024, 1)}
LEAF_MODULE = {"classes": Key("str_list", ()), "names": Key("str_list", ()), "name_suffixes": Key("str_list", ())}
ACTIVATION_CHECKPOINTING = {
    "partition_activations": _bool(False), "cpu_checkpointing": _bool(False),
    "contiguous_memory_optimization": _bool(False), "number_checkpoints": Key("int_or_null", None, 1),
    "synchronize_checkpoint_boundary": _bool(False), "profile": _bool(False),
}
DATA_TYPES = {
    "grad_accum_dtype": Key("dtype_or_null", None),
    "param_dtype": DefaultOnly(None, "a parameter dtype apart from fp16/bf16"),
    "buffer_dtype": DefaultOnly(None, "a buffer dtype apart from the model's"),
    "keep_in_fp32_modules": DefaultOnly("auto", "modules kept in fp32 under 16-bit training"),
}
# DeepSpeed's aio section: zkern's reader is a thread pool over pread/pwrite (cpu/aio.py). thread_count is
# DeepSpeed's older name of intra_op_parallelism.
AIO = {
    "block_size": _int(1_048_576, 1), "queue_depth": _int(8, 1), "thread_count": _int(1, 1),
    "intra_op_parallelism": _int(1, 1),
    # libaio submission and completion modes a thread pool does not have (parsed; a value other than the default is
    # said once in the log)
    "single_submit": _bool(False), "overlap_events": _bool(True),
    "use_gds": DefaultOnly(False, "GPUDirect Storage"),
}
FLOPS_PROFILER = {
    "enabled": _bool(False), "profile_step": _int(1, 1), "module_depth": _int(-1, -1), "top_modules": _int(1, 1),
    "detailed": _bool(True), "output_file": Key("str_or_null", None), "recompute_fwd_factor": _float(0.0, 0.0),
}
COMMS_LOGGER = {"enabled": _bool(False), "prof_all": _bool(True), "prof_ops": Key("str_list", ()),
                "verbose": _bool(False), "debug": _bool(False)}
MONITOR_FILES = {"enabled": _bool(False), "output_path": Key("str", ""), "job_name": Key("str", "DeepSpeedJobName")}
WANDB = {"enabled": _bool(False), "group": Key("str_or_null", None), "team": Key("str_or_null", None),
         "project": Key("str", "deepspeed")}
COMET = {"enabled": _bool(False), "samples_log_interval": _int(100, 1), "project": Key("str_or_null", None),
         "workspace": Key("str_or_null", None), "api_key": Key("str_or_null", None),
         "experiment_name": Key("str_or_null", None), "experiment_key": Key("str_or_null", None),
         "online": Key("json", None), "mode": Key("str_or_null", None)}
CHECKPOINT = {
    "tag_validation": Key("str", "Warn"),
    "load_universal": Inert("every zkern checkpoint is universal: it loads at any world size, stage and offload"),
    "use_node_local_storage": _bool(False),
    "parallel_write": Inert("zkern's ranks always write their files in parallel"),
    "serialization": Inert("zkern writes safetensors and JSON"),
    "writer": Inert("zkern's writer is its own (async_save=True writes in a thread)"),
}

OPTIMIZER_PARAMS = {
    # every optimizer: what a param-group dict may set too
    "lr": _float(1e-3, 0.0), "weight_decay": _float(0.0, 0.0),
}
ADAM_PARAMS = {**OPTIMIZER_PARAMS, "betas": Key("betas", (0.9, 0.999)), "eps": _float(1e-8, 0.0),
               "adam_w_mode": _bool(True), "torch_adam": _bool(False),
               "amsgrad": DefaultOnly(False, "AMSGrad"), "bias_correction": DefaultOnly(True, "Adam without bias "
                                                                                           "correction"),
               "fused": Inert("zkern's Adam is fused (one pass per chunk)")}
LAMB_PARAMS = {**OPTIMIZER_PARAMS, "betas": Key("betas", (0.9, 0.999)), "eps": _float(1e-8, 0.0),
               "max_coeff": _float(10.0, 0.0), "min_coeff": _float(0.01, 0.0),
               "bias_correction": _bool(True)}
LION_PARAMS = {**OPTIMIZER_PARAMS, "betas": Key("betas", (0.9, 0.99))}
SGD_PARAMS = {**OPTIMIZER_PARAMS, "momentum": _float(0.0, 0.0), "dampening": _float(0.0),
              "nesterov": _bool(False), "maximize": _bool(False)}
ADAGRAD_PARAMS = {**OPTIMIZER_PARAMS, "lr_decay": _float(0.0, 0.0), "eps": _float(1e-10, 0.0),
                  "initial_accumulator_value": _float(0.0, 0.0)}
# DeepSpeed's MuonWithAuxAdam: lr for both halves unless muon_lr / adam_lr say otherwise (their defaults 0.02 and
# 3e-4 where neither is given); momentum and ns_method for the Muon half, betas and eps for the AdamW half
MUON_PARAMS = {"lr": Key("float_or_null", None, 0.0), "weight_decay": _float(0.0, 0.0),
               "muon_lr": Key("float_or_null", None, 0.0), "adam_lr": Key("float_or_null", None, 0.0),
               "momentum": _float(0.95, 0.0, 1.0), "ns_method": Key("str", "gram"),
               "ns_steps": _int(5, 1, 99), "nesterov": _bool(True),
               "betas": Key("betas", (0.9, 0.95)), "eps": _float(1e-10, 0.0),
               "per_head_muon": DefaultOnly(False, "per-head Muon (zkern orthogonalizes each matrix whole)")}
MUON_DEFAULT_LR, MUON_ADAM_DEFAULT_LR = 0.02, 3e-4
OPTIMIZERS = {"adam": ADAM_PARAMS, "adamw": ADAM_PARAMS, "lamb": LAMB_PARAMS, "lion": LION_PARAMS,
              "sgd": SGD_PARAMS, "adagrad": ADAGRAD_PARAMS, "muon": MUON_PARAMS}
# DeepSpeed's own optimizers zkern does not have (DeepSpeed also takes any torch.optim class name: zkern does for
# the element-wise ones above)
MISSING_OPTIMIZERS = {"muadam", "muadamw", "musgd", "cpuadam", "fusedadam", "fusedlamb"}
REMOVED_OPTIMIZERS = {"onebitadam": "1-bit Adam", "zerooneadam": "0/1 Adam", "onebitlamb": "1-bit LAMB"}

_LAST = {"last_batch_iteration": _int(-1, -1)}
# WarmupLR's warmup_max_lr defaults to each param group's own lr (DeepSpeed 0.19), WarmupDecayLR's to 1e-3.
_WARMUP = {"warmup_min_lr": _float(0.0, 0.0), "warmup_max_lr": Key("float_or_null", None, 0.0),
           "warmup_num_steps": _int(1000, 0), "warmup_type": Key("str", "log"), **_LAST}
SCHEDULERS = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {**_WARMUP, "warmup_max_lr": _float(1e-3, 0.0), "total_num_steps": _int(None, 1)},
    "WarmupCosineLR": {"total_num_steps": _int(None, 1), "warmup_min_ratio": _float(0.0, 0.0, 1.0),
                       "warmup_num_steps": _int(1000, 0), "cos_min_ratio": _float(0.0001, 0.0, 1.0),
                       "warmup_type": Key("str", "log"), **_LAST},
    "OneCycle": {"cycle_min_lr": _float(None, 0.0), "cycle_max_lr": _float(None, 0.0),
                 "decay_lr_rate": _float(0.0, 0.0), "cycle_first_step_size": _int(2000, 1),
                 "cycle_second_step_size": Key("int_or_null", None, 0), "cycle_first_stair_count": _int(0, 0),
                 "cycle_second_stair_count": Key("int_or_null", None, 0), "decay_step_size": _int(0, 0),
                 "cycle_momentum": _bool(True), "cycle_min_mom": _float(0.8, 0.0, 1.0),
                 "cycle_max_mom": _float(0.9, 0.0, 1.0), "decay_mom_rate": _float(0.0, 0.0), **_LAST},
    "LRRangeTest": {"lr_range_test_min_lr": _float(1e-3, 0.0), "lr_range_test_step_size": _int(2000, 1),
                    "lr_range_test_step_rate": _float(1.0, 0.0), "lr_range_test_staircase": _bool(False), **_LAST},
}

# Sections whose unknown keys are errors (DeepSpeed's pydantic models forbid extras); elsewhere a warning.
STRICT = {"fp16", "bf16", "zero_optimization", "zero_optimization.offload_optimizer",
          "zero_optimization.offload_param", "activation_checkpointing", "comms_logger", "tensorboard",
          "csv_monitor", "wandb", "comet", "zero_optimization.zeropp_loco_param", "zero_optimization.leaf_module",
          "optimizer.params", "scheduler.params"}

SECTIONS: dict[str, dict] = {
    "": TOP, "fp16": FP16, "bf16": BF16, "torch_autocast": TORCH_AUTOCAST, "zero_optimization": ZERO,
    "zero_optimization.offload_optimizer": OFFLOAD["offload_optimizer"],
    "zero_optimization.offload_param": OFFLOAD["offload_param"],
    "zero_optimization.zeropp_loco_param": LOCO, "zero_optimization.leaf_module": LEAF_MODULE,
    "activation_checkpointing": ACTIVATION_CHECKPOINTING, "data_types": DATA_TYPES, "aio": AIO,
    "flops_profiler": FLOPS_PROFILER, "comms_logger": COMMS_LOGGER, "tensorboard": MONITOR_FILES,
    "csv_monitor": MONITOR_FILES, "wandb": WANDB, "comet": COMET, "checkpoint": CHECKPOINT,
}


def all_known_paths() -> list[str]:
    """Every key path zkern knows (for 'did you mean' across sections)."""
    out = []
    for section, keys in SECTIONS.items():
        out += [f"{section}.{k}" if section else k for k in keys]
    for table in OPTIMIZERS.values():
        out += [f"optimizer.params.{k}" for k in table]
    for table in SCHEDULERS.values():
        out += [f"scheduler.params.{k}" for k in table]
    return sorted(set(out))


MAXSIZE = sys.maxsize
