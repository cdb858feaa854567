"""THE front door to zkern's kernels: one function per op; each call picks its backend.

    ZKERN_BACKEND=reference python -m zkern.env_report     # force a backend and see what is active

Backends: "reference" (zkern.reference, pure torch, always there); "cpu" (zkern.cpu, the fused CPU Adam
extension: adam_step_ on host tensors when the extension is built); "triton" (zkern.triton: CUDA tensors when
Triton imports, or any tensors under TRITON_INTERPRET=1 when forced); "cuda" (zkern.cuda, CUDA C++: adam_step_
and the quantization ops, where torch has CUDA and nvcc and ninja are installed; built on first use).
Every op keeps the signature and semantics documented in zkern.reference.

The rule, per op and tensor: ZKERN_BACKEND=reference|cpu|triton|cuda forces one backend for every op it has
(the others take the reference); forcing one that is not available is an error, never a silent fallback.
Otherwise a host tensor takes "cpu" where it has the op, and a CUDA tensor takes the first of ON_CUDA that is
available and has the op; anything else takes "reference". Triton comes before CUDA C++ on a GPU: the Triton
kernels have run (under the interpreter, in CI, on the engine's own views), the CUDA kernels only compiled
(their per-element code runs on the host in the tests, their launchers have not met a GPU yet).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

from zkern import reference
from zkern.cpu import _ext as cpu_ext

BACKENDS = ("reference", "cpu", "triton", "cuda")


# Every kernel op and, per backend that has it, the file that holds it: zkern/triton/<file>.py,
# zkern/cuda/csrc/<file>.cu, the CPU extension's zkern/cpu/csrc/<file>.h. zkern.reference has every op (its twin:
# the semantics, the signature). The one list: the dispatch below, the table's test (tests/kernels/test_ops.py),
# zkern.env_report and the GPU static gate (bench/gpu_static_suite.py, which fails on a Triton or CUDA op it does not
# compile) all read it.
OPS: dict[str, dict[str, str]] = {
    "flatten": {"triton": "flatten"},
    "unflatten": {"triton": "flatten"},
    "unflatten_into_": {"triton": "flatten"},
    "unscale_and_check_": {"triton": "overflow"},
    "adam_step_": {"cpu": "adam", "triton": "adam", "cuda": "adam"},
    "quantize": {"triton": "quant", "cuda": "quant"},
    "dequantize": {"triton": "quant", "cuda": "quant"},
    "dequant_sum": {"triton": "quant", "cuda": "quant"},
    "dequant_sum_requant": {"triton": "quant", "cuda": "quant"},
}


def ops_of(backend: str) -> tuple[str, ...]:
    """The ops a backend has (every op for "reference")."""
    return tuple(op for op, homes in OPS.items() if backend == "reference" or backend in homes)


class _CpuBackend:
    """The CPU extension's ops (host tensors only)."""

    adam_step_ = staticmethod(cpu_ext.adam_step_)


class _LazyTriton:
    """zkern.triton's ops, each file imported on first use (importing Triton costs about a second)."""

    def __getattr__(self, op: str):
        if "triton" not in OPS.get(op, {}):
            raise AttributeError(op)
        return getattr(importlib.import_module(f"zkern.triton.{OPS[op]['triton']}"), op)


def _triton_usable() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") == "1"


# The order a CUDA tensor's op looks for a backend in (see the module's docstring).
ON_CUDA = ("triton", "cuda")

# Backends that exist in this build and on this machine.
AVAILABLE: dict[str, object] = {"reference": reference}
if cpu_ext.available():
    AVAILABLE["cpu"] = _CpuBackend
if _triton_usable():
    AVAILABLE["triton"] = _LazyTriton()
if torch.cuda.is_available():
    from zkern import cuda as _cuda

    if _cuda.why_unavailable() is None:
        AVAILABLE["cuda"] = _cuda


def _why_missing(name: str) -> str:
    if name == "cpu":
        return f" ({cpu_ext.LOAD_ERROR}; {cpu_ext.BUILD_HINT})"
    if name == "triton":
        if importlib.util.find_spec("triton") is None:
            return " (Triton is not installed: pip install triton)"
        return " (no CUDA device; on a CPU the kernels run only under TRITON_INTERPRET=1)"
    from zkern import cuda

    return f" ({cuda.why_unavailable()})"


def forced_backend() -> str | None:
    """The backend ZKERN_BACKEND forces, or None when it is unset."""
    name = os.environ.get("ZKERN_BACKEND", "").strip().lower()
    if not name:
        return None
    if name not in BACKENDS:
        raise ValueError(f"ZKERN_BACKEND={name!r} is not a backend; choose one of {', '.join(BACKENDS)}")
    if name not in AVAILABLE:
        raise RuntimeError(f"ZKERN_BACKEND={name}: zkern has no {name} kernels here{_why_missing(name)}; unset "
                           f"ZKERN_BACKEND or use ZKERN_BACKEND=reference")
    return name


