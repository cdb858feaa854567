"""The checkpoint suite: save, load, asynchronous save and consolidation, zkern against PyTorch DCP and DeepSpeed in
the same run, against the disk's own bandwidth measured in that run.

    python bench/run.py --suite checkpoint                  # 25m model (265 MiB of training state), stage 2, world 2
    python bench/run.py --suite checkpoint --stage 3 --peers dcp

Per contender (bench/checkpoint_peers.py), on its own ranks: a synchronous save of the whole training state (model
and AdamW) and the seconds until its files are durable (zkern and DCP fsync before they return; DeepSpeed's files are
fsynced by the suite after its call returns, and that time counted), then a load with the checkpoint's files evicted
from the page cache first (posix_fadvise DONTNEED on the fsynced files: the load reads the disk, as a resume after a
restart does), then the training steps around an asynchronous save: how long the call itself blocks the caller,
and how much longer the steps run while the save writes than the quiet steps before and after (the sum of the
excess is time the save took from training). Then, each in a process of its own, the consolidation of the
checkpoint into one set of full weights: `python -m zkern.checkpoint consolidate`, DeepSpeed's zero_to_fp32 and
DCP's dcp_to_torch_save, with their seconds and peak resident memory (VmHWM). The disk: one writer writes a file
of the checkpoint's size in 8 MiB blocks and fsyncs it, then reads it back after evicting it (disk_bandwidth), before
the contenders; each timed save starts after os.sync() and a pause, so none pays for what an earlier one left.
"ratios" holds the goals' figures, for bench/gates.toml.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from bench.checkpoint_peers import CONTENDERS
from bench.engine_suite import MODELS, make_spec
from bench.peers import installed
from zkern.testing.ranks import spawn
from zkern.testing.runs import TrainSpec

BLOCK = 8 << 20
SETTLE_S = 3.0  # pause after os.sync() before each timed save: the disk's own write cache drains
GOAL_DISK_FRACTION = 0.8  # sync save and load: at least this share of the disk's sequential bandwidth
GOAL_ASYNC_BLOCK = 0.1  # an asynchronous save takes less than this share of a synchronous save's time from training
GOAL_CONSOLIDATE_PEAK = 0.05  # consolidation's peak memory at most this share of the checkpoint's size


def _files(path: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]


def _tree_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in _files(path))


def _fsync_tree(path: str) -> None:
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict(path: str) -> None:
    """Drop a directory's (fsynced) files from the page cache, so that the next read comes from the disk."""
    for f in _files(path) if os.path.isdir(path) else [path]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_bandwidth(directory: str, nbytes: int, trials: int = 2) -> dict:
    """Sequential write (fsynced) and read (evicted first) of one file of nbytes, in bytes per second: the best
    of `trials`, the disk's capability rather than one noisy moment. The writer hands each block to write-back as
    it goes (as a streaming writer should), so the figure is the device's rate, not write-then-flush in series."""
    path = os.path.join(directory, "disk-bandwidth.bin")
    block = os.urandom(BLOCK)
    count = max(1, nbytes // BLOCK)
    buf = bytearray(BLOCK)
    write_s, read_s = [], []
    for _ in range(trials):
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for i in range(count):
                f.write(block)
                os.posix_fadvise(f.fileno(), i * BLOCK, BLOCK, os.POSIX_FADV_DONTNEED)  # start its write-back
            os.fsync(f.fileno())
        write_s.append(time.perf_counter() - start)
        evict(path)
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
        read_s.append(time.perf_counter() - start)
        os.remove(path)
    return {"bytes": count * BLOCK, "write_bps": count * BLOCK / min(write_s), "read_bps": count * BLOCK / min(read_s),
            "write_s": write_s, "read_s": read_s}


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _rank(rank: int, world: int, spec: TrainSpec, root: str, steps: int, name: str, settle: bool) -> dict:
    c = CONTENDERS[name](rank, world, spec)
    for s in range(2):  # warm-up: the optimizer state exists, the first steps' one-off costs are paid
        c.step(s)
    sync_dir, async_dir = os.path.join(root, name, "sync"), os.path.join(root, name, "async")
    if rank == 0 and settle:  # every contender's save starts with nothing of an earlier one left to write back
        os.sync()
        time.sleep(SETTLE_S)
    _barrier()
    start = time.perf_counter()
    c.save(sync_dir)
    save_s = time.perf_counter() - start
    if not c.fsyncs:
        _fsync_tree(sync_dir)
    durable_s = time.perf_counter() - start
    _barrier()
    if rank == 0:
        evict(sync_dir)
    _barrier()
    start = time.perf_counter()
    c.load(sync_dir)
    load_s = time.perf_counter() - start
    out = {"save_s": save_s, "durable_s": durable_s, "load_s": load_s,
           "quiet_steps_s": [c.step(s) for s in range(steps)]}
    if c.start_async is not None:
        _barrier()
        start = time.perf_counter()
        c.start_async(async_dir)
        out["async_call_s"] = time.perf_counter() - start
        during = []
        while c.in_flight():
            during.append(c.step(len(during)))
        out["async_total_s"] = time.perf_counter() - start
        c.wait()
        out["steps_during_async_s"] = during
        out["quiet_steps_s"] += [c.step(s) for s in range(steps)]
    return out


def _consolidate(tool: str, ckpt: str, out: str) -> dict:
    """One consolidation in a process of its own: seconds, peak resident memory, bytes written."""
    run = {"zkern": f"from zkern.checkpoint.__main__ import main; rc = main(['consolidate', {ckpt!r}, {out!r}])",
           "deepspeed": "from deepspeed.utils.zero_to_fp32 import convert_zero_checkpoint_to_fp32_state_dict as c; "
                        f"c({ckpt!r}, {out!r}, tag='ckpt'); rc = 0",
           "dcp": "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as c; "
                  f"c({ckpt!r}, {os.path.join(out, 'model.pt')!r}); rc = 0",
           "baseline": "import torch; rc = 0"}[tool]  # the interpreter with torch imported, doing nothing
    if tool == "dcp":
        os.makedirs(out, exist_ok=True)
    code = ("import sys\n" + run + "\nhwm = next(int(line.split()[1]) for line in open('/proc/self/status') "
            "if line.startswith('VmHWM'))\nprint(hwm * 1024)\nsys.exit(rc)")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"bench: {tool} consolidation failed: {done.stderr[-2000:]}")
    return {"seconds": seconds, "peak_rss": int(done.stdout.split()[-1]),
            "bytes_written": _tree_bytes(out) if os.path.isdir(out) else 0}


