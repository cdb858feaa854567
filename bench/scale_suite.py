"""Scale suite: a MODEL of stage 3's and ZeRO++'s step time for 7B and 70B GPT shapes from 8 to 1024 GPUs, built
from the bytes zkern's counters showed (tests/comm/test_zeropp.py checks them to the byte) and link bandwidths
given as arguments, checked against the one point this machine can measure (world 4 = 2 "nodes" x 2 ranks).

    python bench/run.py --suite scale                      # table + check (a world-4 run of the small model)
    python bench/run.py --suite scale --plot scale.png     # and the chart
    python bench/run.py --suite scale --intra-gbs 376 --inter-gbs 50 --gpus-per-node 8 --mfu 0.45

Assumptions (a model, not a measurement):
- bf16 weights and gradients, Ψ parameters in L equal layers, one fetch unit and one gradient bucket per layer;
  a fixed global batch (default 4M tokens) split evenly over N GPUs, so the compute per GPU falls as 1/N.
- compute = 6·Ψ·tokens_per_gpu / (peak_tflops · mfu).
- a collective over a group inside one node moves its per-GPU bytes at intra_gbs (NVLink, per direction); one
  that spans nodes at inter_gbs / gpus_per_node (the node's NICs shared by its GPUs); each costs its group's
  (size - 1) hops of latency (a ring).
- stage 3 per step per GPU: 2 all-gathers and 1 reduce-scatter of the model, (N-1)/N · 2Ψ bytes each, across
  nodes once N > gpus_per_node. ZeRO++ (k = gpus_per_node): int8 forward all-gather (N-1)/N · Ψ·(1 + 4/2048)
  across nodes; backward all-gather of the secondary copy (k-1)/k · 2Ψ inside the node; qgZ's int4 hops
  (k-1)/k · Ψ·(1/2 + 4/64) inside and (N/k-1)/(N/k) · Ψ/k·(1/2 + 4/64) across.
- step = compute + max(0, comm - overlap · compute): overlap 1 (prefetch and bucketed reduction hide
  communication behind compute, as on a GPU with NCCL streams) for the prediction; the check on this CPU uses
  overlap 0 (gloo's threads and the model share 2 cores) and leaves out the quantize/dequantize time, which the
  GPU kernels run at memory bandwidth and this CPU's reference path does not.
- a system "stops scaling" at the smallest N where its step time is more than twice compute (communication
  dominates: adding GPUs no longer buys speed).
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import torch

import zkern
from bench.engine_suite import _git_sha, make_spec, sent_per_step, zeropp_config
from zkern.env_report import cpu_model
from zkern.testing import engine_run, spawn

GPUS = [8, 16, 32, 64, 128, 256, 512, 1024]
WEIGHT_G, GRAD_G = 2048, 64


@dataclass(frozen=True)
class Links:
    intra_gbs: float = 376.0  # GB/s per GPU per direction inside a node (NVLink 4 on H100: 450 GB/s, 376 achieved)
    inter_gbs: float = 50.0  # GB/s per node across nodes (4 x 100 Gb/s InfiniBand)
    intra_latency_us: float = 3.0
    inter_latency_us: float = 10.0
    gpus_per_node: int = 8


@dataclass(frozen=True)
class Shape:
    name: str
    params: float
    layers: int


SHAPES = [Shape("7B", 6.7e9, 32), Shape("70B", 70e9, 80)]


def _collective(bytes_per_gpu: float, group: int, inter: bool, count: int, links: Links) -> float:
    """Seconds for `count` collectives moving `bytes_per_gpu` in all over a group of `group` ranks."""
    if group <= 1:
        return 0.0
    bw = (links.inter_gbs / links.gpus_per_node if inter else links.intra_gbs) * 1e9
    latency = (links.inter_latency_us if inter else links.intra_latency_us) * 1e-6
    return bytes_per_gpu / bw + count * (group - 1) * latency


def comm_seconds(system: str, psi: float, layers: int, n: int, links: Links) -> float:
    k = min(links.gpus_per_node, n)
    spans = n > k
    if system == "stage 3":
        return _collective(3 * (n - 1) / n * 2 * psi, n, spans, 3 * layers, links)
    grad = 0.5 + 4 / GRAD_G  # int4 codes + an fp32 scale per group, bytes per element
    nodes = n // k
    return (_collective((n - 1) / n * psi * (1 + 4 / WEIGHT_G), n, spans, layers, links)
            + _collective((k - 1) / k * 2 * psi, k, False, layers, links)
            + _collective((k - 1) / k * psi * grad, k, False, layers, links)
            + _collective((nodes - 1) / max(nodes, 1) * psi / k * grad, nodes, True, layers, links))


def step_seconds(compute: float, comm: float, overlap: float) -> float:
    return compute + max(0.0, comm - overlap * compute)


def predict(links: Links, peak_tflops: float, mfu: float, global_tokens: float) -> list[dict]:
    rows = []
    for shape in SHAPES:
        for n in GPUS:
            compute = 6 * shape.params * global_tokens / n / (peak_tflops * 1e12 * mfu)
            row = {"shape": shape.name, "gpus": n, "compute_s": compute}
            for system in ("stage 3", "zero++"):
                comm = comm_seconds(system, shape.params, shape.layers, n, links)
                row[f"{system} comm_s"] = comm
                row[f"{system} step_s"] = step_seconds(compute, comm, 1.0)
            rows.append(row)
    return rows


def stops_scaling(rows: list[dict]) -> dict:
    out = {}
    for shape in SHAPES:
        for system in ("stage 3", "zero++"):
            over = [r["gpus"] for r in rows if r["shape"] == shape.name and r[f"{system} step_s"] > 2 * r["compute_s"]]
            out[f"{shape.name} {system}"] = over[0] if over else None
    return out


# -- the measurable point --------------------------------------------------------------------------------------------
def _loopback(rank: int, world: int, numel: int, reps: int) -> dict:
    """Per-rank bandwidth and latency of gloo all-gathers on this machine (the 'links' of the check)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")  # spawn set torchrun's environment
    big, small = torch.zeros(numel), torch.zeros(1)
    out_big, out_small = torch.empty(numel * world), torch.empty(world)
    times = {"big": [], "small": []}
    for _ in range(reps):
        for name, (o, i) in (("big", (out_big, big)), ("small", (out_small, small))):
            dist.barrier()
            start = time.perf_counter()
            dist.all_gather(list(o.chunk(world)), i)
            times[name].append(time.perf_counter() - start)
    dist.destroy_process_group()
    latency = statistics.median(times["small"]) / (world - 1)
    sent = (world - 1) * numel * 4
    return {"gbs": sent / (statistics.median(times["big"]) - latency * (world - 1)) / 1e9, "latency_s": latency}


