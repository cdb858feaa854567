import json

import pytest

from zkern import Config, ConfigError


def load(**kw):
    return Config.load({"train_micro_batch_size_per_gpu": 1, **kw})


def test_defaults_are_deepspeed_code_defaults():
    cfg = load().resolve(world_size=1)
    assert cfg.gradient_clipping == 1.0  # DeepSpeed's since 0.19.2 (it was 0.0), named in the start-up block
    assert ("gradient_clipping", "1.0 (absent: DeepSpeed's default since 0.19.2; 0 turns clipping off)") in \
        cfg.notes.filled
    assert cfg.zero_optimization.stage == 0
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.zero_optimization.allgather_bucket_size == 500_000_000
    assert cfg.zero_optimization.contiguous_gradients is True
    assert cfg.zero_optimization.reduce_scatter is True
    assert cfg.zero_optimization.overlap_comm is False  # code default: stage == 3
    assert cfg.fp16 == type(cfg.fp16)(enabled=False, loss_scale=0.0, initial_scale_power=16, loss_scale_window=1000,
                                      hysteresis=2, consecutive_hysteresis=False, min_loss_scale=1.0)
    assert cfg.comm_timeout_s == 600.0
    assert cfg.precision == "fp32"


def test_optimizer_adam_is_decoupled_unless_adam_w_mode_false():
    assert load(optimizer={"type": "Adam", "params": {"lr": 0.1}}).optimizer.adamw is True
    o = load(optimizer={"type": "Adam", "params": {"adam_w_mode": False}}).optimizer
    assert o.adamw is False and o.lr == 1e-3 and o.weight_decay == 0.0 and o.betas == (0.9, 0.999)
    o = load(optimizer={"type": "AdamW", "params": {"betas": [0.8, 0.9], "eps": 1e-6, "weight_decay": 0.1}}).optimizer
    assert o.adamw and o.betas == (0.8, 0.9) and o.eps == 1e-6 and o.weight_decay == 0.1


@pytest.mark.parametrize("keys, world, expect", [
    (dict(train_batch_size=32, train_micro_batch_size_per_gpu=4), 2, (32, 4, 4)),
    (dict(train_batch_size=32, gradient_accumulation_steps=2), 4, (32, 4, 2)),
    (dict(train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=5), 2, (30, 3, 5)),
    (dict(train_batch_size=8), 4, (8, 2, 1)),
    (dict(train_micro_batch_size_per_gpu=3), 2, (6, 3, 1)),
    (dict(train_batch_size=24, train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=2), 4, (24, 3, 2)),
    (dict(train_batch_size=24, train_micro_batch_size_per_gpu="auto", gradient_accumulation_steps=2), 4, (24, 3, 2)),
])
def test_batch_arithmetic_any_two_give_the_third(keys, world, expect):
    cfg = Config.load(keys).resolve(world_size=world)
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps) == expect


@pytest.mark.parametrize("keys, world, message", [
    (dict(train_batch_size=30, train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2), 4,
     "'train_batch_size' (30) != 'train_micro_batch_size_per_gpu' (4) x 'gradient_accumulation_steps' (2) x world "
     "size (4) = 32"),
    (dict(train_batch_size=30, train_micro_batch_size_per_gpu=4), 2, "not divisible by "
     "'train_micro_batch_size_per_gpu' (4) x world size (2) = 8"),
    (dict(train_batch_size=30, gradient_accumulation_steps=4), 2, "(4) x world size (2) = 8"),
    (dict(train_batch_size=7), 2, "'train_batch_size' (7) is not divisible by the world size (2)"),
    (dict(gradient_accumulation_steps=2), 1, "set 'train_batch_size' or 'train_micro_batch_size_per_gpu'"),
    (dict(train_batch_size="auto", train_micro_batch_size_per_gpu="auto"), 1, "can derive one of the three"),
])
def test_batch_arithmetic_errors_show_the_arithmetic(keys, world, message):
    with pytest.raises(ConfigError) as e:
        Config.load(keys).resolve(world_size=world)
    assert message in str(e.value)


