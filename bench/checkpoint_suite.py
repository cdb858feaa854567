"""The checkpoint suite: save, load, asynchronous save and consolidation of a training run, timed.

    python bench/run.py --suite checkpoint                  # 25m model, stage 2, world 2 (CPU)

Per rank: a synchronous save's seconds and bytes; a load's seconds; then the training step time while an
asynchronous save is in flight against the steps with none (same run, same engine: the ratio is what the issue
asks, "within 10%"); then, in a process of its own, the streaming consolidation's seconds and peak resident memory
(VmHWM) against the checkpoint's size.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench.engine_suite import MODELS, make_spec
from zkern.testing.ranks import spawn
from zkern.testing.runs import TrainSpec


def _rank(rank: int, world: int, spec: TrainSpec, root: str, steps: int) -> dict:
    import zkern

    model = spec.make_model()
    engine = zkern.Engine(model, spec.config(world))
    batches = spec.batches(world)

    def step(s: int) -> float:
        start = time.perf_counter()
        idx, tgt = batches[s % len(batches)][0][rank]
        engine.backward(spec.loss(engine, idx, tgt, s, rank))
        engine.step()
        return time.perf_counter() - start

    for s in range(2):  # warm-up
        step(s)
    start = time.perf_counter()
    path = engine.save_checkpoint(os.path.join(root, "sync"))
    save_s = time.perf_counter() - start
    nbytes = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    start = time.perf_counter()
    engine.load_checkpoint(os.path.join(root, "sync"))
    load_s = time.perf_counter() - start
    quiet = [step(s) for s in range(steps)]
    start = time.perf_counter()
    engine.save_checkpoint(os.path.join(root, "async"), async_save=True)
    copy_s = time.perf_counter() - start  # the host copy the caller waits for
    during = []
    while _in_flight_on_any_rank(engine):
        during.append(step(len(during)))
    async_s = time.perf_counter() - start
    engine.wait_checkpoint()
    after = [step(s) for s in range(steps)]
    return {"save_s": save_s, "bytes": nbytes, "load_s": load_s, "quiet_steps_s": quiet + after,
            "steps_during_async_s": during, "async_copy_s": copy_s, "async_total_s": async_s}


def _in_flight_on_any_rank(engine) -> bool:
    """Whether any rank's asynchronous save still writes (engine.checkpoint_in_flight agrees across ranks, so every
    rank takes the same number of steps during the save)."""
    return engine.checkpoint_in_flight


def _consolidate(ckpt: str, out: str) -> dict:
    code = ("import sys; from zkern.checkpoint.__main__ import main; "
            f"rc = main(['consolidate', {ckpt!r}, {out!r}]); "
            "hwm = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM')); "
            "print(hwm * 1024); sys.exit(rc)")
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if run.returncode != 0:
        raise SystemExit(f"bench: consolidation failed: {run.stderr}")
    return {"seconds": seconds, "peak_rss": int(run.stdout.split()[-1])}


def run(model: str = "25m", world: int = 2, stage: int = 2, steps: int = 6, root: str | None = None) -> dict:
    spec = make_spec(stage, model, steps=max(steps, 8))
    own = root is None
    root = root or tempfile.mkdtemp(prefix="zkern-bench-ckpt-")
    try:
        ranks = spawn(_rank, world, spec, root, steps, subprocess=True, timeout=1800)
        ckpt_bytes = ranks[0]["bytes"]  # the whole tag directory, every rank's file
        cons = _consolidate(os.path.join(root, "sync"), os.path.join(root, "consolidated"))
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    quiet = statistics.median(s for r in ranks for s in r["quiet_steps_s"])
    during = [s for r in ranks for s in r["steps_during_async_s"]]
    return {"suite": "checkpoint", "model": model, "world": world, "stage": stage, "threads": torch.get_num_threads(),
            "params": spec.num_params(), "checkpoint_bytes": ckpt_bytes,
            "save_s": max(r["save_s"] for r in ranks), "load_s": max(r["load_s"] for r in ranks),
            "step_s_quiet_median": quiet, "step_s_during_async_mean": statistics.mean(during) if during else None,
            "steps_during_async": len(during), "async_copy_s": max(r["async_copy_s"] for r in ranks),
            "async_total_s": max(r["async_total_s"] for r in ranks),
            "async_slowdown": statistics.mean(during) / quiet if during else None,
            "consolidate_s": cons["seconds"], "consolidate_peak_rss": cons["peak_rss"], "ranks": ranks,
            "preset": MODELS[model]}


def table(record: dict) -> str:
    mib = 2 ** 20
    size = record["checkpoint_bytes"]
    slow = record["async_slowdown"]
    return "\n".join([
        f"checkpoint suite: {record['model']} ({record['params'] / 1e6:.1f}M parameters), stage {record['stage']}, "
        f"world {record['world']}, {record['threads']} threads", "",
        "| measure | value |", "|---|---|",
        f"| checkpoint size (all ranks) | {size / mib:.1f} MiB |",
        f"| synchronous save | {record['save_s']:.2f} s ({size / mib / record['save_s']:.0f} MiB/s) |",
        f"| load (every rank reads its shard, verifies) | {record['load_s']:.2f} s |",
        f"| step time, no save in flight (median) | {record['step_s_quiet_median'] * 1e3:.0f} ms |",
        f"| step time while an async save writes (mean of {record['steps_during_async']}) | "
        + (f"{record['step_s_during_async_mean'] * 1e3:.0f} ms (x{slow:.2f}) |" if slow else "the save ended "
           "before a step could run |"),
        f"| async save: host copy the caller waits for / whole save | {record['async_copy_s'] * 1e3:.0f} ms / "
        f"{record['async_total_s']:.2f} s |",
        f"| consolidate (own process) | {record['consolidate_s']:.2f} s, peak RSS "
        f"{record['consolidate_peak_rss'] / mib:.1f} MiB ({record['consolidate_peak_rss'] / size:.1%} of the "
        f"checkpoint) |"])
