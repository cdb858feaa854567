"""Adam suite: zkern's fused CPU Adam against the stock ways of doing the same step, at 50M parameters.

    python bench/run.py --suite adam                 # 50M parameters, torch's thread count (OMP_NUM_THREADS)
    python bench/run.py --suite adam --adam-numel 5000000

The step ZeRO-Offload runs on the host every iteration: a bf16 gradient arrives, the fp32 master and moments
are updated, a bf16 parameter goes back. Candidates, each timed over the same buffers' sizes in one run,
interleaved round by round so that the machine's noise falls on all of them alike:

  zkern offload       one pass: bf16 grad in, fp32 param/exp_avg/exp_avg_sq updated, bf16 param out
  stock offload       grad.float(), torch.optim.AdamW(fused=True).step(), bf16 copy of the param
  deepspeed offload   DeepSpeedCPUAdam's equivalent (grad copied into a preallocated fp32 buffer, step, param
                      copy), when deepspeed is installed (never a zkern dependency)
  zkern fp32          the plain fp32 step (fp32 grad, no copy)
  torch fused fp32    torch.optim.AdamW(fused=True).step() alone
  zkern offload 1t    the offload step on one thread (the 1 -> 2 thread speed-up)
  zkern bf16 states   the offload step with bf16 moments (bf16.bf16_optimizer_states): 20 bytes per parameter
  zkern bf16 states sr  the same, rounding stochastically (bf16_stochastic_rounding)
  zkern bf16 master   bf16 master and moments (bf16_master_weights_and_grads too): 16 bytes per parameter
  in-place bandwidth  x.mul_(c) over a buffer of the working set's size: bytes read + written per second

The roofline of the offload step: 28 bytes per parameter (2 in, 12 read, 12 written, 2 out) at the measured
in-place bandwidth; 20 with bf16 moments (2 in, 8 read, 8 written, 2 out), 16 with a bf16 master too.

The ratios are paired: each round times zkern's offload step next to each peer, the ratio is taken within the
round, and the figure is the median over rounds. A shared machine's memory bandwidth moves by up to 2x between
moments (seen here: the in-place pass at 55 and at 95 GB/s within one run); medians of each candidate taken apart
put that swing into the ratio, pairs taken a few milliseconds apart cancel it.
"""

from __future__ import annotations

import datetime
import importlib.util
import platform
import statistics
import sys
import time

import torch

import zkern
from bench.engine_suite import _git_sha, _quantiles
from zkern.cpu import _ext
from zkern.env_report import cpu_model

BYTES_PER_PARAM = 28  # offload step: 2 (bf16 grad) + 12 read + 12 written (param, exp_avg, exp_avg_sq) + 2 out
BF16_STATES_BYTES = 20  # the same with bf16 moments: 2 + 8 read + 8 written + 2
BF16_MASTER_BYTES = 16  # and a bf16 master: 2 + 6 read + 6 written + 2
DEFAULT_NUMEL = 50_000_000


def _time_round_robin(candidates: dict, reps: int, progress) -> dict[str, list[float]]:
    """Each candidate once to warm up, then `reps` rounds that time every candidate once."""
    for name, fn in candidates.items():
        progress(f"adam: warm-up {name}")
        fn()
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for r in range(reps):
        progress(f"adam: round {r + 1}/{reps}")
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def _deepspeed_candidate(numel: int, grad: torch.Tensor, out: torch.Tensor):
    """DeepSpeedCPUAdam's pipeline, or (None, why) when deepspeed or its op is not usable here."""
    if importlib.util.find_spec("deepspeed") is None:
        return None, "deepspeed not installed"
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        p = torch.nn.Parameter(torch.randn(numel))
        opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.01, adamw_mode=True)
    except Exception as error:  # its C++ op builds on first use and may fail; report, never crash the suite
        return None, f"DeepSpeedCPUAdam unusable: {error}"
    # As DeepSpeed's offload engine does it: the gradient copied into a preallocated fp32 buffer (no fresh
    # allocation), the step, the parameter copied out.
    p.grad = torch.empty(numel)

    def step():
        p.grad.copy_(grad)
        opt.step()
        out.copy_(p.detach())

    return step, None


def _deepspeed_version() -> str:
    import deepspeed

    return deepspeed.__version__


