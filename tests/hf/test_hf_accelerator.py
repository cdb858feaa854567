"""zkern.hf.Accelerator against plain Accelerate (DDP): examples/accelerate_clm.py, an Accelerate+DeepSpeed script of
the shape of accelerate's deepspeed_with_config_support.py, run unchanged but for the import at world 2 on the CPU.

- its logged losses, learning rates and gradient norms equal plain Accelerate's at stages 0-3, with offload, with
  DummyOptim/DummyScheduler and with a torch optimizer and scheduler;
- save_state/load_state resume exactly (the run resumed from a mid-epoch checkpoint logs what the straight run
  logged), and a checkpoint loads on another world size and stage;
- the final save_pretrained folder loads in transformers, in a process that never imports zkern, to the weights
  the checkpoint holds;
- what save_state writes is JSON and safetensors only; registered objects, schedulers, samplers and the random
  generators round-trip; a damaged file is an error;
- the errors Accelerate gives for what may be passed to prepare(), and zkern's for what it refuses.

    python -m pytest tests/hf/test_hf_accelerator.py -q
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch
from accelerate_runs import example_worker, fresh_accelerate, read_log

from zkern.testing.ranks import spawn

AUTO_BATCH = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
# The config's optimizer and scheduler through DummyOptim/DummyScheduler, "auto" filled from them. The schedule is
# constant (the warm-up floor is the peak): DeepSpeed's warm-up (max(2, n) steps, the first at the floor) has no
# transformers counterpart, and Accelerate steps a torch scheduler once per process per step.
DUMMY = {"optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": [0.9, 0.999],
                                                   "eps": 1e-8}},
         "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-3, "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto"}}}
ARGS = ["--num_train_epochs", "2", "--checkpointing_steps", "4", "--lr_scheduler_type", "constant"]
# As tests/hf/test_hf_trainer.py: losses are means over 16 tokens x 2 samples, one step moves them by ~1e-3, and the
# runs differ only in the order of fp32 sums (a few ulps per step): 1e-5 over 12 steps is crossed by any change in the
# arithmetic (another LR, a missed micro-batch, one more clip) and not by rounding. The host Adam (offload) rounds
# differently from torch's AdamW in the last bits of each update, which stays far inside the same bound.
LOSS_ATOL = 1e-5


def config(stage: int, **zero) -> dict:
    if stage == 3:  # the default threshold (1e5 elements) would keep every tensor of this small model whole
        zero = {"stage3_param_persistence_threshold": 0, **zero}
    return {**AUTO_BATCH, **DUMMY, "zero_optimization": {"stage": stage, **zero}}


RUNS = [{"name": "ddp", "config": None, "args": ARGS}]
RUNS += [{"name": f"stage{s}", "config": config(s), "args": ARGS} for s in range(4)]
RUNS += [{"name": "stage3_offload", "config": config(3, offload_optimizer={"device": "cpu"}), "args": ARGS},
         # no optimizer or scheduler section: the script's torch AdamW and transformers scheduler, Accelerate
         # stepping the scheduler
         {"name": "stage2_torch", "config": {**AUTO_BATCH, "zero_optimization": {"stage": 2}}, "args": ARGS},
         {"name": "stage3_bf16", "config": {**config(3), "bf16": {"enabled": True}}, "args": ARGS}]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("accelerate"))
    # One job per run: the script ends with accelerator.end_training(), which destroys the process group, as a
    # script's last line may.
    results = [{}, {}]
    for run in RUNS:
        for rank, result in enumerate(spawn(example_worker, 2, root, [run], timeout=600)):
            results[rank].update(result)
    return root, results


def assert_logs_match(got: list[dict], want: list[dict], what: str, atol: float = LOSS_ATOL) -> None:
    assert len(got) == len(want) == 24, (what, len(got), len(want))  # 12 steps x 2 micro-batches
    for g, w in zip(got, want):
        assert (g["step"], g["sync"]) == (w["step"], w["sync"]), (what, g, w)
        assert abs(g["loss"] - w["loss"]) <= atol, (what, g, w)
        assert math.isclose(g["lr"], w["lr"], rel_tol=1e-12), (what, g, w)
        if w["grad_norm"] is not None:
            assert math.isclose(g["grad_norm"], w["grad_norm"], rel_tol=1e-4), (what, g, w)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", ["stage0", "stage1", "stage2", "stage3", "stage3_offload", "stage2_torch"])
def test_the_script_logs_what_plain_accelerate_logs(trained, name):
    root, results = trained
    want = read_log(os.path.join(root, "ddp.jsonl"))
    assert want[-1]["loss"] < want[0]["loss"] and want[-1]["step"] == 12
    assert_logs_match(read_log(os.path.join(root, f"{name}.jsonl")), want, name)
    # the script's own check passed on every rank: the best checkpoint reloaded to the same perplexity
    assert results[0][name]["perplexity"] == results[1][name]["perplexity"]
    assert results[0][name]["completed_steps"] == 12


@pytest.mark.dist
@pytest.mark.slow
def test_bf16_trains_and_saves_bf16_weights(trained):
    root, _ = trained
    log = read_log(os.path.join(root, "stage3_bf16.jsonl"))
    want = read_log(os.path.join(root, "ddp.jsonl"))
    # bf16 weights and activations: each loss within bf16's resolution of the fp32 run's (2^-8 relative, a few
    # roundings deep), not equal to it
    for g, w in zip(log, want):
        assert abs(g["loss"] - w["loss"]) <= 0.05 * w["loss"], (g, w)
    from safetensors.torch import load_file

    saved = load_file(os.path.join(root, "stage3_bf16", "final", "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}


def _load_with_transformers_only(folder: str, out: str) -> dict:
    """from_pretrained in a fresh interpreter that never imports zkern; its state dict written to `out`."""
    code = (
        "import sys, json\n"
        "from transformers import GPT2LMHeadModel\n"
        "from safetensors.torch import save_file\n"
        f"model, info = GPT2LMHeadModel.from_pretrained({folder!r}, output_loading_info=True)\n"
        "assert not any(m.startswith('zkern') for m in sys.modules), 'zkern was imported'\n"
        "state = {k: v.contiguous() for k, v in model.state_dict().items() if k != 'lm_head.weight'}\n"
        f"save_file(state, {out!r})\n"
        "print(json.dumps({k: sorted(v) if isinstance(v, (list, set)) else str(v) for k, v in info.items()}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=os.path.dirname(out))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", ["stage1", "stage3", "stage3_bf16"])
def test_the_saved_folder_loads_in_transformers_to_the_checkpoint_weights(trained, name):
    """The script reloads its best checkpoint and then saves with save_pretrained(state_dict=get_state_dict(...)):
    the folder must hold exactly the checkpoint's weights (read by zkern's own consolidation, cast to the saved
    dtype as the engine's working copy is)."""
    from safetensors.torch import load_file

    from zkern.checkpoint import load_fp32_state_dict

    root, _ = trained
    out = os.path.join(root, f"{name}_reloaded.safetensors")
    info = _load_with_transformers_only(os.path.join(root, name, "final"), out)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    loaded = load_file(out)
    reference = load_fp32_state_dict(os.path.join(root, name, "best_checkpoint"))
    dtype = torch.bfloat16 if name.endswith("bf16") else torch.float32
    assert set(loaded) <= set(reference)
    for key, value in loaded.items():
        if key.endswith(".attn.bias") or key.endswith("masked_bias"):
            continue  # buffers transformers rebuilds
        torch.testing.assert_close(value.to(dtype), reference[key].to(dtype), rtol=0, atol=0, msg=key)


