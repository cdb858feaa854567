"""DeepSpeed's WarmupLR and WarmupDecayLR, with its formulas, driving an optimizer's param_groups[i]["lr"].

    python -c "from zkern.engine.lr_schedules import warmup_gamma; print(warmup_gamma(10, 100, 'log'))"

The engine calls step() once per optimizer step that was not skipped, as DeepSpeed does. At construction the
learning rate is set to warmup_min_lr; the k-th step() (k from 0) sets min + (max - min) * gamma(k).
"""

from __future__ import annotations

import math

import torch

from zkern.config import SchedulerConfig


def warmup_gamma(iteration: int, warmup_num_steps: int, warmup_type: str) -> float:
    """Fraction of the way from min to max learning rate during warm-up (1.0 after it)."""
    warmup_num_steps = max(2, warmup_num_steps)
    if iteration >= warmup_num_steps:
        return 1.0
    match warmup_type:
        case "log":
            return math.log(iteration + 1) / math.log(warmup_num_steps)
        case "linear":
            return iteration / warmup_num_steps
        case other:
            raise ValueError(f"warmup_type must be 'log' or 'linear', got {other!r}")


class WarmupLR:
    """Warm up from warmup_min_lr to warmup_max_lr over warmup_num_steps, then hold."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedulerConfig):
        self.optimizer, self.cfg = optimizer, cfg
        self.last_batch_iteration = -1
        self._last_lr = self._apply(cfg.warmup_min_lr)

    def gamma(self, iteration: int) -> float:
        return warmup_gamma(iteration, self.cfg.warmup_num_steps, self.cfg.warmup_type)

    def _apply(self, lr: float) -> list[float]:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return [lr] * len(self.optimizer.param_groups)

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return [self.cfg.warmup_min_lr] * len(self.optimizer.param_groups)
        lo, hi = self.cfg.warmup_min_lr, self.cfg.warmup_max_lr
        return [lo + (hi - lo) * self.gamma(self.last_batch_iteration)] * len(self.optimizer.param_groups)

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def step(self) -> None:
        self.last_batch_iteration += 1
        self._last_lr = self._apply(self.get_lr()[0])

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._last_lr = self._apply(self.get_lr()[0])


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def gamma(self, iteration: int) -> float:
        warmup = max(2, self.cfg.warmup_num_steps)
        if iteration < warmup:
            return super().gamma(iteration)
        total = self.cfg.total_num_steps
        return max(0.0, (total - iteration) / max(1.0, total - warmup))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig):
    match cfg.type:
        case "WarmupLR":
            return WarmupLR(optimizer, cfg)
        case "WarmupDecayLR":
            return WarmupDecayLR(optimizer, cfg)
        case other:
            raise ValueError(f"unknown scheduler type {other!r}")
