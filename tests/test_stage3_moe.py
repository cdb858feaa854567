"""Stage 3 when ranks run different modules in one step: routed experts, a branch one rank takes, and the ranks'
gathers checked against each other.

Each rank routes its sequences to experts by their data (TinyMoE: the first token picks the expert), so in one
step rank 0 runs experts the other ranks do not. Every result is compared with a single-process run of the same
global batches: the sum over ranks of what each rank computed.
"""

import pytest
import torch

import zkern
from zkern.testing import TinyGPT, TrainSpec, assert_params_close, engine_run, reference_run, spawn


def engine_runs(rank, world, specs):
    return [engine_run(rank, world, s) for s in specs]


def moe_specs(world):
    first_step_apart = {0: list(range(world))}  # step 0: rank r's sequences all go to expert r
    return [
        # HF Trainer's decay / no-decay groups, small gradient buckets (several reduce groups per backward)
        TrainSpec(stage=3, arch="moe", steps=5, param_groups=True, forced_routes=first_step_apart,
                  reduce_bucket_size=3000),
        # accumulation, overlap off, and the routing under activation checkpointing
        TrainSpec(stage=3, arch="moe", steps=5, accumulation=2, overlap_comm=False, forced_routes=first_step_apart,
                  model=dict(checkpoint="non_reentrant"), param_groups=True),
    ]


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_routed_experts_train_like_one_process_with_no_configuration(world):
    specs = moe_specs(world)
    per_rank = spawn(engine_runs, world, specs)
    for i, spec in enumerate(specs):
        ref_state, _ = reference_run(spec, world)
        assert_params_close(per_rank[0][i]["state"], ref_state, lr=spec.lr, steps=spec.steps)
        assert per_rank[0][i]["skipped"] == 0
        merges = [m for m in per_rank[0][i]["log"] if "now gathers its" in m]
        # one merge per MoE block, found in the first step, said once each
        assert len(merges) == spec.model.get("n_layer", 2), merges
        assert all("under 'blocks." in m and ".experts' together on every rank" in m for m in merges)


def merge_off_worker(rank, world):
    spec = TrainSpec(stage=3, arch="moe", steps=2, forced_routes={0: list(range(world))},
                     zero={"stage3_merge_divergent_modules": False})
    engine = zkern.Engine(spec.make_model(), spec.config(world))
    before = engine.full_state_dict()
    idx, tgt = spec.batches(world)[0][0][rank]
    try:
        engine.backward(engine(idx, tgt))
        engine.step()
        error = None
    except zkern.CommError as e:
        error = str(e)
    after = engine.full_state_dict()
    return {"error": error, "unchanged": all(torch.equal(before[k], after[k]) for k in before),
            "steps": engine.global_steps}


@pytest.mark.dist
def test_with_the_merge_off_a_divergence_is_a_comm_error_before_any_update():
    results = spawn(merge_off_worker, 2)
    for rank, r in enumerate(results):
        assert r["error"] is not None and r["unchanged"] and r["steps"] == 0
        assert f"zkern rank {rank} of 2" in r["error"]
        assert "rank 0 was about to all-gather unit 'blocks.0.experts.0.fc'" in r["error"]
        assert "rank 1 was about to all-gather unit 'blocks.0.experts.1.fc'" in r["error"]
        assert "stage3_fetch_units" in r["error"]  # what to do


@pytest.mark.dist
def test_a_divergence_first_seen_after_the_verifying_step_is_discarded_never_applied():
    """Steps 0-1 route every rank's sequences to expert 0 (no divergence: nothing to merge, and step 1 no longer
    verifies); step 2 sends rank r to expert r. Its gathers pair different experts across ranks; the step's gather
    signatures differ, so no rank applies it. Passes verify from then on, find the divergence in step 3 and merge;
    the result equals a single-process run that leaves step 2 out."""
    world = 2
    spec = TrainSpec(stage=3, arch="moe", steps=6, forced_routes={0: [0, 0], 1: [0, 0], 2: [0, 1], 3: [0, 1]},
                     zero={"stage3_prefetch_bucket_size": 0})
    result = spawn(engine_runs, world, [spec])[0][0]
    assert result["skipped"] == 1 and result["global_steps"] == spec.steps
    assert any("the step is discarded, no rank applied it" in m for m in result["log"])
    ref_state = reference_skipping(spec, world, skip={2})
    assert_params_close(result["state"], ref_state, lr=spec.lr, steps=spec.steps)


def reference_skipping(spec, world, skip):
    """reference_run, leaving the steps in `skip` out entirely (no update, no Adam step)."""
    from zkern.testing import global_batch

    model = spec.make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    batches = spec.batches(world)
    for step in range(spec.steps):
        if step in skip:
            continue
        opt.zero_grad()
        idx, tgt = global_batch(batches, step)
        spec.loss(model, idx, tgt, step).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def branch_worker(rank, world, spec):
    """Rank 1 runs the extra branch every step, rank 0 never: parameters only some ranks use."""
    engine = zkern.Engine(spec.make_model(), spec.config(world))
    batches = spec.batches(world)
    for step in range(spec.steps):
        idx, tgt = batches[step][0][rank]
        engine.backward(engine(idx, tgt, use_extra=rank == 1))
        engine.step()
    return engine.full_state_dict()


@pytest.mark.dist
def test_a_branch_only_one_rank_takes_trains_like_one_process():
    spec = TrainSpec(stage=3, steps=4, model=dict(extra_branch=True), reduce_bucket_size=3000)
    world = 2
    state = spawn(branch_worker, world, spec)[0]
    torch.manual_seed(spec.seed)
    model = TinyGPT(extra_branch=True)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
    batches = spec.batches(world)
    for step in range(spec.steps):  # the global loss: the mean of the ranks' losses, each rank with its branch
        opt.zero_grad()
        loss = sum(model(*batches[step][0][r], use_extra=r == 1) for r in range(world)) / world
        loss.backward()
        opt.step()
    assert_params_close(state, {k: v.detach() for k, v in model.state_dict().items()}, lr=spec.lr, steps=spec.steps)