def _resume_worker(rank: int, world: int, root: str, name: str, run_config: dict, checkpoint: str) -> dict:
    out = os.path.join(root, f"{name}_resumed")
    argv = ["--output_dir", out, "--log_file", os.path.join(root, f"{name}_resumed.jsonl"), *ARGS,
            "--resume_from_checkpoint", checkpoint]
    from accelerate_runs import run_example

    path = os.path.join(root, f"{name}_resumed.rank{rank}.json")
    with open(path, "w") as f:
        json.dump(run_config, f)
    return run_example(argv, path)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("name", ["stage3", "stage3_offload", "stage1"])
def test_load_state_resumes_exactly(trained, name):
    """A new job resumes from step_4 (mid-epoch: load_state, then skip_first_batches) and logs, micro-step by
    micro-step, what the uninterrupted job logged: weights, moments, schedule, data position and dropout masks."""
    root, results = trained
    run = next(r for r in RUNS if r["name"] == name)
    checkpoint = os.path.join(root, name, "step_4")
    resumed = spawn(_resume_worker, 2, root, name, run["config"], checkpoint, timeout=600)
    straight = read_log(os.path.join(root, f"{name}.jsonl"))
    again = read_log(os.path.join(root, f"{name}_resumed.jsonl"))
    first = next(i for i, e in enumerate(straight) if e["step"] == 4 and not e["sync"])
    assert len(again) == len(straight) - first
    for g, w in zip(again, straight[first:]):
        assert g == w, (g, w)
    assert resumed[0]["perplexity"] == results[0][name]["perplexity"]


