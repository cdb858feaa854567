"""What a config asks the engine to report, beside training: wall_clock_breakdown, memory_breakdown, comms_logger,
flops_profiler and the monitors (zkern/monitor.py). Each costs nothing when off: the engine calls these hooks, which
return at once.

    python -m pytest tests/engine/test_reporting.py -q

Times are the host clock around each phase, after a CUDA synchronisation when the engine is on a GPU (as DeepSpeed's
timers synchronise), so a phase's time is its GPU work; they are logged every steps_per_print optimizer steps on
rank 0, and written to the monitors as DeepSpeed's "Train/Samples/elapsed_time_ms_<phase>" events.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from zkern.config import Config
from zkern.config.report import startup_block
from zkern.core.buffers import allocated_bytes
from zkern.core.measure import peak_rss_bytes, rss_bytes
from zkern.core.runtime import Runtime
from zkern.engine.parts import EngineParts
from zkern.monitor import Monitors
from zkern.offload.nvme_muon import NvmeMuon
from zkern.optim.piece_states import PieceStates

log = logging.getLogger("zkern")
PHASES = ("forward", "backward", "step")


class Reporter:
    def __init__(self, parts: EngineParts):
        cfg = parts.config
        self.parts, self.cfg = parts, cfg
        self.timing = cfg.wall_clock_breakdown
        self.monitors = Monitors(cfg.monitor, parts.rank)
        self.comms = cfg.comms_logger.enabled
        parts.comm.times.on = self.timing or self.comms
        self.seconds = dict.fromkeys(PHASES, 0.0)  # since the last print
        self.steps_timed = 0
        self.losses: list[torch.Tensor] = []  # this accumulation's (only kept for the monitors)
        self.profiled = not cfg.flops_profiler.enabled
        self.profile: dict | None = None  # the flops profiler's result, once taken

    # -- phases -----------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.parts.device.type == "cuda":
            torch.cuda.synchronize(self.parts.device)

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.timing:
            yield
            return
        self._sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] += time.perf_counter() - start

    def loss(self, loss: torch.Tensor) -> None:
        if self.monitors.enabled:
            self.losses.append(loss.detach().float())

    def forward(self, run, args, kwargs):
        """The model's forward; at flops_profiler.profile_step, counted and timed per module (once)."""
        if self.profiled or self.parts.counters.global_steps + 1 != self.cfg.flops_profiler.profile_step:
            return run(*args, **kwargs)
        from zkern.engine.flops_profile import profile_forward

        self.profiled = True
        out, self.profile = profile_forward(self.parts, run, args, kwargs, self.cfg.flops_profiler)
        return out

    # -- at each optimizer step ---------------------------------------------------------------------------------
    def stepped(self) -> None:
        """After the optimizer step at an accumulation boundary (taken or skipped)."""
        parts, cfg = self.parts, self.parts.config  # the config as it is now (set_train_batch_size replaces it)
        self.steps_timed += 1
        steps = parts.counters.global_steps
        samples = steps * cfg.train_batch_size
        if self.monitors.enabled:
            events = []
            if self.losses:
                events.append(("Train/Samples/train_loss", float(torch.stack(self.losses).mean()), samples))
            events.append(("Train/Samples/lr", float(parts.optimizer.param_groups[0]["lr"]), samples))
            if cfg.precision == "fp16":
                events.append(("Train/Samples/loss_scale", float(parts.scaler.scale), samples))
            if self.timing:
                events += [(f"Train/Samples/elapsed_time_ms_{p}", 1000 * self.seconds[p] / self.steps_timed,
                            samples) for p in PHASES]
            self.monitors.write(events)
        self.losses = []
        # The breakdowns every steps_per_print steps; with none given, every step (DeepSpeed's timers and memory
        # lines ignore its None); 0 silences them.
        every = 1 if cfg.steps_per_print is None else cfg.steps_per_print
        if not every or steps % every:
            return
        totals = parts.comm.times.take() if parts.comm.times.on else {}
        if self.timing and parts.rank == 0:
            per = {p: 1000 * self.seconds[p] / self.steps_timed for p in PHASES}
            collectives = ", ".join(f"{kind} {1000 * seconds / self.steps_timed:.2f}"
                                    for kind, (_, _, seconds) in sorted(totals.items())) or "none"
            log.info("zkern wall clock (ms per step, mean of %d): forward %.2f | backward %.2f | step %.2f | "
                     "collectives %s", self.steps_timed, per["forward"], per["backward"], per["step"], collectives)
        if self.comms and parts.rank == 0:
            for line in self.comms_lines(totals):
                log.info("zkern comms: %s", line)
        if cfg.memory_breakdown and parts.rank == 0:
            log.info("zkern memory (bytes by place): %s", memory_report(parts))
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.steps_timed = 0

    def comms_lines(self, totals: dict) -> list[str]:
        """Per collective kind since the last report: calls, bytes, latency and algorithmic bandwidth (bytes this rank
        sent over the time from issue to completion)."""
        ops = set(self.cfg.comms_logger.prof_ops)
        out = []
        for kind, (calls, nbytes, seconds) in sorted(totals.items()):
            if not self.cfg.comms_logger.prof_all and kind not in ops:
                continue
            gbps = nbytes * 8 / seconds / 1e9 if seconds > 0 else 0.0
            out.append(f"{kind}: {calls} calls, {nbytes} bytes, {1000 * seconds:.3f} ms total, "
                       f"{1000 * seconds / max(1, calls):.3f} ms avg, algbw {gbps:.3f} Gbps")
        return out

    def close(self) -> None:
        self.monitors.close()


