"""Stock-PyTorch peers for the engine suite, each training TrainSpec's model, data and seed on one rank.

    python bench/run.py --stage 3      # zkern stage 3 against FSDP2 fully_shard (and DDP for the loss curve)

Peers by stage: DDP is the reference curve for every stage; FSDP2 fully_shard (each Block, then the root) is
stage 3's peer. Each returns losses, step times, the model-state bytes this rank holds and its peak RSS.
"""

from __future__ import annotations

import time

import torch

from zkern.testing import TrainSpec, ddp_run, model_state_bytes, peak_rss_bytes, reset_peak_rss

__all__ = ["ddp_run", "fsdp2_run", "PEERS"]


def fsdp2_run(rank: int, world: int, spec: TrainSpec, reshard_after_forward: bool = True) -> dict:
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
    batches = spec.batches(world)
    reset_peak_rss()
    losses, times = [], []
    for step in range(spec.steps):
        start = time.perf_counter()
        opt.zero_grad()
        total = 0.0
        for micro in range(spec.accumulation):
            idx, tgt = batches[step][micro][rank]
            model.set_requires_gradient_sync(micro == spec.accumulation - 1)
            loss = model(idx, tgt, **spec.forward_kwargs(step))
            (loss / spec.accumulation).backward()
            total += loss.item()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(total / spec.accumulation)
    return {"losses": losses, "step_times": times, "peak_rss": peak_rss_bytes(),
            "model_state_bytes": model_state_bytes(model, opt)}


# stage -> the stock peers that do that stage's job (DDP runs for every stage as the loss reference)
PEERS = {0: {}, 1: {}, 2: {}, 3: {"fsdp2": fsdp2_run}}
