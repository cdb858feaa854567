"""--suite overhead: the host's part of a step. A deep model of tiny layers (zkern.testing.DeepMLP: 96 x Linear(16, 16)
+ ReLU), where the arithmetic is negligible and a step's time is each framework's per-module bookkeeping: what bounds
a GPU step whose kernels are short, and what made DeepSpeed's ZeRO-3 lose to FSDP for its users (their issue 5047).

    python bench/run.py --suite overhead                  # stages 0-3 against their peers, worlds 1 and 2, one run

Per stage and world, zkern and the stock system doing the same job, each in its own ranks: DDP (stage 0),
ZeroRedundancyOptimizer (1), FSDP2 with reshard_after_forward=False (2) and fully_shard (3), each layer wrapped (FSDP2)
or a fetch unit of its own (zkern stage 3: persistence threshold 0). fp32, AdamW, the same data and seed; the median
step time after warm-up, the slowest rank's. Ratios zkern / peer, and stage 3's host time per unit per step over
stage 0's (what each gather, release and reduction costs the host).
"""

from __future__ import annotations

import datetime
import statistics
import time

import torch

from bench import engine_suite, probe_systems
from zkern.env_report import cpu_model
from zkern.testing import TrainSpec, spawn

MODEL = dict(depth=96, width=16, vocab=67, seq=16)
PEERS = {0: "ddp", 1: "zero1", 2: "fsdp2-zero2", 3: "fsdp2"}
WORLDS = (1, 2)
WARMUP, TIMED = 3, 8


def spec_for(stage: int) -> TrainSpec:
    # stage 3: every layer a unit of its own (the probe's default is a unit per Block)
    zero = {"stage3_fetch_units": [], "stage3_param_persistence_threshold": 0} if stage == 3 else {}
    return TrainSpec(stage=stage, arch="deep", model=MODEL, micro_batch=2, steps=WARMUP + TIMED, lr=1e-3,
                     reduce_bucket_size=50_000, zero=zero)


def _time(rank: int, world: int, name: str, spec: TrainSpec) -> list[float]:
    """Seconds of each timed step of system `name` on this rank."""
    system = probe_systems.build(name, spec, world)
    batches = spec.batches(world)
    times = []
    for s in range(spec.steps):
        idx, tgt = batches[s][0][rank]
        start = time.perf_counter()
        system.backward(system.forward(idx, tgt, s, rank))
        system.step()
        if s >= WARMUP:
            times.append(time.perf_counter() - start)
    system.close()
    return times


def measure(name: str, stage: int, world: int) -> float:
    """The median over timed steps of the slowest rank's step time."""
    per_rank = spawn(_time, world, name, spec_for(stage), timeout=600, subprocess=True)
    return statistics.median(max(ts) for ts in zip(*per_rank))


def run(stages: list[int], worlds: tuple[int, ...] = WORLDS, progress=print) -> dict:
    torch.set_num_threads(1)  # per-module bookkeeping, not arithmetic: one thread, as each rank gets
    rows, ratios = [], {}
    units = MODEL["depth"] + 2  # every layer's Linear, the embedding, the head
    for world in worlds:
        for stage in stages:
            zk, peer = measure(f"zkern{stage}", stage, world), measure(PEERS[stage], stage, world)
            rows.append({"stage": stage, "world": world, "zkern_s": zk, "peer": PEERS[stage], "peer_s": peer})
            ratios[f"stage{stage}_world{world}_over_peer"] = zk / peer
            progress(f"[overhead] stage {stage} world {world}: zkern {zk * 1e3:.1f} ms, {PEERS[stage]} "
                     f"{peer * 1e3:.1f} ms (x{zk / peer:.2f})")
        by_stage = {r["stage"]: r["zkern_s"] for r in rows if r["world"] == world}
        if 0 in by_stage and 3 in by_stage:
            ratios[f"stage3_world{world}_host_ms_per_unit"] = (by_stage[3] - by_stage[0]) / units * 1e3
    return {"suite": "overhead", "device": "cpu", "model": MODEL, "units": units, "warmup": WARMUP, "timed": TIMED,
            "rows": rows, "ratios": ratios, "cpu": cpu_model(), "torch": torch.__version__,
            "git_sha": engine_suite._git_sha(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def table(record: dict) -> str:
    out = [f"overhead suite: {record['model']['depth']} x Linear({record['model']['width']}, "
           f"{record['model']['width']}) + ReLU, fp32, median step time of the slowest rank", "",
           f"{'stage':>5} {'world':>5} {'zkern ms':>9} {'peer':<12} {'peer ms':>8} {'ratio':>6}"]
    for r in record["rows"]:
        out.append(f"{r['stage']:>5} {r['world']:>5} {r['zkern_s'] * 1e3:>9.1f} {r['peer']:<12} "
                   f"{r['peer_s'] * 1e3:>8.1f} {r['zkern_s'] / r['peer_s']:>6.2f}")
    for key, value in record["ratios"].items():
        if key.endswith("_host_ms_per_unit"):
            out.append(f"{key}: {value:.3f} ms (stage 3 over stage 0, per unit per step)")
    return "\n".join(out)
