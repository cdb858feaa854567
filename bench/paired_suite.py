"""The paired suite: zkern and its stock peer in the same ranks, stepping in turn, timed step by step.

    python bench/run.py --suite paired --stage 0,1 --model small --steps 30

The engine suite runs each system in processes of its own, one after the other, so a shared machine's load that
comes and goes falls on one system and not the other: on 2026-11-24 two back-to-back runs read stage 0 at x0.81
and x1.00 DDP's step time. Here stage 0 (against DDP + AdamW) and stage 1 (against DDP +
ZeroRedundancyOptimizer) are built side by side in each rank, from the same initial weights, and step the same
batches in turn (zkern first on even steps, the peer first on odd ones); the figure is the median over steps of
zkern's time over the peer's in that step, with the forward, backward and optimizer-step medians of each, and the
largest relative loss gap between them (the same model, weights and data: what separates them is float32 rounding,
compounded over the steps).
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time

import torch

import zkern
from bench.engine_suite import _git_sha, make_spec
from zkern.env_report import cpu_model
from zkern.testing.ranks import spawn
from zkern.testing.runs import init_peer_group

PEERS = {0: "ddp", 1: "zero1"}
WARMUP = 3


def _peer(stage: int, model: torch.nn.Module, spec):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    params = list(model.parameters())
    if stage == 1:
        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=spec.lr,
                                      weight_decay=spec.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return ddp, opt


def _rank(rank: int, world: int, stage: int, model: str, steps: int) -> dict:
    spec = make_spec(stage, model, steps)
    init_peer_group(spec)
    ddp, opt = _peer(stage, spec.make_model(), spec)
    engine = spec.build_engine(spec.make_model(), world)
    batches = spec.batches(world)
    phases = {"zkern": [], "peer": []}
    gap = 0.0
    for step in range(steps):
        idx, tgt = batches[step][0][rank]
        losses = {}
        for who in (("zkern", "peer") if step % 2 == 0 else ("peer", "zkern")):
            start = time.perf_counter()
            if who == "peer":
                opt.zero_grad()
                loss = spec.loss(ddp, idx, tgt, step, rank)
                forward = time.perf_counter()
                loss.backward()
                backward = time.perf_counter()
                opt.step()
            else:
                loss = spec.loss(engine, idx, tgt, step, rank)
                forward = time.perf_counter()
                engine.backward(loss)
                backward = time.perf_counter()
                engine.step()
            end = time.perf_counter()
            losses[who] = loss.item()
            phases[who].append((end - start, forward - start, backward - forward, end - backward))
        gap = max(gap, abs(losses["zkern"] - losses["peer"]) / abs(losses["peer"]))
    engine.destroy()
    return {"phases": phases, "loss_gap": gap}


def _median(rows: list[tuple], k: int) -> float:
    return statistics.median(r[k] for r in rows)


def run_stage(stage: int, world: int, model: str, steps: int) -> dict:
    per_rank = spawn(_rank, world, stage, model, steps, timeout=1800.0)
    out = {"stage": stage, "peer": PEERS[stage], "ranks": []}
    for res in per_rank:
        z, p = res["phases"]["zkern"][WARMUP:], res["phases"]["peer"][WARMUP:]
        ratios = sorted(a[0] / b[0] for a, b in zip(z, p))
        out["ranks"].append({
            "step_time_paired_ratio": statistics.median(ratios),
            "ratio_p20_p80": [ratios[len(ratios) // 5], ratios[(4 * len(ratios)) // 5]],
            **{f"{who}_{name}_s": _median(rows, k) for who, rows in (("zkern", z), ("peer", p))
               for k, name in enumerate(("step", "forward", "backward", "optimizer"))},
            "max_loss_gap": res["loss_gap"]})
    out["step_time_paired_ratio"] = max(r["step_time_paired_ratio"] for r in out["ranks"])
    return out


def run(stages: list[int], world: int | None = None, model: str = "small", steps: int | None = None) -> dict:
    unknown = [s for s in stages if s not in PEERS]
    if unknown:
        raise SystemExit(f"bench: the paired suite runs stages 0 and 1 (peers {PEERS}); got {unknown}")
    world, steps = world or 2, steps or 30
    if steps <= WARMUP + 2:
        raise SystemExit(f"bench: the paired suite needs --steps above {WARMUP + 2} ({WARMUP} are warm-up)")
    return {"suite": "paired", "model": model, "world": world, "steps": steps, "warmup": WARMUP, "device": "cpu",
            "device_name": cpu_model(), "git_sha": _git_sha(),
            "versions": {"zkern": zkern.__version__, "torch": torch.__version__, "python": platform.python_version()},
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "stages": [run_stage(s, world, model, steps) for s in stages]}


def table(record: dict) -> str:
    out = [f"paired suite: world {record['world']}, model {record['model']}, {record['steps']} steps "
           f"({record['warmup']} warm-up), {record['device_name']}", "",
           "| stage | peer | rank | zkern / peer, per-step median [p20-p80] | step ms zkern, peer | forward | backward "
           "| optimizer | max loss gap |", "|---|---|---|---|---|---|---|---|---|"]
    for st in record["stages"]:
        for rank, r in enumerate(st["ranks"]):
            ms = {k: v * 1e3 for k, v in r.items() if k.endswith("_s")}
            out.append(f"| {st['stage']} | {st['peer']} | {rank} | x{r['step_time_paired_ratio']:.3f} "
                       f"[{r['ratio_p20_p80'][0]:.2f}-{r['ratio_p20_p80'][1]:.2f}] | {ms['zkern_step_s']:.1f}, "
                       f"{ms['peer_step_s']:.1f} | {ms['zkern_forward_s']:.1f}, {ms['peer_forward_s']:.1f} | "
                       f"{ms['zkern_backward_s']:.1f}, {ms['peer_backward_s']:.1f} | {ms['zkern_optimizer_s']:.1f}, "
                       f"{ms['peer_optimizer_s']:.1f} | {r['max_loss_gap']:.1e} |")
    return "\n".join(out)
