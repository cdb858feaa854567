"""DeepSpeed's learning-rate schedulers with its formulas, driving an optimizer's param_groups[i]["lr"]: WarmupLR,
WarmupDecayLR, WarmupCosineLR, OneCycle (which also cycles Adam's beta1) and LRRangeTest.

    python -m pytest tests/optim/test_lr_schedules.py -q        # step by step against DeepSpeed's own classes

The engine calls step() once per optimizer step that was not skipped, as DeepSpeed does. Every scheduler counts
its steps in last_batch_iteration (-1 before the first), sets the lr at construction as DeepSpeed's does, and saves
only that count.
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


class _Schedule:
    """The shared part: a step count, lrs set on every param group, the count as the whole state."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedulerConfig):
        self.optimizer, self.cfg, self.p = optimizer, cfg, cfg.params
        self.last_batch_iteration = self.p.get("last_batch_iteration", -1)
        self._last_lr = [g["lr"] for g in optimizer.param_groups]

    def lrs(self) -> list[float]:
        raise NotImplementedError

    def _apply(self) -> None:
        lrs = self.lrs()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = list(lrs)

    def get_lr(self) -> list[float]:
        return self.lrs()

    def get_last_lr(self) -> list[float]:
        return self._last_lr

    def step(self) -> None:
        self.last_batch_iteration += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state: dict) -> None:
        self.last_batch_iteration = state["last_batch_iteration"]
        self._apply()


class WarmupLR(_Schedule):
    """Warm up from warmup_min_lr to warmup_max_lr (absent: each group's own lr) over warmup_num_steps, then hold."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedulerConfig):
        super().__init__(optimizer, cfg)
        top = self.p.get("warmup_max_lr")
        self.max_lrs = [g["lr"] for g in optimizer.param_groups] if top is None else [top] * len(
            optimizer.param_groups)
        self.min_lrs = [self.p["warmup_min_lr"]] * len(optimizer.param_groups)
        if self.last_batch_iteration == -1:
            self._apply()

    def gamma(self, iteration: int) -> float:
        return warmup_gamma(iteration, self.p["warmup_num_steps"], self.p["warmup_type"])

    def lrs(self) -> list[float]:
        if self.last_batch_iteration < 0:
            return list(self.min_lrs)
        g = self.gamma(self.last_batch_iteration)
        return [lo + (hi - lo) * g for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def gamma(self, iteration: int) -> float:
        warmup = max(2, self.p["warmup_num_steps"])
        if iteration < warmup:
            return super().gamma(iteration)
        total = self.p["total_num_steps"]
        return max(0.0, (total - iteration) / max(1.0, total - warmup))


class WarmupCosineLR(_Schedule):
    """Each group's lr times a ratio: from warmup_min_ratio to 1 over warmup_num_steps, then down a half cosine to
    cos_min_ratio at total_num_steps (and held there). Before the first step the ratio is 0, as in DeepSpeed."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedulerConfig):
        super().__init__(optimizer, cfg)
        self.base_lrs = [g["lr"] for g in optimizer.param_groups]
        if self.last_batch_iteration == -1:
            self._apply()

    def ratio(self) -> float:
        k, p = self.last_batch_iteration, self.p
        if k < 0:
            return 0.0
        warmup = max(2, p["warmup_num_steps"])
        if k < warmup:
            g = math.log(k + 1) / math.log(warmup) if p["warmup_type"] == "log" else k / warmup
            return p["warmup_min_ratio"] + g * (1.0 - p["warmup_min_ratio"])
        progress = min(1.0, (k - warmup + 1) / max(1, p["total_num_steps"] - warmup))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, p["cos_min_ratio"] + (1.0 - p["cos_min_ratio"]) * cosine)

    def lrs(self) -> list[float]:
        r = self.ratio()
        return [lr * r for lr in self.base_lrs]