def run(numel: int = DEFAULT_NUMEL, reps: int = 15, progress=None, deepspeed: bool = True) -> dict:
    """deepspeed: time DeepSpeedCPUAdam too where the package imports (its op compiles at first use: off for the
    CI gate, which names its peers)."""
    if not _ext.available():
        raise SystemExit(f"bench: the adam suite measures zkern's CPU Adam extension, which is missing: "
                         f"{_ext.LOAD_ERROR}; {_ext.BUILD_HINT}")
    progress = progress or (lambda line: print(f"[bench] {line}", file=sys.stderr, flush=True))
    threads = torch.get_num_threads()
    isa = _ext.active_isa()
    hyper = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw=True)
    gen = torch.Generator().manual_seed(0)
    grad16 = torch.randn(numel, generator=gen).bfloat16()
    grad32 = torch.randn(numel, generator=gen)

    # zkern's buffers
    zp, zm, zv = torch.randn(numel, generator=gen), torch.zeros(numel), torch.zeros(numel)
    zout = torch.empty(numel, dtype=torch.bfloat16)
    # bf16 state: the moments (and for the last candidate the master) in bf16
    bm, bv = torch.zeros(numel, dtype=torch.bfloat16), torch.zeros(numel, dtype=torch.bfloat16)
    bp = zp.bfloat16()
    # torch's: its own parameter and optimizer state
    tp = torch.nn.Parameter(zp.clone())
    topt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=0.01, fused=True)
    tout = torch.empty(numel, dtype=torch.bfloat16)
    bandwidth_buf = torch.randn(numel * BYTES_PER_PARAM // 8, generator=gen)  # the step's working-set size

    def zkern_offload(t: int = threads):
        _ext.adam_step_(zp, grad16, zm, zv, step=10, param_out=zout, threads=t, **hyper)

    def stock_offload():
        tp.grad = grad16.float()
        topt.step()
        tout.copy_(tp.detach())

    def zkern_bf16_states(sr: int | None = None):
        _ext.adam_step_(zp, grad16, bm, bv, step=10, param_out=zout, threads=threads, sr_seed=sr, **hyper)

    def zkern_bf16_master():
        _ext.adam_step_(bp, grad16, bm, bv, step=10, param_out=zout, threads=threads, **hyper)

    def zkern_fp32():
        _ext.adam_step_(zp, grad32, zm, zv, step=10, threads=threads, **hyper)

    def torch_fused_fp32():
        tp.grad = grad32
        topt.step()

    def inplace_bandwidth():
        bandwidth_buf.mul_(1.0000001)

    # The bandwidth pass runs right after zkern's offload step in every round: the roofline ratio pairs them.
    candidates = {"zkern offload": zkern_offload, "in-place bandwidth": inplace_bandwidth,
                  "stock offload": stock_offload}
    ds_step, ds_why = _deepspeed_candidate(numel, grad16, tout) if deepspeed else (None, "not asked for (--peers)")
    if ds_step is not None:
        candidates["deepspeed offload"] = ds_step
    candidates.update({"zkern fp32": zkern_fp32, "torch fused fp32": torch_fused_fp32,
                       "zkern offload 1t": lambda: zkern_offload(1), "zkern bf16 states": zkern_bf16_states,
                       "zkern bf16 states sr": lambda: zkern_bf16_states(sr=12345),
                       "zkern bf16 master": zkern_bf16_master})
    times = _time_round_robin(candidates, reps, progress)

    figures = {}
    for name, ts in times.items():
        q = _quantiles(ts)
        if name == "in-place bandwidth":
            q["gb_per_s"] = bandwidth_buf.numel() * 8 / q["median_s"] / 1e9
        else:
            q["mparams_per_s"] = numel / q["median_s"] / 1e6
        figures[name] = q
    bandwidth = figures["in-place bandwidth"]["gb_per_s"]
    roofline = bandwidth * 1e9 / BYTES_PER_PARAM / 1e6

    def paired(slow: str, fast: str) -> float:
        """Median over rounds of time(slow) / time(fast), both timed in the same round."""
        return statistics.median(s / f for s, f in zip(times[slow], times[fast]))

    # The bandwidth pass moves (to rounding) the offload step's 28 bytes per parameter, so time(bandwidth) /
    # time(offload), scaled by the two byte counts, is the fraction of the roofline the offload step reaches.
    ratios = {
        "offload_over_stock": paired("stock offload", "zkern offload"),
        "offload_of_roofline": paired("in-place bandwidth", "zkern offload")
        * numel * BYTES_PER_PARAM / (bandwidth_buf.numel() * 8),
        "fp32_over_torch_fused": paired("torch fused fp32", "zkern fp32"),
        "thread_speedup": paired("zkern offload 1t", "zkern offload"),
        # bf16 state: parameters per second over the fp32-state offload step, and the fraction of the new roofline
        "bf16_states_over_offload": paired("zkern offload", "zkern bf16 states"),
        "bf16_states_of_roofline": paired("in-place bandwidth", "zkern bf16 states")
        * numel * BF16_STATES_BYTES / (bandwidth_buf.numel() * 8),
        "bf16_states_sr_over_offload": paired("zkern offload", "zkern bf16 states sr"),
        "bf16_master_over_offload": paired("zkern offload", "zkern bf16 master"),
        "bf16_master_of_roofline": paired("in-place bandwidth", "zkern bf16 master")
        * numel * BF16_MASTER_BYTES / (bandwidth_buf.numel() * 8),
    }
    if ds_step is not None:
        ratios["offload_over_deepspeed"] = paired("deepspeed offload", "zkern offload")
    return {
        "suite": "adam",
        "numel": numel,
        "threads": threads,
        "isa": isa,
        "reps": reps,
        "device": "cpu",
        "device_name": cpu_model(),
        "versions": {"zkern": zkern.__version__, "torch": torch.__version__, "python": platform.python_version(),
                     **({"deepspeed": _deepspeed_version()} if ds_step is not None else {})},
        "git_sha": _git_sha(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "figures": figures,
        "roofline_mparams_per_s": roofline,
        "peers_skipped": {} if ds_step is not None else {"deepspeed offload": ds_why},
        "ratios": ratios,
        "spread": {name: statistics.pstdev(ts) / statistics.mean(ts) for name, ts in times.items()},
    }


def table(record: dict) -> str:
    out = [f"adam suite: {record['numel'] / 1e6:.0f}M parameters, {record['threads']} threads, ISA "
           f"{record['isa']}, {record['device_name']}", "",
           "| candidate | median [p20-p80] | rate |", "|---|---|---|"]
    for name, f in record["figures"].items():
        rate = f"{f['gb_per_s']:.1f} GB/s" if "gb_per_s" in f else f"{f['mparams_per_s']:.0f} M params/s"
        out.append(f"| {name} | {f['median_s'] * 1e3:.1f} ms [{f['p20_s'] * 1e3:.1f}-{f['p80_s'] * 1e3:.1f}] | "
                   f"{rate} |")
    r = record["ratios"]
    out += ["", f"roofline (28 B/param at the in-place bandwidth): {record['roofline_mparams_per_s']:.0f} M params/s",
            f"zkern offload step: x{r['offload_over_stock']:.2f} the stock pipeline, "
            f"{r['offload_of_roofline'] * 100:.0f}% of the roofline"
            + (f", x{r['offload_over_deepspeed']:.2f} DeepSpeedCPUAdam" if "offload_over_deepspeed" in r else ""),
            f"zkern fp32 step: x{r['fp32_over_torch_fused']:.2f} torch.optim.AdamW(fused=True); 1 -> "
            f"{record['threads']} threads: x{r['thread_speedup']:.2f}"]
    if "bf16_states_over_offload" in r:
        out += [f"bf16 moments (20 B/param): x{r['bf16_states_over_offload']:.2f} the fp32-state offload step, "
                f"{r['bf16_states_of_roofline'] * 100:.0f}% of their roofline; stochastic rounding "
                f"x{r['bf16_states_sr_over_offload']:.2f}; bf16 master and moments (16 B/param) "
                f"x{r['bf16_master_over_offload']:.2f}, {r['bf16_master_of_roofline'] * 100:.0f}% of their roofline"]
    out += [f"skipped: {k}: {v}" for k, v in record["peers_skipped"].items()]
    return "\n".join(out)
