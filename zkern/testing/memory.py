"""This process's memory as the machine sees it: what the memory tests and benchmarks measure (zkern.core.measure
holds the functions; these are their public names in zkern.testing)."""

from __future__ import annotations

from zkern.core.measure import AllocationPeak, allocation_peak, peak_rss_bytes, reset_peak_rss, rss_bytes

__all__ = ["AllocationPeak", "allocation_peak", "peak_rss_bytes", "reset_peak_rss", "rss_bytes"]
