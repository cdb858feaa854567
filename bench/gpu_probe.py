"""What one lent GPU can tell in minutes: the machine's ceilings, each system's step time and the memory the
allocator really holds, and zkern over NCCL at world 2 on one card. Every part runs on a CPU too (smaller), which is
how tests/bench/test_gpu_probe.py checks it.

    python bench/gpu_probe.py bw --json out/bw.json
    python bench/gpu_probe.py variants zkern0 zkern3 ddp-fused fsdp2-fused --model 1b --json out/variants.json
    python bench/gpu_probe.py variants zkern3 --model 1b --snapshot --json out/zkern3.json
    python bench/gpu_probe.py world2 --json out/world2.json              # bench/probe_world2.py's checks

bw        device copy (bytes read + written), host<->device pinned and pageable, a bf16 8192^3 matrix product, host
          memory bandwidth with every core (torch's copy)
variants  each system (bench/probe_systems.py) in a fresh process with every core and nothing returned but figures;
          the JSON is rewritten after every variant, so a run cut off keeps what finished. Per system: step time
          (CUDA events per step, and the host clock over the timed steps), tokens/s, TFLOPS and MFU against the
          measured matrix rate (--matmul-tflops, or the bw record's), memory at build, after forward, peak in
          backward, after the step and the peak over the timed steps (allocated and reserved; RSS on a CPU), the
          three phases' times, the host step's phases for offload, and with --snapshot the allocations live at the
          peak of one step attributed to the first zkern (else bench, else other) frame that made them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import engine_suite, flops, probe_systems  # noqa: E402
from bench.probe_record import machine, write_json  # noqa: E402,F401  (the probe's record: its machine, its file)
from bench.probe_report import _line, summary, table  # noqa: E402
from zkern.testing import TrainSpec, rank_device, spawn  # noqa: E402
from zkern.testing.memory import peak_rss_bytes, reset_peak_rss  # noqa: E402


# -- bw ------------------------------------------------------------------------------------------------------------
def _time_cuda(fn, reps: int) -> float:
    """Median seconds of fn over reps, each timed with CUDA events after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def _time_host(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bandwidth(nbytes: int = 1 << 30, threads: int | None = None) -> dict:
    """GB/s of each path (10^9 bytes per second), bytes counted once per direction; the device copy counts bytes
    read plus written, as the kernels suite does."""
    threads = threads or os.cpu_count()
    torch.set_num_threads(threads)
    n = nbytes // 4
    src, dst = torch.randn(n), torch.empty(n)
    out = {"bytes": nbytes, "host_threads": threads,
           "host_copy_gbs": 2 * nbytes / _time_host(lambda: dst.copy_(src), 5) / 1e9}
    if not torch.cuda.is_available():
        out["device"] = "no CUDA device: the host figure only"
        return out
    dev = torch.device("cuda")
    d_src, d_dst = torch.randn(n, device=dev), torch.empty(n, device=dev)
    out["device_copy_gbs"] = 2 * nbytes / _time_cuda(lambda: d_dst.copy_(d_src), 20) / 1e9
    pinned = torch.empty(n, pin_memory=True)
    pinned.copy_(src)
    for name, host in (("pinned", pinned), ("pageable", src)):
        out[f"h2d_{name}_gbs"] = nbytes / _time_cuda(lambda h=host: d_dst.copy_(h, non_blocking=True), 5) / 1e9
        out[f"d2h_{name}_gbs"] = nbytes / _time_cuda(lambda h=host: h.copy_(d_src, non_blocking=True), 5) / 1e9
    out["matmul_bf16_tflops"] = flops.measure_matmul_tflops(dev)
    return out


# -- variants ------------------------------------------------------------------------------------------------------
def _mem(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device)}
    with open("/proc/self/statm") as f:
        return {"rss": int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")}


def _host_figures(system) -> dict:
    """The host memory the process held at its peak (VmHWM, over its life on a GPU, since the timed steps began on a
    CPU: page-locked buffers count once touched, at the size the allocator gave them) beside what zkern's
    memory_report counts on the host: where they part, the books are wrong (torch's caching host allocator rounds
    each pinned allocation up to a power of two)."""
    out = {"peak_rss": peak_rss_bytes()}
    engine = getattr(system, "engine", None)
    if engine is not None and hasattr(engine, "memory_report"):
        out["zkern_counted"] = sum(engine.memory_report().get("host", {}).values())
    return out


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()


def _peak(device: torch.device) -> dict:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return {"allocated": torch.cuda.max_memory_allocated(device),
                "reserved": torch.cuda.max_memory_reserved(device)}
    return {"rss": peak_rss_bytes()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Clock:
    """Seconds of a region: CUDA events on a GPU (read after a synchronize), the host clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]


def attribute_peak(trace: list[dict], base: int, top: int = 12) -> dict:
    """Replay an allocator trace (torch.cuda.memory._snapshot()['device_traces'][i]): find the moment the allocated
    bytes peaked and sum what was live then by the first zkern frame (else bench, else any) of its allocation.
    base: bytes allocated before the trace began (no frames: "before the step")."""
    live: dict[int, tuple[int, str]] = {}
    now = peak = base
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in trace:
        action = ev.get("action")
        if action == "alloc":
            live[ev["addr"]] = (ev["size"], _site(ev.get("frames") or []))
            now += ev["size"]
            if now > peak:
                peak, at_peak = now, dict(live)
        elif action == "free_completed":
            # a block from before the trace (no alloc event) still leaves the count when it is freed
            now -= live.pop(ev["addr"])[0] if ev["addr"] in live else ev.get("size", 0)
    sites: dict[str, int] = {}
    for size, site in at_peak.values():
        sites[site] = sites.get(site, 0) + size
    ranked = sorted(sites.items(), key=lambda kv: -kv[1])
    return {"peak_allocated": peak, "before_the_step": base,
            "sites": [{"site": s, "bytes": b} for s, b in ranked[:top]],
            "other_sites_bytes": sum(b for _, b in ranked[top:])}


def _site(frames: list[dict]) -> str:
    """'file:line function' of the innermost zkern frame (the engine's, or the model's in zkern/testing), else the
    innermost bench frame, else the innermost."""
    def where(f: dict) -> str:
        name = f.get("filename", "")
        short = "zkern/" + name.split("/zkern/")[-1] if "/zkern/" in name else os.path.basename(name)
        return f"{short}:{f.get('line')} {f.get('name')}"

    for marker in ("/zkern/", "/bench/"):
        for f in frames:
            if marker in f.get("filename", ""):
                return where(f)
    return where(frames[0]) if frames else "(no frame)"


def measure(rank: int, world: int, name: str, spec: TrainSpec, warmup: int, timed: int, snapshot: bool,
            grad_norms: bool = False) -> dict:
    """Build system name, train warmup + timed steps, then one instrumented step. Returns figures only; with
    grad_norms also the gradient norm of every step (the torch systems then read their gradients once more before
    each step, inside the timed span)."""
    device = rank_device(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _reset_peak(device)
    t0 = time.perf_counter()
    system = probe_systems.build(name, spec, world)
    system.record_norms = grad_norms
    _sync(device)
    out = {"system": name, "build_s": time.perf_counter() - t0, "memory": {"build": _mem(device),
                                                                          "build_peak": _peak(device)}}
    batches = spec.batches(world)
    losses, norms = [], []

    def one(step: int, clock: _Clock | None = None):
        idx, tgt = (t.to(device) for t in batches[step][0][rank])
        loss = system.forward(idx, tgt, step, rank)
        if clock:
            clock.mark()
        system.backward(loss)
        if clock:
            clock.mark()
        system.step()
        if grad_norms:
            norms.append(system.grad_norm())
        return loss

    for s in range(warmup):
        losses.append(float(one(s).detach()))
    _reset_peak(device)
    clock = _Clock(device)
    start = time.perf_counter()
    clock.mark()
    pending = []
    for s in range(warmup, warmup + timed):
        pending.append(one(s))
        clock.mark()
    _sync(device)
    host_s = (time.perf_counter() - start) / timed
    losses += [float(x.detach()) for x in pending]
    steps = clock.spans()
    out["memory"]["timed_peak"] = _peak(device)
    # the instrumented step: memory between phases, phase times, offload phases, an optional allocator trace
    s = warmup + timed
    idx, tgt = (t.to(device) for t in batches[s][0][rank])
    phases, offload = {}, {}
    recording = snapshot and device.type == "cuda"
    if recording:
        base = torch.cuda.memory_allocated(device)
        torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks="python")
    _sync(device)
    t = time.perf_counter()
    loss = system.forward(idx, tgt, s, rank)
    _sync(device)
    phases["forward_s"] = time.perf_counter() - t
    out["memory"]["after_forward"] = _mem(device)
    _reset_peak(device)
    t = time.perf_counter()
    system.backward(loss)
    _sync(device)
    phases["backward_s"] = time.perf_counter() - t
    out["memory"]["backward_peak"] = _peak(device)
    with probe_systems.offload_phases(system, offload):
        t = time.perf_counter()
        system.step()
        phases["step_host_s"] = time.perf_counter() - t
        t = time.perf_counter()
        _sync(device)
    phases["step_tail_s"] = time.perf_counter() - t
    if grad_norms:
        norms.append(system.grad_norm())
    if offload:
        offload["upload_tail"] = phases["step_tail_s"]
        offload["host_adam"] = phases["step_host_s"] - offload["wait_down"] - offload["upload_issue"]
        out["offload_phases_s"] = offload
    out["memory"]["after_step"] = _mem(device)
    losses.append(float(loss.detach()))
    if recording:
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        out["peak_sites"] = attribute_peak(snap["device_traces"][device.index or 0], base)
    out["host"] = _host_figures(system)
    system.close()
    tokens = spec.micro_batch * spec.model["seq"] * world
    median = statistics.median(steps)
    if grad_norms:
        out["grad_norms"] = norms
    out.update(phases=phases, losses=losses, step_s={"median": median, "min": min(steps), "max": max(steps),
                                                     "all": steps}, host_step_s=host_s,
               tokens_per_step=tokens, tokens_per_s=tokens / median,
               tflops_per_rank=flops.train_flops_per_token(spec.model) * tokens / median / world / 1e12)
    return out


def run_variants(names: list[str], model: str, device: str, json_path: str | None, *, steps: int | None,
                 warmup: int, micro_batch: int | None, snapshot: bool, matmul_tflops: float | None,
                 threads: int, timeout: float, world: int = 1, checkpoint: str = "", lr: float | None = None,
                 grad_norms: bool = False) -> dict:
    """world > 1 on a GPU puts every rank on GPU 0 (probe_world2.one_gpu_env): each rank's allocator figures are its
    own and real, its step times are not (the ranks share one GPU and talk over sockets). lr: the optimizers' rate
    (default the engine suite's 1e-3, under which a 7B model's loss climbs and two systems' losses part within a few
    steps; parity runs take a smaller one). grad_norms: every step's gradient norm per system."""
    timed = steps or 6
    precision = "bf16"  # every system's recipe is a bf16 one (torch-mixed has no fp32 form)
    spec = engine_suite.make_spec(0, model, warmup + timed + 1, precision, device)
    if micro_batch:
        spec = dataclasses.replace(spec, micro_batch=micro_batch)
    if checkpoint:  # every system's blocks recompute in backward (the model's own run_block, the same for all)
        spec = dataclasses.replace(spec, model={**spec.model, "checkpoint": checkpoint})
    if lr is not None:
        spec = dataclasses.replace(spec, lr=lr)
    record = {"probe": "variants", "machine": machine(), "model": model, "model_kwargs": spec.model,
              "world": world, "timing_meaningful": world == 1 or device != "cuda", "lr": spec.lr,
              "grad_norms": grad_norms,
              "params": spec.num_params(), "micro_batch": spec.micro_batch, "precision": precision,
              "warmup": warmup, "timed_steps": timed, "matmul_tflops": matmul_tflops, "variants": []}
    for name in names:
        if name not in probe_systems.NAMES:
            raise SystemExit(f"probe: unknown variant {name!r}; known: {', '.join(probe_systems.NAMES)}")
    for name in names:
        print(f"[probe] {name} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            from bench.probe_world2 import one_gpu_env

            ranks = spawn(measure, world, name, spec, warmup, timed, snapshot, grad_norms, subprocess=True,
                          threads=threads, timeout=timeout,
                          rank_env=one_gpu_env if device == "cuda" and world > 1 else None)
            res = ranks[0]
            res["peak_per_rank"] = [r["memory"]["timed_peak"] for r in ranks]
            if matmul_tflops:
                res["mfu_of_matmul"] = res["tflops_per_rank"] / matmul_tflops
            peak = flops.peak_tflops(record["machine"]["device"] or "", precision)
            res["mfu"] = res["tflops_per_rank"] / peak if peak else None
        except Exception as e:  # recorded, and the next variant runs
            res = {"system": name, "error": str(e)[-3000:]}
        res["wall_s"] = time.perf_counter() - t
        record["variants"].append(res)
        write_json(json_path, record)
        print(f"[probe] {name}: {_line(res)}", file=sys.stderr, flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bw")
    b.add_argument("--json")
    b.add_argument("--bytes", type=int, default=1 << 30)
    v = sub.add_parser("variants")
    v.add_argument("names", nargs="+")
    v.add_argument("--model", default="1b", choices=sorted(engine_suite.MODELS))
    v.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    v.add_argument("--steps", type=int, default=None, help="timed steps (default 6)")
    v.add_argument("--warmup", type=int, default=2)
    v.add_argument("--micro-batch", type=int, default=None)
    v.add_argument("--snapshot", action="store_true")
    v.add_argument("--matmul-tflops", type=float, default=None)
    v.add_argument("--bw-json", help="a bw record whose matmul_bf16_tflops to use")
    v.add_argument("--threads", type=int, default=os.cpu_count())
    v.add_argument("--timeout", type=float, default=300)
    v.add_argument("--world", type=int, default=1, help="ranks (on a GPU: all on GPU 0; memory per rank only)")
    v.add_argument("--checkpoint", default="", help="activation checkpointing of every block: non_reentrant, zkern")
    v.add_argument("--lr", type=float, default=None, help="the optimizers' learning rate (default 1e-3)")
    v.add_argument("--grad-norms", action="store_true", help="record every step's gradient norm per system")
    v.add_argument("--json")
    w = sub.add_parser("world2")
    w.add_argument("--json")
    w.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    w.add_argument("--checks", default=None, help="comma-separated; default all")
    w.add_argument("--timeout", type=float, default=120)
    sm = sub.add_parser("summary")
    sm.add_argument("folder")
    args = p.parse_args(argv)
    if args.cmd == "summary":
        print(summary(args.folder))
    elif args.cmd == "bw":
        rec = {"probe": "bw", "machine": machine(), **bandwidth(args.bytes)}
        write_json(args.json, rec)
        print(json.dumps(rec, indent=1))
    elif args.cmd == "variants":
        matmul = args.matmul_tflops
        if matmul is None and args.bw_json and os.path.exists(args.bw_json):
            with open(args.bw_json) as f:
                matmul = json.load(f).get("matmul_bf16_tflops")
        rec = run_variants(args.names, args.model, args.device, args.json, steps=args.steps, warmup=args.warmup,
                           micro_batch=args.micro_batch, snapshot=args.snapshot, matmul_tflops=matmul,
                           threads=args.threads, timeout=args.timeout, world=args.world,
                           checkpoint=args.checkpoint, lr=args.lr, grad_norms=args.grad_norms)
        print(table(rec))
        return int(any("error" in r for r in rec["variants"]))
    else:
        from bench import probe_world2

        rec = probe_world2.run(args.device, args.json, args.checks.split(",") if args.checks else None,
                               args.timeout)
        print(probe_world2.table(rec))
        return int(any(c["status"] != "pass" for c in rec["checks"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
