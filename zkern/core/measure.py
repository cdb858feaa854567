"""What the machine says a process holds, as opposed to what zkern counts: the resident set, and the bytes torch's
allocators hand out.

    python -c "import torch; from zkern.core.measure import *; print(allocation_peak(torch.ones, 10**6)[1])"

- rss_bytes / peak_rss_bytes / reset_peak_rss: the process's resident set now and at its peak (/proc/self). Coarse:
  it holds the interpreter and libraries, and freed memory the C library keeps for reuse.
- allocation_peak(fn): every allocation and free through torch's CPU allocator (and CUDA's on a GPU) while fn runs,
  replayed in order: the peak of bytes live beyond those live when fn began, and the bytes still live beyond them
  when it ends. Resolution: one allocation, whatever its size; not seen: memory outside torch's allocators (numpy
  arrays, Python objects, a backend's private buffers). torch's profiler records the events (profile_memory), so fn
  runs slower; use it for a measured step, not a timed one.

Depends on torch alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM). Not getrusage's ru_maxrss: Linux carries that across
    execve, so a freshly spawned rank starts with its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """This process's resident set size now (/proc/self/statm; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def reset_peak_rss() -> None:
    """Restart the peak-RSS count from the current resident size (Linux: /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


@dataclass(frozen=True)
class AllocationPeak:
    """Bytes beyond those live when the measured call began, per device type ("cpu", "cuda")."""

    peak: dict[str, int]  # the most live at any moment of the call
    end: dict[str, int]  # live when it returned
    events: int  # allocations and frees seen


def allocation_peak(fn, *args, **kwargs) -> tuple[object, AllocationPeak]:
    """Run fn(*args, **kwargs) and measure what torch's allocators held during it (module docstring)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True) as prof:
        result = fn(*args, **kwargs)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now: dict[str, int] = {}
    peak: dict[str, int] = {}
    for e in events:
        kind = "cuda" if "cuda" in str(e.device_type()).lower() else "cpu"
        now[kind] = now.get(kind, 0) + e.nbytes()
        peak[kind] = max(peak.get(kind, 0), now[kind])
    return result, AllocationPeak(peak=peak, end=now, events=len(events))
