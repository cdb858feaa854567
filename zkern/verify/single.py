"""The independent reference of a draw: plain single-process torch on the whole global batch of each step, doing the
draw's arithmetic (Working): a bf16 or fp16 copy of the model running forward and backward beside an fp32 master, as
the engine does; with qwZ, the weights each forward and backward see quantized to int8 and back as the engine's
gathers deliver them (zkern.reference's quantize, the kernels' spec, on the engine's unit layout); with bf16 optimizer
state, torch's Adam whose moments (and master) are stored rounded to bf16 (reference_math.round_state_to_bf16). Then
the draw's optimizer (torch's AdamW, Adam, SGD, Adagrad, or Lion and Lamb written out in reference_math.py),
torch.nn.utils.clip_grad_norm_, the scheduler's formula written out in reference_math.py. None of zkern's engine,
optimizers or schedulers runs in it: checkpoints, offload and sharding must change nothing, so the reference has none
of them; a load that leaves the optimizer, the scheduler or everything but the weights behind starts those afresh here
at the same step. qgZ, which quantizes each rank's gradient before the ranks' sum, is the one arithmetic it does not
redo: those draws run it in fp32 and are held to wider bounds (check.py).

    python -c "from zkern.verify.single import reference; from zkern.verify.draws import Draw; print(reference(Draw()))"
"""

from __future__ import annotations

import copy
import math

import torch

import zkern.reference as zref
from zkern.verify.draws import Draw
from zkern.verify.recipes import WEIGHT_DECAY
from zkern.verify.reference_math import hyper_at, make_optimizer, round_state_to_bf16, set_hyper
from zkern.verify.runner import (
    QWZ_GROUP,
    freeze,
    global_batches,
    groups,
    make_model,
    set_value,
    written_name,
    written_value,
)


