"""NVMe suite: this machine's disk through zkern's reader and through dd, then the NVMe-offloaded Adam step of a
50M-parameter shard against the disk's bandwidth and against the host-memory offload step.

    python bench/run.py --suite nvme                          # a directory under the system's temp dir
    python bench/run.py --suite nvme --nvme-path /mnt/nvme0   # the disk to measure

1. Sequential bandwidth of the three state files' bytes (master, exp_avg, exp_avg_sq: 12 bytes per parameter),
   written then read with zkern's reader (O_DIRECT where the file system takes it, so the page cache does not
   stand in for the disk), and the same bytes with `dd oflag=direct` / `iflag=direct` (the stock reference).
2. The NVMe Adam step (zkern/offload/nvme.py): every step reads and writes the 12 bytes per parameter, through
   `buffer_count` tile buffers of `sub_group_size` elements. Its rate is the ideal time, reads at the measured
   read bandwidth plus writes at the measured write bandwidth, over the step time.
3. The same step with the state in host memory (ShardAdam: the ZeRO-Offload step), timed alone: the compute.
   The pipeline overlaps when the NVMe step takes less than the I/O time plus the compute time.
Steps and passes are interleaved round by round so that the disk's moods fall on every figure alike.
"""

from __future__ import annotations

import datetime
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import zkern
from bench.engine_suite import _git_sha, _quantiles
from zkern import ops
from zkern.cpu import _ext
from zkern.env_report import cpu_model
from zkern.offload.nvme import NvmeAdam, NvmeShard
from zkern.optim.shard_adam import Chunk, ShardAdam, ShardGroup

DEFAULT_NUMEL = 50_000_000
STATE_BYTES = 12  # fp32 master, exp_avg, exp_avg_sq
HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw=True)


def _groups(numel: int, shard: NvmeShard | None = None) -> list[ShardGroup]:
    """One chunk of numel elements: resident, or (shard given) with its master in a region of the shard's files."""
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(numel, generator=gen)
    if shard is not None:
        region = shard.add_region(numel)
        shard.write("master", region, param)
        param = region
    chunk = Chunk(param=param, grad=torch.randn(numel, generator=gen).bfloat16(),
                  out=torch.empty(numel, dtype=torch.bfloat16), pieces=[(0, 0, numel)])
    return [ShardGroup(pieces=[param], chunks=[chunk])]


def _reader_pass(path: str, nbytes: int, pool, tile_bytes: int, write: bool, create: bool = False) -> float:
    """Seconds to write (or read) nbytes of one existing file (create: a new one) in tile_bytes requests, up to
    four in flight (the NVMe step's own depth), through zkern's reader."""
    f = ops.nvme_file(path, nbytes, pool, create=create)
    buffers = [ops.aligned_empty(tile_bytes, torch.uint8) for _ in range(4)]
    for b in buffers:
        b.fill_(7)
    start = time.perf_counter()
    works = []
    for i, offset in enumerate(range(0, nbytes, tile_bytes)):
        if len(works) == len(buffers):
            works.pop(0).wait()
        n = min(tile_bytes, nbytes - offset)
        buf = buffers[i % len(buffers)][:n]
        works.append(f.write(buf, offset, async_op=True) if write else f.read(buf, offset, async_op=True))
    for w in works:
        w.wait()
    if write:
        os.fsync(f.fd)
    seconds = time.perf_counter() - start
    f.close()
    return seconds


def _dd(args: list[str]) -> float | None:
    """Seconds dd took (its own report), or None where dd or O_DIRECT is not available."""
    if shutil.which("dd") is None:
        return None
    out = subprocess.run(["dd", *args], capture_output=True, text=True)
    if out.returncode != 0:
        return None
    m = re.search(r"copied, ([0-9.]+) s", out.stderr)
    return float(m.group(1)) if m else None


