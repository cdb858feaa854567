"""What every GPU probe record carries and how it is written: the machine it ran on (versions, the device, its
NCCL, the git sha) and the JSON file, replaced whole. gpu_probe.py and probe_world2.py write through it; it imports
neither (the probe's parts point one way: gpu_probe -> probe_report -> probe_world2 -> probe_record).

    python -c "from bench.probe_record import machine; print(machine())"
"""

from __future__ import annotations

import json
import os
import time

import torch

from bench import engine_suite


def write_json(path: str | None, record: dict) -> None:
    """Write record to path through a temporary file, so a run killed mid-write leaves the last whole record."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".tmp", path)


def machine() -> dict:
    import platform

    out = {"torch": torch.__version__, "python": platform.python_version(), "cores": os.cpu_count(),
           "cuda": torch.version.cuda, "device": None, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out.update(device=p.name, sm_count=p.multi_processor_count, memory_bytes=p.total_memory)
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as e:  # a build without NCCL: say so, measure the rest
            out["nccl"] = f"unavailable: {e}"
    out["git_sha"] = engine_suite._git_sha()
    return out
