"""python -m zkern.verify: zkern's self-test on this machine or cluster, against an independent single-process
reference, in about a minute. Run it before the first job on new machines.

    python -m zkern.verify                                  # CPU: 2 ranks over gloo; one GPU machine: a rank per GPU
    torchrun --nnodes 2 --nproc_per_node 8 -m zkern.verify  # a cluster: every rank of the job (nccl)
    python -m zkern.verify --world 4 --json verify.json

A short matrix of stages and features (the fuzzer's draws, fixed): ZeRO stages 0-3 in fp32 and bf16, offload,
ZeRO++, routed experts, fp16 overflow, checkpoints resumed in place, into fresh engines and at another world size
and stage, frozen layers. Each row is trained by zkern's engine on this machine's devices and by plain torch in one
process, and compared (zkern.verify.check); the table gives PASS/FAIL, the largest weight difference and the bound it
was held to, and the environment (torch, CUDA, NCCL, the CPU's instruction sets, zkern's kernel paths). Exit code 1
when a row fails.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

from zkern.verify.check import compare, compare_runs, weight_distance
from zkern.verify.draws import Draw
from zkern.verify.harness import twin_without_checkpoint
from zkern.verify.runner import run_phases
from zkern.verify.single import reference, units_of


def matrix(world: int) -> list[tuple[str, Draw]]:
    """The rows: what users combine most, and the crossings that once trained wrong."""
    w2 = 2 if world >= 2 and world % 2 == 0 else world
    rows = [(f"stage {s} {p}", Draw(stage=s, precision=p, world=world, accumulation=2 if world <= 2 else 1,
                                   clip=0.05 if s == 2 else 0.0, groups=s == 1))
            for s in (0, 1, 2, 3) for p in ("fp32", "bf16")]
    rows += [
        ("stage 2 offload_optimizer cpu", Draw(stage=2, world=world, offload_optimizer="cpu", precision="bf16")),
        ("stage 3 offload optimizer+param cpu", Draw(stage=3, world=world, offload_optimizer="cpu",
                                                     offload_param="cpu")),
        ("stage 3 routed experts", Draw(stage=3, world=world, arch="moe", checkpoint="non_reentrant")),
        ("stage 2 fp16 overflow skipped", Draw(stage=2, world=world, precision="fp16", overflow_at=1)),
        ("stage 1 load mid-accumulation", Draw(stage=1, world=world, accumulation=2 if world <= 2 else 1,
                                               save_at=1, load_into="live", async_save=True)),
        ("stage 3 resume, frozen at load", Draw(stage=3, world=world, save_at=1, frozen="load", write_at=2)),
        ("stage 2 -> stage 3 at world 1", Draw(stage=2, world=world, save_at=1, world_after=1, stage_after=3)),
    ]
    if world >= 2:
        rows.append(("stage 3 qwZ+hpZ+qgZ+LoCo", Draw(stage=3, world=w2, qwz=True, hpz=w2 % 2 == 0, qgz=True,
                                                       loco=True, precision="bf16")))
    return [(name, d.checked()) for name, d in rows]


def environment(device: str, world: int) -> dict:
    from zkern.env_report import report

    data = report()
    return {"device": device, "world": world, "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": _nccl_version(), "cpu": data.get("cpu"),
            "cpu_adam": data.get("cpu_adam"), "backends": data.get("backends")}


def _nccl_version() -> str | None:
    try:
        return ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception:
        return None


def _pack(result: dict, steps: int) -> torch.Tensor:
    """A rank's losses and gradient norms per step as float64 (NaN: none), to all-gather under a launcher."""
    values = [result[key].get(s) for key in ("losses", "grad_norms") for s in range(steps)]
    return torch.tensor([float("nan") if v is None else float(v) for v in values], dtype=torch.float64)


def _unpack(packed: torch.Tensor, steps: int, local: dict) -> dict:
    values = packed.tolist()
    out = dict(local)
    for k, key in enumerate(("losses", "grad_norms")):
        out[key] = {s: values[k * steps + s] for s in range(steps) if s in local[key]}
        out[key] = {s: (None if v != v else v) for s, v in out[key].items()}
    return out


def _engine(d: Draw, where: str, world: int, device: str, group) -> list[list[dict]]:
    """Per phase, per rank: the draw on spawned ranks, or on this job's ranks under a launcher (group: a gloo group
    over them, for the losses)."""
    from zkern.testing.ranks import spawn

    runs = []
    for index, (w, _, _, _) in enumerate(d.phases):
        if group is None:
            runs.append(spawn(run_phases, w, d, where, [index], device))
            continue
        rank = torch.distributed.get_rank()
        local = run_phases(rank, w, d, where, [index], device)
        packed = _pack(local, d.steps)
        gathered = [torch.empty_like(packed) for _ in range(w)]
        torch.distributed.all_gather(gathered, packed, group=group)
        runs.append([_unpack(g, d.steps, local) for g in gathered])
    return runs


