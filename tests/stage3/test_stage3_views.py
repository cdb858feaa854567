"""Stage 3 with modules whose forward hands out a view of their own parameter: a learned positional embedding's
slice, a CLS token's `expand`, a transpose, a `view`, an `as_strided`, the parameter itself, and a view a module
keeps on itself for its parent to read. Each view outlives the call that made it, so the unit's storage must not be
freed under it (escapes.py); before, the first forward read freed memory (a segmentation fault). Trained against
single-process torch at worlds 1 and 2, with offload_param, qwZ and activation checkpointing.

    python -m pytest tests/stage3/test_stage3_views.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import zkern
from zkern.testing import assert_params_close, spawn

D, T, VOCAB, LR, STEPS = 16, 8, 40, 1e-2, 3


class Hands(nn.Module):
    """One parameter handed out as `kind` of view."""

    def __init__(self, kind: str, shape: tuple[int, ...]):
        super().__init__()
        self.kind = kind
        self.p = nn.Parameter(torch.randn(*shape) * 0.3 + (1.0 if kind == "itself" else 0.0))

    def forward(self, batch: int):
        match self.kind:
            case "slice":  # a learned positional embedding
                return self.p[:, :T]
            case "expand":  # a CLS token
                return self.p.expand(batch, -1, -1)
            case "transpose":
                return self.p.t()
            case "view":
                return self.p.view(D)
            case "as_strided":
                return self.p.as_strided((D,), (2,))
            case "itself":
                return self.p
            case "cached":  # kept on the module for the parent to read
                self.kept = self.p[0, :T]
                return None
        raise ValueError(self.kind)


class ViewNet(nn.Module):
    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.pos = Hands("slice", (1, 2 * T, D))
        self.cls = Hands("expand", (1, 1, D))
        self.mix = Hands("transpose", (D, D))
        self.gain = Hands("view", (1, D))
        self.shift = Hands("as_strided", (2 * D,))
        self.scale = Hands("itself", (D,))
        self.memo = Hands("cached", (1, 2 * T, D))
        self.head = nn.Linear(D, VOCAB)
        self.checkpointed = checkpointed

    def body(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        x = x + self.pos(b) + self.cls(b)
        x = torch.tanh(x @ self.mix(b))
        x = x * self.gain(b) + self.shift(b)
        x = x * self.scale(b)
        self.memo(b)
        return x + self.memo.kept

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        x = checkpoint(self.body, x, use_reentrant=False) if self.checkpointed else self.body(x)
        return self.head(x)


def _batches(world: int):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2 * world, T), generator=g) for _ in range(STEPS)]


def _loss(model, idx):
    return F.cross_entropy(model(idx).float().reshape(-1, VOCAB), idx.reshape(-1))


def _reference(world: int) -> dict:
    torch.manual_seed(0)
    model = ViewNet()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    losses = []
    for idx in _batches(world):
        opt.zero_grad()
        loss = _loss(model, idx)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "losses": losses}


CASES = {
    "plain": ({}, False),
    "checkpointed": ({}, True),
    "params-on-host": ({"offload_param": {"device": "cpu"}}, False),
    "qwz": ({"zero_quantized_weights": True}, False),
}


def _train(rank: int, world: int, cases: list[str]) -> dict:
    out = {}
    for case in cases:
        zero, checkpointed = CASES[case]
        torch.manual_seed(0)
        model = ViewNet(checkpointed)
        engine = zkern.Engine(model, {
            "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "gradient_clipping": 0.0, "device": "cpu",
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}})
        losses = []
        for idx in _batches(world):
            loss = _loss(engine, idx[2 * rank:2 * rank + 2])
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            if world > 1:  # the global batch's loss, as the reference computes it
                torch.distributed.all_reduce(mean)
            losses.append(mean.item() / world)
        with torch.no_grad():  # an evaluation forward reads every view too (gradients off)
            evaluated = _loss(engine, _batches(world)[0][:2]).item()
        out[case] = {"losses": losses, "state": engine.full_state_dict(rank0_only=True), "eval": evaluated}
        engine.destroy()
    return out


def _check(results: list[dict], world: int) -> None:
    ref = _reference(world)
    for case, got in results[0].items():
        if case == "qwz":
            # int8 weights in every gather: the losses follow torch's to the quantization's error, which a view read
            # from freed or zeroed memory would leave far behind
            for mine, theirs in zip(got["losses"], ref["losses"]):
                assert abs(mine - theirs) <= 0.02 * theirs, (case, got["losses"], ref["losses"])
            continue
        assert_params_close(got["state"], ref["state"], lr=LR, steps=STEPS)
        assert torch.isfinite(torch.tensor(got["eval"])), (case, got["eval"])


def test_views_of_parameters_train_as_torch_at_world_1():
    _check(spawn(_train, 1, ["plain", "checkpointed"]), 1)


@pytest.mark.dist
def test_views_of_parameters_train_as_torch_at_world_2():
    _check(spawn(_train, 2, sorted(CASES)), 2)


def test_a_view_kept_past_release_keeps_its_values_and_its_memory_goes_with_it():
    import weakref

    torch.manual_seed(0)
    model = ViewNet()
    engine = zkern.Engine(model, {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "device": "cpu",
                                  "optimizer": {"type": "AdamW", "params": {"lr": LR}},
                                  "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    with torch.no_grad():
        kept = engine.module.pos(2)  # the slice outlives the call, gradients off
        expected = kept.clone()
        second = engine.module.pos(2)  # a second gather of the same unit goes to a fresh storage
        assert second.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()
        storage = weakref.ref(second.untyped_storage())
        del second
        assert storage() is None  # its memory went with its last holder
    assert torch.equal(kept, expected)
    head = engine.runtime.shards.unit_of[id(engine.module.head.weight)]
    engine.module.head(torch.randn(2, D))  # hands out no view of its own: its unit's bytes are freed at rest
    assert head.slot.untyped_storage().nbytes() == 0
    engine.destroy()


def test_a_model_keeping_a_view_of_its_parameter_is_freed_with_its_engine():
    """A module that keeps a view of its parameter on itself (ViewTap's `kept`): the view's gradient hook is held from
    C++, where the collector cannot see it; it held the module (so the model, whose hooks hold the runtime) and the
    runtime, and a dropped engine and model were never freed (the fuzzer's dropped-engine check, 2026-11-28)."""
    import gc
    import weakref

    from zkern.testing.models import ViewTap

    class Keeper(nn.Module):
        def __init__(self):
            super().__init__()
            self.tap, self.lin = ViewTap(16, 8), nn.Linear(8, 8)

        def forward(self, x):
            scale, cls = self.tap(2, 16)
            return (self.lin(x) * scale + cls).sum()

    model = Keeper()
    cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3,
                                                                      "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    engine = zkern.Engine(model, cfg)
    engine.backward(engine(torch.ones(2, 16, 8)))
    engine.step()
    engine(torch.ones(2, 16, 8))  # a forward whose kept view is still on the module when both are dropped
    assert model.tap.kept is not None
    runtime, module = weakref.ref(engine.runtime), weakref.ref(model)
    del engine, model
    gc.collect()
    assert module() is None and runtime() is None