class OneCycle(_Schedule):
    """The 1cycle policy: lr up from cycle_min_lr to cycle_max_lr over cycle_first_step_size steps and back over
    cycle_second_step_size (optionally in stairs), then decayed; beta1 cycles the other way (max -> min -> max) and
    beta2 is set to 0.99, as DeepSpeed's does."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedulerConfig):
        super().__init__(optimizer, cfg)
        p = self.p
        self.first = float(p["cycle_first_step_size"])
        second = p["cycle_second_step_size"]
        self.second = self.first if second is None else float(second)
        self.total = self.first + self.second
        self.first_stairs = p["cycle_first_stair_count"]
        stairs = p["cycle_second_stair_count"]
        self.second_stairs = self.first_stairs if stairs is None else stairs
        self.momentum = p["cycle_momentum"] and "betas" in optimizer.defaults
        if self.last_batch_iteration == -1:
            for group in optimizer.param_groups:
                group["lr"] = p["cycle_min_lr"]
                if self.momentum:
                    group["betas"] = (p["cycle_min_mom"], 0.99)
            self._last_lr = [p["cycle_min_lr"]] * len(optimizer.param_groups)

    def _scale(self) -> float:
        it = self.last_batch_iteration + 1
        cycle = math.floor(1 + it / self.total)
        x = 1.0 + it / self.total - cycle
        ratio = self.first / self.total
        if x <= ratio:
            scale, stairs = x / ratio, self.first_stairs
        else:
            scale, stairs = (x - 1) / (ratio - 1), self.second_stairs
        if stairs > 0:  # stairs counted from the integer step (the float scale can sit just under a stair)
            at = it % self.total
            position = at * stairs / self.first if at <= self.first else (self.total - at) * stairs / self.second
            scale = math.floor(position) / stairs
        return scale

    def _decay_steps(self) -> float | None:
        """Steps into the decay (None within the cycle, or when decay is off)."""
        if self.last_batch_iteration < self.total:
            return None
        return self.last_batch_iteration - self.total + 1

    def lrs(self) -> list[float]:
        p, n = self.p, len(self.optimizer.param_groups)
        decay = self._decay_steps()
        if decay is None:
            return [p["cycle_min_lr"] + (p["cycle_max_lr"] - p["cycle_min_lr"]) * self._scale()] * n
        if math.isclose(p["decay_step_size"], 0) or math.isclose(p["decay_lr_rate"], 0):
            return [p["cycle_min_lr"]] * n
        return [p["cycle_min_lr"] / (1 + p["decay_lr_rate"] * decay / p["decay_step_size"])] * n

    def beta1(self) -> float:
        p = self.p
        if self.last_batch_iteration < 0:  # as built: a reset or a load of a fresh count must give what __init__ set
            return p["cycle_min_mom"]
        decay = self._decay_steps()
        if decay is None:
            return p["cycle_max_mom"] - (p["cycle_max_mom"] - p["cycle_min_mom"]) * self._scale()
        if math.isclose(p["decay_step_size"], 0) or math.isclose(p["decay_mom_rate"], 0):
            return p["cycle_max_mom"]
        return p["cycle_max_mom"] * (1 + p["decay_mom_rate"] * decay / p["decay_step_size"])

    def _apply(self) -> None:
        super()._apply()
        if self.momentum:
            for group in self.optimizer.param_groups:
                group["betas"] = (self.beta1(), 0.99)


class LRRangeTest(_Schedule):
    """lr = lr_range_test_min_lr * (1 + step_rate * (steps / step_size)), continuous or in stairs."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: SchedulerConfig):
        super().__init__(optimizer, cfg)
        if self.last_batch_iteration == -1:
            for group in optimizer.param_groups:
                group["lr"] = self.p["lr_range_test_min_lr"]
            self._last_lr = [self.p["lr_range_test_min_lr"]] * len(optimizer.param_groups)

    def lrs(self) -> list[float]:
        p = self.p
        interval = (self.last_batch_iteration + 1) / p["lr_range_test_step_size"]
        if p["lr_range_test_staircase"]:
            interval = math.floor(interval)
        return [p["lr_range_test_min_lr"] * (1 + p["lr_range_test_step_rate"] * interval)] * len(
            self.optimizer.param_groups)


SCHEDULERS = {"WarmupLR": WarmupLR, "WarmupDecayLR": WarmupDecayLR, "WarmupCosineLR": WarmupCosineLR,
              "OneCycle": OneCycle, "LRRangeTest": LRRangeTest}


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig):
    if cfg.type not in SCHEDULERS:
        raise ValueError(f"unknown scheduler type {cfg.type!r}; zkern has {sorted(SCHEDULERS)}")
    return SCHEDULERS[cfg.type](optimizer, cfg)
