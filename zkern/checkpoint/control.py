"""The checkpoint's own collectives: small JSON messages between ranks on a process group of their own.

    python -m pytest tests/checkpoint/test_checkpoint.py -q

A save or load agrees across ranks (a temporary directory's name, every rank's file index and whether it
succeeded) so that no rank commits or changes state while another failed, and none waits forever: the group
has the engine's comm_timeout_s. It is a group apart from the engine's, with counters apart, so an asynchronous
save can talk from its writer thread while training's collectives run (gloo's groups are independent), and
comm_stats() still counts training traffic only. Messages are JSON bytes in uint8 tensors on the host: nothing a
peer sends is ever unpickled.
"""

from __future__ import annotations

import ctypes
import json

import torch

from zkern.comm.collectives import Comm


def control_comm(engine_comm: Comm) -> Comm:
    """A Comm for checkpoint messages (a collective: every rank calls it, once per engine)."""
    return engine_comm.sibling(backend="gloo", share_counters=False)


def _encode(obj) -> torch.Tensor:
    raw = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)


def all_gather_json(comm: Comm, obj, purpose: str) -> list:
    """Every rank's obj, in rank order."""
    if comm.world == 1:
        return [json.loads(json.dumps(obj))]
    data = _encode(obj)
    sizes = torch.zeros(comm.world, dtype=torch.int64)
    comm.all_gather(sizes, torch.tensor([data.numel()], dtype=torch.int64), f"{purpose}: sizes")
    width = int(sizes.max())
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:data.numel()] = data
    out = torch.empty(width * comm.world, dtype=torch.uint8)
    comm.all_gather(out, mine, purpose)
    return [json.loads(ctypes.string_at(out.data_ptr() + r * width, int(sizes[r]))) for r in range(comm.world)]


def broadcast_json(comm: Comm, obj, purpose: str):
    """Rank 0's obj on every rank."""
    if comm.world == 1:
        return obj
    return all_gather_json(comm, obj if comm.rank == 0 else None, purpose)[0]
