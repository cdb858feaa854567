"""The reference's optimizers and learning-rate schedules, written out here from DeepSpeed's and the papers' formulas:
none of zkern's optimizer or scheduler code runs in the reference. torch's own AdamW, Adam, SGD and Adagrad step it
where DeepSpeed's config names them; Lion, Lamb and Muon (with its AdamW half) are below.

    python -m pytest tests/verify/test_verify.py -q -k schedule      # these schedules against DeepSpeed's own classes
"""

from __future__ import annotations

import math

import torch

from zkern.verify import recipes
from zkern.verify.draws import Draw


class RefLion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, Algorithm 2): c = b1 m + (1 - b1) g; w <- w - lr (sign(c) + wd w);
    m <- b2 m + (1 - b2) g."""

    def __init__(self, params, lr: float, betas: tuple[float, float], weight_decay: float):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                direction = torch.sign(b1 * m + (1 - b1) * p.grad)
                p.sub_(group["lr"] * (direction + group["weight_decay"] * p))
                m.copy_(b2 * m + (1 - b2) * p.grad)


def _moments(state: dict, grad: torch.Tensor, b1: float, b2: float) -> tuple[int, torch.Tensor, torch.Tensor]:
    """Adam's moments, written out: t += 1; m <- b1 m + (1 - b1) g; v <- b2 v + (1 - b2) g^2 (state starts empty)."""
    if not state:
        state.update(t=0, m=torch.zeros_like(grad), v=torch.zeros_like(grad))
    state["t"] += 1
    m, v = state["m"], state["v"]
    m.copy_(b1 * m + (1 - b1) * grad)
    v.copy_(b2 * v + (1 - b2) * grad * grad)
    return state["t"], m, v


class RefLamb(torch.optim.Optimizer):
    """LAMB as DeepSpeed's FusedLamb (csrc/lamb): Adam's moments m, v; u = m / (sqrt(v) + eps) + wd w; trust ratio
    r = ||w|| / ||u|| clamped to [min_coeff, max_coeff], 1 where a norm is 0; w <- w - lr sqrt(1 - b2^t) / (1 - b1^t)
    r u."""

    def __init__(self, params, lr: float, eps: float, weight_decay: float, max_coeff: float, min_coeff: float,
                 betas: tuple[float, float] = (0.9, 0.999)):
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay,
                                  "max_coeff": max_coeff, "min_coeff": min_coeff})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                t, m, v = _moments(self.state[p], p.grad, b1, b2)
                u = m / (v.sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm, u_norm = float(p.double().norm()), float(u.double().norm())
                ratio = 1.0 if w_norm == 0 or u_norm == 0 else min(max(w_norm / u_norm, group["min_coeff"]),
                                                                   group["max_coeff"])
                p.sub_(group["lr"] * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) * ratio * u)


