"""The fused CPU Adam extension (zkern.cpu._adam_ext) seen from Python: loading, ISA choice, checked calls.

    python -m zkern.env_report                       # which path is active, and why
    ZKERN_CPU_ISA=avx2 python -m pytest tests/kernels/test_cpu_adam.py -q

The extension takes raw data pointers, so every check a torch op would make happens here first: device,
dtype, contiguity, sizes. The ISA path is the fastest this CPU supports, or the one ZKERN_CPU_ISA forces
(forcing one this CPU or build lacks is an error, never a quiet fallback).
"""

from __future__ import annotations

import math
import os

import torch

BUILD_HINT = ("build it with `pip install -e .` in the zkern checkout (or `make setup`); it needs g++ with OpenMP, "
              "and pip fetches pybind11 for the build")

try:
    from zkern.cpu import _adam_ext as EXT

    LOAD_ERROR: str | None = None
except ImportError as error:  # a source tree used without building, or a failed build
    EXT = None
    LOAD_ERROR = f"zkern.cpu._adam_ext is not importable ({error})"

ISAS = ("avx512", "avx2", "scalar")
SUPPORTED: tuple[str, ...] = tuple(i for i in EXT.compiled_isas() if EXT.cpu_supports(i)) if EXT else ()
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def available() -> bool:
    return EXT is not None


_said_threads = False


