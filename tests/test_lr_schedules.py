"""WarmupLR / WarmupDecayLR against DeepSpeed's documented formulas, written out independently here."""

import math

import torch

from zkern.config import SchedulerConfig
from zkern.engine.lr_schedules import WarmupDecayLR, WarmupLR


def opt():
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=123.0)


def test_warmup_lr_log_and_linear():
    o = opt()
    s = WarmupLR(o, SchedulerConfig(type="WarmupLR", warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=10))
    assert o.param_groups[0]["lr"] == 0.1  # set to the minimum at construction
    seen = []
    for _ in range(12):
        s.step()
        seen.append(o.param_groups[0]["lr"])
    expect = [0.1 + 1.0 * math.log(k + 1) / math.log(10) for k in range(10)] + [1.1, 1.1]
    assert all(abs(a - b) < 1e-12 for a, b in zip(seen, expect))
    o = opt()
    s = WarmupLR(o, SchedulerConfig(type="WarmupLR", warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4,
                                    warmup_type="linear"))
    got = []
    for _ in range(6):
        s.step()
        got.append(o.param_groups[0]["lr"])
    assert got == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_warmup_decay_reaches_zero_at_total():
    o = opt()
    s = WarmupDecayLR(o, SchedulerConfig(type="WarmupDecayLR", warmup_min_lr=0.0, warmup_max_lr=1.0,
                                         warmup_num_steps=2, warmup_type="linear", total_num_steps=6))
    got = []
    for _ in range(8):
        s.step()
        got.append(o.param_groups[0]["lr"])
    # iterations 0,1 warm up (0, 0.5); then (6 - k) / (6 - 2) for k = 2..7, floored at 0
    assert got == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    state = s.state_dict()
    o2 = opt()
    s2 = WarmupDecayLR(o2, s.cfg)
    s2.load_state_dict(state)
    assert o2.param_groups[0]["lr"] == 0.0 and s2.last_batch_iteration == 7
