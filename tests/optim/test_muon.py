"""Muon ("optimizer": {"type": "Muon"}, DeepSpeed's MuonWithAuxAdam) on every stage, sharded and offloaded, against
torch.optim.Muon for the hidden matrices with torch.optim.AdamW for the rest, in one process.

    python -m pytest tests/optim/test_muon.py -q

At world 1 the gradients are torch's to the bit, so zkern's "standard" Newton-Schulz (torch's bf16 iteration) must
give torch's weights to the bit. Across ranks the gradients are summed in another order, and one flipped bf16
rounding inside the iteration moves an output element by about a bf16 unit of the whole update, so the sharded runs
use "gram" (fp32 on a CPU: 1e-6 of the exact iteration) against torch.optim.Muon whose iteration is made exact
(fp64): what is left is fp32 rounding, held to zkern's equivalence bar (compare_params), which a dropped assembly
(each rank orthogonalizing its own piece), a missing sqrt(rows/cols) or a momentum without Nesterov all fail by
orders of magnitude.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch
from checkpoint_runs import assert_same_state, spec_for, topology_source, topology_target, with_stage
from muon_runs import ADAM_LR, MUON_LR, muon_spec, reference

import zkern
from zkern.checkpoint import load_optimizer_state_dict
from zkern.testing import TrainSpec, assert_params_close, engine_run, global_batch, spawn


def runs(rank: int, world: int, specs: list[TrainSpec]) -> list[dict]:
    return [engine_run(rank, world, s) for s in specs]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_muon_at_world_1_gives_torch_muons_weights_bit_for_bit(stage):
    spec = muon_spec(stage, "standard")
    got = engine_run(0, 1, spec)["state"]
    expected = reference(spec, 1, exact=False)
    for name, e in expected.items():
        assert torch.equal(got[name], e), f"stage {stage}: {name} differs from torch.optim.Muon + AdamW"


SHARDED = [(2, 1, {}), (2, 2, {}), (2, 3, {}), (2, 2, {"offload_optimizer": {"device": "cpu"}}),
           (2, 3, {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
           (3, 3, {}), (4, 1, {})]


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3, 4])
def test_muon_on_sharded_states_equals_one_process(world):
    """Accumulation and clipping at stages 1-3, both offloads at world 2, an odd world at stage 3 (every matrix split
    over ranks), world 4 at stage 1."""
    cases = [(stage, zero) for w, stage, zero in SHARDED if w == world]
    specs = [muon_spec(stage, accumulation=2, clip=0.5, zero=zero) for stage, zero in cases]
    per_rank = spawn(runs, world, specs, timeout=900)
    for (stage, zero), spec, result in zip(cases, specs, per_rank[0]):
        what = f"world {world} stage {stage} {zero}"
        assert result["skipped"] == 0, what
        try:
            assert_params_close(result["state"], reference(spec, world, exact=True), lr=MUON_LR, steps=spec.steps)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None


@pytest.mark.dist
def test_muon_with_partial_offload_trains_as_plain_muon():
    """offload_optimizer.ratio < 1: a Muon matrix's pieces may lie on both sides of the split (momentum and master on
    the device for some, on the host for others); each piece steps where it lies and the matrices are put together
    as ever. On a CPU both sides are one memory, so the run equals plain Muon's bit for bit (world 2, stages 1-3,
    accumulation and clipping)."""
    cases = [(stage, ratio) for stage in (1, 2, 3) for ratio in (None, 0.3, 0.7)]
    specs = [muon_spec(stage, accumulation=2, clip=0.5,
                       zero={} if ratio is None else {"offload_optimizer": {"device": "cpu", "ratio": ratio}})
             for stage, ratio in cases]
    results = spawn(runs, 2, specs, timeout=900)[0]
    plain = {stage: r for (stage, ratio), r in zip(cases, results) if ratio is None}
    for (stage, ratio), r in zip(cases, results):
        if ratio is None:
            continue
        assert r["losses"] == plain[stage]["losses"], f"stage {stage} ratio {ratio}"
        for key, value in plain[stage]["state"].items():
            assert torch.equal(r["state"][key], value), f"stage {stage} ratio {ratio}: {key}"


@pytest.mark.dist
def test_muon_with_zeropp_trains_as_plain_muon():
    """Muon over ZeRO++ at world 2: qgZ's int4 gradients (stage 2), qwZ's int8 weight gathers (stage 3) and both.
    Newton-Schulz orthogonalizes the quantized momentum, so the weights part from plain Muon's (by design), but each
    step's loss stays within 1% of plain Muon's (measured 2026-11-28 over 8 steps: at most 0.25% with qgZ, 0.02% with
    qwZ). The fuzzer holds fp32 Muon with qwZ and hpZ to the reference that redoes the int8 gathers
    (zkern/verify/draws.py); qgZ it does not draw with Muon (its fp32 reference's bound is Adam's)."""
    base = replace(muon_spec(2), steps=8)
    zeropp = [(2, {"zero_quantized_gradients": True}), (3, {"zero_quantized_weights": True}),
              (3, {"zero_quantized_weights": True, "zero_quantized_gradients": True})]
    specs = [base] + [replace(muon_spec(stage, zero=zero), steps=8) for stage, zero in zeropp]
    per_rank = spawn(runs, 2, specs, timeout=900)
    losses = [[(a + b) / 2 for a, b in zip(r0["losses"], r1["losses"])] for r0, r1 in zip(*per_rank)]
    assert losses[0][-1] < losses[0][0]
    for (stage, zero), got, result in zip(zeropp, losses[1:], per_rank[0][1:]):
        gap = max(abs(a - b) / b for a, b in zip(got, losses[0]))
        assert gap < 0.01, f"stage {stage} {zero}: a loss {gap:.2%} from plain Muon's"
        moved = max(float((result["state"][k] - v).abs().max()) for k, v in per_rank[0][0]["state"].items())
        assert moved > 0, f"stage {stage} {zero}: the weights equal plain Muon's (nothing was quantized)"


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_each_spanning_matrix_is_orthogonalized_once_by_its_owner(world):
    """Stage 0 holds every matrix whole: no traffic for Muon, and every rank orthogonalizes every matrix (as torch's
    Muon under DDP). Stage 3 cuts units over the ranks, so most matrices span ranks: each is orthogonalized exactly
    once, by one rank holding a piece of it (its owner, the same on every rank), each matrix held whole by the rank
    that holds it; the step's Muon traffic is two all-to-alls (the pieces to their owners, the results back), in
    which a rank sends the elements of its pieces that others own and its owned matrices' slices that others hold,
    each once, and nothing more."""
    per_rank = spawn(_spanning, world, timeout=300)
    stage0 = [r[0] for r in per_rank]
    stage3 = [r[1] for r in per_rank]
    for r in stage0:
        assert (r["calls"], r["bytes"]) == (0, 0) and sorted(r["orthogonalized"]) == sorted(r["owners"])
    owners = stage3[0]["owners"]
    assert all(r["owners"] == owners for r in stage3)  # one plan on every rank
    done = [j for r in stage3 for j in r["orthogonalized"]]
    assert sorted(done) == sorted(owners)  # each matrix once over the ranks
    assert sum(o is not None for o in owners.values()) > 1 and stage3[0]["spanning"] > 0
    for rank, r in enumerate(stage3):
        for j in r["orthogonalized"]:  # by its owner, or by the one rank holding it whole
            assert owners[j] in (rank, None) and (owners[j] == rank or r["whole"][j])
        assert r["calls"] == 2  # one bucket: out to the owners and back
        to_owners, back = r["assembly"]
        assert r["bytes"] == 4 * (to_owners + back)  # "gram" on a CPU: results in fp32
    sent = sum(r["assembly"][0] for r in stage3)
    assert sent == sum(r["assembly"][1] for r in stage3)  # every element out comes back
    assert 0 < sent < stage3[0]["spanning"]  # an owner's own pieces stay where they are


def _spanning(rank: int, world: int) -> list[dict]:
    out = []
    for stage in (0, 3):
        spec = muon_spec(stage)
        engine = spec.build_engine(spec.make_model(), world)
        optimizer = engine.optimizer
        done = []
        orthogonalized = optimizer._orthogonalized

        def counted(m, whole, orthogonalized=orthogonalized, done=done):
            done.append(m.index)
            return orthogonalized(m, whole)

        optimizer._orthogonalized = counted
        idx, tgt = global_batch(spec.batches(world), 0)
        before = engine.comm_stats()
        loss = engine(idx[rank::world], tgt[rank::world])
        engine.backward(loss)
        engine.step()
        after = engine.comm_stats()
        whole = {j: bool(m.pieces) and sum(n for *_, n in m.pieces) == m.numel
                 for j, m in optimizer._matrices.items()}
        out.append({"spanning": optimizer.spanning_numel(), "owners": optimizer.owners(), "orthogonalized": done,
                    "assembly": optimizer.assembly_numel(), "whole": whole,
                    "calls": after["calls"].get("muon", 0) - before["calls"].get("muon", 0),
                    "bytes": after.get("muon", 0) - before.get("muon", 0)})
        engine.destroy()
    return out


@pytest.mark.dist
def test_muon_checkpoint_resumes_at_other_worlds_and_stages(tmp_path):
    """Saved at world 2 stage 3, loaded at world 1 stage 1 and world 4 stage 2 with offload: the momentum buffers and
    AdamW moments come back whole and exact, and training goes on as the run that saved."""
    source = spec_for(2, stage=3, extra_config=muon_spec(3).extra_config)
    src = spawn(topology_source, 2, source, str(tmp_path / "src"))[0]
    saved = load_optimizer_state_dict(tmp_path / "src")
    assert set(saved["blocks.0.fc.weight"]) == {"momentum_buffer"}
    assert set(saved["blocks.0.fc.bias"]) == {"exp_avg", "exp_avg_sq", "step"}
    for name, (world, stage, zero) in {"w1_stage1": (1, 1, {}),
                                       "w4_stage2_offload": (4, 2, {"offload_optimizer": {"device": "cpu"}})}.items():
        out = spawn(topology_target, world, with_stage(source, world, stage, **zero), str(tmp_path / "src"),
                    str(tmp_path / name))[0]
        assert_same_state(load_optimizer_state_dict(tmp_path / name), saved, f"{name}: optimizer state after loading")
        assert_params_close(out["final"], src["final"], lr=MUON_LR, steps=3)


def test_muon_in_bf16_resumes_bit_for_bit(tmp_path):
    spec = replace(spec_for(1, stage=2, extra_config=muon_spec(2).extra_config), precision="bf16")
    straight = topology_source(0, 1, spec, str(tmp_path / "a"))
    resumed = topology_target(0, 1, spec, str(tmp_path / "a"), str(tmp_path / "b"))
    assert_same_state(resumed["final"], straight["final"], "bf16 Muon resumed from step 3")


# -- DeepSpeed's config and tags -------------------------------------------------------------------------------------
def _config(**params) -> dict:
    return {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon", "params": params}}


def test_muon_learning_rates_resolve_as_deepspeeds():
    o = zkern.Config.load(_config()).optimizer.params
    assert (o["muon_lr"], o["adam_lr"], o["momentum"], o["ns_method"], o["weight_decay"]) == (0.02, 3e-4, 0.95, "gram",
                                                                                              0.0)
    o = zkern.Config.load(_config(lr=1e-3)).optimizer.params
    assert (o["muon_lr"], o["adam_lr"]) == (1e-3, 1e-3)
    o = zkern.Config.load(_config(lr=1e-3, muon_lr=5e-2, adam_lr=4e-4)).optimizer.params
    assert (o["muon_lr"], o["adam_lr"]) == (5e-2, 4e-4)


def test_muon_tags_hidden_matrices_and_keeps_users_tags():
    spec = muon_spec(1, "standard")
    model = spec.make_model()
    model.blocks[0].fc.weight.use_muon = False  # the user's tag wins
    engine = zkern.Engine(model, spec.config(1))
    tags = {n: p.use_muon for n, p in model.named_parameters()}
    assert tags["blocks.0.fc.weight"] is False and tags["blocks.1.fc.weight"] is True
    assert tags["blocks.0.proj.bias"] is False and tags["ln_f.weight"] is False and tags["tok.weight"] is True
    groups = engine.optimizer.param_groups
    assert [g["use_muon"] for g in groups] == [True, False]
    assert groups[0]["lr"] == MUON_LR and groups[1]["lr"] == ADAM_LR and groups[1]["betas"] == (0.9, 0.99)
    engine.destroy()
    expected = reference(spec, 1, exact=False, prepare=lambda m: setattr(m.blocks[0].fc.weight, "use_muon", False))
    model = spec.make_model()
    model.blocks[0].fc.weight.use_muon = False
    got = engine_run_on(model, spec)
    assert [k for k, v in expected.items() if not torch.equal(got[k], v)] == []


def engine_run_on(model, spec: TrainSpec) -> dict:
    engine = zkern.Engine(model, spec.config(1))
    batches = spec.batches(1)
    for step in range(spec.steps):
        idx, tgt = global_batch(batches, step)
        engine.backward(engine(idx, tgt))
        engine.step()
    state = engine.full_state_dict()
    engine.destroy()
    return state


def test_embedding_and_lm_head_names_stay_with_adamw():
    class Named(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(11, 8)
            self.hidden = torch.nn.Linear(8, 8)
            self.lm_head = torch.nn.Linear(8, 11)

        def forward(self, x):
            return self.lm_head(self.hidden(self.embed_tokens(x))).sum()

    model = Named()
    engine = zkern.Engine(model, _config(lr=1e-3))
    assert {n: p.use_muon for n, p in model.named_parameters()} == {
        "embed_tokens.weight": False, "hidden.weight": True, "hidden.bias": False, "lm_head.weight": False,
        "lm_head.bias": False}
    engine.backward(engine(torch.tensor([[1, 2, 3]])))
    engine.step()
    engine.destroy()


def test_muon_refusals_name_the_key():
    base = {"train_micro_batch_size_per_gpu": 1}
    with pytest.raises(zkern.ConfigError, match="per-head Muon"):
        zkern.Config.load(_config(per_head_muon=True))
    with pytest.raises(zkern.ConfigError, match="'optimizer.params.ns_method' must be \"gram\""):
        zkern.Config.load(_config(ns_method="quintic"))
    delayed = {"stage": 2, "offload_optimizer": {"device": "cpu", "delayed_update": True}}
    with pytest.raises(zkern.ConfigError, match="delayed_update' runs zkern's own Adam/AdamW"):
        zkern.Config.load({**_config(), "zero_optimization": delayed})
    with pytest.raises(zkern.ConfigError, match="'bf16.bf16_optimizer_states' keeps zkern's fused Adam's state"):
        zkern.Config.load({**_config(), "bf16": {"enabled": True, "bf16_optimizer_states": True},
                           "zero_optimization": {"stage": 1}})
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model[0].bias.use_muon = True
    with pytest.raises(ValueError, match="parameter '0.bias' has use_muon = True and shape \\(4,\\)"):
        zkern.Engine(model, {**base, "optimizer": {"type": "Muon"}})


def test_a_torch_muon_passed_as_the_optimizer_points_to_the_config():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(zkern.ConfigError, match="\"type\": \"Muon\""):
        zkern.Engine(model, {"train_micro_batch_size_per_gpu": 1}, optimizer=torch.optim.Muon([model.weight]))


def test_the_start_up_block_names_muon(caplog):
    with caplog.at_level(logging.INFO, logger="zkern"):
        engine = zkern.Engine(torch.nn.Linear(4, 4), _config())
    engine.destroy()
    assert "optimizer: muon {'lr': 0.02, 'weight_decay': 0.0, 'muon_lr': 0.02, 'adam_lr': 0.0003" in caplog.text
    assert "Muon on 1 matrices (16 elements; 0 of them in matrices that span ranks" in caplog.text
    assert "AdamW on the other 1 parameters: bias" in caplog.text