def _cross_layout_worker(rank: int, world: int, checkpoint: str, saved_config: dict) -> dict:
    """Prepare the example's model on another world size and stage, load_state, and report what was restored."""
    from accelerate.utils import DummyOptim, DummyScheduler
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator

    from zkern.hf import Accelerator

    fresh_accelerate()
    torch.manual_seed(123)  # other initial weights than the saved run's
    model = GPT2LMHeadModel(GPT2Config(vocab_size=67, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    loader = DataLoader([{"input_ids": torch.arange(16), "labels": torch.arange(16)}] * 8, batch_size=2,
                        collate_fn=default_data_collator)
    acc = Accelerator(zkern_config={**saved_config, "zero_optimization": {"stage": 1}}, gradient_accumulation_steps=2)
    no_decay = ["bias", "ln_"]  # the example's two groups: the optimizer state loads group by group
    groups = [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)]},
              {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
               "weight_decay": 0.0}]
    optimizer = DummyOptim(groups, lr=1e-3)
    model, optimizer, loader, _, scheduler = acc.prepare(model, optimizer, loader, DataLoader(loader.dataset),
                                                         DummyScheduler(optimizer))  # the example's two loaders
    acc.load_state(checkpoint)
    return {"weights": acc.engine.full_state_dict(), "global_steps": acc.engine.global_steps, "step": acc.step,
            "lr": scheduler.get_last_lr()}


@pytest.mark.slow
def test_a_checkpoint_loads_on_another_world_size_and_stage(trained):
    from zkern.checkpoint import load_fp32_state_dict

    root, _ = trained
    checkpoint = os.path.join(root, "stage3", "step_8")
    saved = load_fp32_state_dict(checkpoint)
    got = spawn(_cross_layout_worker, 1, checkpoint, config(3))[0]
    # 8 optimizer steps; Accelerate's micro-step counter restarts each epoch (6 steps of 2), so 4 micro-batches in
    assert got["global_steps"] == 8 and got["step"] == 4
    assert got["lr"] == [1e-3, 1e-3]
    for key, value in got["weights"].items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0, msg=key)


def _sharded_worker(rank: int, world: int, folder: str) -> dict:
    """Under a stage-3 Accelerator: zkern.hf.from_pretrained (no config: the Accelerator's) and a model built in
    accelerator.init_sharded() come partitioned; prepare() takes them; get_state_dict gathers onto rank 0."""
    from accelerate.utils import DummyOptim, DummyScheduler
    from torch.utils.data import DataLoader
    from transformers import GPT2LMHeadModel, default_data_collator

    import zkern.hf
    from zkern.hf import Accelerator
    from zkern.stage3.sharded_init import is_sharded

    fresh_accelerate()
    acc = Accelerator(zkern_config=config(3), gradient_accumulation_steps=1)
    model = zkern.hf.from_pretrained(GPT2LMHeadModel, folder)
    with acc.init_sharded():
        built = GPT2LMHeadModel(model.config)
    partitioned = [all(is_sharded(p) for p in m.parameters()) for m in (model, built)]
    loader = DataLoader([{"input_ids": torch.arange(16), "labels": torch.arange(16)}] * 4, batch_size=2,
                        collate_fn=default_data_collator)
    optimizer = DummyOptim(model.parameters(), lr=1e-3)
    model, optimizer, loader, _ = acc.prepare(model, optimizer, loader, DummyScheduler(optimizer))
    weights = acc.get_state_dict(model)
    acc.end_training()
    return {"partitioned": partitioned, "weights": weights}