def check(progress) -> dict:
    """Plain stage 3 and ZeRO++ (all three) on the small model at world 4 = 2 x 2 here: compute is what the plain
    run's step leaves after its modelled communication; the model then predicts the ZeRO++ step."""
    world = 4
    link = spawn(_loopback, world, 2_000_000, 5, timeout=600)[0]
    progress(f"scale: loopback all-gather {link['gbs']:.2f} GB/s per rank, {link['latency_s'] * 1e6:.0f} us per hop")
    spec = dataclasses.replace(make_spec(3, "small", None), extra_config={"ranks_per_node": 2})
    runs = {}
    for name, zero in (("stage 3", {}), ("zero++", zeropp_config("qwz+hpz+qgz", world))):
        progress(f"scale: world 4 {name}")
        s = dataclasses.replace(spec, zero={**spec.zero, **zero})
        res = spawn(engine_run, world, s, timeout=3600, subprocess=True)
        warm = 3
        step = statistics.median(res[0]["step_times"][warm:])
        sent = {w: sent_per_step(res, ("reduce_scatter", "all_gather", "all_to_all"), s.steps, where=w)
                for w in ("intra", "inter")}
        runs[name] = {"step_s": step, "bytes": sent}
    # Here every link is the loopback: comm time = all bytes / the loopback's measured bandwidth
    gbs = link["gbs"] * 1e9

    def modelled(name: str) -> float:
        return (runs[name]["bytes"]["intra"] + runs[name]["bytes"]["inter"]) / gbs

    compute = runs["stage 3"]["step_s"] - modelled("stage 3")
    predicted = step_seconds(compute, modelled("zero++"), 0.0)
    return {"loopback": link, "runs": runs, "compute_s": compute, "predicted_zeropp_step_s": predicted,
            "measured_zeropp_step_s": runs["zero++"]["step_s"],
            "predicted_over_measured": predicted / runs["zero++"]["step_s"]}