def _has(backend: str, op: str) -> bool:
    return backend == "reference" or backend in OPS[op]


def backend_for(t: torch.Tensor | None = None, op: str = "adam_step_") -> str:
    """The backend op on tensor t runs on."""
    forced = forced_backend()
    if forced is not None:
        if forced == "cpu" and t is not None and t.device.type != "cpu":
            raise RuntimeError(f"ZKERN_BACKEND=cpu: the CPU kernels take host tensors, got one on {t.device}")
        return forced if _has(forced, op) else "reference"
    on_cpu = t is None or t.device.type == "cpu"
    for backend in ("cpu",) if on_cpu else ON_CUDA:
        if backend in AVAILABLE and _has(backend, op):
            return backend
    return "reference"


def _impl(t: torch.Tensor | None, op: str):
    return getattr(AVAILABLE[backend_for(t, op)], op)


_KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def flatten(tensors: list[torch.Tensor], dtype: torch.dtype | None = None, *, align: int = 1,
            pad_to: int = 1) -> torch.Tensor:
    # The kernels take floating-point data; integer buffers (a step counter, token ids) are torch.cat's job.
    if any(t.dtype not in _KERNEL_DTYPES for t in tensors) or (dtype is not None and dtype not in _KERNEL_DTYPES):
        return reference.flatten(tensors, dtype, align=align, pad_to=pad_to)
    return _impl(tensors[0] if tensors else None, "flatten")(tensors, dtype, align=align, pad_to=pad_to)


def unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    return _impl(flat, "unflatten")(flat, like)


def unflatten_into_(flat: torch.Tensor, tensors: list[torch.Tensor], *, align: int = 1) -> None:
    _impl(flat, "unflatten_into_")(flat, tensors, align=align)


def unscale_and_check_(flat_grad: torch.Tensor, inv_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(flat_grad, "unscale_and_check_")(flat_grad, inv_scale)


def adam_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, *,
               step: int, lr: float, betas: tuple[float, float], eps: float, weight_decay: float, adamw: bool,
               grad_scale: float = 1.0, param_out: torch.Tensor | None = None, sr_seed: int | None = None,
               sr_offset: int = 0, save: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
               threads: int | None = None) -> None:
    """One fused Adam/AdamW step, in place. save: three buffers shaped like (param, exp_avg, exp_avg_sq) that take
    their values before the step (the CPU kernel stores them in its one pass; the others copy them first). threads:
    the CPU kernel's (default: zkern.cpu._ext.cpu_threads()); a device kernel's are its device's."""
    hyper = dict(step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw=adamw,
                 grad_scale=grad_scale, param_out=param_out, sr_seed=sr_seed, sr_offset=sr_offset)
    impl = _impl(param, "adam_step_")
    if backend_for(param, "adam_step_") == "cpu":  # the kernel's own arguments
        hyper.update(threads=threads, save=save)
    elif save is not None:
        for buf, now in zip(save, (param, exp_avg, exp_avg_sq)):
            buf.copy_(now)
    impl(param, grad, exp_avg, exp_avg_sq, **hyper)


def cpu_adam_threads(share: float = 1.0) -> int | None:
    """The CPU Adam kernel's threads for `share` (0-1] of those it may use (offload_optimizer.cpuadam_cores_perc, for
    an Adam beside the training thread); None where the kernel is not built (the fallback is torch's own threads)."""
    return cpu_ext.threads_share(share) if cpu_ext.available() else None


def quantize(x: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return _impl(x, "quantize")(x, bits, group_size)


def dequantize(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return _impl(q, "dequantize")(q, scales, bits, group_size, numel, dtype)


def dequant_sum(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int) -> torch.Tensor:
    return _impl(q, "dequant_sum")(q, scales, bits, group_size, numel)


def dequant_sum_requant(q: torch.Tensor, scales: torch.Tensor, bits: int, group_size: int, numel: int,
                        out_bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _impl(q, "dequant_sum_requant")(q, scales, bits, group_size, numel, out_bits)


# -- NVMe I/O (ZeRO-Infinity): one implementation, the extension's thread pool over pread/pwrite ---------------
def nvme_pool(thread_count: int = 1, block_size: int = 1 << 20, queue_depth: int = 8):
    """The I/O threads NVMe files share (zkern.cpu.aio.IoPool; DeepSpeed's aio section)."""
    from zkern.cpu import aio

    return aio.IoPool(thread_count, block_size, queue_depth)


def nvme_file(path: str, nbytes: int, pool, *, create: bool = True):
    """A preallocated file read and written through pool (zkern.cpu.aio.NvmeFile)."""
    from zkern.cpu import aio

    return aio.NvmeFile(path, nbytes, pool, create=create)


def aligned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A host buffer aligned for O_DIRECT (zkern.cpu.aio.aligned_empty)."""
    from zkern.cpu import aio

    return aio.aligned_empty(numel, dtype)