def test_unknown_key_names_path_and_nearest():
    with pytest.raises(ConfigError, match=r"unknown config key 'zero_optimization.reduce_bucket_sise'; did you mean "
                                          r"'zero_optimization.reduce_bucket_size'"):
        load(zero_optimization={"reduce_bucket_sise": 5})
    with pytest.raises(ConfigError, match=r"unknown config key 'gradient_cliping'; did you mean 'gradient_clipping'"):
        load(gradient_cliping=1.0)
    # a key at the wrong level points to where it belongs
    with pytest.raises(ConfigError, match=r"unknown config key 'stage'; did you mean 'zero_optimization.stage'"):
        load(stage=2)
    with pytest.raises(ConfigError, match=r"unknown config key 'fp16.initial_scale_pow'; did you mean "
                                          r"'fp16.initial_scale_power'"):
        load(fp16={"initial_scale_pow": 8})


def test_deepspeed_keys_are_accepted_when_they_ask_for_nothing_else_and_refused_when_they_do():
    cfg = load(zero_optimization={"stage": 2, "offload_optimizer": {"device": "none"}, "round_robin_gradients": True,
                                  "stage3_max_reuse_distance": 5, "stage3_module_granularity_threshold": 5,
                                  "stage3_prefetch_bucket_size": "auto"},
               tensorboard={"enabled": False}, fp16={"enabled": False, "auto_cast": False},
               bf16={"immediate_grad_update": True}, compile={"deepcompile": False}, tensor_parallel={"autotp_size": 1})
    assert cfg.zero_optimization.stage == 2
    inert = dict(cfg.notes.inert)
    for path in ("zero_optimization.round_robin_gradients", "zero_optimization.stage3_max_reuse_distance",
                 "bf16.immediate_grad_update", "compile", "tensor_parallel"):
        assert path in inert, path  # said in the start-up block
    cases = [
        (dict(fp16={"fp16_master_weights_and_grads": True}),
         "'fp16.fp16_master_weights_and_grads' = true asks for fp16 master weights"),
        (dict(optimizer={"type": "Adam", "params": {"amsgrad": True}}), "'optimizer.params.amsgrad' = true"),
        (dict(tensor_parallel={"autotp_size": 2}), "'tensor_parallel' asks for tensor parallelism"),
        (dict(pipeline={"stages": 2}), "'pipeline' asks for pipeline parallelism"),
        (dict(zero_optimization={"mics_shard_size": 8}), "asks for MiCS"),
    ]
    for keys, text in cases:
        with pytest.raises(ConfigError) as e:
            load(**keys)
        assert text in str(e.value) and "zkern does not implement" in str(e.value), str(e.value)


def test_keys_that_are_not_deepspeeds_warn_and_near_misses_are_errors():
    cfg = load(comms_config={"x": 1}, monitor_config={}, zero3_init_flag=True, _comment="a note")
    warned = [path for path, _ in cfg.notes.warned]
    assert warned == ["comms_config", "monitor_config", "zero3_init_flag", "_comment"]
    for keys, near in [(dict(zero_optimisation={"stage": 2}), "zero_optimization"),
                       (dict(gradient_acumulation_steps=2), "gradient_accumulation_steps"),
                       (dict(zero_optimization={"reduce_bucket_sise": 5}), "zero_optimization.reduce_bucket_size"),
                       (dict(stage=3), "zero_optimization.stage"),
                       (dict(fp16={"initial_scale_pow": 3}), "fp16.initial_scale_power")]:
        with pytest.raises(ConfigError, match=rf"did you mean '{near}'"):
            load(**keys)
    with pytest.raises(ConfigError, match="unknown config key 'zero_optimization.fancy'; known keys here"):
        load(zero_optimization={"fancy": 1})  # DeepSpeed's section model refuses extras too


