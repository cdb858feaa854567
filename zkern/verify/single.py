"""The independent reference of a draw: plain single-process torch on the whole global batch of each step, in fp32 (or,
for bf16 and fp16 draws without quantized collectives or bf16 optimizer state, a 16-bit copy of the model running
forward and backward beside an fp32 master, as the engine does: Working), the draw's optimizer (torch's AdamW, Adam,
SGD, Adagrad, or Lion and Lamb written out in reference_math.py), torch.nn.utils.clip_grad_norm_, the scheduler's
formula written out in reference_math.py. None of zkern's engine, optimizers or schedulers runs in it: checkpoints,
offload, sharding and quantization must change nothing, so the reference has none of them; a load that leaves the
optimizer, the scheduler or everything but the weights behind starts those afresh here at the same step.

    python -c "from zkern.verify.single import reference; from zkern.verify.draws import Draw; print(reference(Draw()))"
"""

from __future__ import annotations

import copy
import math

import torch

from zkern.verify.draws import Draw
from zkern.verify.recipes import WEIGHT_DECAY
from zkern.verify.reference_math import hyper_at, make_optimizer, set_hyper
from zkern.verify.runner import freeze, global_batches, groups, make_model, written_name, written_value


def _optimizer(draw: Draw, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return make_optimizer(draw, groups(model) if draw.groups else [{"params": params, "weight_decay": WEIGHT_DECAY}])


class Working:
    """The 16-bit arithmetic of a draw, single-process (same_arithmetic): a bf16 or fp16 copy of the model runs the
    forward and backward on the whole global batch (the loss times the loss scale in fp16), its gradients go to the
    fp32 master as float32 (divided by the scale), the optimizer steps the master, and the copy takes the master's
    values rounded to its dtype, as the engine's working weights do. fp32 draws run the master itself."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None):
        self.master, self.dtype = model, dtype
        self.model = model if dtype is None else copy.deepcopy(model).to(dtype)

    def pairs(self):
        return zip(self.master.parameters(), self.model.parameters())

    def backward(self, loss: torch.Tensor, scale: float) -> None:
        (loss * scale if scale != 1.0 else loss).backward()
        if self.dtype is None:
            return
        for p, w in self.pairs():
            p.grad = None if w.grad is None else w.grad.float() / scale
            w.grad = None

    def sync(self) -> None:
        """The working copy from the master (after a step or a write), and which parameters train."""
        if self.dtype is None:
            return
        with torch.no_grad():
            for p, w in self.pairs():
                w.copy_(p)
                w.requires_grad_(p.requires_grad)


def same_arithmetic(draw: Draw) -> bool:
    """Whether the reference computes in the draw's 16-bit dtype (Working): bf16 and fp16 draws whose optimizer
    state is fp32 and whose collectives are not quantized. The others compute in fp32 and are held to wider bounds
    (check.py)."""
    return draw.precision != "fp32" and not (draw.qwz or draw.qgz or draw.bf16_state)


def reference(draw: Draw) -> dict:
    """losses and gradient norms per step (None for a skipped step's norm: it was not finite), the skipped and
    global step counts, the final loss scale (fp16) and the final fp32 state_dict."""
    model = make_model(draw)
    if draw.frozen == "start":
        freeze(model)
    working = Working(model, {"bf16": torch.bfloat16, "fp16": torch.float16}[draw.precision]
                      if same_arithmetic(draw) else None)
    opt = _optimizer(draw, model)
    count = -1  # the scheduler's steps taken, less one
    hyper = hyper_at(draw, count)  # what the scheduler set in the optimizer's groups: (lr, beta1)
    batches = global_batches(draw)
    losses, norms, skipped, global_steps = {}, {}, 0, 0
    scale = LossScale() if draw.precision == "fp16" else None
    for step in range(draw.steps):
        if step == draw.write_at:
            with torch.no_grad():
                target = dict(model.named_parameters())[written_name(draw)]
                target.copy_(written_value(target.shape))
            working.sync()
        opt.zero_grad()
        idx, tgt = batches[step]
        part = 1
        if step == draw.short_at:  # only the first micro-step of each rank ran: the batch's first 1 / accumulation,
            part = draw.accumulation  # its loss still divided by the accumulation steps
            idx, tgt = idx[:len(idx) // part], tgt[:len(tgt) // part]
        loss = working.model(idx, tgt)
        losses[step] = loss.item()
        loss = loss / part if part > 1 else loss
        global_steps += 1
        used = 1.0 if scale is None or working.dtype is None else scale.scale
        if scale is not None:
            scale.update(step == draw.overflow_at)
        if step == draw.overflow_at:  # every rank skips it: no update, no optimizer step, no scheduler step
            skipped += 1
            norms[step] = None
        else:
            working.backward(loss, used)
            trainable = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
            norms[step] = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in trainable))
            if draw.clip > 0:
                torch.nn.utils.clip_grad_norm_(trainable, draw.clip)
            set_hyper(opt, hyper)
            opt.step()
            working.sync()
            count += 1
            hyper = hyper_at(draw, count)
        if step == draw.save_at:
            if draw.frozen == "load":
                freeze(model)  # the engine after the load was built with these layers frozen, which it keeps in
                for p in model.parameters():  # the working dtype only (no fp32 master for a frozen layer)
                    if not p.requires_grad:
                        p.grad = None
                        if draw.precision != "fp32":
                            with torch.no_grad():
                                p.copy_(p.to({"bf16": torch.bfloat16, "fp16": torch.float16}[draw.precision]))
                working.sync()
            if draw.load_flags in ("no_optimizer", "module_only"):  # a fresh optimizer: no moments, step 0
                opt = _optimizer(draw, model)
            if draw.load_flags == "module_only":  # and a fresh scheduler, scaler and counters
                count, skipped, global_steps = -1, 0, 0
                scale = LossScale() if draw.precision == "fp16" else None
            if draw.load_flags == "no_scheduler":  # the scheduler starts again; the optimizer's groups keep the lr
                count = -1  # (and betas) they were saved with until its next step
            elif draw.load_flags:
                hyper = _after_load(draw, count, hyper)
    return {"losses": losses, "grad_norms": norms, "skipped": skipped, "global_steps": global_steps,
            "loss_scale": None if scale is None else scale.scale,
            "state": {k: v.detach().float().clone() for k, v in model.state_dict().items()}}


def _after_load(draw: Draw, count: int, hyper: tuple) -> tuple:
    """The groups' (lr, beta1) after a load that built the optimizer afresh: DeepSpeed's schedulers (zkern's) set
    them from their step count when loaded; a torch scheduler's load_state_dict sets nothing, so the groups keep what
    the scheduler set when it was built."""
    if draw.scheduler == "client":
        return hyper_at(draw, -1)
    return hyper_at(draw, count)


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