class RefMuon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024, as torch.optim.Muon and DeepSpeed's MuonWithAuxAdam) on every parameter of two or more
    dimensions, AdamW on the rest (the fuzzer's models name no "embed" or "lm_head", so that is DeepSpeed's rule):
    buf <- momentum buf + (1 - momentum) g; u = momentum buf + (1 - momentum) g (Nesterov); O = the quintic
    Newton-Schulz map of u / ||u|| five times, in float64, on the matrix (rows, numel / rows);
    w <- w (1 - lr wd) - lr sqrt(max(1, rows / cols)) O. AdamW: torch's formulas, written out."""

    def __init__(self, params, lr: float, weight_decay: float, momentum: float, betas: tuple[float, float],
                 eps: float):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay, "momentum": momentum,
                                  "adam_betas": tuple(betas), "eps": eps})

    @staticmethod
    def orthogonalized(u: torch.Tensor) -> torch.Tensor:
        x = u.double().reshape(u.shape[0], -1)
        tall = x.shape[0] > x.shape[1]
        x = x.T if tall else x
        x = x / max(float(x.norm()), 1e-7)
        for _ in range(5):
            gram = x @ x.T
            x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
        return (x.T if tall else x).reshape(u.shape).float()

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if p.dim() >= 2:
                    buf = state.setdefault("buf", torch.zeros_like(p))
                    mu = group["momentum"]
                    buf.copy_(mu * buf + (1 - mu) * p.grad)
                    rows = p.shape[0]
                    scale = math.sqrt(max(1.0, rows / (p.numel() // rows)))
                    update = self.orthogonalized(mu * buf + (1 - mu) * p.grad)
                    p.copy_(p * (1 - lr * wd) - lr * scale * update)
                    continue
                t, m, v = _moments(state, p.grad, *group["adam_betas"])
                b1, b2 = group["adam_betas"]
                denom = (v / (1 - b2 ** t)).sqrt() + group["eps"]
                p.copy_(p * (1 - lr * wd) - lr * (m / (1 - b1 ** t)) / denom)


def make_optimizer(draw: Draw, groups: list[dict]) -> torch.optim.Optimizer:
    """The reference's optimizer of the draw over these param groups (each may set its own weight_decay)."""
    p = recipes.optimizer_params(draw)
    match draw.optimizer:
        case "AdamW" | "Adam" | "torch_adam" | "client":  # DeepSpeed's Adam decouples weight decay by default
            return torch.optim.AdamW(groups, lr=p["lr"], weight_decay=p["weight_decay"], eps=p["eps"])
        case "Adam_l2":
            return torch.optim.Adam(groups, lr=p["lr"], weight_decay=p["weight_decay"], eps=p["eps"])
        case "SGD":
            return torch.optim.SGD(groups, lr=p["lr"], weight_decay=p["weight_decay"], momentum=p["momentum"],
                                   nesterov=p["nesterov"])
        case "Adagrad":
            return torch.optim.Adagrad(groups, lr=p["lr"], weight_decay=p["weight_decay"], eps=p["eps"],
                                       lr_decay=p["lr_decay"],
                                       initial_accumulator_value=p["initial_accumulator_value"])
        case "Lion":
            return RefLion(groups, lr=p["lr"], betas=p["betas"], weight_decay=p["weight_decay"])
        case "Muon":
            return RefMuon(groups, lr=p["lr"], weight_decay=p["weight_decay"], momentum=p["momentum"],
                           betas=p["betas"], eps=p["eps"])
        case "Lamb":
            return RefLamb(groups, lr=p["lr"], eps=p["eps"], weight_decay=p["weight_decay"],
                           max_coeff=p["max_coeff"], min_coeff=p["min_coeff"])
    raise ValueError(f"no reference optimizer for {draw.optimizer!r}")


@torch.no_grad()
def round_state_to_bf16(opt: torch.optim.Optimizer, master: bool) -> None:
    """DeepSpeed's bf16_optimizer_states after a step of torch's Adam/AdamW: the moments stored in bf16, rounded to
    nearest even from the fp32 values the step computed (the next step reads them back exactly); master
    (bf16_master_weights_and_grads): the weights too. Rounding each stored value after the fp32 step is what a
    fused kernel that keeps bf16 state does, element by element, so no layout enters."""
    for group in opt.param_groups:
        for p in group["params"]:
            state = opt.state.get(p)
            if state:
                for key in ("exp_avg", "exp_avg_sq"):
                    state[key].copy_(state[key].bfloat16())
            if master:
                p.copy_(p.bfloat16())


def _warmup_fraction(k: int, steps: int, kind: str) -> float:
    """DeepSpeed's warm-up: over max(2, steps) scheduler steps, log(k + 1) / log(W) or k / W, then 1."""
    w = max(2, steps)
    if k >= w:
        return 1.0
    return math.log(k + 1) / math.log(w) if kind == "log" else k / w


def hyper_at(draw: Draw, k: int) -> tuple[float, float | None]:
    """(lr, beta1 or None where the schedule leaves the betas) after k + 1 scheduler steps; k = -1 is the value the
    scheduler sets when it is built. A scheduler steps once per applied (not skipped) optimizer step."""
    p, lr = recipes.scheduler_params(draw), recipes.base_lr(draw)
    match draw.scheduler:
        case "none":
            return lr, None
        case "client":  # torch's LambdaLR: built at step 0, so k + 1 steps
            return lr * recipes.client_factor(k + 1), None
        case "WarmupLR" | "WarmupLR_log" | "WarmupDecayLR":
            low, high = p["warmup_min_lr"], p["warmup_max_lr"]
            if k < 0:
                return low, None
            w = max(2, p["warmup_num_steps"])
            if draw.scheduler == "WarmupDecayLR" and k >= w:  # from max back down towards min, reached at the total
                return low + (high - low) * max(0.0, (p["total_num_steps"] - k) / max(1.0, p["total_num_steps"] - w)), \
                    None
            return low + (high - low) * _warmup_fraction(k, p["warmup_num_steps"], p["warmup_type"]), None
        case "WarmupCosineLR":
            if k < 0:
                return 0.0, None
            w = max(2, p["warmup_num_steps"])
            if k < w:
                return lr * (p["warmup_min_ratio"] + (1 - p["warmup_min_ratio"]) * _warmup_fraction(
                    k, w, p["warmup_type"])), None
            progress = min(1.0, (k - w + 1) / max(1, p["total_num_steps"] - w))
            return lr * max(0.0, p["cos_min_ratio"] + (1 - p["cos_min_ratio"]) * (1 + math.cos(math.pi * progress))
                            / 2), None
        case "OneCycle":
            return _one_cycle(p, k)
        case "LRRangeTest":
            return p["lr_range_test_min_lr"] * (1 + p["lr_range_test_step_rate"] * (k + 1)
                                                / p["lr_range_test_step_size"]), None
    raise ValueError(f"no reference schedule for {draw.scheduler!r}")


def _one_cycle(p: dict, k: int) -> tuple[float, float]:
    """1cycle (Smith 2018) as DeepSpeed's: a triangle from min to max lr over the first half cycle and back over the
    second, beta1 the other way (max -> min -> max); after the cycle lr decays as min / (1 + rate * n / size) and
    beta1 holds at its max. Built (k = -1) at min lr and min beta1."""
    if k < 0:
        return p["cycle_min_lr"], p["cycle_min_mom"]
    first, second = p["cycle_first_step_size"], p["cycle_second_step_size"]
    total = first + second
    if k >= total:
        return p["cycle_min_lr"] / (1 + p["decay_lr_rate"] * (k - total + 1) / p["decay_step_size"]), \
            p["cycle_max_mom"]
    at = (k + 1) % total
    height = at / first if at <= first else (total - at) / second
    lr = p["cycle_min_lr"] + (p["cycle_max_lr"] - p["cycle_min_lr"]) * height
    return lr, p["cycle_max_mom"] - (p["cycle_max_mom"] - p["cycle_min_mom"]) * height


def set_hyper(optimizer: torch.optim.Optimizer, hyper: tuple[float, float | None]) -> None:
    """Write the schedule's lr (and beta1, with beta2 = 0.99 as DeepSpeed's OneCycle sets) into every group."""
    lr, beta1 = hyper
    for group in optimizer.param_groups:
        group["lr"] = lr
        if beta1 is not None and "betas" in optimizer.defaults:
            group["betas"] = (beta1, 0.99)
