"""Engine suite: zkern stage N against that stage's stock peers (bench/peers.py) and DDP, same model, data and
seed: N ranks over gloo on a CPU, or one rank per GPU over nccl.

    python bench/run.py --stage 3                  # the 25M-parameter GPT, world 2, CPU
    python bench/run.py --stage 0,1,2,3 --model tiny --plot out.png
    python bench/run.py --stage 0,1,2,3 --model 1b # on a GPU machine: every GPU, bf16

Per system and rank: step time (median, p20-p80 after warm-up), tokens/s, model-state bytes, peak RSS (and on
a GPU the CUDA allocator's max allocated, TFLOPS and MFU), bytes sent per step, the loss curve and its largest
gap from DDP's. Per stage, the ratios CI gates on: zkern's step time over the peer's, zkern's model-state bytes
over the ZeRO formula and over the peer's, and the bytes zkern sends over what the stage must send. On a
shared CPU only ratios from the same run mean anything. Every system runs in fresh processes, so no peak of
one counts against another.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import platform
import statistics
import subprocess
import sys
import time

import torch

import zkern
from bench import flops, peers
from zkern.env_report import cpu_model
from zkern.testing import TrainSpec, engine_run, mean_losses, spawn

# TinyGPT presets. bucket: reduce_bucket_size (about 1/8 of the model, so reduction overlaps backward as DDP's
# 25 MB buckets do); steps: default optimizer steps, the first `warmup` untimed.
MODELS = {
    "tiny": dict(model=dict(vocab=67, dim=32, n_layer=2, n_head=2, seq=16), micro_batch=4, steps=8, warmup=2,
                 bucket=4096),
    "small": dict(model=dict(vocab=2053, dim=256, n_layer=4, n_head=4, seq=64), micro_batch=4, steps=12, warmup=3,
                  bucket=1_000_000),
    "25m": dict(model=dict(vocab=8195, dim=512, n_layer=6, n_head=8, seq=128), micro_batch=4, steps=8, warmup=2,
                bucket=3_000_000),
    # GPU presets (bf16): the engine suite runs them only on CUDA machines. 1b: 0.87B parameters, whose DDP
    # reference (16 bytes/parameter, 13 GiB) fits one 80 GB GPU; 7b: 6.58B, whose unsharded peers need 98 GiB of
    # model states per rank and are skipped where that does not fit (zkern stage 3: 12.3 GiB a rank on 8 GPUs).
    "1b": dict(model=dict(vocab=32003, dim=2048, n_layer=16, n_head=16, seq=1024), micro_batch=4, steps=20,
               warmup=5, bucket=100_000_000, gpu=True, precision="bf16"),
    "7b": dict(model=dict(vocab=32003, dim=4096, n_layer=32, n_head=32, seq=2048), micro_batch=1, steps=10,
               warmup=3, bucket=200_000_000, gpu=True, precision="bf16"),
    # 7b-slice: two of the 7b's blocks at its width and vocabulary, 0.67B parameters, a short sequence: the 7b's
    # per-element arithmetic (its 4096-wide layers, a 0.67B-element bucket) within a CPU's reach
    "7b-slice": dict(model=dict(vocab=32003, dim=4096, n_layer=2, n_head=32, seq=256), micro_batch=2, steps=5,
                     warmup=1, bucket=200_000_000, precision="bf16"),
    # 13b: 12.7B parameters, for the largest model one GPU trains with ZeRO-Offload's host Adam (the GPU lease's
    # `largest` step: bf16 weights and gradients on the device, 51 GB; on the host bf16 master and moments, 76 GB,
    # and 25 GB of staging)
    "13b": dict(model=dict(vocab=32003, dim=5120, n_layer=40, n_head=40, seq=2048), micro_batch=1, steps=6,
                warmup=1, bucket=200_000_000, gpu=True, precision="bf16"),
}

# The stage whose ZeRO formula bounds each peer's model states, for the does-it-fit check on a GPU.
PEER_STAGE = {"ddp": 0, "zero1": 1}
FIT_FRACTION = 0.9  # model states may take this much of a GPU; the rest is activations and the allocator's


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


# ZeRO++ variants for --zeropp (stage 3; world = 2 "nodes" of world / 2 ranks): a name, or names joined by "+".
ZEROPP_KEYS = {"qwz": {"zero_quantized_weights": True}, "hpz": {"zero_hpz_partition_size": None},
               "qgz": {"zero_quantized_gradients": True}}


def zeropp_config(variant: str, world: int) -> dict:
    """The zero_optimization keys of a --zeropp variant ("qwz", "hpz+qgz", ...); hpZ over the world / 2 ranks of
    a node."""
    keys = {}
    for name in variant.split("+"):
        if name not in ZEROPP_KEYS:
            raise SystemExit(f"bench: --zeropp: unknown variant {name!r}; use qwz, hpz, qgz or names joined by +")
        if name == "hpz" and world < 4:
            raise SystemExit(f"bench: --zeropp hpz needs 2 nodes of at least 2 ranks (--world 4 or more), got world "
                             f"{world}")
        keys.update({k: (world // 2 if v is None else v) for k, v in ZEROPP_KEYS[name].items()})
    return keys


def make_spec(stage: int, model: str, steps: int | None, precision: str = "fp32", device: str = "cpu") -> TrainSpec:
    preset = MODELS[model]
    # Stage 3 gathers one transformer block per fetch unit, as the FSDP2 peer is wrapped.
    zero = {"stage3_fetch_units": ["Block"]} if stage == 3 else {}
    return TrainSpec(stage=stage, steps=steps or preset["steps"], micro_batch=preset["micro_batch"],
                     model=preset["model"], lr=1e-3, overlap_comm=True, reduce_bucket_size=preset["bucket"], zero=zero,
                     precision=precision, device=device)


def required_bytes_per_step(stage: int, numel: int, world: int, width: int, accumulation: int) -> int:
    """What a rank must send per optimizer step at this stage (ring volumes, ZeRO paper): stages 0-2 one
    reduce-scatter and one all-gather of the model (stage 2 reduces every micro-step), stage 3 two all-gathers
    and one reduce-scatter per micro-step."""
    passes = {0: 2, 1: 2, 2: accumulation + 1, 3: 3 * accumulation}[stage]
    return int(passes * (world - 1) * numel * width / world)


SENT_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "all_to_all", "control", "muon")


def sent_per_step(results: list[dict], kinds: tuple[str, ...], steps: int, where: str | None = None) -> float:
    """The most bytes any rank's comm_stats() counted of `kinds` between start and end, per step; where: "intra"
    or "inter" for that part of the split, None for all."""
    def sent(r: dict, at: str) -> int:
        stats = r[at] if where is None else r[at][where]
        return sum(stats[k] for k in kinds)

    return max(sent(r, "comm_end") - sent(r, "comm_start") for r in results) / steps


def _summary(name: str, results: list[dict], warmup: int, tokens_per_step: int, ddp_losses: list[float] | None,
             flops_per_token: int, peak_tflops: float | None, matmul_tflops: float | None) -> dict:
    times = _quantiles(results[0]["step_times"][warmup:])
    losses = mean_losses(results)
    if "memory" in results[0]:  # zkern: its own report (model states only) and its own byte counters
        state = [sum(v for k, v in r["memory"][next(iter(r["memory"]))].items()
                     if k in ("params", "grads", "optimizer", "master")) for r in results]
        steps = len(results[0]["step_times"])
        comm = sent_per_step(results, SENT_KINDS, steps)
        # per node boundary: the largest rank's bytes inside one node and across nodes (ranks_per_node)
        split = {w: sent_per_step(results, SENT_KINDS, steps, where=w) for w in ("intra", "inter")}
    else:
        state = [r["model_state_bytes"] for r in results]
        state = None if None in state else state  # a peer that cannot be measured from outside (DeepSpeed)
        comm = results[0].get("comm_bytes_per_step")
        split = {"intra": None, "inter": None}
    tokens_per_s = tokens_per_step / times["median_s"]
    tflops = flops_per_token * tokens_per_s / len(results) / 1e12  # model FLOPs per second per rank
    cuda = [r["peak_cuda"] for r in results]
    return {
        "system": name,
        **times,
        "tokens_per_s": tokens_per_s,
        "model_state_bytes_per_rank": None if state is None else max(state),
        "peak_rss_bytes_per_rank": max(r["peak_rss"] for r in results),
        "peak_cuda_bytes_per_rank": None if None in cuda else max(cuda),
        "tflops_per_rank": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
        "mfu_of_matmul": tflops / matmul_tflops if matmul_tflops else None,
        "comm_bytes_per_step": comm,
        "comm_measured": "memory" in results[0],
        "comm_intra_bytes_per_step": split["intra"],
        "comm_inter_bytes_per_step": split["inter"],
        "memory_report": results[0].get("memory"),
        "final_loss": losses[-1],
        "max_loss_gap_vs_ddp": (None if ddp_losses is None else
                                max(abs(a - b) / abs(b) for a, b in zip(losses, ddp_losses))),
        "losses": losses,
    }


def _does_not_fit(stage: int, numel: int, world: int, precision: str, device_bytes: int | None) -> str | None:
    """Why a system at this stage cannot hold its model states on this GPU, or None when it can (or on a CPU)."""
    if device_bytes is None:
        return None
    need = zkern.estimate_memory(numel, world, stage, precision=precision)["total"]
    if need <= FIT_FRACTION * device_bytes:
        return None
    return (f"does not fit: its model states alone need {need / 2**30:.1f} GiB per rank (ZeRO formula, stage "
            f"{stage}, world {world}), over {FIT_FRACTION:.0%} of this GPU's {device_bytes / 2**30:.1f} GiB")


def run_stage(stage: int, world: int, model: str, steps: int | None, wanted_peers: list[str] | None,
              progress, hw: dict, zeropp: list[str] | None = None, offload: bool = False) -> dict:
    spec = make_spec(stage, model, steps, hw["precision"], hw["device"])
    if zeropp:  # two "nodes" of world / 2 ranks: comm_stats splits bytes at that boundary
        if stage != 3 or world < 2 or world % 2:
            raise SystemExit(f"bench: --zeropp adds ZeRO++ rows to stage 3 at an even world size; got stage {stage}, "
                             f"world {world}")
        spec = dataclasses.replace(spec, extra_config={"ranks_per_node": world // 2})
    preset = MODELS[model]
    warmup = min(preset["warmup"], spec.steps - 1)
    tokens_per_step = spec.micro_batch * preset["model"]["seq"] * world
    numel = spec.num_params()
    # the stock peers keep fp32 parameters (autocast), zkern and DeepSpeed 16-bit ones with an fp32 master
    peer_precision = "fp32"
    engine_precision = "fp32" if spec.precision == "fp32" else "mixed"
    why = _does_not_fit(stage, numel, world, engine_precision, hw["device_bytes"])
    if why:
        raise SystemExit(f"bench: zkern stage {stage} with model {model!r} {why}; use more GPUs, a higher stage or "
                         f"a smaller preset")
    runners = {}
    skipped = {}
    candidates = {"ddp": peers.ddp_peer, **peers.PEERS[stage]}
    for name, fn in candidates.items():
        if name != "ddp" and wanted_peers is not None and name not in wanted_peers:
            continue
        if not peers.installed(name):
            skipped[name] = "not installed"
            continue
        why = _does_not_fit(PEER_STAGE.get(name, stage), numel, world,
                            engine_precision if name == "deepspeed" else peer_precision, hw["device_bytes"])
        if why:
            skipped[name] = why
            continue
        runners[name] = fn
    runners[f"zkern stage {stage}"] = engine_run
    variants = {f"zkern stage 3 + {v}": dataclasses.replace(spec, zero={**spec.zero, **zeropp_config(v, world)})
                for v in zeropp or ()}
    offloaded = {f"zkern stage {stage} + {name}": dataclasses.replace(spec, zero={**spec.zero, **keys})
                 for name, keys in (offload_configs(stage) if offload else {}).items()}
    runs = {}
    for name, fn in [*runners.items(), *((v, engine_run) for v in [*variants, *offloaded])]:
        start = time.monotonic()
        progress(f"stage {stage}: {name} ({spec.steps} steps, world {world})")
        runs[name] = spawn(fn, world, {**variants, **offloaded}.get(name, spec), timeout=3600, subprocess=True)
        progress(f"stage {stage}: {name} done in {time.monotonic() - start:.1f}s")
    ddp_losses = mean_losses(runs["ddp"]) if "ddp" in runs else None
    flops_per_token = flops.train_flops_per_token(preset["model"])
    systems = [_summary(name, results, warmup, tokens_per_step, ddp_losses, flops_per_token, hw["peak_tflops"],
                        hw["matmul_tflops"]) for name, results in runs.items()]
    # The stage's own stock-PyTorch peer is what the ratios (and CI's gates) compare with: DDP where none other
    # ran (stage 0). DeepSpeed, an optional peer, gets its own step-time ratio.
    by_name = {s["system"]: s for s in systems}
    zk = by_name[f"zkern stage {stage}"]
    stock = [n for n in runners if n not in ("ddp", "deepspeed") and not n.startswith("zkern")]
    peer = by_name.get(stock[0] if stock else "ddp")
    width = 4 if spec.precision == "fp32" else 2
    formula = zkern.estimate_memory(numel, world, stage, precision=engine_precision)["total"]
    required = required_bytes_per_step(stage, numel, world, width, spec.accumulation)
    return {
        "stage": stage,
        "config": spec.config(world),
        "systems": systems,
        "peer": None if peer is None else peer["system"],
        "peers_skipped": skipped,
        "flops_per_token": flops_per_token,
        "ratios": {
            "step_time_zkern_over_peer": None if peer is None else zk["median_s"] / peer["median_s"],
            "model_state_zkern_over_peer": (zk["model_state_bytes_per_rank"] / peer["model_state_bytes_per_rank"]
                                            if peer and peer["model_state_bytes_per_rank"] else None),
            "model_state_over_formula": zk["model_state_bytes_per_rank"] / formula,
            "comm_over_required": zk["comm_bytes_per_step"] / required if required else 1.0,
            "loss_gap_vs_ddp": zk["max_loss_gap_vs_ddp"],
            **({"step_time_zkern_over_deepspeed": zk["median_s"] / by_name["deepspeed"]["median_s"]}
               if "deepspeed" in by_name else {}),
        },
        "formula_model_state_bytes": formula,
        "required_comm_bytes_per_step": required,
        "zeropp": [_zeropp_ratios(name, by_name[name], zk) for name in variants],
        # ZeRO-Offload rows against the same stage on the device: step time and the device's model states
        "offload": [{"variant": name.removeprefix(f"zkern stage {stage} + "),
                     "step_time_over_on_device": by_name[name]["median_s"] / zk["median_s"],
                     "model_state_over_on_device": (by_name[name]["model_state_bytes_per_rank"]
                                                    / zk["model_state_bytes_per_rank"]
                                                    if zk["model_state_bytes_per_rank"] else None)}
                    for name in offloaded],
    }


def offload_configs(stage: int) -> dict[str, dict]:
    """--offload: the ZeRO-Offload rows of a stage (none at stage 0): the optimizer on the host (the CPU Adam), and at
    stage 3 the parameters too."""
    if stage == 0:
        return {}
    host = {"device": "cpu", "pin_memory": True}
    out = {"offload_optimizer": {"offload_optimizer": host}}
    if stage == 3:
        out["offload_optimizer+offload_param"] = {"offload_optimizer": host, "offload_param": host}
    return out


def _zeropp_ratios(name: str, row: dict, plain: dict) -> dict:
    """A ZeRO++ row against plain stage 3 in the same run: bytes across and inside nodes, step time, loss curve."""
    def ratio(a, b):
        return None if a is None or not b else a / b

    return {
        "variant": name.removeprefix("zkern stage 3 + "),
        "inter_over_plain": ratio(row["comm_inter_bytes_per_step"], plain["comm_inter_bytes_per_step"]),
        "total_bytes_over_plain": ratio(row["comm_bytes_per_step"], plain["comm_bytes_per_step"]),
        "step_time_over_plain": ratio(row["median_s"], plain["median_s"]),
        "max_loss_gap_vs_plain": max(abs(a - b) / abs(b) for a, b in zip(row["losses"], plain["losses"])),
        "final_loss_gap_vs_plain": (row["final_loss"] - plain["final_loss"]) / plain["final_loss"],
        "model_states_over_plain": ratio(row["model_state_bytes_per_rank"], plain["model_state_bytes_per_rank"]),
        "extra_memory": {k: v for where in (row["memory_report"] or {}).values() for k, v in where.items()
                         if k in ("hpz_secondary", "loco_error")},
    }


def hardware(device: str | None, world: int | None, model: str, precision: str | None,
             peak_tflops: float | None) -> tuple[int, dict]:
    """(world, what the suite runs on): the device ("cuda" where torch sees a GPU unless told "cpu"), the world
    size (every GPU, or 2 ranks on a CPU), the precision (the preset's: bf16 for the GPU presets, else fp32), the
    GPU's memory, its datasheet peak (or peak_tflops) and its measured bf16 matrix-product rate."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = MODELS[model]
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench: --device cuda, but torch sees no CUDA device")
    if preset.get("gpu") and device != "cuda":
        raise SystemExit(f"bench: model preset {model!r} is for GPUs and this run is on the CPU; use tiny, small "
                         f"or 25m")
    precision = precision or preset.get("precision", "fp32")
    if precision not in ("fp32", "bf16"):
        raise SystemExit(f"bench: --precision {precision!r}: the engine suite compares fp32 or bf16 runs (the stock "
                         f"peers have no fp16 loss scaler that skips the steps zkern's does)")
    if device == "cpu":
        return world or 2, {"device": "cpu", "device_name": cpu_model(), "precision": precision,
                            "device_bytes": None, "peak_tflops": None, "peak_tflops_source": None,
                            "matmul_tflops": None}
    gpus = torch.cuda.device_count()
    world = world or gpus
    if world > gpus:
        raise SystemExit(f"bench: --world {world} on CUDA needs one GPU per rank; this machine has {gpus}")
    # Asked in a process of its own: this one must hold no CUDA context or cached blocks while the ranks run.
    facts = spawn(_gpu_facts, 1, subprocess=True)[0]
    datasheet = flops.peak_tflops(facts["name"], precision)
    return world, {
        "device": "cuda", "device_name": facts["name"], "precision": precision, "device_bytes": facts["bytes"],
        "peak_tflops": peak_tflops or datasheet,
        "peak_tflops_source": "--peak-tflops" if peak_tflops else ("datasheet" if datasheet else None),
        "matmul_tflops": facts["matmul_tflops"],
    }


def _gpu_facts(rank: int, world: int) -> dict:
    device = torch.device("cuda", 0)
    return {"name": torch.cuda.get_device_name(device),
            "bytes": torch.cuda.get_device_properties(device).total_memory,
            "matmul_tflops": flops.measure_matmul_tflops(device)}


def run(stages: list[int], world: int | None, model: str, steps: int | None = None,
        wanted_peers: list[str] | None = None, progress=None, device: str | None = None,
        precision: str | None = None, peak_tflops: float | None = None, zeropp: list[str] | None = None,
        offload: bool = False) -> dict:
    world, hw = hardware(device, world, model, precision, peak_tflops)
    progress = progress or (lambda line: print(f"[bench] {line}", file=sys.stderr, flush=True))
    spec = make_spec(stages[0], model, steps, hw["precision"], hw["device"])
    return {
        "suite": "engine",
        "world": world,
        "model": model,
        "num_params": spec.num_params(),
        "steps": spec.steps,
        "warmup_steps": min(MODELS[model]["warmup"], spec.steps - 1),
        **hw,
        "versions": {"zkern": zkern.__version__, "torch": torch.__version__, "python": platform.python_version(),
                     **({"cuda": torch.version.cuda} if hw["device"] == "cuda" else {}),
                     **({"deepspeed": importlib.metadata.version("deepspeed")}
                        if peers.installed("deepspeed") else {})},
        "git_sha": _git_sha(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "stages": [run_stage(s, world, model, steps, wanted_peers, progress, hw, zeropp if s == 3 else None,
                             offload=offload) for s in stages],
    }


def _mib(n: int | None) -> str:
    return "— (not measured)" if n is None else f"{n / 2**20:.2f} MiB"


def _x(r: float | None) -> str:
    return "—" if r is None else f"x{r:.2f}"


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def table(record: dict) -> str:
    cuda = record["device"] == "cuda"
    head = (f"engine suite: world {record['world']}, model {record['model']} ({record['num_params'] / 1e6:.2f}M "
            f"params), {record['steps']} steps ({record['warmup_steps']} warm-up), {record['precision']}, "
            f"{record['device']} ({record['device_name']})")
    if cuda:
        peak = (f"{record['peak_tflops']:.0f} TFLOP/s ({record['peak_tflops_source']})" if record["peak_tflops"]
                else "unknown (pass --peak-tflops)")
        head += f"; peak {peak}, measured bf16 matmul {record['matmul_tflops']:.0f} TFLOP/s"
    out = [head, ""]
    gpu_cols = " peak allocated / rank | TFLOPS / GPU | MFU (of matmul) |" if cuda else ""
    out.append("| stage | system | step time median [p20-p80] | tokens/s | model states / rank | peak RSS / rank |"
               f"{gpu_cols} sent / step / rank | final loss | max loss gap vs DDP |")
    out.append("|---" * (9 + 3 * cuda) + "|")
    for st in record["stages"]:
        for s in st["systems"]:
            comm = "—" if s["comm_bytes_per_step"] is None else (
                f"{s['comm_bytes_per_step'] / 2**20:.2f} MiB{'' if s['comm_measured'] else ' (alg.)'}")
            gpu = ""
            if cuda:
                gpu = (f" {_mib(s['peak_cuda_bytes_per_rank'])} | {s['tflops_per_rank']:.1f} | "
                       f"{_cell(s['mfu'], '.1%')} ({_cell(s['mfu_of_matmul'], '.1%')}) |")
            out.append(f"| {st['stage']} | {s['system']} | {s['median_s'] * 1e3:.1f} ms [{s['p20_s'] * 1e3:.1f}-"
                       f"{s['p80_s'] * 1e3:.1f}] | {s['tokens_per_s']:.0f} | "
                       f"{_mib(s['model_state_bytes_per_rank'])} | "
                       f"{s['peak_rss_bytes_per_rank'] / 2**20:.0f} MiB |{gpu} {comm} | {s['final_loss']:.4f} | "
                       f"{_cell(s['max_loss_gap_vs_ddp'], '.2e')} |")
    out.append("")
    for st in record["stages"]:
        r = st["ratios"]
        skipped = "".join(f"; {k}: {v}" for k, v in st["peers_skipped"].items())
        if "step_time_zkern_over_deepspeed" in r:
            skipped = f"; zkern / deepspeed step time x{r['step_time_zkern_over_deepspeed']:.2f}" + skipped
        versus = (f"zkern / {st['peer']}: step time {_x(r['step_time_zkern_over_peer'])}, model states "
                  f"{_x(r['model_state_zkern_over_peer'])}" if st["peer"] else "no peer ran")
        out.append(f"stage {st['stage']}: {versus}; model states / ZeRO formula "
                   f"x{r['model_state_over_formula']:.3f}; sent / required x{r['comm_over_required']:.3f}{skipped}")
    zeropp = [z for st in record["stages"] for z in st.get("zeropp", [])]
    if zeropp:
        out += ["", f"ZeRO++ against plain stage 3 (same run; 2 nodes of {record['world'] // 2} ranks):", "",
                "| variant | bytes across nodes | all bytes | step time | max loss gap | final loss gap | extra "
                "memory |",
                "|---|---|---|---|---|---|---|"]
        for z in zeropp:
            extra = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in z["extra_memory"].items()) or "—"
            out.append(f"| {z['variant']} | {_x(z['inter_over_plain'])} | {_x(z['total_bytes_over_plain'])} | "
                       f"{_x(z['step_time_over_plain'])} | {z['max_loss_gap_vs_plain']:.2%} | "
                       f"{z['final_loss_gap_vs_plain']:+.2%} | {extra} |")
    return "\n".join(out)