def log_layout(config: Config, runtime: Runtime, rank: int) -> None:
    """Say once what zkern made of the config (a warning when a key was not DeepSpeed's), how the parameters were
    laid out (padding included), and warn about costly layouts."""
    if rank != 0:
        return
    log.log(logging.WARNING if config.notes.warned else logging.INFO, "%s", startup_block(config))
    for line in runtime.describe():
        log.info("zkern: %s", line)
    for line in runtime.warnings(config.zero_optimization.reduce_bucket_size):
        log.warning("zkern: %s", line)


def log_offload(parts: EngineParts) -> None:
    """Say where the optimizer's states went, and what the offload keys that do nothing here would have done."""
    zero = parts.config.zero_optimization
    if parts.nvme is not None:
        parts.nvme.buffers()  # the tile size is fixed now that every region exists
    store = parts.runtime.param_store
    if parts.rank != 0:
        return
    if store is not None:
        log.info("zkern NVMe: stage-3 parameter shard in %s (%.1f MB per rank), read ahead by up to %d reads / "
                 "%d elements, up to %d elements cached in host memory", store.directory, store.nbytes / 1e6,
                 store.buffer_count, store.buffer_size, store.max_in_cpu)
    step = parts.host_step
    if step is not None and zero.offload_optimizer_ratio < 1.0:
        total = max(1, step.device_numel + step.host_numel)
        log.info("zkern partial offload: %.1f%% of rank 0's optimizer shard on the host (%d of %d elements; ratio %g, "
                 "split where a parameter's piece ends), the rest stepped on the device", 100 * step.host_numel / total,
                 step.host_numel, total, zero.offload_optimizer_ratio)
    if zero.offload_param_device != "nvme" and zero.offload_param_nvme_path is not None:
        log.warning("zkern: zero_optimization.offload_param.nvme_path is set but the device is %r: the "
                    "parameter shards are not on NVMe (set device \"nvme\" for that)", zero.offload_param_device)
    if parts.nvme is not None and isinstance(parts.optimizer, NvmeMuon):
        log.info("zkern NVMe: master and AdamW moments in %s (%.1f MB per rank, %s I/O), Muon's momentum %s; read "
                 "and written a piece at a time, a matrix whole before it steps", parts.nvme.directory,
                 parts.nvme.nbytes() / 1e6, parts.nvme.io_path,
                 "in host memory" if parts.optimizer.momentum_in_memory else "in the exp_avg files")
        return
    if parts.nvme is not None:
        log.info("zkern NVMe: master and Adam moments in %s (%.1f MB per rank, %s I/O), stepped in tiles of %d "
                 "elements through %d buffer sets (%.1f MB of host memory)", parts.nvme.directory,
                 parts.nvme.nbytes() / 1e6, parts.nvme.io_path, parts.nvme.tile, parts.nvme.buffer_count,
                 parts.nvme.buffer_bytes() / 1e6)
        if parts.nvme.buffer_bytes() > 1 << 30:
            log.warning("zkern NVMe: the tile buffers take %.1f GB of host memory (buffer_count x 3 states x "
                        "sub_group_size x 4 bytes); lower zero_optimization.sub_group_size (e.g. 1e7)",
                        parts.nvme.buffer_bytes() / 1e9)
        return
    if zero.offload_optimizer_nvme_path is not None:
        log.warning("zkern: zero_optimization.offload_optimizer.nvme_path is set but the device is %r: the "
                    "optimizer states are not on NVMe (set device \"nvme\" for that)",
                    zero.offload_optimizer_device)
    if zero.sub_group_size != 1_000_000_000:
        log.info("zkern: zero_optimization.sub_group_size sets the tile of the NVMe optimizer step; with "
                 "offload_optimizer.device %r it changes nothing", zero.offload_optimizer_device)