def _summary(ranks: list[dict], nbytes: int) -> dict:
    quiet = statistics.median(s for r in ranks for s in r["quiet_steps_s"])
    out = {"bytes": nbytes, "save_s": max(r["save_s"] for r in ranks),
           "durable_s": max(r["durable_s"] for r in ranks), "load_s": max(r["load_s"] for r in ranks),
           "step_s_quiet_median": quiet, "ranks": ranks}
    if "async_call_s" in ranks[0]:
        # Time the save took from training on the slowest rank: the call's wait plus the steps' excess over quiet.
        taken = [r["async_call_s"] + sum(max(0.0, s - quiet) for s in r["steps_during_async_s"]) for r in ranks]
        out.update(async_call_s=max(r["async_call_s"] for r in ranks),
                   async_total_s=max(r["async_total_s"] for r in ranks),
                   steps_during_async=len(ranks[0]["steps_during_async_s"]), async_blocked_s=max(taken),
                   async_blocked_of_sync=max(taken) / out["durable_s"])
    return out


def run(model: str = "25m", world: int = 2, stage: int = 2, steps: int = 6, peers: list[str] | None = None,
        root: str | None = None) -> dict:
    names = ["zkern"] + [p for p in (peers if peers is not None else ["dcp", "deepspeed"]) if p in CONTENDERS]
    if "deepspeed" in names and not installed("deepspeed"):
        names.remove("deepspeed")
    spec = make_spec(stage, model, steps=max(steps, 8))
    own = root is None
    root = root or tempfile.mkdtemp(prefix="zkern-bench-ckpt-")
    contenders, consolidation = {}, {}
    try:
        # the disk first, from the same settled state as each contender's save, at the size of their checkpoints
        # (weights and AdamW's two moments in fp32)
        settle = len(names) > 1  # zkern alone (make gate) has no one to be fair to
        if settle:
            os.sync()
            time.sleep(SETTLE_S)
        disk = disk_bandwidth(root, 12 * spec.num_params())
        for name in names:
            ranks = spawn(_rank, world, spec, root, steps, name, settle, subprocess=True, timeout=1800)
            contenders[name] = _summary(ranks, _tree_bytes(os.path.join(root, name, "sync")))
        for tool in names + (["baseline"] if settle else []):  # the torch-importing peers' floor, beside them
            ckpt = os.path.join(root, tool, "sync")
            consolidation[tool] = _consolidate(tool, ckpt, os.path.join(root, f"{tool}-consolidated"))
            shutil.rmtree(os.path.join(root, f"{tool}-consolidated"), ignore_errors=True)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
    judged = goals(contenders, consolidation, disk)
    return {"suite": "checkpoint", "model": model, "world": world, "stage": stage, "threads": torch.get_num_threads(),
            "params": spec.num_params(), "disk": disk, "contenders": contenders, "consolidation": consolidation,
            "goals": judged, "ratios": judged["figures"], "preset": MODELS[model]}


