"""--suite memory: what each rank really holds, stage by stage, for zkern and the systems that do each stage's job.

    python bench/run.py --suite memory                          # small GPT, world 2, stages 0-3
    python bench/run.py --suite memory --world 4 --peers zero1,fsdp2   # CI's gate (the world-4 ratios)
    python bench/run.py --suite memory --world 2,4,8 --json out.json --plot out.png   # peak against world size

Per stage, each system in processes of its own, the same model, data and seed (bench/probe_systems.py): zkern;
DDP (stage 0), ZeroRedundancyOptimizer (1), FSDP2 with reshard_after_forward=False (2) and fully sharded (3);
DeepSpeed at the same stage where it is installed; at stage 3 also zkern keeping a bf16 working shard to gather
from (zkern3-keep: its between-steps K, and its step time over the default's). bf16 for all: zkern and DeepSpeed
keep bf16 weights and an fp32 master, the stock systems fp32 weights under autocast (PyTorch's recipe; FSDP2 a bf16
MixedPrecisionPolicy).

It runs on the CPU (ranks over gloo); a GPU's per-phase allocator figures come from `bench/gpu_probe.py variants`.
A rank's peak is measured, not counted: on a CPU every allocation and free through torch's allocator from before
the model is built to the end of two training steps, replayed in order (zkern.testing.allocation_peak: model
states, activations, buffers and temporaries, at the resolution of one allocation); on a GPU the CUDA allocator's
max allocated over the same span. Beside it: the ZeRO formula's model states (zkern.estimate_memory, mixed
precision) and the activations (the live bytes a plain bf16 forward leaves on one rank's batch), and the step
time of a few more steps taken without the measurement (the profiler slows what it watches). Buckets as a Hugging
Face Trainer user's "auto" sets them, for zkern and DeepSpeed alike (run's comment).

Between steps: what every live tensor holds at the end of the measured span, beyond what was live before it (a walk
over the garbage collector's tensors, overlaps merged: the replay's end can miss a free made on one of gloo's
threads), after the second step and a zero_grad(set_to_none=True) for the stock loops, as a torch user's next step
begins: the model states a rank keeps,
in bytes and in bytes per model parameter times the world size (ZeRO's K for what is sharded: 12 for FSDP2's fp32
shard and two moments). With several worlds (--world 2,4,8) the record holds one run per world and its ratios are
keyed "world<N>_..."; the plot is each system's peak per rank against the world size.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

import zkern
from bench import engine_suite, probe_systems
from zkern.testing import TrainSpec, allocation_peak, live_tensor_bytes, rank_device, spawn

PEERS = {0: ("ddp",), 1: ("zero1",), 2: ("fsdp2-zero2",), 3: ("fsdp2",)}
STOCK_NAME = {"ddp": "ddp", "zero1": "zero1", "fsdp2-zero2": "fsdp2", "fsdp2": "fsdp2"}
MEASURED_STEPS, TIMED_STEPS = 2, 4
# zkern beside itself: stage 3 keeping a bf16 working shard to gather from (what it costs in memory, buys in time)
ZKERN_VARIANTS = {3: ("zkern3-keep",)}


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
        if hasattr(system, "opt"):  # a stock loop's gradients go at its next zero_grad: what a step leaves
            system.opt.zero_grad(set_to_none=True)
        return system

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        system = build_and_train()
        peak = torch.cuda.max_memory_allocated(device) - base
        between = torch.cuda.memory_allocated(device) - base
    else:
        before = live_tensor_bytes()
        system, measured = allocation_peak(build_and_train)
        # between steps: every live tensor's bytes (the replay's end can miss a free made on a gloo thread)
        peak, between = measured.peak["cpu"], live_tensor_bytes() - before
    times = []
    for s in range(MEASURED_STEPS, MEASURED_STEPS + TIMED_STEPS):
        start = time.perf_counter()
        step(system, s)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    system.close()
    return {"peak_bytes": peak, "between_bytes": between, "step_s": statistics.median(times)}


def activation_bytes(spec: TrainSpec) -> int:
    """The bytes a plain forward of the bf16 model leaves live on one rank's micro-batch (what backward will need)."""
    model = spec.make_model().to(torch.bfloat16)
    idx, tgt = spec.batches(1)[0][0][0]
    loss, measured = allocation_peak(lambda: spec.loss(model, idx, tgt, 0))
    del loss
    return measured.end["cpu"]