@pytest.mark.dist
@pytest.mark.slow
def test_from_pretrained_and_init_sharded_follow_the_accelerators_config(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    reference = GPT2LMHeadModel(GPT2Config(vocab_size=67, n_positions=16, n_embd=32, n_layer=2, n_head=2))
    reference.save_pretrained(tmp_path)
    got = spawn(_sharded_worker, 2, str(tmp_path), timeout=300)
    assert [r["partitioned"] for r in got] == [[True, True], [True, True]]
    assert got[1]["weights"] == {}  # the main process alone holds the gathered weights
    want = reference.state_dict()
    assert sorted(got[0]["weights"]) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[0]["weights"][key], value, rtol=0, atol=0, msg=key)


@pytest.mark.dist
@pytest.mark.slow
def test_save_state_writes_no_pickle(trained):
    root, _ = trained
    for name in ("stage3", "stage2_torch"):
        for folder, _, files in os.walk(os.path.join(root, name, "step_4")):
            for f in files:
                assert not f.endswith((".pkl", ".bin", ".pt")), os.path.join(folder, f)


# -- in this process, world size 1 ----------------------------------------------------------------------------------
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")


@pytest.fixture
def solo():
    """A clean Accelerate state before, and after (the Accelerator leaves a one-process group and its state)."""
    fresh_accelerate()
    yield
    fresh_accelerate()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
        self.config = types.SimpleNamespace(hidden_size=8)  # what the "auto" bucket sizes are derived from

    def forward(self, x, y):
        x = x.to(self.a.weight.dtype)  # float inputs in the training dtype (fp16 templates), as a script casts them
        return torch.nn.functional.mse_loss(self.b(torch.tanh(self.a(x))).float(), y)


def batches(n: int = 8, size: int = 2) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(6, generator=g), torch.randn(3, generator=g)) for _ in range(n)]
    return torch.utils.data.DataLoader(data, batch_size=size)


class Counter:
    """An object registered for checkpointing whose state has what JSON alone would lose."""

    def __init__(self):
        self.state = {"seen": 0, "ema": torch.zeros(3), "pair": (1, 2.5), 7: "int key", "odd": float("nan"),
                      "nested": [{"t": torch.arange(4, dtype=torch.int16)}]}

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.state = state


def stage_config(stage: int, **extra) -> dict:
    return {**AUTO_BATCH, "zero_optimization": {"stage": stage}, **extra}


def prepared(config: dict, accumulation: int = 2):
    from zkern.hf import Accelerator

    torch.manual_seed(0)
    acc = Accelerator(zkern_config=config, gradient_accumulation_steps=accumulation)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    return (acc, *acc.prepare(model, optimizer, batches(), scheduler))


def train(acc, model, optimizer, loader, scheduler, micro_steps: int) -> None:
    it = iter(loader)
    for _ in range(micro_steps):
        x, y = next(it)
        with acc.accumulate(model):
            acc.backward(model(x, y))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def test_save_state_round_trips_what_accelerate_saves_without_pickle(solo, tmp_path):
    acc, model, optimizer, loader, scheduler = prepared(stage_config(1))
    counter = Counter()
    acc.register_for_checkpointing(counter)
    train(acc, model, optimizer, loader, scheduler, 4)
    acc.save_state(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["accelerate_state.safetensors", "latest", "pytorch_model"]
    after_save = torch.rand(4)  # what the generators draw next
    saved_lr, saved_weights = scheduler.get_last_lr(), acc.engine.full_state_dict()
    saved_counter = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in counter.state.items()}
    counter.state = {"seen": 99}
    train(acc, model, optimizer, loader, scheduler, 4)
    assert scheduler.get_last_lr() != saved_lr
    acc.load_state(str(tmp_path))
    torch.testing.assert_close(torch.rand(4), after_save, rtol=0, atol=0)
    assert scheduler.get_last_lr() == saved_lr and acc.step == 0 and acc.engine.global_steps == 2
    for key, value in acc.engine.full_state_dict().items():
        torch.testing.assert_close(value, saved_weights[key], rtol=0, atol=0)
    got = counter.state
    assert set(got) == set(saved_counter) and got["pair"] == (1, 2.5) and got[7] == "int key"
    assert math.isnan(got["odd"]) and got["seen"] == 0
    torch.testing.assert_close(got["ema"], saved_counter["ema"], rtol=0, atol=0)
    assert got["nested"][0]["t"].dtype == torch.int16


