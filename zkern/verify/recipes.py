"""What a draw's user writes for the optimizer and the scheduler: the config's "optimizer" and "scheduler" sections,
or the client objects, for each of Draw's OPTIMIZERS and SCHEDULERS. The numbers are the draw's input; the engine
(runner.py) is given them as a user would give them, and the reference (reference_math.py) reads the same numbers and
does its own arithmetic.

    python -c "from zkern.verify.recipes import optimizer_section; from zkern.verify import Draw; \
print(optimizer_section(Draw(optimizer='Lamb')))"
"""

from __future__ import annotations

import torch

from zkern.verify.draws import Draw

WARMUP = 3  # WarmupLR's steps: lr goes from lr / 4 to lr over the first applied steps
# Adam's eps in draws. Adam's step lr * g / (|g| + eps) turns a rounding difference dg of a gradient element into
# up to lr * dg / eps (at |g| near 0), where dg is the float32 error of a sum over tokens and ranks in another order:
# about 1e-9 to 1e-8 here (terms of 1e-3 to 1e-2). The exact bar allows 1e-3 lr per step for that amplification, so
# eps must be at least 1e3 dg. With torch's 1e-8, a routed expert's gradient of about 1e-9 in the step it first got
# one moved 1.3% of a step apart between two exact implementations; with 1e-6, the first step after a load that
# rebuilt the optimizer (load_module_only at world 4) met an element whose gradient was 3.7e-7 and moved it 4.7e-3
# of a step apart (2026-11-26, seed 483672). At 1e-5 the amplification is at most about 1e-3; a wrong update (of
# order lr, as Adam's steps are for every gradient above eps) still shows.
ADAM_EPS = 1e-5
WEIGHT_DECAY = 0.01
CONFIG_TYPE = {"AdamW": "AdamW", "Adam": "Adam", "Adam_l2": "Adam", "torch_adam": "AdamW", "Lamb": "Lamb",
               "Lion": "Lion", "SGD": "SGD", "Adagrad": "Adagrad", "Muon": "Muon"}


def base_lr(draw: Draw) -> float:
    """The optimizer's lr: the draw's, ten times it for SGD (whose step is lr * g, not about lr as Adam's)."""
    return draw.lr * (10 if draw.optimizer == "SGD" else 1)


def optimizer_params(draw: Draw) -> dict:
    """The optimizer's hyper-parameters as the config's 'optimizer.params' spells them."""
    lr, name = base_lr(draw), draw.optimizer
    if name in ("AdamW", "Adam", "Adam_l2", "torch_adam", "client"):
        params = {"lr": lr, "weight_decay": WEIGHT_DECAY, "eps": ADAM_EPS}
        if name == "Adam_l2":
            params["adam_w_mode"] = False
        if name == "torch_adam":
            params["torch_adam"] = True
        return params
    return {"Lamb": {"lr": lr, "weight_decay": WEIGHT_DECAY, "eps": ADAM_EPS, "max_coeff": 10.0, "min_coeff": 0.01},
            "Lion": {"lr": lr, "weight_decay": WEIGHT_DECAY, "betas": [0.9, 0.99]},
            "SGD": {"lr": lr, "weight_decay": WEIGHT_DECAY, "momentum": 0.9, "nesterov": True},
            "Adagrad": {"lr": lr, "weight_decay": WEIGHT_DECAY, "eps": 1e-10, "lr_decay": 0.1,
                        "initial_accumulator_value": 0.1},
            # one lr for both halves; "gram" iterates in fp32 on a CPU, 1e-6 of the exact iteration (bf16's
            # "standard" would put a bf16 unit of noise in every exact draw)
            "Muon": {"lr": lr, "weight_decay": WEIGHT_DECAY, "momentum": 0.9, "ns_method": "gram",
                     "betas": [0.9, 0.999], "eps": ADAM_EPS}}[name]


def optimizer_section(draw: Draw) -> dict | None:
    """The config's 'optimizer' section (None for a client optimizer)."""
    if draw.optimizer == "client":
        return None
    return {"type": CONFIG_TYPE[draw.optimizer], "params": optimizer_params(draw)}


def scheduler_params(draw: Draw) -> dict:
    """DeepSpeed's parameters of the draw's scheduler (every schedule moves within the draw's 3 to 5 steps)."""
    lr = base_lr(draw)
    low = 0.0 if draw.frontend == "trainer" else lr / 4  # the Trainer's warm-up starts at 0 (fill_auto checks it)
    match draw.scheduler:
        case "WarmupLR" | "WarmupLR_log":
            return {"warmup_min_lr": low, "warmup_max_lr": lr, "warmup_num_steps": WARMUP,
                    "warmup_type": "log" if draw.scheduler.endswith("log") else "linear"}
        case "WarmupDecayLR":
            return {"warmup_min_lr": low, "warmup_max_lr": lr, "warmup_num_steps": 2, "total_num_steps": 5,
                    "warmup_type": "linear"}
        case "WarmupCosineLR":
            return {"total_num_steps": 5, "warmup_num_steps": 2, "warmup_min_ratio": 0.25, "cos_min_ratio": 0.1,
                    "warmup_type": "linear"}
        case "OneCycle":
            return {"cycle_min_lr": lr / 4, "cycle_max_lr": lr, "cycle_first_step_size": 2,
                    "cycle_second_step_size": 1, "decay_lr_rate": 0.5, "decay_step_size": 1,
                    "cycle_min_mom": 0.85, "cycle_max_mom": 0.95}
        case "LRRangeTest":
            return {"lr_range_test_min_lr": lr / 4, "lr_range_test_step_size": 2, "lr_range_test_step_rate": 1.0}
    return {}


def scheduler_section(draw: Draw) -> dict | None:
    """The config's 'scheduler' section (None for a client scheduler or none)."""
    if draw.scheduler in ("client", "none"):
        return None
    return {"type": draw.scheduler.removesuffix("_log"), "params": scheduler_params(draw)}


def client_factor(count: int) -> float:
    """The client LambdaLR's factor after `count` scheduler steps."""
    return 1.0 / (1.0 + 0.5 * count)


def client_optimizer(draw: Draw, params) -> torch.optim.Optimizer:
    """A user's own torch AdamW (params: the parameters or their groups)."""
    return torch.optim.AdamW(params, lr=base_lr(draw), weight_decay=WEIGHT_DECAY, eps=ADAM_EPS)


def client_scheduler(optimizer: torch.optim.Optimizer):
    """A user's own scheduler, as the callable optimizer -> scheduler zkern and DeepSpeed take."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, client_factor)
