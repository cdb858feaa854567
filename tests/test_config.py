import json

import pytest

from zkern import Config, ConfigError


def load(**kw):
    return Config.load({"train_micro_batch_size_per_gpu": 1, **kw})


def test_defaults_are_deepspeed_code_defaults():
    cfg = load().resolve(world_size=1)
    assert cfg.gradient_clipping == 0.0
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
     "train_batch_size (30) != train_micro_batch_size_per_gpu (4) x gradient_accumulation_steps (2) x world size (4) "
     "= 32"),
    (dict(train_batch_size=30, train_micro_batch_size_per_gpu=4), 2, "not divisible by train_micro_batch_size_per_gpu "
     "(4) x world size (2) = 8"),
    (dict(train_batch_size=30, gradient_accumulation_steps=4), 2, "(4) x world size (2) = 8"),
    (dict(train_batch_size=7), 2, "train_batch_size (7) is not divisible by the world size (2)"),
    (dict(gradient_accumulation_steps=2), 1, "set train_batch_size or train_micro_batch_size_per_gpu"),
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


def test_not_implemented_keys_pass_at_default_and_fail_otherwise():
    cfg = load(zero_optimization={"stage": 2, "offload_optimizer": {"device": "none"}, "round_robin_gradients": False,
                                  "stage3_prefetch_bucket_size": "auto"},
               wall_clock_breakdown=False, tensorboard={"enabled": False}, fp16={"enabled": False, "auto_cast": False})
    assert cfg.zero_optimization.stage == 2
    cases = [
        (dict(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}),
         "zero_optimization.offload_optimizer.ratio"),
        (dict(zero_optimization={"stage3_module_granularity_threshold": 5}),
         "zero_optimization.stage3_module_granularity_threshold"),
        (dict(zero_optimization={"stage3_max_reuse_distance": 5}), "zero_optimization.stage3_max_reuse_distance"),
        (dict(wall_clock_breakdown=True), "wall_clock_breakdown"),
        (dict(tensorboard={"enabled": True, "output_path": "x"}), "tensorboard"),
        (dict(fp16={"auto_cast": True}), "fp16.auto_cast"),
        (dict(bf16={"immediate_grad_update": True}), "bf16.immediate_grad_update"),
        (dict(optimizer={"type": "Adam", "params": {"amsgrad": True}}), "optimizer.params.amsgrad"),
    ]
    for keys, path in cases:
        with pytest.raises(ConfigError) as e:
            load(**keys)
        assert f"'{path}' is a DeepSpeed key that zkern does not implement yet" in str(e.value), str(e.value)


def test_stage3_keys_and_unimplemented_optimizers_and_schedulers_say_so():
    zero = load(zero_optimization={"stage": 3, "stage3_fetch_units": ["Block"], "stage3_max_live_parameters": 1e8,
                                   "stage3_gather_16bit_weights_on_model_save": True}).resolve(1).zero_optimization
    assert zero.stage == 3 and zero.stage3_fetch_units == ("Block",) and zero.stage3_max_live_parameters == 10**8
    assert zero.overlap_comm is True  # DeepSpeed's code default for stage 3
    assert zero.stage3_prefetch_bucket_size == 50_000_000 and zero.stage3_param_persistence_threshold == 100_000
    with pytest.raises(ConfigError, match="stage3_fetch_units' must be a list of module class names"):
        load(zero_optimization={"stage": 3, "stage3_fetch_units": "Block"})
    with pytest.raises(ConfigError, match="must be 0, 1, 2 or 3, got 5"):
        load(zero_optimization={"stage": 5})
    with pytest.raises(ConfigError, match="'Lamb' is a DeepSpeed optimizer that zkern does not implement"):
        load(optimizer={"type": "Lamb"})
    with pytest.raises(ConfigError, match="'Adamm' is unknown; did you mean 'adam'"):
        load(optimizer={"type": "Adamm"})
    with pytest.raises(ConfigError, match="'OneCycle' is a DeepSpeed scheduler that zkern does not implement"):
        load(scheduler={"type": "OneCycle"})
    with pytest.raises(ConfigError, match="total_num_steps' is required by WarmupDecayLR"):
        load(scheduler={"type": "WarmupDecayLR", "params": {}})
    with pytest.raises(ConfigError, match="warmup_type' must be \"log\" or \"linear\""):
        load(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cosine"}})


def test_value_errors_name_the_key():
    with pytest.raises(ConfigError, match="'fp16.enabled' and 'bf16.enabled' are both true"):
        load(fp16={"enabled": True}, bf16={"enabled": True})
    with pytest.raises(ConfigError, match="'zero_optimization.overlap_comm' must be true or false, got 'yes'"):
        load(zero_optimization={"overlap_comm": "yes"})
    with pytest.raises(ConfigError, match="'zero_optimization.reduce_bucket_size' must be a whole number, got 1.5"):
        load(zero_optimization={"reduce_bucket_size": 1.5})
    with pytest.raises(ConfigError, match="'gradient_clipping' must be >= 0"):
        load(gradient_clipping=-1)
    with pytest.raises(ConfigError, match="'optimizer.params.betas' must be a list of two numbers"):
        load(optimizer={"type": "AdamW", "params": {"betas": 0.9}})
    with pytest.raises(ConfigError, match="'comm_timeout_s' must be > 0"):
        load(comm_timeout_s=0)
    with pytest.raises(ConfigError, match="'fp16.min_loss_scale' must be > 0"):
        load(fp16={"enabled": True, "min_loss_scale": 0})
    with pytest.raises(ConfigError, match="must be a dict, a JSON path or a zkern.Config"):
        Config.load(42)


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
    for keys, path in [(dict(gradient_clipping="auto"), "gradient_clipping"),
                       (dict(optimizer={"type": "AdamW", "params": {"lr": "auto"}}), "optimizer.params.lr"),
                       (dict(fp16={"enabled": "auto"}), "fp16.enabled")]:
        with pytest.raises(ConfigError, match=rf"'{path}': \"auto\" is not resolvable by zkern"):
            load(**keys)
