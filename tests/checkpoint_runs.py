"""Shared pieces of the checkpoint tests: a training loop over a fixed global batch that any world size splits the
same way (so runs at different world sizes train on the same data), and the rank workers.

    python -m pytest tests/checkpoint/test_checkpoint.py tests/checkpoint/test_checkpoint_topology.py -q
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import torch

from zkern.testing.models import make_batches
from zkern.testing.runs import TrainSpec

GLOBAL_BATCH = 4
DATA_STEPS = 64  # the data of step s must not depend on how many steps a run asks for
SCHEDULER = {"scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                          "warmup_num_steps": 4, "warmup_type": "linear"}}}


# A checkpoint in manifest version 2, saved before the checkpoint was written from the state registry (its README).
V2 = Path(__file__).parent / "data" / "checkpoint_v2"


def v2_spec() -> TrainSpec:
    """The run that wrote V2."""
    return spec_for(1, stage=2, precision="fp16", fp16={"initial_scale_power": 16, "hysteresis": 1,
                                                         "loss_scale_window": 2},
                    extra_config=SCHEDULER, model={"vocab": 17, "seq": 8, "dim": 16})


def spec_for(world: int, **kwargs) -> TrainSpec:
    """A spec whose micro-batch makes the global batch GLOBAL_BATCH sequences at this world size."""
    accumulation = kwargs.get("accumulation", 1)
    return TrainSpec(micro_batch=GLOBAL_BATCH // (world * accumulation), **kwargs)


def global_batches(spec: TrainSpec, steps: int):
    """[step] -> (idx, tgt) of GLOBAL_BATCH sequences, the same whatever the world size."""
    vocab, seq = spec.model.get("vocab", 67), spec.model.get("seq", 16)
    batches = make_batches(spec.seed + 1, max(steps, DATA_STEPS), 1, 1, GLOBAL_BATCH, seq, vocab)
    return [b[0][0] for b in batches]


def train(engine, spec: TrainSpec, first: int, last: int, rank: int, world: int) -> list[float]:
    """Steps [first, last): each rank's micro-batches are its rows of the step's global batch."""
    batches = global_batches(spec, last)
    per = GLOBAL_BATCH // (world * spec.accumulation)
    losses = []
    for step in range(first, last):
        idx, tgt = batches[step]
        total = 0.0
        for micro in range(spec.accumulation):
            lo = (micro * world + rank) * per
            loss = engine(idx[lo:lo + per], tgt[lo:lo + per])
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total / spec.accumulation)
    return losses


def build(spec: TrainSpec, world: int):
    model = spec.make_model()
    return spec.build_engine(model, world)


def counters(engine) -> dict:
    return {"global_steps": engine.global_steps, "skipped": engine.skipped_steps, "micro_steps": engine.micro_steps,
            "loss_scale": engine.loss_scale, "lrs": [g["lr"] for g in engine.optimizer.param_groups]}


def resume_first_half(rank: int, world: int, variants: dict, root: str) -> dict:
    """Per variant: 6 uninterrupted steps (saved as tag "end"), then a fresh engine trained 3 steps and saved."""
    out = {}
    for name, spec in variants.items():
        engine = build(spec, world)
        losses = train(engine, spec, 0, 6, rank, world)
        engine.save_checkpoint(os.path.join(root, name, "uninterrupted"), tag="end")
        uninterrupted = {"losses": losses, **counters(engine)}
        engine = build(spec, world)
        first = train(engine, spec, 0, 3, rank, world)
        torch.rand(rank + 1)  # each rank's generator moves differently before the save
        rng = torch.get_rng_state()
        engine.save_checkpoint(os.path.join(root, name, "ckpt"), client_state={"epoch": 1, "rank_note": [name]})
        out[name] = {"uninterrupted": uninterrupted, "first": first, "rng": rng, "at_save": counters(engine)}
    return out


def resume_second_half(rank: int, world: int, variants: dict, root: str) -> dict:
    """Per variant, in fresh processes: build, scramble the generator, load, train steps 3-5, save as "end"."""
    out = {}
    for name, spec in variants.items():
        engine = build(spec, world)
        torch.manual_seed(9999)
        path, client = engine.load_checkpoint(os.path.join(root, name, "ckpt"))
        rng = torch.get_rng_state()
        after_load = counters(engine)
        losses = train(engine, spec, 3, 6, rank, world)
        engine.save_checkpoint(os.path.join(root, name, "resumed"), tag="end")
        out[name] = {"path": path, "client": client, "rng": rng, "after_load": after_load, "losses": losses,
                     **counters(engine)}
    return out


def topology_source(rank: int, world: int, spec: TrainSpec, root: str) -> dict:
    """Train 3 steps, save, train 3 more: the run that never changes topology."""
    engine = build(spec, world)
    train(engine, spec, 0, 3, rank, world)
    at_save = engine.full_state_dict()
    engine.save_checkpoint(root)
    train(engine, spec, 3, 6, rank, world)
    return {"at_save": at_save, "final": engine.full_state_dict()}


def topology_target(rank: int, world: int, spec: TrainSpec, source: str, resaved: str) -> dict:
    """Load a checkpoint saved elsewhere, save it again at once, train 3 more steps."""
    engine = build(spec, world)
    path, _ = engine.load_checkpoint(source)
    after_load = engine.full_state_dict()
    engine.save_checkpoint(resaved)
    global_steps = engine.global_steps
    train(engine, spec, 3, 6, rank, world)
    return {"path": path, "after_load": after_load, "global_steps": global_steps, "final": engine.full_state_dict()}


def cross_resume(rank: int, world: int, specs: dict, root: str, uninterrupted: str = "cpu",
                 async_saves: bool = True) -> dict:
    """specs[uninterrupted] trains 6 steps straight; then each setting saves at step 3 (and asynchronously beside it,
    under "<name>-async", with async_saves) and each loads each other's checkpoint and trains steps 3-5. Returns
    the full state dicts ("uninterrupted", "<src>-><dst>") and each resumed engine's steps ("<src>-><dst> steps")."""
    spec = specs[uninterrupted]
    engine = spec.build_engine(spec.make_model(), world)
    train(engine, spec, 0, 6, rank, world)
    out = {"uninterrupted": engine.full_state_dict()}
    for src, spec in specs.items():
        engine = spec.build_engine(spec.make_model(), world)
        train(engine, spec, 0, 3, rank, world)
        engine.save_checkpoint(os.path.join(root, src))
        if async_saves:
            engine.save_checkpoint(os.path.join(root, f"{src}-async"), async_save=True)
        engine.destroy()  # waits for the asynchronous save first
    for src in specs:
        for dst, spec in specs.items():
            engine = spec.build_engine(spec.make_model(), world)
            engine.load_checkpoint(os.path.join(root, src))
            train(engine, spec, 3, 6, rank, world)
            out[f"{src}->{dst}"] = engine.full_state_dict()
            out[f"{src}->{dst} steps"] = engine.global_steps
            engine.destroy()
    return out


def assert_same_state(a: dict, b: dict, what: str) -> None:
    """Nested dicts of tensors and plain values equal exactly (tensors: same dtype, same bits)."""
    assert sorted(a) == sorted(b), what
    for k in a:
        if isinstance(a[k], dict):
            assert_same_state(a[k], b[k], f"{what}[{k}]")
        elif isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}[{k}] differs"
        else:
            assert a[k] == b[k], f"{what}[{k}]: {a[k]} != {b[k]}"


def with_stage(spec: TrainSpec, world: int, stage: int, **zero) -> TrainSpec:
    return replace(spec, stage=stage, micro_batch=GLOBAL_BATCH // (world * spec.accumulation), zero=zero)
