"""What DeepSpeed configs turn on beside training, done for real: the monitors (CSV and TensorBoard files with
DeepSpeed's event names and the engine's own values; wandb and comet through their packages), wall_clock_breakdown,
memory_breakdown, comms_logger (its bytes equal comm_stats), the flops profiler (its count equals torch's flop
counter on the same forward), fp16.auto_cast, checkpoint.tag_validation, checkpoint.use_node_local_storage and
dataloader_drop_last.

    python -m pytest tests/engine/test_reporting.py -q
"""

from __future__ import annotations

import csv
import logging
import os
import sys
import types

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import zkern
from zkern.testing import TinyGPT, spawn

IDX = torch.randint(0, 67, (2, 17), generator=torch.Generator().manual_seed(0))


def config(**extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 2, "device": "cpu",
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 1}, **extra}


def train(engine, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = engine(IDX[:, :-1], IDX[:, 1:])
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return losses


def test_csv_and_tensorboard_monitors_write_deepspeeds_events_with_the_engines_values(tmp_path):
    cfg = config(csv_monitor={"enabled": True, "output_path": str(tmp_path / "csv"), "job_name": "job"},
                 tensorboard={"enabled": True, "output_path": str(tmp_path / "tb"), "job_name": "job"},
                 wall_clock_breakdown=True)
    torch.manual_seed(0)
    engine = zkern.Engine(TinyGPT(), cfg)
    losses = train(engine, 3)
    lrs = engine.optimizer.param_groups[0]["lr"]
    engine.destroy()
    folder = tmp_path / "csv" / "job"
    with open(folder / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "train_loss"]
    assert [int(r[0]) for r in rows[1:]] == [2, 4, 6]  # samples: steps x train_batch_size
    assert [float(r[1]) for r in rows[1:]] == pytest.approx(losses, rel=1e-6)
    with open(folder / "Train_Samples_lr.csv") as f:
        assert float(list(csv.reader(f))[-1][1]) == lrs
    assert (folder / "Train_Samples_elapsed_time_ms_forward.csv").exists()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb" / "job"))
    events.Reload()
    scalars = events.Scalars("Train/Samples/train_loss")
    assert [s.step for s in scalars] == [2, 4, 6] and [s.value for s in scalars] == pytest.approx(losses, rel=1e-6)


def test_wandb_and_comet_go_through_their_packages_or_say_which_is_missing(monkeypatch):
    calls = []
    fake_wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)),
                                       log=lambda values, step: calls.append(("log", values, step)))
    monkeypatch.setitem(sys.modules, "wandb", fake_wandb)
    engine = zkern.Engine(TinyGPT(), config(wandb={"enabled": True, "project": "p", "group": "g", "team": "t"}))
    train(engine, 2)
    assert calls[0] == ("init", {"project": "p", "group": "g", "entity": "t"})
    logged = [c for c in calls if c[0] == "log"]
    assert ({"Train/Samples/train_loss"} <= {k for c in logged for k in c[1]}) and logged[-1][2] == 4
    monkeypatch.delitem(sys.modules, "wandb")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "site-packages" not in p] or sys.path)
    for section, package in (("wandb", "wandb"), ("comet", "comet_ml")):
        monkeypatch.setitem(sys.modules, package, None)  # "not installed": import fails
        with pytest.raises(zkern.ConfigError, match=rf"'{section}.enabled' is true, but the package '{package}'"):
            zkern.Engine(TinyGPT(), config(**{section: {"enabled": True}}))


def test_wall_clock_comms_and_memory_breakdowns_are_logged_every_steps_per_print(caplog):
    caplog.set_level(logging.INFO, logger="zkern")
    engine = zkern.Engine(TinyGPT(), config(wall_clock_breakdown=True, memory_breakdown=True,
                                            comms_logger={"enabled": True}))
    train(engine, 4)
    text = caplog.text
    assert text.count("zkern wall clock (ms per step, mean of 2): forward") == 2
    assert text.count("zkern memory (bytes by place)") == 2
    assert engine.comm.times.on