def cpu_threads() -> int:
    """Threads the CPU Adam uses when a call names none: ZKERN_CPU_THREADS if set; else the cores this process may
    run on (os.sched_getaffinity), shared among the ranks of this node (LOCAL_WORLD_SIZE) unless the ranks were
    pinned to cores of their own. Not torch.get_num_threads(): torchrun sets OMP_NUM_THREADS=1, which would leave
    an offloaded optimizer step on one core per rank. Said once in the log."""
    global _said_threads
    env = os.environ.get("ZKERN_CPU_THREADS")
    if env is not None:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"ZKERN_CPU_THREADS must be a whole number of threads >= 1, got {env!r}")
        threads, why = int(env), "ZKERN_CPU_THREADS"
    else:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        if cores >= (os.cpu_count() or cores) and ranks > 1:  # every rank may use every core: share them
            threads, why = max(1, cores // ranks), f"{cores} cores shared by {ranks} ranks on this node"
        else:
            threads, why = cores, f"{cores} cores this process may use"
    if not _said_threads:
        _said_threads = True
        import logging

        logging.getLogger("zkern").info("zkern CPU Adam: %d threads (%s; ZKERN_CPU_THREADS overrides)", threads, why)
    return threads


def threads_share(share: float) -> int:
    """The CPU Adam's threads for an Adam that runs beside the training thread: `share` (0-1] of cpu_threads(), at
    least one (offload_optimizer.cpuadam_cores_perc; DeepSpeed's SuperOffload gives its Adam process that share of
    the cores)."""
    if not 0 < share <= 1:
        raise ValueError(f"a share of the CPU Adam's threads is in (0, 1], got {share!r}")
    return max(1, math.floor(cpu_threads() * share + 1e-9))  # 0.29 x 100 is 28.999...: still 29


def active_isa() -> str:
    """The ISA path calls take: ZKERN_CPU_ISA if set (checked), else the fastest this CPU supports."""
    if EXT is None:
        raise RuntimeError(f"the zkern CPU Adam extension is missing: {LOAD_ERROR}; {BUILD_HINT}")
    forced = os.environ.get("ZKERN_CPU_ISA", "").strip().lower()
    if not forced:
        return SUPPORTED[0]
    if forced not in ISAS:
        raise ValueError(f"ZKERN_CPU_ISA={forced!r} is not a path; choose one of {', '.join(ISAS)} or unset it")
    if forced not in SUPPORTED:
        raise RuntimeError(f"ZKERN_CPU_ISA={forced}: this CPU or build cannot run it (paths here: "
                           f"{', '.join(SUPPORTED)}); unset ZKERN_CPU_ISA or choose one of those")
    return forced


def status() -> dict:
    """What env_report shows: whether the extension loaded, which path is active and why."""
    if EXT is None:
        return {"extension": False, "reason": LOAD_ERROR, "hint": BUILD_HINT, "active": "torch fallback"}
    try:
        active = active_isa()
        why = "forced by ZKERN_CPU_ISA" if os.environ.get("ZKERN_CPU_ISA") else "the fastest path this CPU supports"
    except (ValueError, RuntimeError) as error:
        active, why = None, str(error)
    return {"extension": True, "active": active, "why": why, "supported": list(SUPPORTED),
            "compiled": list(EXT.compiled_isas()), "threads": torch.get_num_threads()}


def _check(name: str, t: torch.Tensor, numel: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"CPU Adam: {name} is on {t.device}; the CPU kernel steps host tensors (offload the "
                         f"optimizer, or use a GPU optimizer there)")
    if t.dtype not in dtypes:
        raise TypeError(f"CPU Adam: {name} must be {' or '.join(map(str, dtypes))}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"CPU Adam: {name} is not contiguous; the kernel streams flat buffers (pass "
                         f"{name}.contiguous(), or flat shards as zkern's engine does)")
    if t.numel() != numel:
        raise ValueError(f"CPU Adam: {name} has {t.numel()} elements, param has {numel}")


STATE_DTYPES = (torch.float32, torch.bfloat16)


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, adamw: bool,
               grad_scale: float = 1.0, param_out: torch.Tensor | None = None, sr_seed: int | None = None,
               sr_offset: int = 0, isa: str | None = None, threads: int | None = None,
               save: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
    """zkern.reference.adam_step_'s semantics in one fused pass (to float32 rounding; see csrc/adam_kernel.h).

    param (the master) and the moments may be bfloat16 (rounded to nearest even, or stochastically with sr_seed).
    isa: a path to use instead of active_isa() (tests step every path; "shared" runs the CUDA kernel's per-element
    code, zkern/csrc/zk_adam.h, on the host, one element at a time); threads: default cpu_threads(). save: three
    buffers like (param, exp_avg, exp_avg_sq) that take their values before the step, in the same pass.
    """
    n = param.numel()
    _check("param", param, n, STATE_DTYPES)
    _check("grad", grad, n, tuple(DTYPE_CODES))
    _check("exp_avg", exp_avg, n, STATE_DTYPES)
    _check("exp_avg_sq", exp_avg_sq, n, (exp_avg.dtype,))
    if param_out is not None:
        _check("param_out", param_out, n, tuple(DTYPE_CODES))
    if save is not None:
        for name, buf, like in zip(("save[0]", "save[1]", "save[2]"), save, (param, exp_avg, exp_avg_sq)):
            _check(name, buf, n, (like.dtype,))
    if step < 1:
        raise ValueError(f"CPU Adam: step counts from 1, got {step}")
    chosen = active_isa() if isa is None else isa
    if chosen not in SUPPORTED and chosen != "shared":
        raise ValueError(f"CPU Adam: path {chosen!r} is not available here (paths: {', '.join(SUPPORTED)})")
    EXT.adam_step(chosen, param.data_ptr(), DTYPE_CODES[param.dtype], grad.data_ptr(), DTYPE_CODES[grad.dtype],
                  exp_avg.data_ptr(), exp_avg_sq.data_ptr(), DTYPE_CODES[exp_avg.dtype],
                  0 if param_out is None else param_out.data_ptr(),
                  -1 if param_out is None else DTYPE_CODES[param_out.dtype], n, int(step), float(lr),
                  float(betas[0]), float(betas[1]), float(eps), float(weight_decay), bool(adamw),
                  float(grad_scale), sr_seed is not None, (sr_seed or 0) & 0xFFFFFFFF, int(sr_offset),
                  threads or cpu_threads(), *(0, 0, 0) if save is None else (t.data_ptr() for t in save))


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """zkern.reference.quantize's (codes, scales) from the shared per-element rules (zkern/csrc/zk_quant.h, the CUDA
    kernels' own), on host tensors."""
    from zkern import reference

    reference.check_quantize_args(x, bits, group_size)
    _check("x", x, x.numel(), tuple(DTYPE_CODES))
    codes, scales = reference.quant_outputs(x.numel(), bits, group_size)
    EXT.quantize(x.data_ptr(), DTYPE_CODES[x.dtype], x.numel(), bits, group_size, codes.data_ptr(),
                 scales.data_ptr())
    return codes, scales


def dequant_sum_requant(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int,
                        out_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qgZ's hop in one pass from the shared rules: (the fp32 sum over ranks that reference.dequant_sum gives, and
    that sum's reference.quantize(out_bits) codes and scales). q: (world, codes per chunk), scales: (world, groups)."""
    from zkern import reference

    if not out_bits:
        raise ValueError("dequant_sum_requant on the host requantizes: out_bits must be 4 or 8")
    reference.check_hop_args(q, scales, bits, group_size, numel, out_bits)
    _check("q", q, q.numel(), (torch.int8, torch.uint8))
    _check("scales", scales, scales.numel(), (torch.float32,))
    total = torch.empty(numel, dtype=torch.float32)
    codes, out_scales = reference.quant_outputs(numel, out_bits, group_size)
    EXT.dequant_sum_requant(q.data_ptr(), scales.data_ptr(), q.shape[0], q.shape[1], scales.shape[1], bits,
                            group_size, numel, total.data_ptr(), out_bits, codes.data_ptr(), out_scales.data_ptr())
    return total, codes, out_scales
