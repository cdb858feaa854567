"""Comm's host collectives against sums written out here: a reduce-scatter on gloo is an exchange of sections and a
local sum (collectives.py), and must equal every rank's section added up, in place or not, waited at once or later,
in every dtype the engine reduces, with its receive buffers reused rather than piling up.

    python -m pytest tests/comm/test_comm.py -q
"""

import pytest
import torch
import torch.distributed as dist

from zkern.comm.collectives import Comm
from zkern.testing import spawn

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integers: every partial sum in any order is exact in each dtype, so the check is equality."""
    gen = torch.Generator().manual_seed(17 * rank + n)
    return torch.randint(-8, 9, (n,), generator=gen).to(dtype)


def _reduce_scatters(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    comm = Comm(dist.group.WORLD, rank, world, 60.0)
    wrong, pool_sizes = [], []
    for dtype in DTYPES:
        for section in (64, 1000, 64 * 1024):
            n = section * world
            want = sum(_data(r, n, dtype).double() for r in range(world))[rank * section:(rank + 1) * section]
            separate = torch.full((section,), float("nan"), dtype=dtype)
            comm.reduce_scatter(separate, _data(rank, n, dtype), "separate output").wait()
            in_place = _data(rank, n, dtype)  # the output is the input's own section, as stage 1 reduces
            comm.reduce_scatter(in_place[rank * section:(rank + 1) * section], in_place, "in place").wait()
            # two in flight at once, waited later and out of order: each keeps its own receive buffer
            late = [torch.empty(section, dtype=dtype) for _ in range(2)]
            inputs = [_data(rank, n, dtype) * (k + 1) for k in range(2)]
            works = [comm.reduce_scatter(late[k], inputs[k], "async", async_op=True) for k in range(2)]
            works[1].wait()
            works[0].wait()
            for name, got, expect in (("separate", separate, want), ("in place", in_place[rank * section:
                                      (rank + 1) * section], want), ("async 0", late[0], want),
                                      ("async 1", late[1], 2 * want)):
                if not torch.equal(got.double(), expect):
                    wrong.append((str(dtype), section, name))
            pool_sizes.append(len(comm.scratch.tensors()))
    dist.destroy_process_group()
    return {"wrong": wrong, "pool": pool_sizes, "lent": len(comm.scratch.lent)}


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_host_reduce_scatter_is_every_ranks_section_summed(world):
    for rank, result in enumerate(spawn(_reduce_scatters, world)):
        assert result["wrong"] == [], (rank, result["wrong"])
        # at most two reductions were ever in flight together: never more than two receive buffers kept
        assert max(result["pool"]) <= 2 and result["lent"] == 0, (rank, result)


def test_a_comm_with_nccl_sets_its_communicator_up_at_construction(monkeypatch):
    # NCCL would set a communicator up at the group's first collective, waiting for every member with no timeout;
    # a Comm whose backend carries nccl runs one collective as it is made, while every rank is building (the real
    # proof is bench/gpu_probe.py world2's dead_rank check on a GPU). Gloo connects when its group is made.
    import zkern.comm.collectives as collectives

    calls = []
    monkeypatch.setattr(collectives.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(collectives.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(collectives.torch, "zeros", lambda *a, **k: ("probe", k["device"]))
    monkeypatch.setattr(collectives.dist, "all_reduce", lambda t, group=None: calls.append((t, group)))
    Comm("group-a", 0, 2, 60.0, "cpu:gloo,cuda:nccl")
    Comm("group-b", 0, 2, 60.0, "gloo")
    Comm(None, 0, 1, 60.0, "cpu:gloo,cuda:nccl")  # world 1: no group, nothing to set up
    assert calls == [(("probe", torch.device("cuda", 0)), "group-a")]

    def refuse(t, group=None):
        raise RuntimeError("ncclInvalidUsage")

    monkeypatch.setattr(collectives.dist, "all_reduce", refuse)
    with pytest.raises(collectives.CommError, match="setting up the NCCL communicator.*ncclInvalidUsage"):
        Comm("group-c", 1, 2, 60.0, "cpu:gloo,cuda:nccl")