def run(stages: list[int], worlds: list[int] | int | None, model: str, wanted_peers: list[str] | None,
        progress=print) -> dict:
    worlds = [worlds or 2] if not isinstance(worlds, list) else worlds
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
    record = {"suite": "memory", "device": "cpu", "model": model, "model_kwargs": preset["model"], "worlds": worlds,
              "params": numel, "activation_bytes": activations, "runs": [], "ratios": {}}
    for world in worlds:
        run_ = {"world": world, "stages": []}
        for stage in stages:
            names = [f"zkern{stage}", *ZKERN_VARIANTS.get(stage, ()), *PEERS[stage]]
            if probe_systems.deepspeed_installed() and (wanted_peers is None or "deepspeed" in wanted_peers):
                names.append(f"deepspeed{stage}")
            formula = zkern.estimate_memory(numel, world, stage)["total"]
            systems = {}
            for name in names:
                progress(f"[bench] memory: stage {stage}: {name} (world {world})")
                per_rank = spawn(_run_system, world, name, dataclasses.replace(spec, stage=stage), timeout=900)
                between = max(r["between_bytes"] for r in per_rank)
                systems[name] = {"peak_bytes_per_rank": max(r["peak_bytes"] for r in per_rank),
                                 "between_bytes_per_rank": between, "between_k": between * world / numel,
                                 "step_s": max(r["step_s"] for r in per_rank)}
            run_["stages"].append({"stage": stage, "formula_bytes": formula, "systems": systems})
            record["ratios"].update({f"world{world}_{k}": v for k, v in _ratios(stage, systems, formula,
                                                                                 activations).items()})
        record["runs"].append(run_)
    return record


def _ratios(stage: int, systems: dict, formula: int, activations: int) -> dict:
    zk = systems[f"zkern{stage}"]
    out = {f"stage{stage}_peak_over_formula_plus_activations": zk["peak_bytes_per_rank"] / (formula + activations),
           f"stage{stage}_between_k": zk["between_k"]}
    for peer in PEERS[stage]:
        if peer in systems:
            out[f"stage{stage}_peak_over_{STOCK_NAME[peer]}"] = zk["peak_bytes_per_rank"] / \
                systems[peer]["peak_bytes_per_rank"]
            out[f"stage{stage}_between_over_{STOCK_NAME[peer]}"] = zk["between_bytes_per_rank"] / \
                systems[peer]["between_bytes_per_rank"]
    keep = systems.get(f"zkern{stage}-keep")
    if keep is not None:  # what the kept working shard costs and buys: its bytes, the cast's time
        out[f"stage{stage}_keep_between_k"] = keep["between_k"]
        out[f"stage{stage}_keep_step_over_cast"] = keep["step_s"] / zk["step_s"]
    ds = systems.get(f"deepspeed{stage}")
    if ds is not None:
        out[f"stage{stage}_peak_over_deepspeed"] = zk["peak_bytes_per_rank"] / ds["peak_bytes_per_rank"]
        out[f"stage{stage}_step_over_deepspeed"] = zk["step_s"] / ds["step_s"]
    return out


def table(record: dict) -> str:
    mib = 2**20
    lines = [f"memory suite: {record['model']} ({record['params']:,} parameters), bf16, activations "
             f"{record['activation_bytes'] / mib:.1f} MiB a rank (CPU: torch's allocator, replayed); between steps: "
             f"bytes a rank keeps, and per parameter times the world (K)", "",
             "| world | stage | system | peak per rank | x formula+activations | between steps | K | step |",
             "|---|---|---|---|---|---|---|---|"]
    for run_ in record["runs"]:
        for st in run_["stages"]:
            base = st["formula_bytes"] + record["activation_bytes"]
            for name, s in st["systems"].items():
                lines.append(f"| {run_['world']} | {st['stage']} | {name} | {s['peak_bytes_per_rank'] / mib:.1f} MiB | "
                             f"{s['peak_bytes_per_rank'] / base:.2f} | {s['between_bytes_per_rank'] / mib:.1f} MiB | "
                             f"{s['between_k']:.1f} | {s['step_s'] * 1e3:.1f} ms |")
            lines.append(f"| {run_['world']} | {st['stage']} | ZeRO formula (model states) | "
                         f"{st['formula_bytes'] / mib:.1f} MiB | | | | |")
    lines += ["", "ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in record["ratios"].items())]
    return "\n".join(lines)


def plot(record: dict, path: str) -> None:
    """Each system's peak per rank against the world size (one line per system), the ZeRO formula dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    worlds = [r["world"] for r in record["runs"]]
    names = sorted({n for r in record["runs"] for st in r["stages"] for n in st["systems"]})
    for name in names:
        points = [(r["world"], s["systems"][name]["peak_bytes_per_rank"] / 2**20) for r in record["runs"]
                  for s in r["stages"] if name in s["systems"]]
        ax.plot(*zip(*points), marker="o", label=name, linestyle="-" if name.startswith("zkern") else ":")
    for stage in sorted({st["stage"] for r in record["runs"] for st in r["stages"]}):
        points = [(r["world"], (st["formula_bytes"] + record["activation_bytes"]) / 2**20) for r in record["runs"]
                  for st in r["stages"] if st["stage"] == stage]
        ax.plot(*zip(*points), color="lightgray", linestyle="--", linewidth=1)
    ax.set_xticks(worlds)
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("peak per rank (MiB, measured)")
    ax.set_title(f"{record['model']} ({record['params'] / 1e6:.1f}M parameters), bf16 ({record['device']}); "
                 f"gray: ZeRO formula + activations")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