def _run(name: str, draw: Draw, world: int, device: str, root: str, group) -> dict:
    """One row: the engine run, the reference, the checks (rank 0 judges)."""
    start = time.perf_counter()
    row = {"name": name, "draw": json.loads(draw.to_json()), "failures": []}
    try:
        runs = _engine(draw, os.path.join(root, "run"), world, device, group)
        ref = reference(draw, units_of(runs))
        twin = twin_without_checkpoint(draw)
        twin_runs = _engine(twin, os.path.join(root, "twin"), world, device, group) if twin is not None else None
        if group is not None and torch.distributed.get_rank() != 0:
            return row
        row["failures"] += compare(draw, runs, ref)
        if twin_runs is not None:
            row["failures"] += compare_runs(runs, twin_runs, "resumed vs uninterrupted")
        row["distance"], row["bound"] = weight_distance(draw, runs, ref)
    except Exception as e:
        row["failures"].append(f"{type(e).__name__}: {e}")
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m zkern.verify", description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=None, help="ranks to spawn (default: GPUs, or 2 on a CPU)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda where available")
    parser.add_argument("--only", default=None, help="run the rows whose name contains this text")
    parser.add_argument("--json", default=None, help="write the table and the environment to this file")
    parser.add_argument("--dir", default=None, help="scratch directory for the checkpoint rows; on several nodes it "
                                                    "must be one file system every node sees (default: a temporary "
                                                    "directory, and several nodes skip those rows)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    under_launcher = "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if under_launcher:
        from zkern.comm.collectives import init_distributed

        init_distributed(torch.device(device, int(os.environ.get("LOCAL_RANK", "0"))) if device == "cuda"
                         else torch.device("cpu"), 120.0)
        world = torch.distributed.get_world_size()
    else:
        world = args.world or (torch.cuda.device_count() if device == "cuda" else 2)
    rank0 = not under_launcher or torch.distributed.get_rank() == 0
    rows = [(n, d) for n, d in matrix(world) if args.only is None or args.only in n]
    group = None
    if under_launcher:  # one world only; on several nodes, checkpoints only into a directory every node sees
        several_nodes = int(os.environ.get("LOCAL_WORLD_SIZE", world)) < world
        rows = [(n, d) for n, d in rows if all(w == world for w, _, _, _ in d.phases)
                and not (several_nodes and args.dir is None and d.save_at >= 0)]
        group = torch.distributed.new_group(backend="gloo")
    env = environment(device, world)
    if rank0:
        print(f"zkern.verify: {len(rows)} checks on {world} {device} rank(s); torch {env['torch']}, CUDA "
              f"{env['cuda']}, NCCL {env['nccl']}; CPU Adam {(env['cpu_adam'] or {}).get('active')}", flush=True)
    root = args.dir or tempfile.mkdtemp(prefix="zkern-verify-")
    if under_launcher and args.dir is None:  # rank 0's temporary directory, for the ranks of its node
        from zkern.checkpoint.control import broadcast_json, control_comm
        from zkern.comm.collectives import Comm, backend_for

        comm = control_comm(Comm(group, torch.distributed.get_rank(), world, 120.0, backend_for(torch.device("cpu"))))
        root = broadcast_json(comm, root, "zkern.verify: the scratch directory")
    table = []
    try:
        for i, (name, draw) in enumerate(rows):
            row = _run(name, draw, world, device, os.path.join(root, str(i)), group)
            table.append(row)
            if rank0:
                status = "PASS" if not row["failures"] else "FAIL"
                dist = f"{row['distance']:.2e} (held to {row['bound']})" if "distance" in row else "-"
                print(f"{status}  {name:<38} max weight difference {dist:<32} {row['seconds']:>5} s", flush=True)
                for failure in row["failures"][:5]:
                    print(f"      {failure.splitlines()[0]}")
    finally:
        if rank0 and args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    failed = [r for r in table if r["failures"]]
    if rank0:
        print(f"zkern.verify: {len(table) - len(failed)} of {len(table)} passed" +
              ("" if not failed else "; failing draws repeat with python -m zkern.verify.fuzz --draw '<draw>'"))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"environment": env, "rows": table}, f, indent=1, default=str)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
