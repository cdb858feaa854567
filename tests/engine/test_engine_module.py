"""The engine as a torch.nn.Module, zkern.initialize with deepspeed.initialize's signature (with and without
training_data, param groups as model_parameters), a DeepSpeed-style loop against a single-process torch AdamW, and
generation at stage 3 with every unit gathered once.

    python -m pytest tests/engine/test_engine_module.py -q
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zkern
from zkern.testing import TinyGPT
from zkern.testing.compare import assert_params_close
from zkern.testing.ranks import spawn

LR, WD, STEPS, MICRO = 1e-2, 0.1, 6, 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


class AttnNet(nn.Module):
    """torch's own nn.TransformerEncoderLayer: its nn.MultiheadAttention reads out_proj's parameters without running
    out_proj, which zkern must know at stages 2 and 3. No biases: the key projection's bias has a zero gradient in
    exact arithmetic (softmax ignores a constant added to every score), so Adam would follow rounding noise."""

    def __init__(self):
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, bias=False)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.layer(x.view(x.shape[0], 2, 4).repeat(1, 1, 2)).mean(1))


MODELS = {"mlp": Net, "attention": AttnNet}


def data(n: int = 64):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 8, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def groups(model: nn.Module) -> list[dict]:
    """Decay for weights, none for biases and the norm (with its own lr: per-group options reach the optimizer)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    return [{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0, "lr": LR / 2}]


def config(stage: int, small_units: bool = False) -> dict:
    """small_units: buckets of 64 elements and no persistent units, so that every parameter's gradient and gather
    travel on their own schedule (what a read zkern does not know about would break)."""
    zero = {"stage": stage}
    if small_units:
        zero.update(reduce_bucket_size=64, stage3_param_persistence_threshold=0)
    return {"train_micro_batch_size_per_gpu": MICRO, "optimizer": {"type": "AdamW", "params": {"lr": LR}},
            "gradient_clipping": 0.0,  # the reference is torch's AdamW, unclipped (DeepSpeed's default clips at 1)
            "zero_optimization": zero, "device": "cpu"}


def deepspeed_style_worker(rank: int, world: int, stage: int, kind: str) -> dict:
    torch.manual_seed(0)
    model = MODELS[kind]()
    engine, optimizer, loader, scheduler = zkern.initialize(model=model, model_parameters=groups(model),
                                                            config=config(stage, kind == "attention"),
                                                            training_data=data())
    assert isinstance(engine, nn.Module) and engine.module is model and optimizer is engine.optimizer
    assert scheduler is None and len(loader) == len(data()) // (MICRO * world)
    assert [id(p) for p in engine.parameters()] == [id(p) for p in model.parameters()]
    assert [n for n, _ in engine.named_parameters()] == [f"module.{n}" for n, _ in model.named_parameters()]
    assert engine.train() is engine and model.training and not engine.eval().training and not model.training
    engine.train()
    loader.sampler.set_epoch(0)
    for step, (x, y) in enumerate(loader):  # code written for DeepSpeed's engine, unchanged
        if step == STEPS:
            break
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
    return {"state": engine.full_state_dict(), "lrs": [g["lr"] for g in optimizer.param_groups]}


