"""The contenders of the checkpoint suite, each as the same five calls on one rank of a training run.

    python bench/run.py --suite checkpoint --stage 3        # zkern, PyTorch DCP (FSDP2) and DeepSpeed side by side

Every contender trains TrainSpec's model on its own processes and hands the suite a Contender: step(s) runs one
training step, save(dir)/load(dir) a synchronous save and load of the whole training state (model and AdamW),
start_async(dir) an asynchronous save (None where the contender has none on a CPU), in_flight() whether that save
still writes on any rank (every rank takes the same number of steps meanwhile) and wait() its end.
  zkern      engine.save_checkpoint / load_checkpoint / save_checkpoint(async_save=True)
  dcp        FSDP2 (fully_shard per block and the root, resharded after forward at stage 3) with torch AdamW;
             torch.distributed.checkpoint.save / load / async_save of get_state_dict's model and optimizer state
  deepspeed  deepspeed.initialize at the same stage; save_checkpoint / load_checkpoint (no asynchronous save on a CPU)
The checkpoint collectives of DCP's run go over a gloo group of their own, as torch advises for async_save.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zkern.testing.runs import TrainSpec, init_peer_group


@dataclass
class Contender:
    step: Callable[[int], float]
    save: Callable[[str], None]
    load: Callable[[str], None]
    start_async: Callable[[str], None] | None
    in_flight: Callable[[], bool]
    wait: Callable[[], None]
    fsyncs: bool  # whether save() returns with its files durable (else the suite fsyncs them and times that too)


def _stepper(spec: TrainSpec, world: int, rank: int, run_step: Callable[[torch.Tensor], None]):
    """step(s): one timed training step, run_step(idx, tgt, s), on micro-batch s of the spec's data."""
    batches = spec.batches(world)

    def step(s: int) -> float:
        start = time.perf_counter()
        idx, tgt = batches[s % len(batches)][0][rank]
        run_step(idx, tgt, s)
        return time.perf_counter() - start

    return step


def _engine_contender(engine, rank: int, world: int, spec: TrainSpec, **saving) -> Contender:
    """A DeepSpeed-style engine (zkern's or DeepSpeed's): backward and step per batch, tag "ckpt"; saving: the
    asynchronous-save calls and whether save() fsyncs."""
    def run_step(idx, tgt, s):
        engine.backward(spec.loss(engine, idx, tgt, s, rank))
        engine.step()

    return Contender(step=_stepper(spec, world, rank, run_step),
                     save=lambda d: engine.save_checkpoint(d, tag="ckpt"),
                     load=lambda d: engine.load_checkpoint(d, tag="ckpt"), **saving)


def zkern_contender(rank: int, world: int, spec: TrainSpec) -> Contender:
    import zkern

    engine = zkern.Engine(spec.make_model(), spec.config(world))
    return _engine_contender(engine, rank, world, spec,
                             start_async=lambda d: engine.save_checkpoint(d, tag="ckpt", async_save=True),
                             in_flight=lambda: engine.checkpoint_in_flight,  # agrees across ranks
                             wait=engine.wait_checkpoint, fsyncs=True)


def dcp_contender(rank: int, world: int, spec: TrainSpec) -> Contender:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    init_peer_group(spec)
    model = spec.make_model()
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=spec.stage == 3)
    fully_shard(model, reshard_after_forward=spec.stage == 3)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    group = dist.new_group(backend="gloo")
    pending: list = []

    def run_step(idx, tgt, s):
        opt.zero_grad()
        spec.loss(model, idx, tgt, s, rank).backward()
        opt.step()

    def state() -> dict:
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd}

    def load(d: str) -> None:
        sd = state()
        dcp.load(sd, checkpoint_id=d, process_group=group)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def in_flight() -> bool:
        busy = torch.tensor([int(bool(pending) and not pending[0].done())])
        dist.all_reduce(busy, op=dist.ReduceOp.MAX)
        return bool(busy.item())

    def wait() -> None:
        pending.pop().result()

    return Contender(step=_stepper(spec, world, rank, run_step),
                     save=lambda d: dcp.save(state(), checkpoint_id=d, process_group=group), load=load,
                     start_async=lambda d: pending.append(dcp.async_save(state(), checkpoint_id=d,
                                                                         process_group=group)),
                     in_flight=in_flight, wait=wait, fsyncs=True)  # FileSystemWriter's sync_files defaults on


def deepspeed_contender(rank: int, world: int, spec: TrainSpec) -> Contender:
    import deepspeed

    from bench.peers import deepspeed_config

    model = spec.make_model()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=deepspeed_config(spec, world))
    return _engine_contender(engine, rank, world, spec, start_async=None, in_flight=lambda: False,
                             wait=lambda: None, fsyncs=False)


CONTENDERS = {"zkern": zkern_contender, "dcp": dcp_contender, "deepspeed": deepspeed_contender}