def test_spellings_deepspeed_accepts_are_read_as_their_keys():
    cfg = load(zero_optimization={"stage": 3, "prefetch_bucket_size": 7, "param_persistence_threshold": 8,
                                  "max_live_parameters": 9, "gather_16bit_weights_on_model_save": True,
                                  "cpu_offload": True, "max_reuse_distance": 3},
               bfloat16={"enabled": True})
    zero = cfg.zero_optimization
    assert (zero.stage3_prefetch_bucket_size, zero.stage3_param_persistence_threshold,
            zero.stage3_max_live_parameters, zero.stage3_gather_16bit_weights_on_model_save) == (7, 8, 9, True)
    assert zero.offload_optimizer_device == "cpu" and cfg.precision == "bf16"
    assert load(zero_optimization={"stage": 3, "stage3_gather_fp16_weights_on_model_save": True}) \
        .zero_optimization.stage3_gather_16bit_weights_on_model_save
    assert load(zero_optimization=True).zero_optimization.stage == 1  # DeepSpeed's oldest form
    assert load(zero_optimization={"stage": 3, "leaf_module": {"classes": ["transformers.X.MoeBlock"]}}) \
        .zero_optimization.stage3_fetch_units == ("MoeBlock",)
    with pytest.raises(ConfigError, match="set the same key"):
        load(zero_optimization={"prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2})
    with pytest.raises(ConfigError, match="'bf16' and 'bfloat16' are both set"):
        load(bf16={"enabled": True}, bfloat16={"enabled": True})
    with pytest.raises(ConfigError, match="cpu_offload' .deprecated. and 'zero_optimization.offload_optimizer'"):
        load(zero_optimization={"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}})


def test_stage3_keys_and_optimizers_and_schedulers():
    zero = load(zero_optimization={"stage": 3, "stage3_fetch_units": ["Block"], "stage3_max_live_parameters": 1e8,
                                   "stage3_gather_16bit_weights_on_model_save": True}).resolve(1).zero_optimization
    assert zero.stage == 3 and zero.stage3_fetch_units == ("Block",) and zero.stage3_max_live_parameters == 10**8
    assert zero.overlap_comm is True  # DeepSpeed's code default for stage 3
    assert zero.stage3_prefetch_bucket_size == 50_000_000 and zero.stage3_param_persistence_threshold == 100_000
    with pytest.raises(ConfigError, match="stage3_fetch_units' must be a list of names"):
        load(zero_optimization={"stage": 3, "stage3_fetch_units": "Block"})
    with pytest.raises(ConfigError, match="'zero_optimization.stage' must be from 0 to 3, got 5"):
        load(zero_optimization={"stage": 5})
    assert load(optimizer={"type": "Lamb"}).optimizer.type == "lamb"
    with pytest.raises(ConfigError, match="'Adamm' is unknown; did you mean 'adam'"):
        load(optimizer={"type": "Adamm"})
    assert load(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1}}).scheduler.type \
        == "OneCycle"
    with pytest.raises(ConfigError, match="total_num_steps' is required by WarmupDecayLR"):
        load(scheduler={"type": "WarmupDecayLR", "params": {}})
    with pytest.raises(ConfigError, match="warmup_type' must be \"log\" or \"linear\""):
        load(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cosine"}})


def test_value_errors_name_the_key_and_the_range():
    with pytest.raises(ConfigError, match="'fp16.enabled' and 'bf16.enabled' are both true"):
        load(fp16={"enabled": True}, bf16={"enabled": True})
    with pytest.raises(ConfigError, match="'zero_optimization.overlap_comm' must be true or false, got 'yes'"):
        load(zero_optimization={"overlap_comm": "yes"})
    with pytest.raises(ConfigError, match="'zero_optimization.zero_hpz_partition_size' must be a whole number "
                                          ".>= 0., got 1.5"):
        load(zero_optimization={"zero_hpz_partition_size": 1.5})
    with pytest.raises(ConfigError, match="'zero_optimization.reduce_bucket_size' must be >= 0, got -1"):
        load(zero_optimization={"reduce_bucket_size": -1.5})
    with pytest.raises(ConfigError, match="'gradient_clipping' must be >= 0, got -1"):
        load(gradient_clipping=-1)
    with pytest.raises(ConfigError, match="'optimizer.params.betas' must be a list of two numbers"):
        load(optimizer={"type": "AdamW", "params": {"betas": 0.9}})
    with pytest.raises(ConfigError, match="'comm_timeout_s' must be >= 0.001"):
        load(comm_timeout_s=0)
    with pytest.raises(ConfigError, match="'fp16.min_loss_scale' must be >= 1e-38"):
        load(fp16={"enabled": True, "min_loss_scale": 0})
    with pytest.raises(ConfigError, match="must be a dict, a JSON path or a zkern.Config"):
        Config.load(42)
    # values the config fuzzer found escaping before: NaN in an integer, NaN lr, an absurd scale power
    with pytest.raises(ConfigError, match="'train_micro_batch_size_per_gpu' must be a finite number"):
        Config.load({"train_micro_batch_size_per_gpu": float("nan")})
    with pytest.raises(ConfigError, match="'optimizer.params.lr' must be a finite number"):
        load(optimizer={"type": "AdamW", "params": {"lr": float("nan")}})
    with pytest.raises(ConfigError, match="'fp16.initial_scale_power' must be from 0 to 63, got 10000"):
        load(fp16={"enabled": True, "initial_scale_power": 1e30})


def test_json_float_sizes_bf16_alias_and_json_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},
                                "bfloat16": {"enabled": True}}))
    cfg = Config.load(path)
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000 and cfg.precision == "bf16"
    with pytest.raises(ConfigError, match="does not exist"):
        Config.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        Config.load(tmp_path / "bad.json")


