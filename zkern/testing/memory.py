"""This process's memory as the machine sees it: what the memory tests and benchmarks measure (zkern.core.measure
holds the allocator's meters; these are their public names in zkern.testing), and live_tensor_bytes, a walk over
every tensor the garbage collector finds."""

from __future__ import annotations

import gc
import warnings

import torch

from zkern.core.measure import AllocationPeak, allocation_peak, peak_rss_bytes, reset_peak_rss, rss_bytes

__all__ = ["AllocationPeak", "allocation_peak", "live_tensor_bytes", "peak_rss_bytes", "reset_peak_rss", "rss_bytes"]


def live_tensor_bytes(device: str = "cpu") -> int:
    """The bytes every live tensor on `device` reaches, found by the garbage collector (not by zkern's books): each
    storage's byte range, merged where ranges overlap (a buffer placed inside a larger block, views of one storage,
    count once). Subtract a walk taken before to see what a call left. It sees what Python reaches;
    allocation_peak's replay sees every allocation, but misses a free made on a thread the profiler does not watch
    (gloo's, now and then), which the walk does not depend on."""
    ranges = []
    with warnings.catch_warnings():  # isinstance on every object reads some modules' deprecated attributes
        warnings.simplefilter("ignore")
        tensors = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for t in tensors:
        try:
            if t.device.type != device:  # a meta tensor (a file's stand-in) is not memory
                continue
            storage = t.untyped_storage()
            start, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass or a wrapper without storage of its own
            continue
        if size:
            ranges.append((start, start + size))
    total, end = 0, 0
    for lo, hi in sorted(ranges):  # the union's length: a range counts past the furthest end seen so far
        total += max(0, hi - max(lo, end))
        end = max(end, hi)
    return total
