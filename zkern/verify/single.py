"""The independent reference of a draw: plain single-process torch on the whole global batch of each step, fp32,
torch.optim.AdamW, torch.nn.utils.clip_grad_norm_, the scheduler's formula written out here. None of zkern's engine
runs in it: checkpoints, offload, sharding and quantization must change nothing, so the reference has none of them.

    python -c "from zkern.verify.single import reference; from zkern.verify.draws import Draw; print(reference(Draw()))"
"""

from __future__ import annotations

import math

import torch

from zkern.verify.draws import Draw
from zkern.verify.runner import (
    ADAM_EPS,
    WARMUP,
    freeze,
    global_batches,
    groups,
    make_model,
    written_name,
    written_value,
)


def warmup_lr(draw: Draw, applied: int) -> float:
    """DeepSpeed's linear WarmupLR: lr / 4 for the first applied step, then lr/4 + (3/4) lr * min(k, W) / W after the
    k-th (k from 0; W = max(2, warmup steps))."""
    low, high = draw.lr / 4, draw.lr
    if applied == 0:
        return low
    k = applied - 1
    w = max(2, WARMUP)
    return low + (high - low) * min(k, w) / w


def reference(draw: Draw) -> dict:
    """losses and gradient norms per step (None for a skipped step's norm: it was not finite), the number of skipped
    steps, and the final fp32 state_dict."""
    model = make_model(draw)
    if draw.frozen == "start":
        freeze(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(groups(model) if draw.groups else [{"params": params, "weight_decay": 0.01}],
                            lr=draw.lr, weight_decay=0.01, eps=ADAM_EPS)
    batches = global_batches(draw)
    losses, norms, skipped, applied = {}, {}, 0, 0
    scale = LossScale() if draw.precision == "fp16" else None
    for step in range(draw.steps):
        if step == draw.write_at:
            with torch.no_grad():
                target = dict(model.named_parameters())[written_name(draw)]
                target.copy_(written_value(target.shape))
        opt.zero_grad()
        idx, tgt = batches[step]
        loss = model(idx, tgt)
        losses[step] = loss.item()
        if scale is not None:
            scale.update(step == draw.overflow_at)
        if step == draw.overflow_at:  # every rank skips it: no update, no Adam step, no scheduler step
            skipped += 1
            norms[step] = None
        else:
            loss.backward()
            trainable = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
            norms[step] = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in trainable))
            if draw.clip > 0:
                torch.nn.utils.clip_grad_norm_(trainable, draw.clip)
            for group in opt.param_groups:
                group["lr"] = warmup_lr(draw, applied)
            opt.step()
            applied += 1
        if step == draw.save_at and draw.frozen == "load":
            freeze(model)  # the engine after the load was built with these layers frozen
            for p in model.parameters():
                if not p.requires_grad:
                    p.grad = None
    return {"losses": losses, "grad_norms": norms, "skipped": skipped,
            "loss_scale": None if scale is None else scale.scale,
            "state": {k: v.detach().float().clone() for k, v in model.state_dict().items()}}


class LossScale:
    """DeepSpeed's dynamic loss scale under the draws' fp16 settings (runner.config: initial_scale_power 12,
    hysteresis 1, loss_scale_window 3), written out: an overflow halves it; every third optimizer step since the last
    overflow (or since the start) doubles it. The fp16 draws overflow only where a draw plants one (runner.train_step),
    so this is the whole trajectory."""

    def __init__(self):
        self.scale, self.iter, self.last_overflow = 2.0 ** 12, 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
            self.last_overflow = self.iter
        elif (self.iter - self.last_overflow) % 3 == 0:
            self.scale *= 2
        self.iter += 1