def run(numel: int = DEFAULT_NUMEL, directory: str | None = None, reps: int = 5, tile: int = 4_000_000,
        buffer_count: int = 4, thread_count: int = 2, block_size: int = 1 << 20, queue_depth: int = 32,
        progress=None) -> dict:
    if not _ext.available():
        raise SystemExit(f"bench: the nvme suite needs zkern's C++ extension: {_ext.LOAD_ERROR}; {_ext.BUILD_HINT}")
    progress = progress or (lambda line: print(f"[bench] {line}", file=sys.stderr, flush=True))
    root = tempfile.mkdtemp(prefix="zkern-nvme-bench-", dir=directory)
    try:
        return _run(numel, root, reps, tile, buffer_count, thread_count, block_size, queue_depth, progress)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _run(numel, root, reps, tile, buffer_count, thread_count, block_size, queue_depth, progress) -> dict:
    pool = ops.nvme_pool(thread_count, block_size, queue_depth)
    state_bytes = STATE_BYTES * numel
    mib = -(-state_bytes // (1 << 20))
    seq_path, dd_path = os.path.join(root, "seq.bin"), os.path.join(root, "dd.bin")
    progress(f"nvme: setting up {numel / 1e6:.0f}M parameters in {root}")
    shard = NvmeShard(os.path.join(root, "rank0"), pool, sub_group_size=tile, buffer_count=buffer_count)
    nvme = NvmeAdam(_groups(numel, shard), [HYPER], shard)
    shard.buffers()  # every region exists: the tile size is fixed
    host_groups = _groups(numel)
    host = ShardAdam(host_groups, [HYPER])
    tile_bytes = 4 * shard.tile
    _reader_pass(seq_path, state_bytes, pool, tile_bytes, write=True, create=True)  # timed passes overwrite it

    candidates = {
        "nvme step": lambda: nvme.step(grad_scale=1.0),
        "reader write": lambda: _reader_pass(seq_path, state_bytes, pool, tile_bytes, write=True),
        "reader read": lambda: _reader_pass(seq_path, state_bytes, pool, tile_bytes, write=False),
        "host step": lambda: host.step(grad_scale=1.0),
        "dd write": lambda: _dd(["if=/dev/zero", f"of={dd_path}", "bs=1M", f"count={mib}", "oflag=direct",
                                 "conv=notrunc,fsync"]),
        "dd read": lambda: _dd([f"if={dd_path}", "of=/dev/null", "bs=1M", "iflag=direct"]),
    }
    times: dict[str, list[float]] = {name: [] for name in candidates}
    dd_missing = False
    for r in range(reps + 1):  # round 0 warms up
        progress(f"nvme: round {r}/{reps}")
        for name, fn in candidates.items():
            start = time.perf_counter()
            reported = fn()
            seconds = time.perf_counter() - start
            if name.startswith("dd"):
                if reported is None:
                    dd_missing = True
                    continue
                seconds = reported
            if r > 0:
                times[name].append(seconds)
    if dd_missing:
        times.pop("dd write")
        times.pop("dd read")
    figures = {name: _quantiles(ts) for name, ts in times.items()}
    for name, f in figures.items():
        if name in ("reader write", "reader read", "dd write", "dd read"):
            f["gb_per_s"] = (mib * (1 << 20) if name.startswith("dd") else state_bytes) / f["median_s"] / 1e9

    def paired(a: str, b: str) -> float:
        return statistics.median(x / y for x, y in zip(times[a], times[b]))

    # The step moves state_bytes in and state_bytes out; alone, at the measured sequential rates, that takes
    # read + write time. Paired per round against the step of the same round.
    io_over_step = statistics.median((r + w) / s for r, w, s in zip(times["reader read"], times["reader write"],
                                                                    times["nvme step"]))
    overlap = statistics.median((r + w + h) / s for r, w, h, s in zip(times["reader read"], times["reader write"],
                                                                      times["host step"], times["nvme step"]))
    ratios = {"nvme_of_disk_bandwidth": io_over_step, "io_plus_compute_over_step": overlap,
              "nvme_over_host_step": paired("nvme step", "host step")}
    if not dd_missing:
        ratios["reader_write_over_dd"] = paired("dd write", "reader write") * state_bytes / (mib * (1 << 20))
        ratios["reader_read_over_dd"] = paired("dd read", "reader read") * state_bytes / (mib * (1 << 20))
    return {
        "suite": "nvme",
        "numel": numel,
        "state_bytes": state_bytes,
        "directory": root,
        "io_path": shard.io_path,
        "aio": {"thread_count": thread_count, "block_size": block_size, "queue_depth": queue_depth},
        "sub_group_size": shard.tile,
        "buffer_count": buffer_count,
        "reps": reps,
        "device": "cpu",
        "device_name": cpu_model(),
        "threads": torch.get_num_threads(),
        "versions": {"zkern": zkern.__version__, "torch": torch.__version__, "python": platform.python_version()},
        "git_sha": _git_sha(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "figures": figures,
        "peers_skipped": {"dd": "dd is missing or refuses O_DIRECT here"} if dd_missing else {},
        "ratios": ratios,
    }


def table(record: dict) -> str:
    gb = record["state_bytes"] / 1e9
    out = [f"nvme suite: {record['numel'] / 1e6:.0f}M parameters ({gb:.2f} GB of fp32 state read and written per "
           f"step), {record['io_path']} I/O, {record['aio']['thread_count']} I/O threads, tiles of "
           f"{record['sub_group_size']} elements x {record['buffer_count']} buffers, {record['device_name']}", "",
           "| candidate | median [p20-p80] | rate |", "|---|---|---|"]
    for name, f in record["figures"].items():
        rate = f"{f['gb_per_s']:.2f} GB/s" if "gb_per_s" in f else ""
        out.append(f"| {name} | {f['median_s'] * 1e3:.0f} ms [{f['p20_s'] * 1e3:.0f}-{f['p80_s'] * 1e3:.0f}] | "
                   f"{rate} |")
    r = record["ratios"]
    out += ["", f"NVMe step: {r['nvme_of_disk_bandwidth'] * 100:.0f}% of the disk's sequential bandwidth (reads "
                f"and writes at the reader's measured rates, paired per round); I/O + compute = "
                f"x{r['io_plus_compute_over_step']:.2f} the step (> 1: they overlap); x{r['nvme_over_host_step']:.2f} "
                f"the host-memory offload step's time"]
    if "reader_write_over_dd" in r:
        out.append(f"zkern's reader against dd (O_DIRECT, 1 MiB blocks): write x{r['reader_write_over_dd']:.2f}, "
                   f"read x{r['reader_read_over_dd']:.2f}")
    out += [f"skipped: {k}: {v}" for k, v in record["peers_skipped"].items()]
    return "\n".join(out)
