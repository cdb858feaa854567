"""zkern's benchmark: the same model, data and seed under zkern and under stock PyTorch, side by side.

    python bench/run.py                              # --stage 3, the 25M-parameter GPT, world 2, CPU
    python bench/run.py --stage 0,1,2,3 --model 1b   # a GPU machine: every GPU, nccl, bf16, TFLOPS and MFU
    python bench/run.py --stage 0,1,2,3 --model tiny --json out.json --plot out.png --gate bench/gates.toml

    python bench/run.py --suite adam                 # the CPU Adam at 50M parameters vs torch (and DeepSpeed)
    python bench/run.py --suite checkpoint           # save, load, async save, consolidation: zkern, DCP, DeepSpeed
    python bench/run.py --suite hf                   # stage-3 generate() and sharded from_pretrained, 25m as GPT-2
    python bench/run.py --stage 3 --world 4 --zeropp # + ZeRO++ rows (2 "nodes" of 2 ranks): qwZ+hpZ+qgZ together
    python bench/run.py --stage 3 --world 4 --zeropp qwz,hpz,qgz   # each alone
    python bench/run.py --suite scale --plot scale.png   # a model: stage 3 vs ZeRO++ from 8 to 1024 GPUs
    python bench/run.py --suite nvme                 # the disk (zkern's reader vs dd), the NVMe Adam step at 50M
    python bench/run.py --suite gpu-static           # every Triton kernel compiled for sm_80/sm_90 and checked
    python bench/run.py --suite gpu                  # on a GPU machine: the whole first-run record (bench/gpu_suite.py)
    python bench/run.py --suite bf16-state           # where training ends with bf16 optimizer state, small GPT
    python bench/run.py --suite paired --stage 0,1   # stage 0/1 and DDP/ZeroRedundancyOptimizer stepping in turn
    python bench/run.py --suite offload --stage 2,3  # the offloaded step's time, grads copied in backward vs at step
    python bench/run.py --suite muon                 # Muon against zkern's Adam at stages 0-3, worlds 1 and 2

Suites: engine (zkern vs DDP, ZeroRedundancyOptimizer, FSDP2 and, when installed, DeepSpeed); adam (zkern's
fused CPU Adam vs the stock offload pipeline, torch's fused AdamW and the memory roofline; bench/adam_suite.py).
kernels (zkern's Triton kernels vs stock PyTorch and the copy bandwidth; CUDA only, or --interpret to check
the harness under TRITON_INTERPRET=1). --suite all runs the kernels suite only where a GPU is present. With
several suites, --json writes {"suites": [...]}. gpu-static (bench/gpu_static_suite.py) needs no GPU: the
kernels at the specialisations the launchers produce, compiled ahead of time, checked for spills and 128-bit
access; it exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import (  # noqa: E402
    adam_suite,
    bf16_state_suite,
    checkpoint_suite,
    engine_suite,
    gates,
    gpu_static_suite,
    gpu_suite,
    hf_suite,
    kernels_suite,
    memory_suite,
    muon_suite,
    nvme_suite,
    offload_suite,
    overhead_suite,
    paired_suite,
    peers,
    scale_suite,
)

SUITES = {"engine": engine_suite, "adam": adam_suite, "kernels": kernels_suite, "checkpoint": checkpoint_suite,
          "hf": hf_suite, "scale": scale_suite, "nvme": nvme_suite, "gpu-static": gpu_static_suite,
          "gpu": gpu_suite, "bf16-state": bf16_state_suite, "paired": paired_suite, "memory": memory_suite,
          "offload": offload_suite, "overhead": overhead_suite, "muon": muon_suite}
# --suite all: the scale suite is a model, and the nvme suite moves gigabytes through the disk: both run by name; the
# memory suite too (CI gates it at world 4, `make gate`)
MEASURED = [name for name in SUITES
            if name not in ("scale", "nvme", "gpu-static", "gpu", "bf16-state", "paired", "offload", "muon", "memory")]


def _worlds(text: str) -> list[int]:
    try:
        worlds = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--world takes ranks or a list like 2,4,8, got {text!r}") from None
    if not worlds or any(w < 1 for w in worlds):
        raise argparse.ArgumentTypeError(f"--world takes ranks >= 1, got {text!r}")
    return worlds


def _stages(text: str) -> list[int]:
    try:
        stages = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--stage takes 0, 1, 2, 3 or a list like 0,1,2,3, got {text!r}") from None
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"--stage takes 0, 1, 2, 3 or a list like 0,1,2,3, got {text!r}")
    return stages


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return _run(parser, args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="zkern against stock PyTorch on the same model and data")
    parser.add_argument("--stage", type=_stages, default=[3], help="ZeRO stage(s): 0-3 or a list (default 3)")
    parser.add_argument("--suite", default="engine", choices=[*SUITES, "all"])
    parser.add_argument("--world", type=_worlds, default=None,
                        help="ranks: default 2 over gloo on a CPU, one per GPU over nccl on a GPU machine; the "
                             "memory suite takes a list (2,4,8)")
    parser.add_argument("--model", default=None, choices=sorted(engine_suite.MODELS),
                        help="model preset (default 25m on a CPU, 1b on a GPU)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="where the engine suite trains (default cuda where torch sees a GPU)")
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16"],
                        help="engine suite precision (default: the preset's; bf16 for 1b and 7b, else fp32)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the GPU's dense peak for MFU where the datasheet table (bench/flops.py) lacks it")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    parser.add_argument("--peers", default=None, help="comma list of peers to run (default: every installed one)")
    parser.add_argument("--json", default=None, help="write the record as JSON to this path")
    parser.add_argument("--plot", default=None, help="draw the chart as PNG to this path")
    parser.add_argument("--gate", default=None, help="check the ratios against this gates.toml; fail if one fails")
    parser.add_argument("--interpret", action="store_true",
                        help="kernels suite without a GPU: tiny sizes under TRITON_INTERPRET=1 (timings meaningless)")
    parser.add_argument("--kernels-numel", type=int, default=None, help="elements per kernel operand")
    parser.add_argument("--zeropp", nargs="?", const="qwz+hpz+qgz", default=None,
                        help="stage 3: add ZeRO++ rows (alone: all three together; or a comma list of qwz, hpz, qgz "
                             "and combinations joined by +)")
    parser.add_argument("--offload", action="store_true",
                        help="engine suite: add ZeRO-Offload rows (optimizer on the host; at stage 3 parameters too)")
    parser.add_argument("--dry-run", action="store_true", help="gpu suite: print and record the plan, run nothing")
    parser.add_argument("--intra-gbs", type=float, default=376.0, help="scale suite: GB/s per GPU inside a node")
    parser.add_argument("--inter-gbs", type=float, default=50.0, help="scale suite: GB/s per node across nodes")
    parser.add_argument("--intra-latency-us", type=float, default=3.0, help="scale suite: latency per hop inside")
    parser.add_argument("--inter-latency-us", type=float, default=10.0, help="scale suite: latency per hop across")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="scale suite: GPUs per node")
    parser.add_argument("--mfu", type=float, default=0.45, help="scale suite: model FLOPs utilisation of compute")
    parser.add_argument("--no-check", action="store_true", help="scale suite: the model only, no world-4 check")
    parser.add_argument("--adam-numel", type=int, default=adam_suite.DEFAULT_NUMEL,
                        help="parameters the adam and nvme suites step (default 50M)")
    parser.add_argument("--nvme-path", default=None,
                        help="nvme suite: the directory (on the disk to measure) for its files; default: temp dir")
    return parser


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    suites = list(MEASURED) if args.suite == "all" else [args.suite]
    if args.suite == "all" and not torch.cuda.is_available():
        suites.remove("kernels")
        print("bench/run.py: --suite all on a machine without a GPU runs engine and adam (the kernels suite times "
              "Triton kernels on CUDA)", file=sys.stderr)
    if (args.steps is not None and args.steps < 2) or args.adam_numel < 1:
        parser.error("--adam-numel must be >= 1 and --steps >= 2")
    worlds, args.world = args.world, None
    if worlds is not None and len(worlds) > 1 and suites != ["memory"]:
        parser.error("--world takes a list for --suite memory only; the other suites run one world")
    if worlds is not None and len(worlds) == 1:
        args.world = worlds[0]
    wanted = args.peers.split(",") if args.peers else None
    unknown = sorted(set(wanted or ()) - set(peers.NAMES) - {"dcp"})
    if unknown:
        parser.error(f"--peers: unknown {unknown}; the peers are {', '.join(peers.NAMES)} (and dcp for --suite "
                     f"checkpoint)")
    on_gpu = args.device == "cuda" or (args.device is None and torch.cuda.is_available())
    model = args.model or ("1b" if on_gpu else "25m")
    records = []
    for suite in suites:
        if suite == "engine":
            record = engine_suite.run(args.stage, args.world, model, args.steps, wanted, device=args.device,
                                      precision=args.precision, peak_tflops=args.peak_tflops,
                                      zeropp=args.zeropp.split(",") if args.zeropp else None,
                                      offload=args.offload)
        elif suite == "adam":
            record = adam_suite.run(args.adam_numel, deepspeed=wanted is None or "deepspeed" in wanted)
        elif suite == "checkpoint":
            if len(args.stage) > 1 and args.suite == "checkpoint":
                parser.error("--suite checkpoint measures one stage at a time")
            stage = args.stage[0] if len(args.stage) == 1 else 2  # --suite all with several stages: stage 2
            record = checkpoint_suite.run(args.model or "25m", args.world or 2, stage, peers=wanted)
        elif suite == "hf":
            record = hf_suite.run(args.model or "25m")
        elif suite == "paired":
            record = paired_suite.run(args.stage, args.world, args.model or "small", args.steps)
        elif suite == "offload":
            record = offload_suite.run(args.stage, args.world, args.model or "small", args.steps,
                                       precision=args.precision or "fp32")
        elif suite == "bf16-state":
            record = bf16_state_suite.run(args.model or "small", args.steps)
        elif suite == "gpu-static":
            record = gpu_static_suite.run()
        elif suite == "overhead":
            record = overhead_suite.run(args.stage if args.stage != [3] else [0, 1, 2, 3],
                                        (args.world,) if args.world else overhead_suite.WORLDS,
                                        progress=lambda line: print(line, file=sys.stderr, flush=True))
        elif suite == "muon":
            record = muon_suite.run(args.stage if args.stage != [3] else [0, 1, 2, 3],
                                    (args.world,) if args.world else muon_suite.WORLDS,
                                    progress=lambda line: print(line, file=sys.stderr, flush=True))
        elif suite == "memory":
            record = memory_suite.run(args.stage, worlds, args.model or "small", wanted,
                                      progress=lambda line: print(line, file=sys.stderr, flush=True))
        elif suite == "gpu":
            record = gpu_suite.run(dry_run=args.dry_run)
        elif suite == "nvme":
            record = nvme_suite.run(args.adam_numel, directory=args.nvme_path)
        elif suite == "scale":
            links = scale_suite.Links(args.intra_gbs, args.inter_gbs, args.intra_latency_us, args.inter_latency_us,
                                      args.gpus_per_node)
            record = scale_suite.run(links, args.peak_tflops or 989.0, args.mfu, measure=not args.no_check)
        else:
            record = kernels_suite.run(args.kernels_numel, interpret=args.interpret)
        print(SUITES[suite].table(record) + "\n")
        records.append(record)
    if args.gate:  # before the record is written: it keeps both runs of a stage measured again
        committed = gates.load(args.gate)
        for r in records:
            if r["suite"] == "engine":
                _remeasure_slow_stages(r, committed, lambda stages: engine_suite.run(
                    stages, args.world, model, args.steps, wanted, device=args.device, precision=args.precision,
                    peak_tflops=args.peak_tflops, zeropp=args.zeropp.split(",") if args.zeropp else None))
    if args.json and [r["suite"] for r in records] == ["gpu-static"]:  # one record per Triton version, kept together
        gpu_static_suite.save(args.json, records[0])
        print(f"wrote {args.json} (the Triton {records[0]['triton']} run beside any other version's)")
    elif args.json:
        with open(args.json, "w") as f:
            json.dump(records[0] if len(records) == 1 else {"suites": records}, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        from bench import plot

        engine = [r for r in records if r["suite"] == "engine"]
        scale = [r for r in records if r["suite"] == "scale"]
        memory = [r for r in records if r["suite"] == "memory"]
        if scale:
            scale_suite.plot(scale[0], args.plot)
        elif engine:
            plot.plot(engine[0], args.plot)
        elif memory:
            memory_suite.plot(memory[0], args.plot)
        else:
            parser.error("--plot draws the engine, scale or memory suite; run one of them")
        print(f"wrote {args.plot}")
    step_failures = [line for r in records if r["suite"] in ("gpu-static", "gpu") for line in r["failures"]]
    if step_failures:
        print(f"bench: {len(step_failures)} check(s) or step(s) failed (listed above)")
        return 1
    if args.gate:
        failures = [line for r in records for line in gates.check(r, committed)]
        unchecked = sorted({g.suite for g in committed} - {r["suite"] for r in records})
        elsewhere = [g for g in committed if g.suite in suites and not any(gates.applies(g, r) for r in records)]
        for line in failures:
            print(f"GATE FAILED: {line}")
        if failures:
            return 1
        note = f" (not checked: the {', '.join(unchecked)} suite did not run)" if unchecked else ""
        if elsewhere:
            note += (f" ({len(elsewhere)} gate(s) set for another device or CPU path not checked: "
                     f"{', '.join(sorted({f'{g.figure} ({g.device or g.isa})' for g in elsewhere}))})")
        print(f"gates: all {args.gate} gates of the {', '.join(suites)} suite(s) that apply hold{note}")
    return 0


def _remeasure_slow_stages(record: dict, committed: list, measure) -> None:
    """A stage whose step-time ratio fails its gate is measured once more, and the gate judges the lower of the two
    ratios (both stay in the record under "step_time_runs"). A burst of load from a neighbour on a shared machine
    slows one run of a candidate; a regression slows every run, so it still fails."""
    slow = sorted({st["stage"] for st in record["stages"] for g in committed
                   if gates.applies(g, record) and g.figure.startswith("step_time") and st["stage"] in g.stages
                   and st["ratios"].get(g.figure) is not None
                   and gates._bound_failure("", st["ratios"][g.figure], g) is not None})
    if not slow:
        return
    print(f"bench/run.py: the step time of stage(s) {slow} fails its gate; measuring once more", file=sys.stderr)
    again = {st["stage"]: st for st in measure(slow)["stages"]}
    for st in record["stages"]:
        if st["stage"] not in again:
            continue
        runs = st.setdefault("step_time_runs", {})
        for key, value in again[st["stage"]]["ratios"].items():
            if key.startswith("step_time") and value is not None and st["ratios"].get(key) is not None:
                runs[key] = [st["ratios"][key], value]
                st["ratios"][key] = min(st["ratios"][key], value)
        print(f"stage {st['stage']}: step time ratios of the two runs: {runs}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