def memory_report(parts: EngineParts) -> dict[str, dict[str, int]]:
    """Engine.memory_report (its docstring says what each key counts): the runtime's memory by kind, moved
    under "host" and "nvme" where offload puts it, with the optimizer states and the staging buffers added."""
    device = {"params": 0, "grads": 0, "optimizer": 0, "master": 0, "comm_buffers": 0}
    host = {"params": 0, "optimizer": 0, "master": 0, "offload_buffers": 0}
    held = parts.runtime.memory()
    on_host = held.pop("host_params")
    params_on_disk = held.pop("disk_params", 0)
    master_on_device = held.pop("master_on_device", 0)  # partial offload's device part
    for key, value in held.items():  # ZeRO++ adds hpz_secondary, loco_error and frozen_int8 where they are on
        if key.startswith("host_"):  # resting on the host (offload_param)
            host[key[len("host_"):]] = host.get(key[len("host_"):], 0) + value
        else:
            device[key] = device.get(key, 0) + value
    pool = parts.comm.scratch.nbytes()  # host reduce-scatters' receive buffers (collectives.ScratchPool)
    if parts.device.type == "cpu":
        device["comm_buffers"] += pool
    elif pool:
        host["comm_buffers"] = pool
    trainable = {id(p) for p in parts.runtime.params}
    device["params"] += sum(p.numel() * p.element_size() for p in parts.module.parameters()
                            if id(p) not in trainable)
    optimizer = optimizer_state_bytes(parts.optimizer)
    if parts.offload:
        host["master"], device["master"] = device["master"], master_on_device
        host["optimizer"] = optimizer
        if master_on_device:  # partial offload: the moments of the device part's chunks are on the device
            device["optimizer"] = optimizer * parts.host_step.device_numel // max(
                1, parts.host_step.device_numel + parts.host_step.host_numel)
            host["optimizer"] = optimizer - device["optimizer"]
        host["offload_buffers"] = parts.host_step.staging_bytes
        saves = getattr(parts.optimizer, "saves", [])  # the speculative step's rollback (ShardAdam.keep_saves)
        if saves:
            host["speculation_saves"] = allocated_bytes([t for g in saves for t in g])
    else:
        device["optimizer"] = optimizer
    host["params"], device["params"] = on_host, device["params"] - on_host
    on_nvme = None
    if parts.nvme is not None or params_on_disk:
        on_nvme = {"params": params_on_disk, "master": 0, "optimizer": 0}
    if parts.nvme is not None:  # the master's files, and the moments' (bf16 ones are half the size)
        host["nvme_buffers"] = parts.nvme.buffer_bytes()
        on_nvme.update(master=parts.nvme.nbytes(("master",)), optimizer=parts.nvme.nbytes(("exp_avg", "exp_avg_sq")))
    if on_nvme is not None:
        on_nvme["total"] = sum(on_nvme.values())
    device["total"], host["total"] = sum(device.values()), sum(host.values())
    # the host holds something with offload_optimizer, or with stage 3's parameters resting there (offload_param)
    report = {parts.device.type: device, "host": host} if parts.offload or on_host else {parts.device.type: device}
    if on_nvme is not None:
        report["nvme"] = on_nvme
    report["measured"] = measured(parts.device, device["total"] + (host["total"] if parts.device.type == "cpu"
                                                                    else 0))
    return report


def measured(device: torch.device, accounted: int) -> dict:
    """What the machine says this process holds, beside what zkern accounts on `device` (its "total" there; on a
    CPU-only run the host's too, one memory). On CUDA the caching allocator's figures: bytes allocated now, at the
    peak since the last reset, and reserved; `unaccounted` is what the allocator holds beyond zkern's books
    (activations, the user's tensors, other models), never negative unless the books are wrong. On a CPU the
    process's resident set now and at its peak (/proc/self/status): it holds the libraries and everything else
    too, so only books larger than it are a disagreement."""
    out: dict = {"accounted": accounted}
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        out.update(source="cuda caching allocator", allocated=allocated,
                   peak_allocated=torch.cuda.max_memory_allocated(device),
                   reserved=torch.cuda.memory_reserved(device), unaccounted=allocated - accounted)
        held = allocated
    else:
        held = rss_bytes()
        out.update(source="process resident set", rss=held, peak_rss=peak_rss_bytes())
    out["disagreement"] = None if accounted <= held else (
        f"zkern accounts {accounted} bytes on {device.type} but the machine holds only {held}: its books count "
        f"something that is not there")
    return out


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    if optimizer is None:
        return 0
    if isinstance(optimizer, PieceStates):
        return optimizer.state_bytes()
    seen, total = set(), 0
    for state in optimizer.state.values():
        for t in state.values():
            if isinstance(t, torch.Tensor) and t.numel() > 1 and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total