def reference(world: int, kind: str) -> dict:
    """torch AdamW in one process over the global batch the ranks' DistributedSamplers draw each step."""
    torch.manual_seed(0)
    model = MODELS[kind]()
    opt = torch.optim.AdamW([{**g, "lr": g.get("lr", LR)} for g in groups(model)], lr=LR)
    samplers = [torch.utils.data.DistributedSampler(data(), num_replicas=world, rank=r, shuffle=True)
                for r in range(world)]
    orders = [list(s) for s in samplers]
    x_all, y_all = data().tensors
    for step in range(STEPS):
        idx = [i for order in orders for i in order[step * MICRO:(step + 1) * MICRO]]
        loss = nn.functional.cross_entropy(model(x_all[idx]), y_all[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.state_dict().items()}


@pytest.mark.dist
@pytest.mark.parametrize("stage,kind", [(1, "mlp"), (3, "mlp"), (2, "attention"), (3, "attention")])
def test_initialize_with_training_data_trains_as_torch_adamw_on_the_global_batch(stage, kind):
    results = spawn(deepspeed_style_worker, 2, stage, kind, timeout=300)
    want = reference(2, kind)
    for r in results:
        assert_params_close(r["state"], want, lr=LR, steps=STEPS)
        assert r["lrs"] == [LR, LR / 2]


def test_initialize_without_training_data_and_the_module_contract():
    model = Net()
    engine, optimizer, loader, scheduler = zkern.initialize(model, config=config(0))
    assert loader is None and scheduler is None and isinstance(optimizer, torch.optim.Optimizer)
    with pytest.raises(RuntimeError, match="full_state_dict"):
        engine.state_dict()
    with pytest.raises(RuntimeError, match="load_checkpoint"):
        engine.load_state_dict({})
    with pytest.raises(RuntimeError, match="before building the engine"):
        engine.to(torch.float64)
    engine = zkern.Engine(Net(), {**config(0), "gradient_accumulation_steps": 2})
    engine.backward(engine(torch.randn(2, 8)).sum())
    engine.step()
    assert engine.pending_micro_steps == 1 and engine.is_gradient_accumulation_boundary()
    engine.zero_grad()  # mid-accumulation: drops what backward accumulated, as torch's zero_grad does, and the
    # accumulation keeps counting, as DeepSpeed's does: the next micro-step still ends it
    assert engine.pending_micro_steps == 1 and engine.is_gradient_accumulation_boundary()
    assert all(p.grad is None for p in engine.module.parameters())
    client = zkern.initialize(model=Net(), config={"train_batch_size": 2},
                              optimizer=lambda params: torch.optim.SGD(params, lr=0.1))[1]
    assert isinstance(client, torch.optim.SGD)
    with pytest.raises(ValueError, match="model_parameters group 0 sets \\['momentum'\\]"):
        zkern.initialize(model=Net(), config=config(0), model_parameters=[{"params": [], "momentum": 0.9}])
    with pytest.raises(ValueError, match="config="):
        zkern.initialize(model=Net())


def generation_worker(rank: int, world: int) -> dict:
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=3, n_head=2,
                                       bos_token_id=0, eos_token_id=0)).eval()
    prompt = torch.randint(1, 101, (2, 5), generator=torch.Generator().manual_seed(1))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    whole = model.generate(prompt, **kwargs)
    engine = zkern.Engine(model, {"train_batch_size": world, "optimizer": {"type": "AdamW"}, "device": "cpu",
                                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    engine.eval()
    calls = engine.comm_stats()["calls"]["all_gather"]
    per_use = engine.module.generate(prompt, **kwargs)
    per_use_calls = engine.comm_stats()["calls"]["all_gather"] - calls
    with engine.gathered_for_generation():
        entered = engine.comm_stats()["calls"]["all_gather"]
        once = engine.module.generate(prompt, **kwargs)
        inside = engine.comm_stats()["calls"]["all_gather"] - entered
    return {"whole": whole, "per_use": per_use, "once": once, "inside": inside, "per_use_calls": per_use_calls,
            "pinned_calls": entered - calls - per_use_calls, "units": len(engine.runtime.units)}


@pytest.mark.dist
def test_generation_at_stage_3_gathers_each_unit_once_and_matches_the_whole_model():
    for r in spawn(generation_worker, 2, timeout=300):
        assert torch.equal(r["once"], r["whole"]) and torch.equal(r["per_use"], r["whole"])
        assert r["inside"] == 0  # no gather while generating: every unit stayed whole
        assert r["pinned_calls"] <= r["units"]  # entering gathered each unit at most once
        assert r["per_use_calls"] >= 12 * r["units"] / 2  # without it, units are gathered again for every token


def test_the_loader_zkern_made_resumes_at_its_epoch(tmp_path):
    """The DistributedSampler's epoch (set by the loop each epoch) is part of the engine's state: a checkpoint keeps
    it, a load restores it, a module-only load leaves a fresh loader's."""
    cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW"}, "device": "cpu"}
    data = torch.utils.data.TensorDataset(torch.randint(0, 67, (8, 17)))
    engine, _, loader, _ = zkern.initialize(model=TinyGPT(), config=cfg, training_data=data)
    loader.sampler.set_epoch(3)
    engine.save_checkpoint(tmp_path)
    fresh, _, fresh_loader, _ = zkern.initialize(model=TinyGPT(), config=cfg, training_data=data)
    fresh.load_checkpoint(tmp_path)
    assert fresh_loader.sampler.epoch == 3
    other, _, other_loader, _ = zkern.initialize(model=TinyGPT(), config=cfg, training_data=data)
    other.load_checkpoint(tmp_path, load_module_only=True)
    assert other_loader.sampler.epoch == 0