def test_a_save_that_kept_its_own_copy_of_the_generators_is_read_as_it_was_written(solo, tmp_path):
    """Saves before 2026-11-27 kept every process's generators in Accelerate's entry as well as in the engine's
    record; where that copy is there, it is the one applied (today's saves keep only the engine's)."""
    from zkern.checkpoint.manifest import manifest_bytes
    from zkern.core.generators import rng_state

    acc, model, optimizer, loader, scheduler = prepared(stage_config(1))
    train(acc, model, optimizer, loader, scheduler, 2)
    acc.save_state(str(tmp_path))
    path = tmp_path / "pytorch_model" / "manifest.json"
    outer = json.loads(path.read_text())
    assert "rng" not in outer["manifest"]["client_state"]["zkern.hf.Accelerator"]  # one record: the engine's
    torch.manual_seed(1234)
    outer["manifest"]["client_state"]["zkern.hf.Accelerator"]["rng"] = [rng_state()]
    expected = torch.rand(4)
    path.write_bytes(manifest_bytes(outer["manifest"]))
    train(acc, model, optimizer, loader, scheduler, 2)
    acc.load_state(str(tmp_path))
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)


def test_a_damaged_or_foreign_accelerate_state_is_an_error(solo, tmp_path):
    from zkern.errors import CheckpointError

    acc, model, optimizer, loader, scheduler = prepared(stage_config(0))
    acc.register_for_checkpointing(Counter())
    train(acc, model, optimizer, loader, scheduler, 2)
    acc.save_state(str(tmp_path / "a"))
    with open(tmp_path / "a" / "accelerate_state.safetensors", "r+b") as f:
        f.seek(-2, os.SEEK_END)
        f.write(b"\x00\x01")
    with pytest.raises(CheckpointError, match="does not match the digest"):
        acc.load_state(str(tmp_path / "a"))
    acc.register_for_checkpointing(Counter())  # now two objects; the checkpoint has one
    acc.save_state(str(tmp_path / "b"))
    acc._custom_objects.pop()
    with pytest.raises(CheckpointError, match="2 objects registered for checkpointing, this run has 1"):
        acc.load_state(str(tmp_path / "b"))
    with pytest.raises(FileNotFoundError, match="holds no zkern checkpoint"):
        acc.load_state(str(tmp_path))


FP16 = {"enabled": True, "auto_cast": True, "initial_scale_power": 8}  # 2^8: this model's gradients fit in fp16


def test_a_skipped_step_is_seen_by_the_scheduler_accelerate_steps(solo):
    """fp16 overflow: the engine skips the step, optimizer.step_was_skipped says so, and Accelerate's scheduler
    wrapper does not step the torch scheduler (as under DeepSpeed)."""
    acc, model, optimizer, loader, scheduler = prepared(stage_config(2, fp16=FP16), accumulation=1)
    x, y = next(iter(loader))
    with acc.accumulate(model):
        acc.backward(model(x, y) * float("inf"))
        optimizer.step()
        scheduler.step()
    assert optimizer.step_was_skipped and acc.engine.skipped_steps == 1
    assert scheduler.scheduler.last_epoch == 0
    with acc.accumulate(model):
        acc.backward(model(x, y))
        scheduler.step()
    assert not optimizer.step_was_skipped and scheduler.scheduler.last_epoch == 1


@pytest.mark.parametrize("template", ["zero_stage2_config.json", "zero_stage2_offload_config.json",
                                      "zero_stage3_offload_config.json",
                                      "../ds_configs/accelerate_zero3_template.json"])
