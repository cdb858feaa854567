"""zkern's schedulers against DeepSpeed's own classes, step by step (DeepSpeed installs on the CPU as a test-only
peer), and against the formulas written out here: WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle (with its
momentum cycle and stairs) and LRRangeTest, from the same config sections a user writes.

    python -m pytest tests/optim/test_lr_schedules.py -q
"""

import math

import pytest
import torch

import zkern
from zkern.optim.lr_schedules import build_scheduler


def opt(groups: int = 1, cls=torch.optim.AdamW):
    return cls([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.02 * (g + 1)} for g in range(groups)])


def scheduler(kind: str, optimizer, **params):
    cfg = zkern.Config.load({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": kind, "params": params}})
    return build_scheduler(optimizer, cfg.scheduler)


def test_warmup_lr_log_and_linear_written_out():
    o = opt()
    s = scheduler("WarmupLR", o, warmup_min_lr=0.1, warmup_max_lr=1.1, warmup_num_steps=10)
    assert o.param_groups[0]["lr"] == 0.1  # set to the minimum at construction
    seen = []
    for _ in range(12):
        s.step()
        seen.append(o.param_groups[0]["lr"])
    expect = [0.1 + 1.0 * math.log(k + 1) / math.log(10) for k in range(10)] + [1.1, 1.1]
    assert all(abs(a - b) < 1e-12 for a, b in zip(seen, expect))
    o = opt()
    s = scheduler("WarmupLR", o, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    got = []
    for _ in range(6):
        s.step()
        got.append(o.param_groups[0]["lr"])
    assert got == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]


def test_warmup_decay_reaches_zero_at_total_and_resumes():
    o = opt()
    s = scheduler("WarmupDecayLR", o, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=2,
                  warmup_type="linear", total_num_steps=6)
    got = []
    for _ in range(8):
        s.step()
        got.append(o.param_groups[0]["lr"])
    # iterations 0,1 warm up (0, 0.5); then (6 - k) / (6 - 2) for k = 2..7, floored at 0
    assert got == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0]
    o2 = opt()
    s2 = scheduler("WarmupDecayLR", o2, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=2,
                   warmup_type="linear", total_num_steps=6)
    s2.load_state_dict(s.state_dict())
    assert o2.param_groups[0]["lr"] == 0.0 and s2.last_batch_iteration == 7


CASES = [
    ("WarmupLR", {"warmup_min_lr": 0.001, "warmup_num_steps": 7}),  # max: each group's own lr
    ("WarmupLR", {"warmup_min_lr": 0.0, "warmup_max_lr": 0.05, "warmup_num_steps": 5, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 30, "warmup_max_lr": 0.01, "warmup_num_steps": 6}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 5, "warmup_min_ratio": 0.1,
                        "cos_min_ratio": 0.05}),
    ("WarmupCosineLR", {"total_num_steps": 8, "warmup_num_steps": 10, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 0.001, "cycle_max_lr": 0.01, "cycle_first_step_size": 5,
                  "cycle_second_step_size": 7, "decay_lr_rate": 0.5, "decay_step_size": 3,
                  "decay_mom_rate": 0.1}),
    ("OneCycle", {"cycle_min_lr": 0.0, "cycle_max_lr": 0.02, "cycle_first_step_size": 6, "cycle_first_stair_count": 3,
                  "cycle_momentum": False}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.001, "lr_range_test_step_size": 4, "lr_range_test_step_rate": 2.0}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.002, "lr_range_test_step_size": 3, "lr_range_test_staircase": True}),
]


@pytest.mark.parametrize("kind, params", CASES, ids=[f"{k}-{i}" for i, (k, _) in enumerate(CASES)])
def test_every_scheduler_equals_deepspeeds_step_by_step(kind, params):
    from deepspeed.runtime import lr_schedules as ds

    mine, theirs = opt(2), opt(2)
    s = scheduler(kind, mine, **params)
    t = getattr(ds, kind)(theirs, **params)
    for step in range(40):
        for a, b in zip(mine.param_groups, theirs.param_groups):
            assert a["lr"] == pytest.approx(b["lr"], rel=1e-12, abs=1e-15), (step, a["lr"], b["lr"])
            assert tuple(a["betas"]) == pytest.approx(tuple(b["betas"]), rel=1e-12), step
        s.step()
        t.step()
    assert s.state_dict() == t.state_dict()


def test_scheduler_params_are_checked():
    with pytest.raises(zkern.ConfigError, match="'scheduler.params.total_num_steps' is required by WarmupCosineLR"):
        scheduler("WarmupCosineLR", opt(), warmup_num_steps=3)
    with pytest.raises(zkern.ConfigError, match="cycle_max_lr.*is below cycle_min_lr"):
        scheduler("OneCycle", opt(), cycle_min_lr=0.1, cycle_max_lr=0.01)
    with pytest.raises(zkern.ConfigError, match="'scheduler.params.warmup_num_steps' must be >= 0, got -1"):
        scheduler("WarmupLR", opt(), warmup_num_steps=-1)  # 0 is DeepSpeed's 2-step minimum (test_config_compat)
    with pytest.raises(zkern.ConfigError, match="unknown config key 'scheduler.params.warmup_num_step'; did you mean"):
        scheduler("WarmupLR", opt(), warmup_num_step=10)


@pytest.mark.parametrize("kind, params", [
    ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 2, "cycle_min_mom": 0.85,
                  "cycle_max_mom": 0.95}),
    ("WarmupLR", {"warmup_min_lr": 0.01, "warmup_max_lr": 0.1, "warmup_num_steps": 3}),
    ("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 2}),
    ("LRRangeTest", {"lr_range_test_min_lr": 0.01, "lr_range_test_step_size": 2}),
])
def test_loading_the_count_a_scheduler_was_built_with_sets_what_it_was_built_with(kind, params):
    # A load that leaves the scheduler behind (load_module_only, load_lr_scheduler_states=False) resets it by loading
    # the state it was built with: the groups must then hold what a fresh engine's hold. OneCycle set beta1 to
    # cycle_max_mom there (its cycle formula at the count before the first step) where its constructor sets
    # cycle_min_mom, so the first step after such a load ran with another beta1 than the same step of a fresh run.
    o = opt()
    s = scheduler(kind, o, **params)
    built = {k: v for k, v in o.param_groups[0].items() if k != "params"}
    initial = s.state_dict()
    for _ in range(3):
        s.step()
    s.load_state_dict(initial)
    assert {k: v for k, v in o.param_groups[0].items() if k != "params"} == built