def _optimizer(draw: Draw, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return make_optimizer(draw, groups(model) if draw.groups else [{"params": params, "weight_decay": WEIGHT_DECAY}])


class Working:
    """The working arithmetic of a draw, single-process (same_arithmetic): a bf16 or fp16 copy of the model runs the
    forward and backward on the whole global batch (the loss times the loss scale in fp16), its gradients go to the
    fp32 master as float32 (divided by the scale), the optimizer steps the master, and the copy takes the master's
    values rounded to its dtype, as the engine's working weights do. With qwZ (units: the engine's int8-gathered
    units, observe.quantized_units) the copy then takes what the gathers deliver: each rank's chunk of each unit's
    flat buffer quantized to int8 in groups and dequantized (zkern.reference's quantize, the kernels' spec), so the
    forward and backward see the weights every rank computes with. fp32 draws without qwZ run the master itself."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None, world: int = 1, group: int = 0):
        self.master, self.dtype, self.world, self.group = model, dtype, world, group
        self.model = model if dtype is None else copy.deepcopy(model).to(dtype)
        self.units: list = []

    def pairs(self):
        return zip(self.master.parameters(), self.model.parameters())

    def backward(self, loss: torch.Tensor, scale: float) -> None:
        (loss * scale if scale != 1.0 else loss).backward()
        if self.dtype is None:
            return
        for p, w in self.pairs():
            p.grad = None if w.grad is None else w.grad.float() / scale
            w.grad = None

    def sync(self, units: list | None = None, world: int | None = None, frozen_only: bool = False) -> None:
        """The working copy from the master (after a step, a write or a load into another layout: units and
        world), and which parameters train. frozen_only: only the frozen parameters take the master's values (a
        load that resumes a delayed update in flight keeps the trained ones' working weights)."""
        if units is not None:
            self.units, self.world = units, world
        if self.dtype is None:
            return
        with torch.no_grad():
            for p, w in self.pairs():
                if not frozen_only or not p.requires_grad:
                    w.copy_(p)
                w.requires_grad_(p.requires_grad)
            self._through_int8()

    def _through_int8(self) -> None:
        params = dict(self.model.named_parameters())
        for padded, members in self.units:
            flat = torch.zeros(padded, dtype=self.dtype)
            for name, offset, numel in members:
                flat[offset:offset + numel] = params[name].detach().reshape(-1)
            chunk = padded // self.world
            for r in range(self.world):
                part = flat[r * chunk:(r + 1) * chunk]
                codes, scales = zref.quantize(part, 8, self.group)
                part.copy_(zref.dequantize(codes, scales, 8, self.group, chunk, self.dtype))
            for name, offset, numel in members:
                params[name].copy_(flat[offset:offset + numel].view(params[name].shape))


def _write(draw: Draw, model: torch.nn.Module, working: Working, value) -> None:
    """The master of the written parameter takes value(shape), and the working copy follows: write_at's
    GatheredParameters write, and set_at's safe_set_full_fp32_param (which leaves the gradients as they are)."""
    with torch.no_grad():
        target = dict(model.named_parameters())[written_name(draw)]
        target.copy_(value(target.shape))
    working.sync()


def same_arithmetic(draw: Draw) -> bool:
    """Whether the reference does the draw's arithmetic (Working): its 16-bit dtype, qwZ's int8 gathers, bf16
    optimizer state. Not qgZ: each rank's gradient is quantized before the ranks' sum, which the whole-batch
    reference never holds; those draws compute in fp32 here and are held to wider bounds (check.py). A stochastically
    rounded bf16 master is kept at its fp32 expectation (reference()). torch_autocast draws: the forward under
    torch.autocast in the draw's dtype over the fp32 weights (the Working copy in fp32), fp16's loss scaled."""
    return (draw.precision != "fp32" or draw.qwz or bool(draw.autocast)) and not draw.qgz


def units_of(runs: list[list[dict]]) -> dict:
    """The engine's int8-gathered units per phase (reference's qwz_units) from a draw's runs (per spawn, per rank:
    run_phases' results; rank 0's say it for every rank)."""
    units: dict = {}
    for spawned in runs:
        units.update(spawned[0].get("qwz_units", {}))
    return units


def reference(draw: Draw, qwz_units: dict | None = None) -> dict:
    """losses and gradient norms per step (None for a skipped step's norm: it was not finite), the skipped and
    global step counts, the final loss scale (fp16) and the final fp32 state_dict. qwz_units: for a qwZ draw, per
    phase the engine's int8-gathered units (observe.quantized_units), where its quantization groups fall."""
    if draw.qwz and not (qwz_units and all(k in qwz_units for k in range(len(draw.phases)))):
        raise ValueError("a qwZ draw's reference needs the engine's int8-gathered units of every phase "
                         "(observe.quantized_units, returned by run_phases as 'qwz_units')")
    model = make_model(draw)
    if draw.frozen == "start":
        freeze(model)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[draw.precision]
    # bf16_master_weights_and_grads: the master is bf16 from the start, and after each step rounded to nearest
    # (round_state_to_bf16). Stochastically rounded ("master_sr"), it is the fp32 master in expectation: the
    # reference keeps that one, and the draw's own rounding noise is what its bound (check.py) admits.
    if draw.bf16_state.startswith("master"):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16())
    # the delayed update: the forward's copy trails the master by one update, so it is a copy even in fp32
    working = Working(model, dtype if same_arithmetic(draw) else torch.float32 if draw.delayed_update else None,
                      group=QWZ_GROUP)
    phase = -1
    pending = False  # a delayed update saved in flight, which the load resumes: the trained weights keep trailing
    opt = _optimizer(draw, model)
    count = -1  # the scheduler's steps taken, less one
    hyper = hyper_at(draw, count)  # what the scheduler set in the optimizer's groups: (lr, beta1)
    batches = global_batches(draw)
    losses, norms, skipped, global_steps = {}, {}, 0, 0
    scale = _loss_scale(draw)
    for step in range(draw.steps):
        now = next(k for k, (_, _, first, last) in enumerate(draw.phases) if first <= step < last)
        if now != phase:  # an engine built (or loaded into another layout): its gathers from now on
            phase = now
            working.sync(qwz_units[phase] if draw.qwz else [], draw.phases[phase][0], frozen_only=pending)
        if step == draw.write_at:
            _write(draw, model, working, written_value)
        opt.zero_grad()
        idx, tgt = batches[step]
        part = 1
        if step == draw.short_at:  # only the first micro-step of each rank ran: the batch's first 1 / accumulation,
            part = draw.accumulation  # its loss still divided by the accumulation steps
            idx, tgt = idx[:len(idx) // part], tgt[:len(tgt) // part]
        with torch.autocast("cpu", dtype=AUTOCAST[draw.autocast], enabled=bool(draw.autocast)):
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
            if draw.delayed_update:
                working.sync()  # a skipped step lands the last update all the same
            if step == draw.set_at:
                _write(draw, model, working, set_value)
        else:
            working.backward(loss, used)
            if draw.delayed_update:
                working.sync()  # the last update lands after this step's backward, before its own
            if step == draw.set_at:  # the gradient stays the one taken at the weight before it
                _write(draw, model, working, set_value)
            trainable = [p for p in model.parameters() if p.requires_grad and p.grad is not None]
            norms[step] = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in trainable))
            if draw.clip > 0:
                torch.nn.utils.clip_grad_norm_(trainable, draw.clip)
            set_hyper(opt, hyper)
            opt.step()
            if draw.bf16_state:
                round_state_to_bf16(opt, master=draw.bf16_state == "master")
            if not draw.delayed_update:
                working.sync()
            count += 1
            hyper = hyper_at(draw, count)
        if step == draw.save_at:
            # A save lands nothing: a delayed update in flight is saved pending and a load that takes the optimizer's
            # state resumes it (the run goes on as if it had not saved); a load without it takes the masters, the
            # update landed.
            landed = not draw.delayed_update or draw.load_flags in ("no_optimizer", "module_only")
            pending = not landed
            if draw.delayed_update and landed:
                working.sync()
            if draw.frozen == "load":
                freeze(model)  # the engine after the load was built with these layers frozen, which it keeps in
                for p in model.parameters():  # the working dtype only (no fp32 master for a frozen layer)
                    if not p.requires_grad:
                        p.grad = None
                        if draw.precision != "fp32":
                            with torch.no_grad():
                                p.copy_(p.to({"bf16": torch.bfloat16, "fp16": torch.float16}[draw.precision]))
                working.sync(frozen_only=not landed)  # a frozen layer is loaded from its master
            if draw.load_flags in ("no_optimizer", "module_only"):  # a fresh optimizer: no moments, step 0
                opt = _optimizer(draw, model)
            if draw.load_flags == "module_only":  # and a fresh scheduler, scaler and counters
                count, skipped, global_steps = -1, 0, 0
                scale = _loss_scale(draw)
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


AUTOCAST = {"": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # torch_autocast's dtype


def _loss_scale(draw: Draw):
    """fp16's dynamic loss scale under the draws' settings; under torch_autocast in fp16, torch GradScaler's schedule
    (2^16, doubled after 2000 clean steps: never within a draw), as the engine applies it."""
    if draw.precision == "fp16":
        return LossScale()
    return LossScale(2.0 ** 16, 2000) if draw.autocast == "fp16" else None


class LossScale:
    """DeepSpeed's dynamic loss scale under the draws' fp16 settings (runner.config: initial_scale_power 12,
    hysteresis 1, loss_scale_window 3), written out: an overflow halves it; every third optimizer step since the last
    overflow (or since the start) doubles it. The fp16 draws overflow only where a draw plants one (runner.train_step),
    so this is the whole trajectory."""

    def __init__(self, initial: float = 2.0 ** 12, window: int = 3):
        self.scale, self.window, self.iter, self.last_overflow = initial, window, 0, -1

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.scale / 2, 1.0)
            self.last_overflow = self.iter
        elif (self.iter - self.last_overflow) % self.window == 0:
            self.scale *= 2
        self.iter += 1
