"""The peers zkern is measured against, each training TrainSpec's model, data and seed on one rank.

    python bench/run.py --stage 1 --peers zero1        # one peer by name

Peers by stage (DDP runs for every stage: it is the loss-curve reference):
    0: ddp        DistributedDataParallel + torch.optim.AdamW
    1: zero1      DDP + torch's ZeroRedundancyOptimizer(AdamW)
    2: fsdp2      FSDP2 fully_shard(reshard_after_forward=False) on each block and the root (ZeRO-2's traffic)
    3: fsdp2      FSDP2 fully_shard on each block and the root
    any: deepspeed  deepspeed.initialize with the same stage over gloo, when the deepspeed package imports
Each returns losses, step times, the model-state bytes this rank holds, its peak RSS, and the bytes per step
its algorithm sends per rank (ring volumes, from the algorithm: torch does not count them).
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from zkern.testing import (
    TrainSpec,
    ddp_run,
    engine_training_loop,
    model_state_bytes,
    peak_rss_bytes,
    torch_training_loop,
)


def _ring(world: int, nbytes: float, collectives: float) -> int:
    """Bytes one rank sends for `collectives` reduce-scatters/all-gathers of nbytes under a ring."""
    return int(collectives * (world - 1) * nbytes / world)


def ddp_peer(rank: int, world: int, spec: TrainSpec) -> dict:
    out = ddp_run(rank, world, spec)
    out["comm_bytes_per_step"] = _ring(world, 4 * _numel(spec), 2)  # one all-reduce = 2 ring passes
    return out


def zero1_peer(rank: int, world: int, spec: TrainSpec) -> dict:
    out = ddp_run(rank, world, spec, zero1=True)
    # DDP's all-reduce, then each rank broadcasts its updated partition: about one more ring pass
    out["comm_bytes_per_step"] = _ring(world, 4 * _numel(spec), 3)
    return out


def fsdp2_peer(rank: int, world: int, spec: TrainSpec, reshard_after_forward: bool = True) -> dict:
    """FSDP2: fully_shard each transformer block and the root, torch AdamW on the sharded parameters."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    model = spec.make_model()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward)
    fully_shard(model, reshard_after_forward=reshard_after_forward)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)

    @contextlib.contextmanager
    def sync(last: bool):  # FSDP2 reduce-scatters only on the accumulation step's last micro-batch
        model.set_requires_gradient_sync(last)
        yield

    losses, times = torch_training_loop(spec, rank, world, model, opt, params, sync)
    gathers = 2 if reshard_after_forward else 1  # forward (+ backward when resharded), plus one reduce-scatter
    return {"losses": losses, "step_times": times, "peak_rss": peak_rss_bytes(),
            "model_state_bytes": model_state_bytes(model, opt),
            "comm_bytes_per_step": _ring(world, 4 * _numel(spec), gathers + 1)}


def fsdp2_zero2_peer(rank: int, world: int, spec: TrainSpec) -> dict:
    return fsdp2_peer(rank, world, spec, reshard_after_forward=False)


def deepspeed_peer(rank: int, world: int, spec: TrainSpec) -> dict:
    """DeepSpeed at the same stage (optional: runs only where the deepspeed package is installed)."""
    import deepspeed

    cfg = spec.config(world)
    for key in ("device", "comm_timeout_s"):  # zkern's own keys
        cfg.pop(key)
    cfg["zero_optimization"].pop("stage3_fetch_units", None)
    if not cfg.get("steps_per_print"):
        cfg["steps_per_print"] = 10**9  # DeepSpeed takes steps_per_print modulo; 0 ("never" in zkern) divides by 0
    model = spec.make_model()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses, times = engine_training_loop(spec, rank, world, engine)
    # Model states: not measured. DeepSpeed keeps its flat fp32 partitions and gradient buffers inside its
    # optimizer wrapper, where counting p.grad and the inner optimizer's state (as for the stock peers) misses them.
    return {"losses": losses, "step_times": times, "peak_rss": peak_rss_bytes(), "model_state_bytes": None,
            "comm_bytes_per_step": None}


def _numel(spec: TrainSpec) -> int:
    return sum(p.numel() for p in spec.make_model().parameters())


def installed(name: str) -> bool:
    return name != "deepspeed" or importlib.util.find_spec("deepspeed") is not None


# stage -> the peers that do that stage's job, by name; DDP is added to every run as the loss reference.
PEERS = {
    0: {"deepspeed": deepspeed_peer},
    1: {"zero1": zero1_peer, "deepspeed": deepspeed_peer},
    2: {"fsdp2": fsdp2_zero2_peer, "deepspeed": deepspeed_peer},
    3: {"fsdp2": fsdp2_peer, "deepspeed": deepspeed_peer},
}
