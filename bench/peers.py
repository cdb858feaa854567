"""The peers zkern is measured against, each training TrainSpec's model, data and seed on one rank.

    python bench/run.py --stage 1 --peers zero1        # one peer by name

Peers by stage (DDP runs for every stage: it is the loss-curve reference):
    0: ddp        DistributedDataParallel + torch.optim.AdamW (fused=True on a GPU, as the peers below)
    1: zero1      DDP + torch's ZeroRedundancyOptimizer(AdamW)
    2: fsdp2      FSDP2 fully_shard(reshard_after_forward=False) on each block and the root (ZeRO-2's traffic)
    3: fsdp2      FSDP2 fully_shard on each block and the root
    any: deepspeed  deepspeed.initialize with the same stage, when the deepspeed package imports
On a CPU they run over gloo, on GPUs over nccl, one GPU per rank. A bf16 spec trains the stock peers with fp32
parameters under autocast (FSDP2: its MixedPrecisionPolicy), reducing bf16 gradients as zkern does.
Each returns losses, step times, the model-state bytes this rank holds, its peak RSS (and on a GPU the CUDA
allocator's max allocated), and the bytes per step its algorithm sends per rank (ring volumes, from the
algorithm: torch does not count them).
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from zkern.testing import (
    TrainSpec,
    ddp_run,
    engine_training_loop,
    init_peer_group,
    model_state_bytes,
    peaks,
    peer_autocast,
    rank_device,
    torch_training_loop,
)


def _ring(world: int, nbytes: float, collectives: float) -> int:
    """Bytes one rank sends for `collectives` reduce-scatters/all-gathers of nbytes under a ring."""
    return int(collectives * (world - 1) * nbytes / world)


def _fused(spec: TrainSpec) -> bool | None:
    """The stock peers' AdamW as their users run it: fused on a GPU (foreach, torch's default, moves about 80
    bytes per parameter where the fused kernel and zkern's move 28: the first H100 records credited that gap to
    zkern), torch's default on a CPU."""
    return True if spec.device == "cuda" else None


def ddp_peer(rank: int, world: int, spec: TrainSpec) -> dict:
    out = ddp_run(rank, world, spec, fused=_fused(spec))
    out["comm_bytes_per_step"] = _ring(world, _width(spec) * spec.num_params(), 2)  # one all-reduce = 2 ring passes
    return out


def zero1_peer(rank: int, world: int, spec: TrainSpec) -> dict:
    out = ddp_run(rank, world, spec, zero1=True, fused=_fused(spec))
    # DDP's all-reduce, then each rank broadcasts its updated partition: about one more ring pass
    # (the gradients go in the spec's width, the fp32 parameters in 4 bytes)
    numel = spec.num_params()
    out["comm_bytes_per_step"] = _ring(world, _width(spec) * numel, 2) + _ring(world, 4 * numel, 1)
    return out


def fsdp2_peer(rank: int, world: int, spec: TrainSpec, reshard_after_forward: bool = True) -> dict:
    """FSDP2: fully_shard each transformer block and the root, torch AdamW on the sharded parameters. A bf16
    spec gathers and reduces in bf16 over fp32 shards (MixedPrecisionPolicy), as zkern communicates."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    bf16 = peer_autocast(spec) is not None
    init_peer_group(spec)
    model = spec.make_model().to(rank_device(spec))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else \
        MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, fused=_fused(spec))

    @contextlib.contextmanager
    def sync(last: bool):  # FSDP2 reduce-scatters only on the accumulation step's last micro-batch
        model.set_requires_gradient_sync(last)
        yield

    losses, times = torch_training_loop(spec, rank, world, model, opt, params, sync)
    gathers = 2 if reshard_after_forward else 1  # forward (+ backward when resharded), plus one reduce-scatter
    return {"losses": losses, "step_times": times, **peaks(rank_device(spec)),
            "model_state_bytes": model_state_bytes(model, opt),
            "comm_bytes_per_step": _ring(world, _width(spec, fsdp=True) * spec.num_params(), gathers + 1)}


def fsdp2_zero2_peer(rank: int, world: int, spec: TrainSpec) -> dict:
    return fsdp2_peer(rank, world, spec, reshard_after_forward=False)


def deepspeed_peer(rank: int, world: int, spec: TrainSpec) -> dict:
    """DeepSpeed at the same stage (optional: runs only where the deepspeed package is installed)."""
    import deepspeed

    model = spec.make_model()
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                   config=deepspeed_config(spec, world))
    losses, times = engine_training_loop(spec, rank, world, engine)
    peak = peaks(engine.device)
    # Model states: not measured. DeepSpeed keeps its flat fp32 partitions and gradient buffers inside its
    # optimizer wrapper, where counting p.grad and the inner optimizer's state (as for the stock peers) misses them.
    return {"losses": losses, "step_times": times, **peak, "model_state_bytes": None,
            "comm_bytes_per_step": None}


def deepspeed_config(spec: TrainSpec, world: int) -> dict:
    """The spec's config as DeepSpeed takes it: without zkern's own keys."""
    cfg = spec.config(world)
    for key in ("device", "comm_timeout_s"):
        cfg.pop(key)
    cfg["zero_optimization"].pop("stage3_fetch_units", None)
    if not cfg.get("steps_per_print"):
        cfg["steps_per_print"] = 10**9  # DeepSpeed takes steps_per_print modulo; 0 ("never" in zkern) divides by 0
    return cfg


def _width(spec: TrainSpec, fsdp: bool = False) -> int:
    """Bytes per element the peers communicate: bf16 specs reduce bf16 gradients, except DDP's on gloo (torch's
    bf16 compress hook runs on nccl only)."""
    return 2 if spec.precision == "bf16" and (fsdp or spec.device == "cuda") else 4


def installed(name: str) -> bool:
    return name != "deepspeed" or importlib.util.find_spec("deepspeed") is not None


# stage -> the peers that do that stage's job, by name; DDP is added to every run as the loss reference.
PEERS = {
    0: {"deepspeed": deepspeed_peer},
    1: {"zero1": zero1_peer, "deepspeed": deepspeed_peer},
    2: {"fsdp2": fsdp2_zero2_peer, "deepspeed": deepspeed_peer},
    3: {"fsdp2": fsdp2_peer, "deepspeed": deepspeed_peer},
}

# every peer's name, for --peers
NAMES = ("ddp", *sorted({name for stage in PEERS.values() for name in stage}))
