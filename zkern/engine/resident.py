"""engine.offload_states() / reload_states(): the engine's device memory moved to the host and back, as colocated
RLHF frees the GPU for its rollouts (OpenRLHF, verl) with DeepSpeed's calls of the same names.

    python -m pytest tests/engine/test_engine_frameworks.py -q -k offload_states

What moves is found through the state registry, which claims every tensor the engine owns (tests/core/test_state.py
fails on one it does not): each storage on the engine's device, whole, copied into a host buffer (pinned on CUDA)
and resized to nothing, so the allocator gets its bytes back while every view of it (parameters, optimizer pieces,
bucket views) stays the same object. reload_states() gives each storage its size back and copies the bytes in:
training continues bit for bit. In between, the engine refuses every call that would read the moved state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from zkern.core.buffers import release_storage, restore_storage
from zkern.core.pinned import pinned_empty
from zkern.core.state import StateRegistry

# DeepSpeed's OffloadStateTypeEnum values, and which of zkern's state kinds each covers.
STATE_TYPES = ("optim_states", "hp_params", "lp_params", "lp_grads", "contiguous_grad_buffer")


@dataclass
class Moved:
    storage: torch.UntypedStorage
    host: torch.Tensor  # the bytes, uint8
    device: torch.device
    types: set[str]  # the DeepSpeed state types it holds


class Residency:
    """What offload_states() moved to the host, per engine: the storages, their bytes and the state types they hold.
    device: the engine's device; mixed: whether the weights train in a 16-bit working copy beside fp32 masters."""

    def __init__(self, device: torch.device, mixed: bool):
        self.device, self.mixed = device, mixed
        self.moved: list[Moved] | None = None  # None: nothing moved

    def offload(self, registry: StateRegistry, include, device, pin_memory: bool, non_blocking: bool) -> None:
        target = getattr(device, "value", device)
        if str(target) != "cpu":
            raise ValueError(f"offload_states moves state to the host only (device='cpu'), got {device!r}")
        wanted = _state_types(include)
        moved = self.moved or []
        seen = {m.storage.data_ptr() for m in moved}
        pin = pin_memory and self.device.type == "cuda"
        for storage, types in _storages(registry, self.device, self.mixed):
            if not types & wanted or storage.data_ptr() in seen:
                continue
            data = _bytes(storage, self.device)
            nbytes = storage.nbytes()
            host = pinned_empty(nbytes, torch.uint8) if pin else torch.empty(nbytes, dtype=torch.uint8)
            host.copy_(data, non_blocking=non_blocking and pin)
            seen.add(storage.data_ptr())
            release_storage(storage)  # the allocator may reuse the block: the copy above is ordered before reuse
            moved.append(Moved(storage, host, self.device, types))
        self.moved = moved

    def reload(self, non_blocking: bool) -> None:
        for m in self.moved or ():
            restore_storage(m.storage, m.host.numel())
            _bytes(m.storage, m.device).copy_(m.host, non_blocking=non_blocking and m.host.is_pinned())
        self.moved = None

    def require(self, what: str, reads: tuple[str, ...] = STATE_TYPES) -> None:
        """Refuse `what` while state it reads is on the host (reads: DeepSpeed state types; a forward reads only the
        working weights, lp_params): it would read storages that hold nothing."""
        if self.moved is not None and any(m.types & set(reads) for m in self.moved):
            raise RuntimeError(f"engine.{what}: offload_states() moved this engine's state to the host; call "
                               f"engine.reload_states() first")


def _state_types(include) -> set[str]:
    if include is None:
        return set(STATE_TYPES)
    names = {str(getattr(i, "value", i)) for i in include}
    unknown = names - set(STATE_TYPES)
    if unknown:
        raise ValueError(f"offload_states(include=...): {sorted(unknown)} not among {list(STATE_TYPES)}")
    return names


def _storages(registry: StateRegistry, device: torch.device,
              mixed: bool) -> list[tuple[torch.UntypedStorage, set[str]]]:
    """Every non-empty storage on the engine's device that the registry's components own, with the DeepSpeed state
    types it holds: weights in fp32 beside a 16-bit working copy are hp_params, weights in the working dtype (and
    the copies derived from them) lp_params, an fp32 run's one copy both."""
    found: dict[int, tuple[torch.UntypedStorage, set[str]]] = {}
    for component in registry:
        for t in component.tensors():
            if t.device != device:
                continue
            storage = t.untyped_storage()
            if storage.nbytes() == 0:
                continue
            types = _types_of(component.kind, t.dtype, mixed)
            entry = found.setdefault(storage.data_ptr(), (storage, set()))
            entry[1].update(types)
    return list(found.values())


def _types_of(kind: str, dtype: torch.dtype, mixed: bool) -> set[str]:
    match kind:
        case "optimizer":
            return {"optim_states"}
        case "transient":
            return {"lp_grads"}
        case "scratch":
            return {"contiguous_grad_buffer"}
        case "weights" if dtype == torch.float32:
            return {"hp_params"} if mixed else {"hp_params", "lp_params"}
        case "weights" | "derived":
            return {"lp_params"}
        case _:
            return set()


def _bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
