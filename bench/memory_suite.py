"""--suite memory: what each rank really holds, stage by stage, for zkern and the systems that do each stage's job.

    python bench/run.py --suite memory                          # small GPT, world 2, stages 0-3 (CI's gate)
    python bench/run.py --suite memory --world 4 --model 25m --stage 0,1,2,3 --json out.json --plot out.png

Per stage, each system in processes of its own, the same model, data and seed (bench/probe_systems.py): zkern;
DDP (stage 0), ZeroRedundancyOptimizer (1), FSDP2 with reshard_after_forward=False (2) and fully sharded (3);
DeepSpeed at the same stage where it is installed. bf16 for all: zkern and DeepSpeed keep bf16 weights and an fp32
master, the stock systems fp32 weights under autocast (PyTorch's recipe; FSDP2 a bf16 MixedPrecisionPolicy).

It runs on the CPU (ranks over gloo); a GPU's per-phase allocator figures come from `bench/gpu_probe.py variants`.
A rank's peak is measured, not counted: on a CPU every allocation and free through torch's allocator from before
the model is built to the end of two training steps, replayed in order (zkern.testing.allocation_peak: model
states, activations, buffers and temporaries, at the resolution of one allocation); on a GPU the CUDA allocator's
max allocated over the same span. Beside it: the ZeRO formula's model states (zkern.estimate_memory, mixed
precision) and the activations (the live bytes a plain bf16 forward leaves on one rank's batch), and the step
time of a few more steps taken without the measurement (the profiler slows what it watches). Buckets as a Hugging
Face Trainer user's "auto" sets them, for zkern and DeepSpeed alike (run's comment).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

import zkern
from bench import engine_suite, probe_systems
from zkern.testing import TrainSpec, allocation_peak, rank_device, spawn

PEERS = {0: ("ddp",), 1: ("zero1",), 2: ("fsdp2-zero2",), 3: ("fsdp2",)}
STOCK_NAME = {"ddp": "ddp", "zero1": "zero1", "fsdp2-zero2": "fsdp2", "fsdp2": "fsdp2"}
MEASURED_STEPS, TIMED_STEPS = 2, 4


def _run_system(rank: int, world: int, name: str, spec: TrainSpec) -> dict:
    device = rank_device(spec)
    batches = spec.batches(world)

    def step(system, s: int) -> None:
        idx, tgt = (t.to(device) for t in batches[s][0][rank])
        loss = system.forward(idx, tgt, s, rank)
        system.backward(loss)
        system.step()

    def build_and_train():
        system = probe_systems.build(name, spec, world)
        for s in range(MEASURED_STEPS):
            step(system, s)
        return system

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        system = build_and_train()
        peak = torch.cuda.max_memory_allocated(device) - base
    else:
        system, measured = allocation_peak(build_and_train)
        peak = measured.peak["cpu"]
    times = []
    for s in range(MEASURED_STEPS, MEASURED_STEPS + TIMED_STEPS):
        start = time.perf_counter()
        step(system, s)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    system.close()
    return {"peak_bytes": peak, "step_s": statistics.median(times)}


def activation_bytes(spec: TrainSpec) -> int:
    """The bytes a plain forward of the bf16 model leaves live on one rank's micro-batch (what backward will need)."""
    model = spec.make_model().to(torch.bfloat16)
    idx, tgt = spec.batches(1)[0][0][0]
    loss, measured = allocation_peak(lambda: spec.loss(model, idx, tgt, 0))
    del loss
    return measured.end["cpu"]


