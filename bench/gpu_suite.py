"""--suite gpu: the first GPU run is one command. On whatever CUDA machine it finds, in order (../shared/GPU.md):

    python bench/run.py --suite gpu                  # runs every step; a failing step is recorded, the next runs
    python bench/run.py --suite gpu --dry-run        # the plan, on any machine

  env       python -m zkern.env_report --json                        -> <gpu>-env.json
  tests     pytest -m "gpu or not dist", TRITON_INTERPRET unset     -> <gpu>-tests.log (every kernel compiled)
  kernels   bench/run.py --suite kernels                            -> <gpu>-kernels.json
  engine    bench/run.py --stage 0,1,2,3 --model 1b (+ plot)        -> <gpu>-1b-stages0-3.json / .png
  offload   bench/run.py --stage 2,3 --model 1b --offload           -> <gpu>-1b-offload.json
  verify    python -m zkern.verify --device cuda                    -> <gpu>-verify.json

Everything lands in bench/results/ under the GPU's short name (h100, h200, a100, ...), to commit as it is. Each
step runs in a process of its own with its own time limit, so one that fails or hangs costs only itself; the
suite's record lists each step's command, exit status, seconds and output files. No figure is ever written here
that the GPU did not print.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join("bench", "results")
STEP_TIMEOUT_S = 3000


@dataclass
class Step:
    name: str
    argv: list[str]
    outputs: list[str]  # paths relative to the checkout
    stdout_to: str | None = None  # the step's stdout is this output (env_report prints its JSON)
    env: dict[str, str | None] = field(default_factory=dict)  # None: unset
    timeout_s: int = STEP_TIMEOUT_S


def gpu_slug(device_name: str) -> str:
    """A short file-name prefix for a CUDA device name: 'NVIDIA H100 80GB HBM3' -> 'h100'."""
    known = re.search(r"\b(GH200|GB200|B200|B100|H200|H100|H800|H20|A100|A800|A10G|A10|L40S|L40|L4|V100|T4|"
                      r"RTX ?\d{4})\b", device_name, re.IGNORECASE)
    if known:
        return known.group(1).lower().replace(" ", "")
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower().replace("nvidia", "")).strip("-")
    return slug or "gpu"


def plan(slug: str, python: str = sys.executable) -> list[Step]:
    def out(name: str) -> str:
        return os.path.join(RESULTS, f"{slug}-{name}")

    run_py = [python, os.path.join("bench", "run.py")]
    return [
        Step("env", [python, "-m", "zkern.env_report", "--json"], [out("env.json")], stdout_to=out("env.json")),
        Step("tests", [python, "-m", "pytest", "tests", "-q", "-m", "gpu or not dist", "-p", "no:cacheprovider"],
             [out("tests.log")], stdout_to=out("tests.log"), env={"TRITON_INTERPRET": None}),
        Step("kernels", [*run_py, "--suite", "kernels", "--json", out("kernels.json")], [out("kernels.json")],
             env={"TRITON_INTERPRET": None}),
        Step("engine", [*run_py, "--stage", "0,1,2,3", "--model", "1b", "--json", out("1b-stages0-3.json"),
                        "--plot", out("1b-stages0-3.png")], [out("1b-stages0-3.json"), out("1b-stages0-3.png")]),
        Step("offload", [*run_py, "--stage", "2,3", "--model", "1b", "--offload", "--json", out("1b-offload.json")],
             [out("1b-offload.json")]),
        Step("verify", [python, "-m", "zkern.verify", "--device", "cuda", "--json", out("verify.json")],
             [out("verify.json")]),
    ]


def _execute(step: Step) -> dict:
    env = dict(os.environ)
    for key, value in step.env.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    start = time.monotonic()
    try:
        if step.stdout_to:
            with open(os.path.join(ROOT, step.stdout_to), "w") as f:
                done = subprocess.run(step.argv, cwd=ROOT, env=env, stdout=f, timeout=step.timeout_s)
        else:
            done = subprocess.run(step.argv, cwd=ROOT, env=env, timeout=step.timeout_s)
        rc = done.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    written = [p for p in step.outputs if os.path.exists(os.path.join(ROOT, p))]
    return {**asdict(step), "rc": rc, "seconds": round(time.monotonic() - start, 1), "written": written}


def run(dry_run: bool = False, device_name: str | None = None) -> dict:
    import torch

    if device_name is None:
        if not torch.cuda.is_available():
            if not dry_run:
                raise SystemExit("bench: --suite gpu runs on a CUDA machine, and torch sees no GPU here; "
                                 "`--suite gpu --dry-run` prints the plan, `--suite gpu-static` checks the kernels "
                                 "without a GPU")
            device_name = "GPU"  # files named gpu-*: the plan's shape, no device
        else:
            device_name = torch.cuda.get_device_name(0)
    slug = gpu_slug(device_name)
    steps = plan(slug)
    record = {"suite": "gpu", "device": device_name, "slug": slug, "dry_run": dry_run,
              "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0, "steps": []}
    os.makedirs(os.path.join(ROOT, RESULTS), exist_ok=True)
    for step in steps:
        if dry_run:
            record["steps"].append({**asdict(step), "rc": None, "seconds": None, "written": []})
            continue
        print(f"[bench gpu] {step.name}: {' '.join(step.argv)}", file=sys.stderr, flush=True)
        record["steps"].append(_execute(step))
    record["failures"] = [f"{s['name']}: exit {s['rc']}" for s in record["steps"] if s["rc"] not in (0, None)]
    return record


def table(record: dict) -> str:
    out = [f"GPU run on {record['device']} ({'plan only' if record['dry_run'] else 'executed'}), files "
           f"bench/results/{record['slug']}-*"]
    for s in record["steps"]:
        status = "planned" if s["rc"] is None else (f"ok in {s['seconds']}s" if s["rc"] == 0 else f"FAILED ({s['rc']})")
        out.append(f"  {s['name']:<8} {status:<16} {' '.join(s['argv'][1:])}")
    return "\n".join(out)
