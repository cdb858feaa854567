"""NCCL pairs collectives by the order each communicator sees them, and a blocking collective on one communicator
can wait behind another communicator's on the same GPU: every communicator must see the same sequence on every rank,
and the interleaving of communicators must be the same on every rank too.

Each rank records, over gloo, every collective the engine issues as (process group, collective, size), for a dense
model with small reduce groups and uneven units, and for routed experts whose routing differs between ranks.

    python -m pytest tests/comm/test_collective_order.py -q
"""

import pytest
import torch.distributed as dist

from zkern.comm import collectives as comm_module
from zkern.testing import TrainSpec, engine_run, spawn


def recorded_runs(rank: int, world: int, specs: list[TrainSpec]) -> list[list[tuple[str, str]]]:
    log: list[tuple[str, str]] = []
    issue = comm_module.Comm._run

    def recording(self, fn, what, async_op, *args, **kwargs):
        group = "default" if self.group is None else dist._get_process_group_name(self.group)
        log.append((group, what.split(" (")[0]))  # the collective and its size, not its purpose's wording
        return issue(self, fn, what, async_op, *args, **kwargs)

    comm_module.Comm._run = recording
    out = []
    for spec in specs:
        log.clear()
        engine_run(rank, world, spec)
        out.append(list(log))
    return out


def per_group(sequence: list[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for group, what in sequence:
        out.setdefault(group, []).append(what)
    return out


DENSE = TrainSpec(stage=3, steps=3, reduce_bucket_size=3000, model=dict(vocab=67),
                  zero={"stage3_param_persistence_threshold": 0})


def moe(world: int) -> TrainSpec:
    # step 0: rank r's sequences all go to expert r; later steps route by the data (different experts per rank)
    return TrainSpec(stage=3, arch="moe", steps=3, forced_routes={0: list(range(world))}, reduce_bucket_size=3000)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_every_communicator_sees_one_sequence_on_every_rank(world):
    runs = spawn(recorded_runs, world, [DENSE, moe(world)])
    for i, name in enumerate(("dense", "routed experts")):
        sequences = [per_group(r[i]) for r in runs]
        assert len(sequences[0]) >= 2, sequences[0].keys()  # gathers and reductions on groups of their own
        for rank, s in enumerate(sequences[1:], 1):
            assert s == sequences[0], f"{name}: rank {rank}'s collectives differ from rank 0's"
    # a dense model: gathers and reductions interleave identically on every rank (routed experts: below)
    assert all(r[0] == runs[0][0] for r in runs)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_routed_experts_interleave_gathers_and_reductions_identically_on_every_rank(world):
    """A rank that did not run an expert completes its gradients at the start of backward, the others when they
    arrive: the expert's reduce group waits for the end of backward, so the interleaving is the same everywhere
    (it differed at the 162nd collective of 326 at world 2 before)."""
    runs = spawn(recorded_runs, world, [moe(world)])
    for rank in range(1, world):
        assert runs[rank][0] == runs[0][0], f"rank {rank} interleaves its collectives unlike rank 0"