def test_auto_values():
    class Model:
        config = type("C", (), {"hidden_size": 64})()

    cfg = load(zero_optimization={"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                  "stage3_param_persistence_threshold": "auto"}).resolve(world_size=1, model=Model())
    assert cfg.zero_optimization.reduce_bucket_size == 64 * 64
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == int(0.9 * 64 * 64)
    assert cfg.zero_optimization.stage3_param_persistence_threshold == 640
    with pytest.raises(ConfigError, match="model has no config.hidden_size"):
        load(zero_optimization={"reduce_bucket_size": "auto"}).resolve(world_size=1, model=object())
    # "auto" that nothing fills takes DeepSpeed's default, and the start-up block says so
    cfg = load(gradient_clipping="auto", optimizer={"type": "AdamW", "params": {"lr": "auto"}},
               fp16={"enabled": "auto"},
               zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto"})
    assert cfg.gradient_clipping == 1.0 and cfg.optimizer.lr == 1e-3 and not cfg.fp16.enabled
    assert not cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save
    filled = dict(cfg.notes.filled)
    assert {"gradient_clipping", "optimizer.params.lr", "fp16.enabled",
            "zero_optimization.stage3_gather_16bit_weights_on_model_save"} <= set(filled)


def test_what_real_configs_carry_that_deepspeed_took_is_taken_and_said():
    # a count of elements written as a fraction (Hugging Face's "auto" of 0.9 x hidden^2 for hidden 4096, unrounded)
    cfg = load(zero_optimization={"stage": 3, "stage3_prefetch_bucket_size": 15099494.4, "reduce_bucket_size": 5e8})
    assert cfg.zero_optimization.stage3_prefetch_bucket_size == 15099494
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert any("15099494.4 rounded down" in line for line in cfg.notes.lines())
    # fp16's loss-scale keys left in a bf16 section: nothing to scale in bf16, said in the start-up block
    cfg = load(bf16={"enabled": True, "loss_scale_window": 1000, "initial_scale_power": 16, "hysteresis": 2})
    inert = dict(cfg.notes.inert)
    assert {"bf16.loss_scale_window", "bf16.initial_scale_power", "bf16.hysteresis"} <= set(inert)


@pytest.mark.parametrize("section, feature", [
    ({"optimizer": {"type": "OneBitAdam"}}, "1-bit Adam"),
    ({"optimizer": {"type": "ZeroOneAdam"}}, "0/1 Adam"),
    ({"zero_optimization": {"stage": 3, "mics_shard_size": 8}}, "MiCS"),
    ({"compression_training": {"weight_quantization": {"shared_parameters": {"enabled": True}}}}, "compression"),
])
def test_features_deepspeed_removed_are_refused_naming_the_removal(section, feature):
    with pytest.raises(ConfigError, match=f"{feature}.*removed from DeepSpeed in 2026-09"):
        load(**section)
