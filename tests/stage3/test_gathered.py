"""zkern.GatheredParameters: read, modify (modifier_rank), nest; model.state_dict() at stage 3; stages 0-2 and
init_sharded parameters."""

import pytest
import torch

import zkern
from zkern.testing import TinyGPT, TrainSpec, spawn


def gathered_worker(rank, world, precision, stage=3, zero=None):
    spec = TrainSpec(stage=stage, precision=precision, steps=1, zero=zero or {})
    model = spec.make_model()
    engine = zkern.Engine(model, spec.config(world))
    idx, tgt = spec.batches(world)[0][0][rank]
    engine.backward(engine(idx, tgt))
    engine.step()
    out = {"full": engine.full_state_dict()}
    fc, proj = model.blocks[0].fc.weight, model.blocks[1].proj.weight

    with zkern.GatheredParameters(fc):
        out["read"] = fc.detach().clone()
    try:
        model.state_dict()
        out["outside"] = None
    except RuntimeError as e:
        out["outside"] = str(e)
    with zkern.GatheredParameters(list(model.parameters())):
        out["inside"] = {k: v.detach().clone() for k, v in model.state_dict().items()}

    with zkern.GatheredParameters(fc, modifier_rank=0):
        with torch.no_grad():
            fc.fill_(0.5 if rank == 0 else -7.0)  # only rank 0's values may survive
    out["modified"] = engine.full_state_dict()

    with zkern.GatheredParameters(model.parameters()):  # nested: the outer context holds every unit
        with zkern.GatheredParameters(proj, modifier_rank=world - 1):
            if rank == world - 1:
                with torch.no_grad():
                    proj.mul_(2)
        out["seen_in_outer"] = proj.detach().clone()
    out["nested"] = engine.full_state_dict()
    with torch.no_grad():
        out["idx"], out["logits"] = idx, engine(idx)  # the next forward uses the written values
    out["gathered"] = engine.runtime.gathered_units() if stage == 3 else []
    engine.backward(engine(idx, tgt))  # and training goes on
    engine.step()
    out["after_step"] = engine.full_state_dict()
    return out


def modes_worker(rank, world, modes):
    return [gathered_worker(rank, world, precision, stage, zero) for stage, precision, zero in modes]


MODES = [(stage, precision, {}) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")] + \
    [(2, "bf16", {"offload_optimizer": {"device": "cpu"}}), (1, "fp32", {"offload_optimizer": {"device": "cpu"}})]


@pytest.mark.dist
def test_gathered_parameters_read_modify_and_nest():
    """At every stage (stages 0-2: parameters are whole, but a modifier rank's write must still reach every rank's
    copy and the fp32 masters, or the next step undoes it), in fp32 and bf16, with and without offload."""
    world = 2
    per_rank = spawn(modes_worker, world, MODES)
    for mode, results in zip(MODES, zip(*per_rank)):
        _check_gathered(mode, results)


def _check_gathered(mode, results):
    stage, precision, _ = mode
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    for r in results:
        full = r["full"]
        torch.testing.assert_close(r["read"], full["blocks.0.fc.weight"].to(dtype), rtol=0, atol=0)
        if stage == 3:
            assert "zkern.GatheredParameters" in r["outside"] and "engine.full_state_dict()" in r["outside"]
        for name, value in r["inside"].items():
            torch.testing.assert_close(value, full[name].to(value.dtype), rtol=0, atol=0)
        # rank 0's change is in every rank's fp32 master; nothing else moved
        modified = r["modified"]
        assert torch.equal(modified["blocks.0.fc.weight"], torch.full_like(full["blocks.0.fc.weight"], 0.5))
        assert all(torch.equal(modified[k], full[k]) for k in full if k != "blocks.0.fc.weight")
        # the inner context's change (made on the last rank) is seen by the outer one and kept after both
        doubled = (full["blocks.1.proj.weight"].to(dtype) * 2).float()
        torch.testing.assert_close(r["seen_in_outer"].float(), doubled, rtol=0, atol=0)
        torch.testing.assert_close(r["nested"]["blocks.1.proj.weight"], doubled, rtol=0, atol=0)
        plain = TinyGPT().to(dtype)
        plain.load_state_dict(r["nested"])
        with torch.no_grad():
            torch.testing.assert_close(r["logits"], plain(r["idx"]), rtol=1e-5, atol=1e-5)
        assert r["gathered"] == []
        # the step after the writes started from them: one Adam step of lr 1e-3 away, no more (it was 0.84 away from
        # the written value at stages 1-2 in bf16: the step wrote the old master back)
        step = r["after_step"]["blocks.0.fc.weight"] - 0.5
        assert float(step.abs().max()) <= 1.1e-3 + 1e-2 * 0.5 * 1e-3, mode
        assert len(results) == 2 and torch.equal(results[0]["after_step"]["blocks.0.fc.weight"],
                                                 results[1]["after_step"]["blocks.0.fc.weight"]), mode


def mismatch_worker(rank, world):
    spec = TrainSpec(stage=3)
    model = spec.make_model()
    zkern.Engine(model, spec.config(world))
    param = model.blocks[0].fc.weight if rank == 0 else model.blocks[1].fc.weight
    try:
        with zkern.GatheredParameters(param):
            pass
    except zkern.CommError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_ranks_that_gather_different_parameters_get_a_comm_error():
    for error in spawn(mismatch_worker, 2):
        assert error is not None and "the same parameters in the same order" in error


def test_gathered_parameters_outside_any_engine_is_a_no_op():
    model = TinyGPT()
    with zkern.GatheredParameters(model.parameters(), modifier_rank=0):
        assert all(p.numel() > 0 for p in model.parameters())
    with zkern.GatheredParameters(model.parameters(), enabled=False):
        pass


def sharded_worker(rank, world):
    cfg = {"train_batch_size": world, "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"},
           "device": "cpu"}
    with zkern.init_sharded(cfg):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    with zkern.GatheredParameters(model[0].weight, modifier_rank=0):
        assert model[0].weight.shape == (8, 8)
        with torch.no_grad():
            model[0].weight.fill_(0.25 if rank == 0 else 9.0)  # a custom init on rank 0
    assert model[0].weight.numel() == 0  # partitioned again
    return zkern.Engine(model, cfg).full_state_dict()


@pytest.mark.dist
def test_parameters_built_under_init_sharded_are_gathered_and_written_back():
    for state in spawn(sharded_worker, 2):
        assert torch.equal(state["0.weight"], torch.full((8, 8), 0.25))
