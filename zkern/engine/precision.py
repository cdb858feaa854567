"""Mixed precision: working dtype choice and the fp16 loss scaler (DeepSpeed's dynamic loss scaling rules).

    python -m pytest tests/engine/test_precision.py -q
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from zkern.config import Config
from zkern.errors import LossScaleAtMinimum

log = logging.getLogger("zkern")


@dataclass
class LossScaler:
    """Static (loss_scale > 0) or dynamic scaling, with DeepSpeed's semantics.

    Dynamic: start at 2**initial_scale_power; on overflow, spend one unit of hysteresis, and when none is left
    halve the scale (never below min_loss_scale); after loss_scale_window clean steps since the last overflow,
    double it and refill hysteresis (or refill after every clean step with consecutive_hysteresis). An overflow
    at the minimum scale raises LossScaleAtMinimum.
    """

    scale: float
    dynamic: bool
    window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_scale: float = 1.0
    # the run scales its loss (fp16, or torch_autocast in fp16): a checkpoint's scaler state is restored only then
    loss_scaled: bool = False
    _hysteresis_left: int = 0
    _iter: int = 0
    _last_overflow_iter: int = -1

    @staticmethod
    def from_config(cfg: Config, autocast: torch.dtype | None = None) -> LossScaler:
        """The fp16 section's scaler; under torch_autocast in fp16 (autocast: the dtype it casts to), torch's
        GradScaler's schedule (2**16, doubled after 2000 clean steps, halved on every overflow), ending with
        LossScaleAtMinimum below 1 as the fp16 section's default does."""
        fp16 = cfg.fp16
        if autocast == torch.float16:
            return LossScaler(scale=float(2**16), dynamic=True, window=2000, hysteresis=1, min_scale=1.0,
                              loss_scaled=True, _hysteresis_left=1)
        if not fp16.enabled:
            return LossScaler(scale=1.0, dynamic=False)
        if fp16.loss_scale > 0:
            return LossScaler(scale=fp16.loss_scale, dynamic=False, loss_scaled=True)
        return LossScaler(scale=float(2**fp16.initial_scale_power), dynamic=True, window=fp16.loss_scale_window,
                          hysteresis=fp16.hysteresis, consecutive_hysteresis=fp16.consecutive_hysteresis,
                          min_scale=fp16.min_loss_scale, loss_scaled=True, _hysteresis_left=fp16.hysteresis)

    def update(self, overflow: bool) -> None:
        """Advance by one optimizer step that did (overflow=True) or did not overflow."""
        if not self.dynamic:
            return
        if overflow:
            if self.hysteresis == 1 or self._hysteresis_left <= 1:
                if self.scale <= self.min_scale:
                    raise LossScaleAtMinimum(
                        f"Current loss scale already at minimum ({self.scale:g}) - cannot decrease scale anymore. "
                        f"The fp16 gradients keep overflowing: look for NaN/inf in the data or the loss, lower the "
                        f"learning rate, set gradient_clipping, or train in bf16 (\"bf16\": {{\"enabled\": true}}), "
                        f"which needs no loss scaling.")
                self.scale = max(self.scale / 2.0, self.min_scale)
            else:
                self._hysteresis_left -= 1
            self._last_overflow_iter = self._iter
        else:
            if self.consecutive_hysteresis:
                self._hysteresis_left = self.hysteresis
            if (self._iter - self._last_overflow_iter) % self.window == 0:
                if not self.consecutive_hysteresis:
                    self._hysteresis_left = self.hysteresis
                self.scale *= 2.0
        self._iter += 1

    def state_dict(self) -> dict:
        return {"scale": self.scale, "hysteresis_left": self._hysteresis_left, "iter": self._iter,
                "last_overflow_iter": self._last_overflow_iter}

    def load_state_dict(self, state: dict) -> None:
        self.scale = state["scale"]
        self._hysteresis_left = state["hysteresis_left"]
        self._iter = state["iter"]
        self._last_overflow_iter = state["last_overflow_iter"]


def autocast_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """The dtype torch_autocast casts the forward's operations to (None: off); without one in the config, torch's
    default for the device, as DeepSpeed leaves it to torch."""
    if not cfg.torch_autocast.enabled:
        return None
    if cfg.torch_autocast.dtype is None:
        return torch.get_autocast_dtype(device.type)
    return {"fp16": torch.float16, "bf16": torch.bfloat16}[cfg.torch_autocast.dtype]


def forward_autocast(dtype: torch.dtype | None, device: torch.device):
    """The context the engine's forward runs in: torch.autocast for torch_autocast (replacing a caller's autocast,
    as DeepSpeed does), else nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
