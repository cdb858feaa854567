"""The bf16-state suite: does training with the optimizer's state in bf16 end where training with fp32 state does?

    python bench/run.py --suite bf16-state                  # the small GPT, 300 steps, stage 2, world 1
    python bench/run.py --suite bf16-state --model tiny --steps 600

One model, one data stream (zkern.testing's learnable counting sequences), one seed, bf16 training at stage 2 and
lr 1e-3, run once per optimizer state: fp32 moments and master (the baseline), bf16 moments (bf16.bf16_optimizer_states)
rounded to nearest and stochastically (bf16_stochastic_rounding), and a bf16 master too
(bf16_master_weights_and_grads) rounded each way. Figures: the mean loss of the last 50 steps and its gap to the
baseline's, the loss per 50 steps, and the seconds each run took. The speed of the bf16-state step is the adam
suite's (bytes per parameter and the roofline); this suite is about where training ends.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import time

import torch

import zkern
from bench.engine_suite import _git_sha, make_spec
from zkern.testing import engine_run

VARIANTS = {
    "fp32 state": ({}, False),
    "bf16 moments": ({"bf16_optimizer_states": True}, False),
    "bf16 moments, stochastic": ({"bf16_optimizer_states": True}, True),
    "bf16 master and moments": ({"bf16_optimizer_states": True, "bf16_master_weights_and_grads": True}, False),
    "bf16 master and moments, stochastic": (
        {"bf16_optimizer_states": True, "bf16_master_weights_and_grads": True}, True),
}
TAIL = 50  # the steps whose mean loss is compared


def run(model: str = "small", steps: int | None = None, progress=None) -> dict:
    steps = steps or 300
    if steps <= TAIL:
        raise SystemExit(f"bench: the bf16-state suite compares the mean loss of the last {TAIL} steps: give "
                         f"--steps above {TAIL}")
    progress = progress or (lambda line: print(f"[bench] {line}", flush=True))
    base = make_spec(2, model, steps, precision="bf16")
    runs = {}
    for name, (keys, stochastic) in VARIANTS.items():
        extra = {"bf16": {"enabled": True, **keys}, **({"bf16_stochastic_rounding": True} if stochastic else {})}
        start = time.perf_counter()
        losses = engine_run(0, 1, dataclasses.replace(base, extra_config=extra))["losses"]
        seconds = time.perf_counter() - start
        runs[name] = {"config": extra, "final_loss": sum(losses[-TAIL:]) / TAIL, "seconds": seconds,
                      "loss_per_50": [sum(losses[i:i + 50]) / len(losses[i:i + 50]) for i in range(0, steps, 50)]}
        progress(f"{name}: final loss {runs[name]['final_loss']:.4f} ({seconds:.0f} s)")
    ref = runs["fp32 state"]["final_loss"]
    for r in runs.values():
        r["gap_to_fp32_state"] = (r["final_loss"] - ref) / ref
    return {"suite": "bf16-state", "model": model, "model_config": base.model, "steps": steps, "lr": base.lr,
            "stage": 2, "world": 1, "tail": TAIL, "device": "cpu",
            "versions": {"zkern": zkern.__version__, "torch": torch.__version__, "python": platform.python_version()},
            "git_sha": _git_sha(), "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "runs": runs}


def table(record: dict) -> str:
    out = [f"bf16-state suite: {record['model']} GPT, {record['steps']} steps, stage 2, world 1, lr {record['lr']:g}; "
           f"mean loss of the last {record['tail']} steps", "",
           "| optimizer state | final loss | vs fp32 state | loss per 50 steps | seconds |", "|---|---|---|---|---|"]
    for name, r in record["runs"].items():
        curve = " ".join(f"{x:.3f}" for x in r["loss_per_50"])
        out.append(f"| {name} | {r['final_loss']:.4f} | {r['gap_to_fp32_state'] * 100:+.2f}% | {curve} | "
                   f"{r['seconds']:.0f} |")
    return "\n".join(out)