def test_without_steps_per_print_there_is_no_progress_line_and_the_breakdowns_come_every_step(caplog):
    """DeepSpeed 0.19's default: steps_per_print absent prints no progress line; its timers and memory lines still
    come every step. 0 silences everything."""
    caplog.set_level(logging.INFO, logger="zkern")
    cfg = config(wall_clock_breakdown=True, memory_breakdown=True)
    del cfg["steps_per_print"]
    engine = zkern.Engine(TinyGPT(), cfg)
    assert engine.steps_per_print() is None
    train(engine, 3)
    assert caplog.text.count("zkern wall clock (ms per step, mean of 1)") == 3
    assert caplog.text.count("zkern memory (bytes by place)") == 3
    assert "zkern: step=" not in caplog.text
    caplog.clear()
    train(zkern.Engine(TinyGPT(), config(steps_per_print=0, wall_clock_breakdown=True, memory_breakdown=True)), 3)
    assert "zkern wall clock" not in caplog.text and "zkern memory" not in caplog.text and "step=" not in caplog.text


def comms_worker(rank: int, world: int) -> dict:
    records = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    logging.getLogger("zkern").addHandler(handler)
    logging.getLogger("zkern").setLevel(logging.INFO)
    engine = zkern.Engine(TinyGPT(), config(comms_logger={"enabled": True}, steps_per_print=3,
                                            zero_optimization={"stage": 2, "reduce_bucket_size": 5000}))
    before = engine.comm_stats()
    train(engine, 3)
    after = engine.comm_stats()
    return {"log": records, "sent": {k: after[k] - before[k] for k in ("reduce_scatter", "all_gather")}}


@pytest.mark.dist
def test_comms_logger_counts_what_comm_stats_counts():
    result = spawn(comms_worker, 2)[0]
    lines = {line.split(":")[1].strip(): line for line in result["log"] if line.startswith("zkern comms:")}
    for kind in ("reduce_scatter", "all_gather"):
        assert f"{result['sent'][kind]} bytes" in lines[kind], (kind, lines)
        assert "algbw" in lines[kind]


def test_flops_profiler_counts_what_torch_counts_and_writes_a_table(tmp_path):
    out = tmp_path / "flops.txt"
    torch.manual_seed(0)
    model = TinyGPT()
    engine = zkern.Engine(model, config(flops_profiler={"enabled": True, "profile_step": 2, "output_file": str(out)},
                                        zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0}))
    train(engine, 3)
    profile = engine.reporter.profile
    with FlopCounterMode(display=False) as counter:
        TinyGPT()(IDX[:, :-1], IDX[:, 1:])
    assert profile["total_flops"] == counter.get_total_flops()
    rows = {r["module"]: r for r in profile["rows"]}
    assert rows["TinyGPT"]["params"] == sum(p.numel() for p in TinyGPT().parameters())  # whole, though at rest
    assert rows["TinyGPT.blocks.0.qkv"]["flops"] == 2 * 2 * 16 * 32 * 96
    text = out.read_text()
    assert "TinyGPT.blocks.0" in text and "FLOPs" in text


def test_fp16_auto_cast_casts_the_inputs():
    seen = []

    class Probe(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x):
            seen.append(x.dtype)
            return self.lin(x).float().sum()

    engine = zkern.Engine(Probe(), {"train_micro_batch_size_per_gpu": 1, "device": "cpu",
                                    "optimizer": {"type": "AdamW"}, "fp16": {"enabled": True, "auto_cast": True}})
    engine(torch.ones(2, 4))
    plain = zkern.Engine(Probe(), {"train_micro_batch_size_per_gpu": 1, "device": "cpu",
                                   "optimizer": {"type": "AdamW"}, "fp16": {"enabled": True}})
    with pytest.raises(RuntimeError):  # without auto_cast the fp32 input meets fp16 weights, as in DeepSpeed
        plain(torch.ones(2, 4))
    assert seen[0] == torch.float16


