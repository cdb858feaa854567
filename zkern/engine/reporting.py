"""What a config asks the engine to report, beside training: wall_clock_breakdown, memory_breakdown, comms_logger,
flops_profiler and the monitors (zkern/monitor.py). Each costs nothing when off: the engine calls these hooks, which
return at once.

    python -m pytest tests/test_reporting.py -q

Times are the host clock around each phase, after a CUDA synchronisation when the engine is on a GPU (as DeepSpeed's
timers synchronise), so a phase's time is its GPU work; they are logged every steps_per_print optimizer steps on
rank 0, and written to the monitors as DeepSpeed's "Train/Samples/elapsed_time_ms_<phase>" events.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from zkern.monitor import Monitors

log = logging.getLogger("zkern")
PHASES = ("forward", "backward", "step")


class Reporter:
    def __init__(self, engine):
        cfg = engine.config
        self.engine, self.cfg = engine, cfg
        self.timing = cfg.wall_clock_breakdown
        self.monitors = Monitors(cfg.monitor, engine.rank)
        self.comms = cfg.comms_logger.enabled
        engine.comm.times.on = self.timing or self.comms
        self.seconds = dict.fromkeys(PHASES, 0.0)  # since the last print
        self.steps_timed = 0
        self.losses: list[torch.Tensor] = []  # this accumulation's (only kept for the monitors)
        self.profiled = not cfg.flops_profiler.enabled
        self.profile: dict | None = None  # the flops profiler's result, once taken

    # -- phases -----------------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)

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
        if self.profiled or self.engine.global_steps + 1 != self.cfg.flops_profiler.profile_step:
            return run(*args, **kwargs)
        from zkern.engine.flops_profile import profile_forward

        self.profiled = True
        out, self.profile = profile_forward(self.engine, run, args, kwargs, self.cfg.flops_profiler)
        return out

    # -- at each optimizer step ---------------------------------------------------------------------------------
    def stepped(self) -> None:
        """After the optimizer step at an accumulation boundary (taken or skipped)."""
        engine, cfg = self.engine, self.cfg
        self.steps_timed += 1
        samples = engine.global_steps * cfg.train_batch_size
        if self.monitors.enabled:
            events = []
            if self.losses:
                events.append(("Train/Samples/train_loss", float(torch.stack(self.losses).mean()), samples))
            events.append(("Train/Samples/lr", float(engine.optimizer.param_groups[0]["lr"]), samples))
            if cfg.precision == "fp16":
                events.append(("Train/Samples/loss_scale", float(engine.loss_scale), samples))
            if self.timing:
                events += [(f"Train/Samples/elapsed_time_ms_{p}", 1000 * self.seconds[p] / self.steps_timed,
                            samples) for p in PHASES]
            self.monitors.write(events)
        self.losses = []
        if not cfg.steps_per_print or engine.global_steps % cfg.steps_per_print:
            return
        totals = engine.comm.times.take() if engine.comm.times.on else {}
        if self.timing and engine.rank == 0:
            per = {p: 1000 * self.seconds[p] / self.steps_timed for p in PHASES}
            collectives = ", ".join(f"{kind} {1000 * seconds / self.steps_timed:.2f}"
                                    for kind, (_, _, seconds) in sorted(totals.items())) or "none"
            log.info("zkern wall clock (ms per step, mean of %d): forward %.2f | backward %.2f | step %.2f | "
                     "collectives %s", self.steps_timed, per["forward"], per["backward"], per["step"], collectives)
        if self.comms and engine.rank == 0:
            for line in self.comms_lines(totals):
                log.info("zkern comms: %s", line)
        if cfg.memory_breakdown and engine.rank == 0:
            log.info("zkern memory (bytes by place): %s", engine.memory_report())
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
