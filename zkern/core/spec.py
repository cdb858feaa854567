"""RuntimeSpec: what a stage runtime is built from, resolved once from the config and the device.

    python -c "from zkern.core.spec import RuntimeSpec; help(RuntimeSpec)"

The engine resolves it (RuntimeSpec.resolve) and hands the same object to the stage runtime, which reads its
fields instead of a list of keyword arguments; the config's ZeRO section rides along for the stage-3 keys that only
stage 3 reads (fetch units, prefetch, ZeRO++).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zkern.config import Config
    from zkern.config.sections import ZeroConfig

_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def working_dtype(cfg: Config) -> torch.dtype:
    """The dtype parameters and gradients live in during forward/backward."""
    match cfg.precision:
        case "fp16":
            return torch.float16
        case "bf16":
            return torch.bfloat16
        case "fp32":
            return torch.float32
        case other:
            raise ValueError(f"unknown precision {other!r}")


def gradient_dtypes(cfg: Config, working: torch.dtype) -> tuple[torch.dtype, torch.dtype]:
    """(communication dtype, accumulation dtype) of gradients: communication_data_type and
    data_types.grad_accum_dtype, each the working dtype when not set."""
    comm = _TORCH_DTYPES[cfg.communication_data_type] if cfg.communication_data_type else working
    accum = _TORCH_DTYPES[cfg.grad_accum_dtype] if cfg.grad_accum_dtype else working
    return comm, accum


@dataclass(frozen=True)
class RuntimeSpec:
    """One engine's stage runtime, as the config and the device decide it."""

    stage: int  # 0, 1, 2 or 3
    device: torch.device  # where the working buffers live
    dtype: torch.dtype  # the working dtype (fp16/bf16 in mixed precision)
    mixed: bool  # dtype is not the master's: a master shard apart from the working copy is kept
    master_dtype: torch.dtype  # the optimizer's master shard: fp32, bf16 with bf16.bf16_master_weights_and_grads
    state_dtype: torch.dtype  # zkern's Adam moments: fp32, bf16 with bf16.bf16_optimizer_states
    stochastic_rounding: bool  # bf16 master/moments round stochastically (bf16_stochastic_rounding), else to nearest
    comm_dtype: torch.dtype  # gradients are reduced in this dtype (communication_data_type)
    accum_dtype: torch.dtype  # and accumulated across micro-steps in this one (data_types.grad_accum_dtype)
    bucket_numel: int  # gradient bucket elements (stages 0-2: min of reduce and allgather bucket sizes)
    accumulation: int  # gradient_accumulation_steps: backwards per optimizer step, as configured
    overlap: bool  # overlap_comm: reductions run while backward continues
    reduce_scatter: bool  # stages 1-3: reduce-scatter (else all-reduce and keep this rank's chunk)
    offload_optimizer: str  # "none", "cpu" or "nvme": where the fp32 master and moments live
    offload_ratio: float  # offload_optimizer.ratio: the share of the shard on the host (1: all; partial below)
    offload_param: str  # "none", "cpu" or "nvme": where stage 3's working shard rests
    pin_optimizer: bool  # page-locked host copies of the optimizer's shard (only with a GPU to copy to)
    pin_params: bool  # page-locked host copies of stage 3's working shard (only with a GPU)
    zero: ZeroConfig  # the whole ZeRO section, for the keys stage 3 alone reads

    @staticmethod
    def resolve(cfg: Config, device: torch.device) -> RuntimeSpec:
        zero = cfg.zero_optimization
        dtype = working_dtype(cfg)
        comm_dtype, accum_dtype = gradient_dtypes(cfg, dtype)
        cuda = device.type == "cuda"  # page-locked host memory only helps (and only exists) with a GPU
        bucket = zero.reduce_bucket_size if zero.stage == 3 else \
            min(zero.reduce_bucket_size, zero.allgather_bucket_size)
        master = torch.bfloat16 if cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads else torch.float32
        states = torch.bfloat16 if cfg.bf16.enabled and cfg.bf16.bf16_optimizer_states else torch.float32
        # A bf16 master in bf16 training is the working copy itself (as an fp32 run's is): no second shard.
        return RuntimeSpec(stage=zero.stage, device=device, dtype=dtype, mixed=dtype != master,
                           master_dtype=master, state_dtype=states, stochastic_rounding=cfg.bf16_stochastic_rounding,
                           comm_dtype=comm_dtype, accum_dtype=accum_dtype, bucket_numel=bucket,
                           accumulation=cfg.gradient_accumulation_steps,
                           overlap=zero.overlap_comm, reduce_scatter=zero.reduce_scatter,
                           offload_optimizer=zero.offload_optimizer_device, offload_param=zero.offload_param_device,
                           offload_ratio=(zero.offload_optimizer_ratio if zero.offload_optimizer_device == "cpu"
                                          else 1.0),
                           pin_optimizer=cuda and zero.offload_optimizer_pin_memory,
                           pin_params=cuda and zero.offload_param_pin_memory, zero=zero)

    @property
    def partial(self) -> bool:
        """Partial offload: part of the optimizer's shard on the device, the rest on the host (SplitShard)."""
        return self.offload_optimizer == "cpu" and self.offload_ratio < 1.0

    @property
    def casts_from_master(self) -> bool:
        """Stage 3 keeps no 16-bit working shard: each gather casts this rank's chunk from the fp32 master (FSDP2's
        way: 2 bytes a parameter over N fewer, between steps and within them). In mixed precision with the master
        and the parameters on the device, unless zero_optimization.stage3_keep_working_shard; with any offload the
        working shard stays (the host step writes it, and it is what goes up for a gather)."""
        return self.stage == 3 and self.mixed and self.offload_optimizer == "none" and self.offload_param == "none" \
            and not self.zero.stage3_keep_working_shard

    @property
    def offloaded(self) -> bool:
        """The optimizer steps on the host (ZeRO-Offload) or from files (ZeRO-Infinity)."""
        return self.offload_optimizer in ("cpu", "nvme")
