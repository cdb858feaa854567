"""What one config key alone cannot say: combinations of keys, checked once a Config is built from them.

    python -m pytest tests/test_config.py -q
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zkern.errors import ConfigError

if TYPE_CHECKING:
    from zkern.config.model import Config


def check_combinations(cfg: Config) -> None:
    """What one key alone cannot say: combinations."""
    zero = cfg.zero_optimization
    if cfg.device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"'device' must be \"auto\", \"cpu\" or \"cuda\", got {cfg.device!r}")
    if cfg.gradient_allreduce_op not in ("mean", "sum"):
        raise ConfigError(f"'gradient_allreduce_op' must be \"mean\" or \"sum\", got {cfg.gradient_allreduce_op!r}")
    if zero.offload_optimizer_device != "none" and zero.stage == 0:
        raise ConfigError("'zero_optimization.offload_optimizer' needs ZeRO stage 1, 2 or 3 (each rank offloads "
                          "its optimizer shard); set 'zero_optimization.stage'")
    if zero.offload_param_device == "nvme" and zero.offload_optimizer_device == "none":
        raise ConfigError("'zero_optimization.offload_param' device \"nvme\" needs 'offload_optimizer' with device "
                          "\"cpu\" or \"nvme\" too: the optimizer writes the updated shards into the parameter file "
                          "from the host")
    _check_zeropp(cfg)
    _check_bf16_state(cfg)
    _check_torch_autocast(cfg)


def _check_torch_autocast(cfg: Config) -> None:
    if not cfg.torch_autocast.enabled:
        return
    if cfg.precision != "fp32":
        raise ConfigError(f"'torch_autocast.enabled' and '{cfg.precision}.enabled' are both true: the {cfg.precision} "
                          f"section casts the weights to {cfg.precision}, torch_autocast keeps them fp32 and casts per "
                          f"operation in the forward; choose one")
    if cfg.zero_optimization.zero_quantized_weights:
        raise ConfigError("'torch_autocast.enabled' with 'zero_optimization.zero_quantized_weights' (qwZ): DeepSpeed "
                          "refuses the pair too (int8 weight gathers of fp32 weights under autocast); drop one")


def _check_bf16_state(cfg: Config) -> None:
    """bf16 master weights and moments: DeepSpeed's keys, with its conditions (bf16 on, a ZeRO stage); zkern also
    takes bf16_optimizer_states alone (an fp32 master with bf16 moments), which DeepSpeed refuses."""
    bf16 = cfg.bf16
    for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        if getattr(bf16, key) and not bf16.enabled:
            raise ConfigError(f"'bf16.{key}' keeps optimizer state in bf16 for bf16 training, and 'bf16.enabled' is "
                              f"false; set it to true or remove '{key}'")
        if getattr(bf16, key) and cfg.zero_optimization.stage == 0:
            raise ConfigError(f"'bf16.{key}' applies to the ZeRO optimizer's shard (stages 1, 2 and 3), as in "
                              f"DeepSpeed; set 'zero_optimization.stage' to 1 or more or remove it")
    if cfg.bf16_stochastic_rounding and not (bf16.bf16_master_weights_and_grads or bf16.bf16_optimizer_states):
        raise ConfigError("'bf16_stochastic_rounding' rounds the optimizer state kept in bf16, and none is: set "
                          "'bf16.bf16_optimizer_states' or 'bf16.bf16_master_weights_and_grads', or remove it")


def _check_zeropp(cfg: Config) -> None:
    """ZeRO++'s keys against the stage and each other (the world is checked in resolve)."""
    zero = cfg.zero_optimization
    if zero.zero_quantized_weights and zero.stage != 3:
        raise ConfigError(f"'zero_optimization.zero_quantized_weights' (qwZ) quantizes stage 3's parameter "
                          f"all-gather; the config says stage {zero.stage}")
    if zero.zero_quantized_nontrainable_weights and zero.stage != 3:
        raise ConfigError(f"'zero_optimization.zero_quantized_nontrainable_weights' stores stage 3's frozen parameter "
                          f"shards as int8; the config says stage {zero.stage} (frozen parameters are whole on every "
                          f"rank below stage 3)")
    if zero.zero_hpz_partition_size > 1 and zero.stage != 3:
        raise ConfigError(f"'zero_optimization.zero_hpz_partition_size' (hpZ) keeps a secondary copy of stage 3's "
                          f"partitioned parameters; the config says stage {zero.stage}")
    if zero.zero_quantized_gradients and zero.stage not in (2, 3):
        raise ConfigError(f"'zero_optimization.zero_quantized_gradients' (qgZ) replaces the gradient reduce-scatter "
                          f"of stages 2 and 3; the config says stage {zero.stage}")
    if zero.zero_quantized_gradients and not zero.reduce_scatter:
        raise ConfigError("'zero_optimization.zero_quantized_gradients' replaces the reduce-scatter, and "
                          "'reduce_scatter' is false; drop one of them")
    if zero.loco_err_beta is not None:
        if not zero.zero_quantized_gradients:
            raise ConfigError("'zero_optimization.zeropp_loco_param' is error feedback for quantized gradients; set "
                              "'zero_quantized_gradients': true or remove it")
        if not zero.loco_err_beta < 1.0:
            raise ConfigError(f"'zero_optimization.zeropp_loco_param.err_beta' must be in [0, 1), got "
                              f"{zero.loco_err_beta}")
    for key in ("zeropp_weight_group_size", "zeropp_grad_group_size"):
        value = getattr(zero, key)
        if value < 2 or value & (value - 1):
            raise ConfigError(f"'zero_optimization.{key}' must be a power of two >= 2 (the kernels' tiles are), got "
                              f"{value}")
