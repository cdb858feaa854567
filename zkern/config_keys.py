"""zkern's config key tables: every DeepSpeed key zkern knows, its kind and its default, and the DeepSpeed keys
zkern knows but does not implement (accepted only at the default that asks for nothing). zkern.config parses
against them.

A spec is (kind, default); kind is one of "int", "int_or_null", "float", "bool", "str", "str_list", "betas",
"dtype_or_null" ("fp32", "fp16", "bf16" or torch's names for them), "section", with "_auto" appended where the
value may be "auto".
"""

AUTO = "auto"  # a value zkern fills in from the world size and the model (Config.resolve)


IMPLEMENTED_TOP = {
    "train_batch_size": ("int_auto", None),
    "train_micro_batch_size_per_gpu": ("int_auto", None),
    "gradient_accumulation_steps": ("int_auto", None),
    "gradient_clipping": ("float", 0.0),
    "optimizer": ("section", None),
    "scheduler": ("section", None),
    "fp16": ("section", None),
    "bf16": ("section", None),
    "bfloat16": ("section", None),  # DeepSpeed's older spelling of bf16
    "zero_optimization": ("section", None),
    "steps_per_print": ("int", 10),
    "zero_allow_untested_optimizer": ("bool", False),
    "comm_timeout_s": ("float", 600.0),
    "device": ("str", "auto"),
    # zkern's own: ranks per node, for comm_stats()' intra/inter split and qgZ's first hop (None: the launcher's
    # LOCAL_WORLD_SIZE, else the world: one node)
    "ranks_per_node": ("int_or_null", None),
    "activation_checkpointing": ("section", None),
    # Gradient numerics (DeepSpeed's meanings): divide by the factor before the sum and by world/factor after it
    # (zkern's default when absent: the world size, the whole average before the sum); the dtype of the reduction.
    "gradient_predivide_factor": ("float", None),
    "communication_data_type": ("dtype_or_null", None),
    "data_types": ("section", None),
    "aio": ("section", None),  # the NVMe reader (offload device "nvme"): AIO_KEYS
}
DATA_TYPES_KEYS = {"grad_accum_dtype": ("dtype_or_null", None)}

