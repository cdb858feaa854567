"""Engine suite: zkern stage N against its stock-PyTorch peer (bench/peers.py) and DDP, same model, data, seed.

    python bench/run.py --stage 2 --model tiny

Per system: step time (median, p20-p80, after warm-up), tokens/s, model-state bytes per rank, peak RSS per
rank, final loss and the largest loss gap from DDP's curve. On this CPU only ratios between systems measured
in the same run mean anything; absolute times belong to a GPU.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import subprocess

import torch

from bench import peers
from zkern.testing import TrainSpec, ddp_run, engine_run, mean_losses, spawn

# TinyGPT presets; "steps" is the default number of optimizer steps, the first `warmup` are not timed.
MODELS = {
    "tiny": dict(model=dict(vocab=67, dim=32, n_layer=2, n_head=2, seq=16), micro_batch=4, steps=8, warmup=2,
                 bucket=4096),
    "small": dict(model=dict(vocab=2053, dim=256, n_layer=4, n_head=4, seq=64), micro_batch=4, steps=12, warmup=3,
                  bucket=1_000_000),
}


def _quantiles(times: list[float]) -> dict[str, float]:
    xs = sorted(times)

    def q(f: float) -> float:
        return xs[min(len(xs) - 1, int(round(f * (len(xs) - 1))))]

    return {"median_s": statistics.median(xs), "p20_s": q(0.2), "p80_s": q(0.8)}


def _git_sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run(stage: int, world: int, model: str, steps: int | None = None) -> dict:
    preset = MODELS[model]
    # Buckets of ~1/8 of the model let gradient reduction overlap backward (DDP's 25 MB buckets do the same).
    # Stage 3 gathers one transformer block per fetch unit, as FSDP2 is wrapped here.
    zero = {"stage3_fetch_units": ["Block"]} if stage == 3 else {}
    spec = TrainSpec(stage=stage, steps=steps or preset["steps"], micro_batch=preset["micro_batch"],
                     model=preset["model"], lr=1e-3, overlap_comm=True, reduce_bucket_size=preset["bucket"], zero=zero)
    warmup = min(preset["warmup"], spec.steps - 1)
    tokens_per_step = spec.micro_batch * preset["model"]["seq"] * world
    runs = {"ddp": spawn(ddp_run, world, spec, timeout=1800)}
    for name, fn in peers.PEERS[stage].items():
        runs[name] = spawn(fn, world, spec, timeout=1800)
    runs[f"zkern stage {stage}"] = spawn(engine_run, world, spec, timeout=1800)
    ddp_losses = mean_losses(runs["ddp"])

    def summary(name: str, results: list[dict]) -> dict:
        times = _quantiles(results[0]["step_times"][warmup:])
        losses = mean_losses(results)
        if "memory" in results[0]:  # zkern: its own report, model states only
            state = [sum(v for k, v in r["memory"][next(iter(r["memory"]))].items()
                         if k in ("params", "grads", "optimizer", "master")) for r in results]
        else:
            state = [r["model_state_bytes"] for r in results]
        return {
            "system": name,
            **times,
            "tokens_per_s": tokens_per_step / times["median_s"],
            "model_state_bytes_per_rank": max(state),
            "peak_rss_bytes_per_rank": max(r["peak_rss"] for r in results),
            "final_loss": losses[-1],
            "max_loss_gap_vs_ddp": max(abs(a - b) / abs(b) for a, b in zip(losses, ddp_losses)),
            "losses": losses,
        }

    systems = [summary(name, results) for name, results in runs.items()]
    zk = systems[-1]
    peer = systems[-2]  # the stage's own peer (DDP where the stage has no other)
    return {
        "suite": "engine",
        "stage": stage,
        "world": world,
        "model": model,
        "num_params": sum(p.numel() for p in spec.make_model().parameters()),
        "steps": spec.steps,
        "warmup_steps": warmup,
        "precision": spec.precision,
        "config": spec.config(world),
        "device": "cpu",
        "device_name": platform.processor() or platform.machine(),
        "torch": torch.__version__,
        "git_sha": _git_sha(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "systems": systems,
        "peer": peer["system"],
        "ratios": {"step_time_zkern_over_peer": zk["median_s"] / peer["median_s"],
                   "model_state_zkern_over_peer": (zk["model_state_bytes_per_rank"]
                                                   / peer["model_state_bytes_per_rank"])},
    }


def table(record: dict) -> str:
    head = (f"engine suite: stage {record['stage']}, world {record['world']}, model {record['model']} "
            f"({record['num_params'] / 1e6:.2f}M params), {record['steps']} steps ({record['warmup_steps']} warm-up), "
            f"{record['precision']}, {record['device']}")
    rows = ["| system | step time median [p20-p80] | tokens/s | model states / rank | peak RSS / rank | "
            "final loss | max loss gap vs DDP |",
            "|---|---|---|---|---|---|---|"]
    for s in record["systems"]:
        rows.append(f"| {s['system']} | {s['median_s'] * 1e3:.1f} ms [{s['p20_s'] * 1e3:.1f}-{s['p80_s'] * 1e3:.1f}] | "
                    f"{s['tokens_per_s']:.0f} | {s['model_state_bytes_per_rank'] / 2**20:.2f} MiB | "
                    f"{s['peak_rss_bytes_per_rank'] / 2**20:.0f} MiB | {s['final_loss']:.4f} | "
                    f"{s['max_loss_gap_vs_ddp']:.2e} |")
    r = record["ratios"]
    rows.append(f"\nzkern / {record['peer']}: step time x{r['step_time_zkern_over_peer']:.2f}, model states per "
                f"rank x{r['model_state_zkern_over_peer']:.2f}")
    return head + "\n\n" + "\n".join(rows)