def run(links: Links, peak_tflops: float = 989.0, mfu: float = 0.45, global_tokens: float = 4 * 2**20,
        measure: bool = True, progress=None) -> dict:
    progress = progress or (lambda line: print(f"[bench] {line}", file=sys.stderr, flush=True))
    rows = predict(links, peak_tflops, mfu, global_tokens)
    return {
        "suite": "scale",
        "kind": "model",
        "links": asdict(links),
        "peak_tflops": peak_tflops,
        "mfu": mfu,
        "global_tokens": global_tokens,
        "rows": rows,
        "stops_scaling_at": stops_scaling(rows),
        "check": check(progress) if measure else None,
        "device_name": cpu_model(),
        "versions": {"zkern": zkern.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "git_sha": _git_sha(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ratios": {},
    }


def table(record: dict) -> str:
    li = record["links"]
    out = [f"scale suite (a MODEL, see bench/scale_suite.py for its assumptions): {li['gpus_per_node']} GPUs per node, "
           f"{li['intra_gbs']:.0f} GB/s inside, {li['inter_gbs']:.0f} GB/s per node across "
           f"({li['intra_latency_us']:.0f}/{li['inter_latency_us']:.0f} us per hop), {record['peak_tflops']:.0f} "
           f"TFLOP/s at MFU {record['mfu']:.2f}, {record['global_tokens'] / 2**20:.0f}M tokens per step", "",
           "| shape | GPUs | compute | stage 3 comm | stage 3 step | ZeRO++ comm | ZeRO++ step | ZeRO++ speed-up |",
           "|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        out.append(f"| {r['shape']} | {r['gpus']} | {r['compute_s']:.3f} s | {r['stage 3 comm_s']:.3f} s | "
                   f"{r['stage 3 step_s']:.3f} s | {r['zero++ comm_s']:.3f} s | {r['zero++ step_s']:.3f} s | "
                   f"x{r['stage 3 step_s'] / r['zero++ step_s']:.2f} |")
    out.append("")
    for system, n in record["stops_scaling_at"].items():
        out.append(f"{system}: " + (f"stops scaling at {n} GPUs (step time over twice the compute: communication "
                                     f"no longer hides)" if n else "still scaling at 1024 GPUs"))
    c = record["check"]
    if c:
        out += ["", f"check at world 4 = 2 x 2 on this machine (loopback {c['loopback']['gbs']:.2f} GB/s): plain "
                f"stage 3 {c['runs']['stage 3']['step_s'] * 1e3:.0f} ms/step, compute inferred "
                f"{c['compute_s'] * 1e3:.0f} ms; ZeRO++ predicted {c['predicted_zeropp_step_s'] * 1e3:.0f} ms, "
                f"measured {c['measured_zeropp_step_s'] * 1e3:.0f} ms (x{c['predicted_over_measured']:.2f}; the "
                f"model leaves out quantization time)"]
    return "\n".join(out)


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(11, 4))
    for ax, shape in zip(axes, SHAPES):
        rows = [r for r in record["rows"] if r["shape"] == shape.name]
        n = [r["gpus"] for r in rows]
        ax.plot(n, [r["compute_s"] for r in rows], "k--", label="compute alone")
        ax.plot(n, [r["stage 3 step_s"] for r in rows], "o-", label="ZeRO stage 3")
        ax.plot(n, [r["zero++ step_s"] for r in rows], "s-", label="ZeRO++ (qwZ+hpZ+qgZ)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("step time, s (model)")
        ax.set_title(f"{shape.name}, {record['global_tokens'] / 2**20:.0f}M tokens/step")
        ax.legend()
    fig.suptitle("A model, not a measurement: bench/scale_suite.py states its assumptions")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