FP16_KEYS = {
    "enabled": ("bool", False),
    "loss_scale": ("float", 0.0),
    "initial_scale_power": ("int", 16),
    "loss_scale_window": ("int", 1000),
    "hysteresis": ("int", 2),
    "consecutive_hysteresis": ("bool", False),
    "min_loss_scale": ("float", 1.0),
}
BF16_KEYS = {"enabled": ("bool", False)}
ZERO_KEYS = {
    "stage": ("int", 0),
    "overlap_comm": ("bool", None),
    "contiguous_gradients": ("bool", True),
    "reduce_scatter": ("bool", True),
    "reduce_bucket_size": ("int_auto", 500_000_000),
    "allgather_bucket_size": ("int", 500_000_000),
    "ignore_unused_parameters": ("bool", True),
    "stage3_prefetch_bucket_size": ("int_auto", 50_000_000),
    "stage3_param_persistence_threshold": ("int_auto", 100_000),
    "stage3_max_live_parameters": ("int", 1_000_000_000),
    "stage3_gather_16bit_weights_on_model_save": ("bool", False),
    "stage3_gather_fp16_weights_on_model_save": ("bool", False),  # DeepSpeed's older name of the key above
    "stage3_fetch_units": ("str_list", ()),  # zkern's own: module class names gathered as one unit each
    # zkern's own: when ranks would gather different units (routed experts), gather their container whole
    "stage3_merge_divergent_modules": ("bool", True),
    # Elements per tile of the NVMe optimizer step (offload_optimizer.device "nvme"); no effect otherwise
    "sub_group_size": ("int", 1_000_000_000),
    "offload_optimizer": ("section", None),  # parsed by _parse_offload
    "offload_param": ("section", None),
    # ZeRO++ (engine/zeropp.py): int8 weight all-gather (stage 3), secondary partition over groups of k ranks
    # (stage 3), int4 two-hop gradient all-to-all (stages 2 and 3) with LoCo error feedback.
    "zero_quantized_weights": ("bool", False),
    "zero_quantized_nontrainable_weights": ("bool", False),  # frozen units rest as int8 (stage 3)
    "zero_hpz_partition_size": ("int", 1),
    "zero_quantized_gradients": ("bool", False),
    "zeropp_loco_param": ("section", None),  # {"err_beta": 0.8, "reset_T": 1024}
    # zkern's own: elements per fp32 scale of qwZ's int8 weights and of qgZ's int4 gradients (powers of two)
    "zeropp_weight_group_size": ("int", 2048),
    "zeropp_grad_group_size": ("int", 64),
}
LOCO_KEYS = {"err_beta": ("float", 0.8), "reset_T": ("int", 1024)}
# DeepSpeed's activation_checkpointing section (zkern.checkpointing); number_checkpoints may be null.
ACTIVATION_CHECKPOINTING_KEYS = {
    "partition_activations": ("bool", False),
    "cpu_checkpointing": ("bool", False),
    "contiguous_memory_optimization": ("bool", False),
    "number_checkpoints": ("int_or_null", None),
    "synchronize_checkpoint_boundary": ("bool", False),
    "profile": ("bool", False),
}
OFFLOAD_KEYS = {
    "offload_optimizer": {"device": ("str", "none"), "pin_memory": ("bool", False),
                          # device "nvme": the directory of the state files, the tile buffer sets (>= 3), and
                          # DeepSpeed's faster start (zkern's start is always the fast one: see engine/nvme.py)
                          "nvme_path": ("str_or_null", None), "buffer_count": ("int", 4), "fast_init": ("bool", False)},
    # device "nvme" (stage 3): the directory of the parameter file, the reads in flight ahead of use (count and
    # elements), and the elements of parameter chunks kept in host memory
    "offload_param": {"device": ("str", "none"), "pin_memory": ("bool", False), "nvme_path": ("str_or_null", None),
                      "buffer_count": ("int", 5), "buffer_size": ("int", 100_000_000),
                      "max_in_cpu": ("int", 1_000_000_000)},
}
# DeepSpeed's aio section: zkern's reader is a thread pool over pread/pwrite (cpu/aio.py). thread_count is
# DeepSpeed's older name of intra_op_parallelism; single_submit and overlap_events choose libaio submission modes
# that a thread pool does not have (accepted; a value other than the default is said once in the log).
AIO_KEYS = {
    "block_size": ("int", 1_048_576),
    "queue_depth": ("int", 8),
    "thread_count": ("int", 1),
    "intra_op_parallelism": ("int", 1),
    "single_submit": ("bool", False),
    "overlap_events": ("bool", True),
}
NOT_IMPLEMENTED_AIO = {"use_gds": False}
# DeepSpeed's partial-offload and pipelining keys: accepted at their defaults only.
NOT_IMPLEMENTED_OFFLOAD = {
    "offload_optimizer": {"ratio": 1.0, "pipeline": False, "pipeline_read": False, "pipeline_write": False},
    "offload_param": {},
}
ADAM_PARAMS = {
    "lr": ("float", 1e-3),
    "betas": ("betas", (0.9, 0.999)),
    "eps": ("float", 1e-8),
    "weight_decay": ("float", 0.0),
    "adam_w_mode": ("bool", True),
    "torch_adam": ("bool", False),
}
SCHEDULER_PARAMS = {
    "WarmupLR": {
        "warmup_min_lr": ("float", 0.0),
        "warmup_max_lr": ("float", 1e-3),
        "warmup_num_steps": ("int", 1000),
        "warmup_type": ("str", "log"),
    },
}
SCHEDULER_PARAMS["WarmupDecayLR"] = {**SCHEDULER_PARAMS["WarmupLR"], "total_num_steps": ("int", None)}

