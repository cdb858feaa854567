"""The runtime of an engine built without an optimizer at stages 0-2 (a reference, teacher or eval model): the model
whole on every rank (rank 0's values, broadcast at build), no gradients, no shards. At stage 3 such an engine keeps
Stage3Runtime, its parameters partitioned and gathered per forward like frozen ones.

    python -m pytest tests/engine/test_engine_frameworks.py -q -k reference
"""

from __future__ import annotations

import contextlib

import torch

from zkern.core.runtime import ShardMap


class ReplicatedRuntime:
    """Runtime's protocol for a frozen, whole model: every training hook is a no-op or an error the engine raises
    first (Engine.backward refuses an engine without an optimizer)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.params: list[torch.nn.Parameter] = []
        self.shard_groups: list = []
        self.quantized = None
        self.param_store = None
        self.on_final_grads = None  # no optimizer: nothing is offloaded

    def full_shape(self, p: torch.nn.Parameter) -> torch.Size:
        return p.shape

    @property
    def used(self) -> list[bool]:
        return []

    def abort_pass(self, error: BaseException) -> None:
        pass

    def begin_backward(self, boundary: bool) -> None:
        raise RuntimeError("zkern: this engine has no optimizer: it runs forward only")

    def end_backward(self) -> None:
        pass

    def abort_backward(self) -> None:
        pass

    def grad_segments(self) -> list[torch.Tensor]:
        return []

    def gather_signature(self) -> int:
        return 0

    def diverged_step(self) -> None:
        raise AssertionError("a replicated model gathers nothing, so ranks cannot diverge")

    def active(self, flags: list[bool]) -> list[list[bool]]:
        return []

    def skipped_step(self) -> None:
        pass

    def loss_scale_changed(self, factor: float) -> None:
        pass

    def state_components(self) -> list:
        return []  # the model's tensors are the engine's "module" component

    def chunk_stepped(self, group: int, chunk: int) -> None:
        pass

    def after_step(self) -> None:
        pass

    def refresh(self) -> None:
        pass

    def shard_map(self) -> ShardMap:
        return ShardMap(pieces=[], shapes=[], resting=[])

    def zero_grad(self) -> None:
        pass

    def full_fp32(self, rank0_only: bool, only: set[int] | None = None) -> dict[int, torch.Tensor] | None:
        return {}  # every tensor is whole here: full_state_dict reads them from the module

    def full_working(self) -> dict[int, torch.Tensor]:
        return {}

    def full_grads(self, only: set[int] | None = None) -> dict[int, torch.Tensor]:
        return {}

    def memory(self) -> dict[str, int]:
        # the model's parameters are counted by memory_report with the other whole, untrained ones
        return {"params": 0, "grads": 0, "master": 0, "comm_buffers": 0, "host_params": 0}

    def unguarded(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def describe(self) -> list[str]:
        n = sum(p.numel() for p in self.model.parameters())
        return [f"no optimizer: {n} parameters whole on every rank, frozen (forward only)"]

    def warnings(self, reduce_bucket_size: int) -> list[str]:
        return []
