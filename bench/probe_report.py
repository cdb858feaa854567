"""What `python bench/gpu_probe.py` prints: a variants record as a table (with each system's losses and gradient
norms), one line per finished variant, and the summary of a lease's folder (bench/gpu_lease.sh prints it last).

    python bench/gpu_probe.py summary bench/results/gpu-lease
"""

from __future__ import annotations

import json
import os


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _line(r: dict) -> str:
    if "error" in r:
        return "ERROR " + r["error"].strip().splitlines()[-1][:200]
    m = r["memory"]
    peak = m["timed_peak"].get("allocated", m["timed_peak"].get("rss"))
    mfu = f" MFU(matmul) {r['mfu_of_matmul']:.1%}" if r.get("mfu_of_matmul") else ""
    return (f"step {r['step_s']['median'] * 1e3:.1f} ms, {r['tflops_per_rank']:.1f} TFLOPS{mfu}, peak "
            f"{_gib(peak)} GiB, wall {r['wall_s']:.0f} s")


def table(record: dict) -> str:
    rows = ["| system | step ms (min-max) | TFLOPS | MFU of matmul | build GiB | after fwd | bwd peak | after step | "
            "peak | reserved peak |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["variants"]:
        if "error" in r:
            rows.append(f"| {r['system']} | error: {r['error'].strip().splitlines()[-1][:80]} |||||||||")
            continue
        m, key = r["memory"], "allocated" if "allocated" in r["memory"]["build"] else "rss"
        s = r["step_s"]
        mfu = f"{r['mfu_of_matmul']:.1%}" if r.get("mfu_of_matmul") else "-"
        rows.append(f"| {r['system']} | {s['median'] * 1e3:.1f} ({s['min'] * 1e3:.1f}-{s['max'] * 1e3:.1f}) | "
                    f"{r['tflops_per_rank']:.1f} | {mfu} | {_gib(m['build'][key])} | {_gib(m['after_forward'][key])}"
                    f" | {_gib(m['backward_peak'][key])} | {_gib(m['after_step'][key])} | "
                    f"{_gib(m['timed_peak'][key])} | {_gib(m['timed_peak'].get('reserved'))} |")
    return "\n".join(rows)


def _trajectories(record: dict) -> list[str]:
    """Each system's losses (and gradient norms, where recorded), step by step: what says whether two systems trained
    the same model."""
    lines = []
    for r in record["variants"]:
        if "losses" in r:
            norms = f"; grad norms {', '.join(f'{x:.4g}' for x in r['grad_norms'])}" if r.get("grad_norms") else ""
            lines.append(f"  {r['system']}: losses {', '.join(f'{x:.4f}' for x in r['losses'])}{norms}")
    return lines


def summary(folder: str) -> str:
    """The tables of every record a lease wrote into folder (bw, variants, world2) and its steps' exit lines."""
    from bench import probe_world2

    out = []
    steps = os.path.join(folder, "steps.txt")
    if os.path.exists(steps):
        with open(steps) as f:
            out += ["steps: " + "; ".join(line.strip() for line in f)]
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(folder, name)) as f:
            try:
                rec = json.load(f)
            except json.JSONDecodeError as e:
                out.append(f"{name}: unreadable ({e})")
                continue
        match rec.get("probe"):
            case "bw":
                figures = ", ".join(f"{k} {v:.1f}" for k, v in rec.items() if k.endswith(("_gbs", "_tflops")))
                out.append(f"{name}: {rec['machine'].get('device')}: {figures}")
            case "variants":
                out += [f"{name}: model {rec['model']}, world {rec.get('world', 1)}, "
                        f"micro-batch {rec['micro_batch']}"
                        + ("" if rec.get("timing_meaningful", True)
                           else " (step times not meaningful: ranks share one GPU)"),
                        table(rec)] + _trajectories(rec)
            case "world2":
                out += [f"{name}:", probe_world2.table(rec)]
    return "\n".join(out)