def test_accelerates_own_templates_train_with_dummy_optimizer_and_scheduler(solo, template, tmp_path):
    from accelerate.utils import DummyOptim, DummyScheduler

    from zkern.hf import Accelerator

    acc = Accelerator(zkern_config=os.path.join(DATA, "accelerate_templates", template), gradient_accumulation_steps=1)
    torch.manual_seed(0)
    model = Net()
    optimizer = DummyOptim(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = DummyScheduler(optimizer, total_num_steps=4, warmup_num_steps=2)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, batches(), scheduler)
    before = {k: v.clone() for k, v in acc.engine.full_state_dict().items()}
    for x, y in loader:
        with acc.accumulate(model):
            acc.backward(model(x, y))
            optimizer.step()
            scheduler.step()
    assert acc.engine.global_steps + acc.engine.skipped_steps == 4
    assert any(not torch.equal(v, before[k]) for k, v in acc.engine.full_state_dict().items())
    config = acc.engine.config
    assert config.optimizer.params["lr"] == 1e-2 and config.train_micro_batch_size_per_gpu == 2
    assert config.gradient_clipping == 1.0 and config.scheduler.params["warmup_num_steps"] == 2
    if config.scheduler.type == "WarmupDecayLR":
        assert config.scheduler.params["total_num_steps"] == 4  # DummyScheduler's total over 1 process
    # Accelerate's templates turn fp16 on; the stage-3 one leaves it "auto", filled from mixed_precision ("no")
    assert acc.mixed_precision == ("no" if "ds_configs" in template else "fp16")
    assert acc.get_state_dict(model) is not None  # the leftover "auto" gather flag: zkern gathers


def test_prepare_refuses_what_accelerate_refuses(solo):
    from accelerate.utils import DummyOptim, DummyScheduler

    from zkern.hf import Accelerator

    def fresh(config):
        fresh_accelerate()
        return Accelerator(zkern_config=config)

    model = Net()
    with_optimizer = {**stage_config(1), **DUMMY}
    with pytest.raises(ValueError, match="'optimizer' section and the script passes an optimizer"):
        fresh(with_optimizer).prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), batches())
    with pytest.raises(ValueError, match="the config has no 'optimizer'"):
        fresh(stage_config(1)).prepare(model, DummyOptim(model.parameters()), batches())
    elsewhere = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(Net().parameters(), lr=1), 1)
    with pytest.raises(ValueError, match="must be a DummyScheduler"):
        fresh({**stage_config(1), "optimizer": DUMMY["optimizer"]}).prepare(model, DummyOptim(model.parameters()),
                                                                           batches(), elsewhere)
    with pytest.raises(ValueError, match="train_micro_batch_size_per_gpu is \"auto\""):
        fresh(with_optimizer).prepare(model, DummyOptim(model.parameters()), DummyScheduler(None))
    with pytest.raises(ValueError, match="same prepare"):
        fresh(with_optimizer).prepare(DummyOptim(model.parameters()))
    with pytest.raises(ValueError, match="no optimizer"):
        fresh(stage_config(1)).prepare(model, batches())


def test_the_accelerator_needs_one_config_and_keeps_accelerates_precision_rules(solo):
    from accelerate.utils import DeepSpeedPlugin

    from zkern.hf import Accelerator

    with pytest.raises(TypeError, match="needs zkern_config"):
        Accelerator()
    fresh_accelerate()
    plugin = DeepSpeedPlugin(hf_ds_config=stage_config(2), zero3_init_flag=False)
    with pytest.raises(TypeError, match="both given"):
        Accelerator(zkern_config=stage_config(2), deepspeed_plugin=plugin)
    fresh_accelerate()
    with pytest.raises(ValueError, match="cannot be set to `fp16` when `bf16` is set"):
        Accelerator(zkern_config={**stage_config(2), "bf16": {"enabled": True}}, mixed_precision="fp16")
    fresh_accelerate()
    acc = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    assert acc.distributed_type.value == "DEEPSPEED" and acc.mixed_precision == "bf16"
    assert acc.state.deepspeed_plugin.deepspeed_config["bf16"]["enabled"] is True
    model = Net()
    model, optimizer, loader = acc.prepare(model, torch.optim.AdamW(model.parameters()), batches())
    assert acc.engine.dtype == torch.bfloat16 and acc.engine.config.zero_optimization.stage == 2