def goals(contenders: dict, consolidation: dict, disk: dict) -> dict:
    """The issue's goals, each as its measured figure and whether it holds (None: the peer did not run)."""
    z = contenders["zkern"]
    out = {"save_of_disk_write": z["bytes"] / z["durable_s"] / disk["write_bps"],
           "load_of_disk_read": z["bytes"] / z["load_s"] / disk["read_bps"],
           "async_blocked_of_sync": z.get("async_blocked_s", 0.0) / z["durable_s"],
           "consolidate_peak_of_checkpoint": consolidation["zkern"]["peak_rss"] / z["bytes"]}
    for peer in ("dcp", "deepspeed"):
        if peer in contenders:
            out[f"save_over_{peer}"] = z["durable_s"] / contenders[peer]["durable_s"]
            out[f"load_over_{peer}"] = z["load_s"] / contenders[peer]["load_s"]
            out[f"consolidate_over_{peer}"] = consolidation["zkern"]["seconds"] / consolidation[peer]["seconds"]
    met = {"save_of_disk_write": out["save_of_disk_write"] >= GOAL_DISK_FRACTION,
           "load_of_disk_read": out["load_of_disk_read"] >= GOAL_DISK_FRACTION,
           "async_blocked_of_sync": out["async_blocked_of_sync"] < GOAL_ASYNC_BLOCK,
           "consolidate_peak_of_checkpoint": out["consolidate_peak_of_checkpoint"] <= GOAL_CONSOLIDATE_PEAK}
    met.update({k: v < 1.0 for k, v in out.items() if "_over_" in k})
    return {"figures": out, "met": met}


def table(record: dict) -> str:
    mib = 2 ** 20
    disk = record["disk"]
    lines = [f"checkpoint suite: {record['model']} ({record['params'] / 1e6:.1f}M parameters, fp32 + AdamW), stage "
             f"{record['stage']}, world {record['world']}, {record['threads']} threads; disk "
             f"{disk['write_bps'] / mib:.0f} MiB/s write (fsynced), {disk['read_bps'] / mib:.0f} MiB/s read (cold)",
             "", "| contender | size | save (durable) | load (cold) | async: call / taken from steps / whole |",
             "|---|---|---|---|---|"]
    for name, c in record["contenders"].items():
        size = c["bytes"]
        durable = f"{c['durable_s']:.2f} s ({size / mib / c['durable_s']:.0f} MiB/s)"
        if c["durable_s"] - c["save_s"] > 1e-3:
            durable += f", call {c['save_s']:.2f} s"
        asyn = "none on a CPU" if "async_call_s" not in c else (
            f"{c['async_call_s'] * 1e3:.0f} ms / {c['async_blocked_s']:.2f} s over {c['steps_during_async']} steps / "
            f"{c['async_total_s']:.2f} s")
        lines.append(f"| {name} | {size / mib:.0f} MiB | {durable} | {c['load_s']:.2f} s "
                     f"({size / mib / c['load_s']:.0f} MiB/s) | {asyn} |")
    lines += ["", "| consolidation (own process) | seconds | peak RSS | written |", "|---|---|---|---|"]
    for tool, c in record["consolidation"].items():
        label = {"zkern": "python -m zkern.checkpoint consolidate", "deepspeed": "DeepSpeed zero_to_fp32",
                 "dcp": "DCP dcp_to_torch_save", "baseline": "(python + import torch, nothing else)"}[tool]
        lines.append(f"| {label} | {c['seconds']:.2f} | {c['peak_rss'] / mib:.0f} MiB | "
                     f"{c['bytes_written'] / mib:.0f} MiB |")
    g = record["goals"]
    lines += ["", "goals: " + "; ".join(f"{k} {v:.3g} ({'met' if g['met'][k] else 'NOT met'})"
                                      for k, v in g["figures"].items())]
    return "\n".join(lines)
