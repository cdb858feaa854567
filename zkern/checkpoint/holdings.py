"""What one rank's checkpoint is made of, named: the checkpoint reaches the engine's state through these parts and
nothing else (an engine builds one; a test or another trainer can build one from its own parts).

    python -m pytest tests/checkpoint/test_checkpoint.py -q
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from zkern.comm.collectives import Comm
    from zkern.config.model import Config
    from zkern.core.runtime import Runtime
    from zkern.core.shard_groups import ShardGroup
    from zkern.core.state import StateRegistry
    from zkern.offload.store import ShardStore


@dataclass(frozen=True)
class Holdings:
    """What one rank's checkpoint is made of. The tensors go by element ranges of the model's own tensors (the
    runtime's shard map, the optimizer's per-piece state, the store that knows where each shard rests); everything
    else is a state component's saved form (the registry)."""

    registry: StateRegistry
    runtime: Runtime
    optimizer: torch.optim.Optimizer | None  # None: an engine that runs forward only (it loads weights only)
    module: torch.nn.Module
    store: ShardStore
    comm: Comm  # the engine's: rank, world size, ranks per node (the checkpoints' own group is made from it)
    device: torch.device
    config: Config
    host_groups: tuple[ShardGroup, ...] = ()  # offload's host staging, whose working copies follow the masters

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world
