"""What an engine is built of, handed to the code that acts for it (the step, reports, whole weights, the
parameter views, the state registry) instead of the engine itself: those helpers see the runtime, the optimizer,
the counters and the rest, never Engine's methods, so engine.py imports them and none of them imports engine.py.

    python -m pytest tests/house/test_layout.py -q
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zkern.comm.collectives import Comm
from zkern.config import Config
from zkern.core.runtime import Runtime
from zkern.core.spec import RuntimeSpec
from zkern.core.state import StateRegistry
from zkern.engine.counters import Counters
from zkern.engine.precision import LossScaler
from zkern.engine.resident import Residency
from zkern.offload.host import HostStep
from zkern.offload.nvme import NvmeShard
from zkern.offload.store import ShardStore


@dataclass(eq=False)  # eq=False: hashed by identity, so param_views can hold it in a WeakSet
class EngineParts:
    config: Config  # replaced by set_train_batch_size (a new batch size), so read it here, never keep a copy
    device: torch.device
    spec: RuntimeSpec
    comm: Comm
    module: torch.nn.Module
    runtime: Runtime
    store: ShardStore
    nvme: NvmeShard | None  # the master and moments in files (offload_optimizer device "nvme")
    optimizer: torch.optim.Optimizer | None  # None: an engine without an optimizer runs forward only
    host_step: HostStep | None  # the optimizer's step on the host (offload_optimizer)
    lr_scheduler: object | None
    scaler: LossScaler
    counters: Counters
    residency: Residency  # what offload_states() moved to the host
    state: StateRegistry = field(default_factory=StateRegistry)  # filled by engine_state.build_registry

    @property
    def dtype(self) -> torch.dtype:
        return self.spec.dtype  # the working dtype

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world

    @property
    def inference(self) -> bool:
        return self.optimizer is None

    @property
    def offload(self) -> bool:
        return self.host_step is not None