def test_get_state_dict_at_stage_3_refuses_when_the_config_says_so(solo):
    from accelerate.utils import DummyOptim

    from zkern.hf import Accelerator

    config = {**stage_config(3, **{}), **{"optimizer": DUMMY["optimizer"]}}
    config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = False
    acc = Accelerator(zkern_config=config)
    model = Net()
    model, optimizer, loader = acc.prepare(model, DummyOptim(model.parameters()), batches())
    with pytest.raises(ValueError, match="stage3_gather_16bit_weights_on_model_save is false"):
        acc.get_state_dict(model)


class NoisyNet(Net):
    """Draws from the global generator in its forward (dropout), as the script below does before it (label noise)."""

    def forward(self, x, y):
        x = x.to(self.a.weight.dtype)
        h = torch.nn.functional.dropout(torch.tanh(self.a(x)), 0.5, training=True)
        return torch.nn.functional.mse_loss(self.b(h).float(), y)


def _noisy_run(config: dict, micro_steps: int, save_at: int | None = None, resume_from: str | None = None,
               save_dir: str | None = None) -> list[float]:
    """Micro-steps of a loop that draws label noise before each forward; saves after micro-step save_at, or resumes
    from resume_from mid-epoch (load_state, then skip_first_batches). Returns each micro-step's loss."""
    from zkern.hf import Accelerator

    fresh_accelerate()
    torch.manual_seed(0)
    acc = Accelerator(zkern_config=config, gradient_accumulation_steps=2)
    net = NoisyNet()
    model, optimizer, loader = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-2), batches(12))
    done = 0
    if resume_from is not None:
        acc.load_state(resume_from)
        done = save_at
        loader = acc.skip_first_batches(loader, save_at)
    losses = []
    for x, y in loader:
        if done == micro_steps:
            break
        y = y + 0.1 * torch.randn_like(y)  # a draw between load_state and the forward
        with acc.accumulate(model):
            loss = model(x, y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(float(loss))
        done += 1
        if resume_from is None and done == save_at:
            acc.save_state(save_dir)
    return losses


def test_load_state_restores_the_generators_once_and_a_resumed_loop_draws_what_the_saving_one_did(solo, tmp_path):
    # load_state restored the generators, and the engine's next forward restored them again, undoing what the
    # script drew in between (here label noise): every loss after a resume differed from the run that saved
    config = stage_config(2)
    straight = _noisy_run(config, 8, save_at=4, save_dir=str(tmp_path))
    resumed = _noisy_run(config, 8, save_at=4, resume_from=str(tmp_path))
    assert resumed == straight[4:], (resumed, straight[4:])


def _damaged_rng_worker(rank: int, world: int, root: str) -> dict:
    import json

    from zkern.checkpoint.manifest import manifest_bytes
    from zkern.errors import CheckpointError

    fresh_accelerate()
    acc, model, optimizer, loader, scheduler = prepared(stage_config(2))
    train(acc, model, optimizer, loader, scheduler, 2)
    acc.save_state(root)
    if rank == 0:  # rank 1's generator entry damaged, the manifest signed again: the lie is in the content
        path = os.path.join(root, "pytorch_model", "manifest.json")
        with open(path) as f:
            outer = json.load(f)
        outer["manifest"]["rank_state"]["rank1"]["generators"]["cpu"] = "not base64 at all!"
        with open(path, "wb") as f:
            f.write(manifest_bytes(outer["manifest"]))
    torch.distributed.barrier()
    train(acc, model, optimizer, loader, scheduler, 2)
    before, lr = acc.engine.full_state_dict(), scheduler.get_last_lr()
    try:
        acc.load_state(root)
        error = None
    except CheckpointError as e:
        error = str(e)
    after = acc.engine.full_state_dict()
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "lr_unchanged": scheduler.get_last_lr() == lr}


@pytest.mark.dist
def test_a_damaged_accelerate_entry_on_one_rank_fails_every_rank_before_anything_changes(tmp_path):
    for rank, r in enumerate(spawn(_damaged_rng_worker, 2, str(tmp_path), timeout=300)):
        assert r["error"] is not None and "process 1's random generators" in r["error"], (rank, r["error"])
        assert r["unchanged"] and r["lr_unchanged"], rank
