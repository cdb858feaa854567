"""What this machine gives zkern: versions, devices, backends and CPU instruction sets.

    python -m zkern.env_report            # a readable report
    python -m zkern.env_report --json     # the same as JSON (the benchmark records it)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform

import torch

import zkern
import zkern.cpu
from zkern import ops


def cpu_flags() -> dict[str, bool]:
    """The x86 instruction sets zkern's CPU kernels choose between, from /proc/cpuinfo."""
    wanted = ("avx512f", "avx512bw", "avx512vl", "avx2", "fma")
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        flags = []
    return {name: name in flags for name in wanted}


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.machine())
    except OSError:
        return platform.machine()


def _cpu_adam_threads() -> int | str:
    from zkern.cpu import _ext

    try:
        return _ext.cpu_threads()
    except ValueError as e:
        return f"invalid: {e}"


def _cuda_backends() -> dict[str, str] | str:
    """Each op's backend on a CUDA tensor, by the dispatch rule (zkern.ops)."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        probe = torch.empty(0, device="cuda")
        return {op: ops.backend_for(probe, op) for op in ops.OPS}
    except (RuntimeError, ValueError) as e:
        return f"error: {e}"


def _cuda_why() -> str:
    from zkern import cuda

    return cuda.why_unavailable() or "?"


def _nvcc() -> str:
    from zkern import cuda

    return cuda.nvcc() or "not found"


def _backend_or_error(op: str) -> str:
    try:
        return ops.backend_for(torch.empty(0), op)
    except (ValueError, RuntimeError) as e:
        return f"error: {e}"


def _nvme_io(directory: str | None = None) -> str:
    """The I/O path NVMe offload files get in directory (ZKERN_NVME_PATH, else the temp dir): a 4 KiB probe file."""
    import tempfile

    directory = directory or os.environ.get("ZKERN_NVME_PATH") or tempfile.gettempdir()
    if not zkern.cpu._ext.available():
        return "unavailable (the C++ extension is missing)"
    try:
        with tempfile.TemporaryDirectory(dir=directory) as probe_dir:
            f = ops.nvme_file(os.path.join(probe_dir, "probe.bin"), 4096, ops.nvme_pool())
            path = f.io_path
            f.close()
        return f"{path} in {directory} (ZKERN_NVME_PATH names another directory to probe)"
    except OSError as e:
        return f"error in {directory}: {e}"


def report() -> dict:
    triton_spec = importlib.util.find_spec("triton")
    triton_version = None
    if triton_spec is not None:
        try:
            import triton

            triton_version = triton.__version__
        except Exception as e:  # a broken install is worth reporting, not crashing over
            triton_version = f"import failed: {e}"
    cuda = torch.cuda.is_available()
    try:
        forced = ops.forced_backend()
    except (ValueError, RuntimeError) as e:
        forced = f"invalid: {e}"
    return {
        "zkern": zkern.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": {"model": cpu_model(), "threads": torch.get_num_threads(), "cpu_adam_threads": _cpu_adam_threads(),
                "isa": cpu_flags()},
        "cuda": {"available": cuda, "version": torch.version.cuda,
                 "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []},
        "distributed": {"gloo": torch.distributed.is_gloo_available(),
                        "nccl": torch.distributed.is_nccl_available()},
        "triton": triton_version or "not installed",
        "backends": {
            "available": sorted(ops.AVAILABLE),
            "ZKERN_BACKEND": os.environ.get("ZKERN_BACKEND") or "unset",
            "forced": forced,
            "adam_step_ on CPU tensors": _backend_or_error("adam_step_"),
            "flatten / unscale_and_check_ / quantize on CPU tensors": _backend_or_error("flatten"),
            "on CUDA tensors": _cuda_backends(),
            "cuda_kernels": "available (built on first use)" if "cuda" in ops.AVAILABLE else
                            f"not available: {_cuda_why()}",
            "nvcc": _nvcc(),
        },
        "cpu_adam": zkern.cpu.status(),
        "nvme_io": _nvme_io(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args()
    data = report()
    if args.json:
        print(json.dumps(data, indent=2))
        return

    def show(d: dict, indent: int = 0) -> None:
        for key, value in d.items():
            if isinstance(value, dict):
                print(" " * indent + f"{key}:")
                show(value, indent + 2)
            else:
                print(" " * indent + f"{key}: {value}")

    show(data)


if __name__ == "__main__":
    main()