# DeepSpeed keys zkern knows but does not implement, with the DeepSpeed default value that asks for nothing.
# SECTION_OFF: a section accepted only when it says {"enabled": false} (or is empty).
SECTION_OFF = object()
NOT_IMPLEMENTED_TOP = {
    "prescale_gradients": False,
    "sparse_gradients": False,
    "wall_clock_breakdown": False,
    "memory_breakdown": False,
    "dump_state": False,
    "disable_allgather": False,
    "seq_parallel_communication_data_type": None,
    "dataloader_drop_last": False,
    "zero_force_ds_cpu_optimizer": True,
    "graph_harvesting": False,
    "use_data_before_expert_parallelism": False,
    "flops_profiler": SECTION_OFF,
    "tensorboard": SECTION_OFF,
    "wandb": SECTION_OFF,
    "csv_monitor": SECTION_OFF,
    "comet": SECTION_OFF,
    "comms_logger": SECTION_OFF,
    "amp": SECTION_OFF,
    "sparse_attention": SECTION_OFF,
    "data_efficiency": SECTION_OFF,
    "curriculum_learning": SECTION_OFF,
    "elasticity": SECTION_OFF,
    "autotuning": SECTION_OFF,
    "nebula": SECTION_OFF,
    "eigenvalue": SECTION_OFF,
    "progressive_layer_drop": SECTION_OFF,
    "hybrid_engine": SECTION_OFF,
    "compression_training": SECTION_OFF,
    "pipeline": SECTION_OFF,
    "checkpoint": SECTION_OFF,
    "quantize_training": SECTION_OFF,
    "weight_quantization": SECTION_OFF,
    "timers": SECTION_OFF,
}
NOT_IMPLEMENTED_FP16 = {"auto_cast": False, "fp16_master_weights_and_grads": False}
NOT_IMPLEMENTED_BF16 = {
    "immediate_grad_update": False,
    "check_grad_overflow": False,
    "bf16_master_weights_and_grads": False,
    "bf16_optimizer_states": False,
}
NOT_IMPLEMENTED_ZERO = {
    # Not implemented: only their defaults pass.
    "stage3_max_reuse_distance": 1_000_000_000,
    "stage3_module_granularity_threshold": 0,
    "allgather_partitions": True,
    "round_robin_gradients": False,
    "elastic_checkpoint": False,
    "load_from_fp32_weights": True,
    "use_multi_rank_bucket_allreduce": True,
    "cpu_offload": False,
    "cpu_offload_params": False,
    "cpu_offload_use_pin_memory": False,
    "memory_efficient_linear": True,
    "mics_shard_size": -1,
    "mics_hierarchical_params_gather": False,
    "legacy_stage1": False,
    "pipeline_loading_checkpoint": False,
    "override_module_apply": True,
    "log_trace_cache_warnings": False,
}
NOT_IMPLEMENTED_OPTIMIZER_PARAMS = {"amsgrad": False, "bias_correction": True}
NOT_IMPLEMENTED_OPTIMIZERS = {"lamb", "onebitadam", "zerooneadam", "onebitlamb", "adagrad", "lion", "muadam",
                               "muadamw", "musgd", "sgd", "cpuadam", "fusedadam"}
NOT_IMPLEMENTED_SCHEDULERS = {"LRRangeTest", "OneCycle", "WarmupCosineLR"}

ALL_KNOWN_PATHS = (
    [*IMPLEMENTED_TOP, *NOT_IMPLEMENTED_TOP]
    + [f"fp16.{k}" for k in [*FP16_KEYS, *NOT_IMPLEMENTED_FP16]]
    + [f"bf16.{k}" for k in [*BF16_KEYS, *NOT_IMPLEMENTED_BF16]]
    + [f"zero_optimization.{k}" for k in [*ZERO_KEYS, *NOT_IMPLEMENTED_ZERO]]
    + [f"activation_checkpointing.{k}" for k in ACTIVATION_CHECKPOINTING_KEYS]
    + [f"zero_optimization.zeropp_loco_param.{k}" for k in LOCO_KEYS]
    + [f"data_types.{k}" for k in DATA_TYPES_KEYS]
    + [f"aio.{k}" for k in [*AIO_KEYS, *NOT_IMPLEMENTED_AIO]]
    + [f"zero_optimization.{name}.{k}" for name, specs in OFFLOAD_KEYS.items() for k in specs]
    + [f"optimizer.params.{k}" for k in [*ADAM_PARAMS, *NOT_IMPLEMENTED_OPTIMIZER_PARAMS]]
)