def run(stages: list[int], world: int | None, model: str, wanted_peers: list[str] | None, progress=print) -> dict:
    world = world or 2
    preset = engine_suite.MODELS[model]
    # The buckets a Hugging Face Trainer user gets ("auto": reduce hidden^2, prefetch 0.9 hidden^2, persistence
    # 10 hidden), for zkern and DeepSpeed alike: DeepSpeed's own 5e7-element prefetch default gathers every unit of
    # a model this small ahead at once, which says nothing about a real model's memory.
    hidden = preset["model"]["dim"]
    spec = dataclasses.replace(engine_suite.make_spec(0, model, MEASURED_STEPS + TIMED_STEPS, "bf16", "cpu"),
                               reduce_bucket_size=hidden**2,
                               zero={"stage3_prefetch_bucket_size": int(0.9 * hidden**2),
                                     "stage3_param_persistence_threshold": 10 * hidden})
    numel = spec.num_params()
    activations = activation_bytes(spec)
    record = {"suite": "memory", "device": "cpu", "model": model, "model_kwargs": preset["model"], "world": world,
              "params": numel, "activation_bytes": activations, "stages": [], "ratios": {}}
    for stage in stages:
        names = [f"zkern{stage}", *PEERS[stage]]
        if probe_systems.deepspeed_installed() and (wanted_peers is None or "deepspeed" in wanted_peers):
            names.append(f"deepspeed{stage}")
        formula = zkern.estimate_memory(numel, world, stage)["total"]
        systems = {}
        for name in names:
            progress(f"[bench] memory: stage {stage}: {name} (world {world})")
            per_rank = spawn(_run_system, world, name, dataclasses.replace(spec, stage=stage), timeout=900)
            systems[name] = {"peak_bytes_per_rank": max(r["peak_bytes"] for r in per_rank),
                             "step_s": max(r["step_s"] for r in per_rank)}
        record["stages"].append({"stage": stage, "formula_bytes": formula, "systems": systems})
        record["ratios"].update(_ratios(stage, systems, formula, activations))
    return record


def _ratios(stage: int, systems: dict, formula: int, activations: int) -> dict:
    zk = systems[f"zkern{stage}"]
    out = {f"stage{stage}_peak_over_formula_plus_activations": zk["peak_bytes_per_rank"] / (formula + activations)}
    for peer in PEERS[stage]:
        out[f"stage{stage}_peak_over_{STOCK_NAME[peer]}"] = zk["peak_bytes_per_rank"] / \
            systems[peer]["peak_bytes_per_rank"]
    ds = systems.get(f"deepspeed{stage}")
    if ds is not None:
        out[f"stage{stage}_peak_over_deepspeed"] = zk["peak_bytes_per_rank"] / ds["peak_bytes_per_rank"]
        out[f"stage{stage}_step_over_deepspeed"] = zk["step_s"] / ds["step_s"]
    return out


def table(record: dict) -> str:
    mib = 2**20
    lines = [f"memory suite: {record['model']} ({record['params']:,} parameters), world {record['world']}, bf16, "
             f"activations {record['activation_bytes'] / mib:.1f} MiB a rank (CPU: torch's allocator, replayed)",
             "", "| stage | system | peak per rank | x formula+activations | step |", "|---|---|---|---|---|"]
    for st in record["stages"]:
        base = st["formula_bytes"] + record["activation_bytes"]
        for name, s in st["systems"].items():
            lines.append(f"| {st['stage']} | {name} | {s['peak_bytes_per_rank'] / mib:.1f} MiB | "
                         f"{s['peak_bytes_per_rank'] / base:.2f} | {s['step_s'] * 1e3:.1f} ms |")
        lines.append(f"| {st['stage']} | ZeRO formula (model states) | {st['formula_bytes'] / mib:.1f} MiB | | |")
    lines += ["", "ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in record["ratios"].items())]
    return "\n".join(lines)


def plot(record: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    stages = [st["stage"] for st in record["stages"]]
    kinds = sorted({name.rstrip("0123") for st in record["stages"] for name in st["systems"]})
    width = 0.8 / (len(kinds) + 1)
    for k, kind in enumerate(kinds):
        values = [next((s["peak_bytes_per_rank"] / 2**20 for n, s in st["systems"].items()
                        if n.rstrip("0123") == kind), 0) for st in record["stages"]]
        ax.bar([x + k * width for x in stages], values, width, label=kind)
    ax.bar([x + len(kinds) * width for x in stages],
           [(st["formula_bytes"] + record["activation_bytes"]) / 2**20 for st in record["stages"]], width,
           label="formula + activations", color="lightgray")
    ax.set_xticks([x + width * len(kinds) / 2 for x in stages], [f"stage {s}" for s in stages])
    ax.set_ylabel("peak per rank (MiB, measured)")
    ax.set_title(f"{record['model']}, world {record['world']}, bf16 ({record['device']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
