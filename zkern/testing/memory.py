"""This process's peak resident memory, and restarting its count: what the memory tests and benchmarks measure."""

from __future__ import annotations


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


def reset_peak_rss() -> None:
    """Restart the peak-RSS count from the current resident size (Linux: /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