def tags_worker(rank: int, world: int, root: str, mode: str):
    engine = zkern.Engine(TinyGPT(), config(checkpoint={"tag_validation": mode}))
    train(engine, 1)
    try:
        return engine.save_checkpoint(root, tag=f"from_rank{rank}")
    except zkern.CheckpointError as e:
        return f"error: {e}"


@pytest.mark.dist
def test_tag_validation_fail_refuses_and_warn_saves_under_rank_0s_tag(tmp_path):
    failed = spawn(tags_worker, 2, str(tmp_path / "fail"), "Fail")
    assert all(r.startswith("error:") and "different tags" in r for r in failed)
    warned = spawn(tags_worker, 2, str(tmp_path / "warn"), "Warn")
    assert warned == [str(tmp_path / "warn" / "from_rank0")] * 2
    assert (tmp_path / "warn" / "latest").read_text() == "from_rank0"


def node_local_worker(rank: int, world: int, root: str, load_from: str | None):
    cfg = config(checkpoint={"use_node_local_storage": True}, ranks_per_node=1, zero_optimization={"stage": 3})
    torch.manual_seed(0)
    engine = zkern.Engine(TinyGPT(), cfg)
    if load_from is None:
        train(engine, 2)
        engine.save_checkpoint(os.path.join(root, f"node{rank}"))  # each node's own disk
        return engine.full_state_dict()
    try:
        engine.load_checkpoint(os.path.join(root, load_from.format(rank=rank)))
    except zkern.CheckpointError as e:
        return f"error: {e}"
    return engine.full_state_dict()


@pytest.mark.dist
def test_node_local_storage_writes_each_nodes_files_there_and_resumes_at_the_same_layout(tmp_path):
    saved = spawn(node_local_worker, 2, str(tmp_path), None)
    for rank in (0, 1):
        files = os.listdir(tmp_path / f"node{rank}" / "global_step2")
        assert sorted(files) == sorted(["manifest.json", f"rank{rank:05d}.safetensors"])
    loaded = spawn(node_local_worker, 2, str(tmp_path), "node{rank}")
    for name, value in saved[0].items():
        assert torch.equal(loaded[0][name], value), name
    elsewhere = spawn(node_local_worker, 1, str(tmp_path), "node0")  # one node: rank 1's file is on another disk
    assert elsewhere[0].startswith("error:") and "rank00001.safetensors" in elsewhere[0]


def test_dataloader_drop_last():
    data = torch.utils.data.TensorDataset(torch.arange(7))
    cfg = {"train_micro_batch_size_per_gpu": 2, "device": "cpu", "optimizer": {"type": "AdamW"}}
    _, _, loader, _ = zkern.initialize(model=TinyGPT(), config={**cfg, "dataloader_drop_last": True},
                                       training_data=data)
    assert len(loader) == 3
    _, _, loader, _ = zkern.initialize(model=TinyGPT(), config=cfg, training_data=data)
    assert len(loader) == 4


def bucket_warning_worker(rank: int, world: int, bucket: int) -> list[str]:
    torch.manual_seed(0)
    model = TinyGPT(vocab=67, dim=32, n_layer=2, n_head=2, seq=16)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    cfg = {"train_batch_size": world, "steps_per_print": 0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": bucket}}
    engine = zkern.Engine(model, cfg, model_parameters=[{"params": decay}, {"params": no_decay, "weight_decay": 0.0}])
    lines = engine.runtime.warnings(bucket)
    engine.destroy()
    return lines


def test_stage_2_warns_of_one_bucket_only_when_the_whole_gradient_is_one_bucket_per_group():
    """The small no-decay group (biases, norms) fits one bucket beside a many-bucket decay group: no warning. A bucket
    size over every group's elements: the warning, with the whole gradient's size."""
    small, large = spawn(bucket_warning_worker, 2, 1000)[0], spawn(bucket_warning_worker, 2, 10**8)[0]
    assert small == []
    assert len(large) == 1 and "one gradient bucket per group" in large[0], large
