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
def test_a_divergence_first_seen_after_the_verifying_step_trains_like_one_process():
    """Steps 0-1 route every rank's sequences to expert 0 (no divergence: nothing to merge, and step 1 no longer
    verifies); step 2 sends rank r to expert r, which rank 1's recorded order does not hold. Rank 1 issues the rest of
    the record and asks for each further all-gather; rank 0 serves them at the end of its pass. No step is discarded
    and no collective pairs different units: the result equals a single-process run of every step."""
    world = 2
    spec = TrainSpec(stage=3, arch="moe", steps=6, forced_routes={0: [0, 0], 1: [0, 0], 2: [0, 1], 3: [0, 1]},
                     zero={"stage3_prefetch_bucket_size": 0})
    per_rank = spawn(engine_runs, world, [spec])
    result = per_rank[0][0]
    assert result["skipped"] == 0 and result["global_steps"] == spec.steps
    assert any("where its recorded order has none left" in m for m in per_rank[1][0]["log"])
    ref_state = reference_skipping(spec, world, skip=set())
    assert_params_close(result["state"], ref_state, lr=spec.lr, steps=spec.steps)


class _Experts(torch.nn.Module):
    """Two experts in a ModuleDict; forward runs the ones named in `use` (per rank, per step)."""

    def __init__(self, dim: int):
        super().__init__()
        self.experts = torch.nn.ModuleDict({"e0": torch.nn.Linear(dim, dim), "e1": torch.nn.Linear(dim, dim)})

    def forward(self, x, use):
        out = torch.zeros_like(x)
        for name in use:
            out = out + self.experts[name](x)
        return out


class _LateRouting(torch.nn.Module):
    """Five plain layers, then the experts, then a head (the reviewer's repro)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(5))
        self.moe = _Experts(dim)
        self.head = torch.nn.Linear(dim, 1)

    def forward(self, x, use):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(self.moe(x, use)).pow(2).mean()


def _late_use(step: int, rank: int, pattern: str) -> list[str]:
    """Both experts everywhere in steps 0-2; from step 3 rank 1 uses only e1 ("skip"), or the ranks swap to one
    expert each, rank 0 e1 and rank 1 e0 ("swap"), or rank 1 adds nothing new but runs e1 twice ("reuse")."""
    if step < 3 or rank == 0 and pattern != "swap":
        return ["e0", "e1"]
    return {"skip": ["e1"], "swap": ["e1"] if rank == 0 else ["e0"], "reuse": ["e1", "e1"]}[pattern]


def late_routing_worker(rank: int, world: int, cases: list[dict]) -> list:
    out = []
    for case in cases:
        torch.manual_seed(0)
        model = _LateRouting()
        cfg = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 1200,
                                     **case["zero"]},
               "comm_timeout_s": 60, "device": "cpu"}
        engine = zkern.Engine(model, cfg)
        for step in range(6):
            x = torch.randn(2, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            engine.backward(engine(x, _late_use(step, rank, case["pattern"])))
            engine.step()
        out.append({"state": engine.full_state_dict(), "skipped": engine.skipped_steps})
    return out


LATE_CASES = [
    {"pattern": "skip", "zero": {"stage3_prefetch_bucket_size": 0}},
    {"pattern": "skip", "zero": {}},  # prefetch on: passed-over experts were gathered ahead
    {"pattern": "skip", "zero": {"overlap_comm": False}},  # reductions block as they launch
    {"pattern": "skip", "zero": {"stage3_fetch_units": ["_Experts"], "stage3_prefetch_bucket_size": 0}},
    # the deadlock: rank 0 blocks in the MoE unit's reduce-scatter, which rank 1 (expert 0 unused) reached only at the
    # end of backward, while rank 1 waits in the next unit's all-gather
    {"pattern": "skip", "zero": {"stage3_fetch_units": ["_Experts"], "overlap_comm": False,
                                 "stage3_prefetch_bucket_size": 0}},
    {"pattern": "swap", "zero": {}},
    {"pattern": "reuse", "zero": {"stage3_prefetch_bucket_size": 0}},
]


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_routing_that_changes_after_the_first_steps_trains_like_one_process(world):
    """The reviewer's repro: every rank uses both experts for three steps, then routing changes. Before, gloo
    aborted the job at step 3 ("collective mismatch"), and with the MoE module declared in stage3_fetch_units, the
    ranks deadlocked (one in the MoE unit's reduce-scatter, waiting on a rank that completes it only at the end of
    backward, the other in an all-gather of the next unit). Now every case equals one process summing every rank's
    loss, with no step skipped."""
    per_rank = spawn(late_routing_worker, world, LATE_CASES, timeout=600)
    for i, case in enumerate(LATE_CASES):
        torch.manual_seed(0)
        model = _LateRouting()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        for step in range(6):
            opt.zero_grad()
            loss = sum(model(torch.randn(2, 16, generator=torch.Generator().manual_seed(100 * step + r)),
                             _late_use(step, r, case["pattern"])) for r in range(world)) / world
            loss.backward()
            opt.step()
        expected = {k: v.detach() for k, v in model.state_dict().items()}
        for rank in range(world):
            assert per_rank[rank][i]["skipped"] == 0, (case, rank)
        assert_params_close(per_rank[0][i]["state"], expected, lr=1e-2, steps=6)


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
