"""Page-locked host buffers at exactly their size (zkern/core/pinned.py). CUDA's registration is faked: this machine
has no GPU, and what is checked is what zkern asks of it (the lent GPU's probe records the host's peak RSS beside
zkern's count, bench/gpu_probe.py)."""

import gc

import pytest
import torch

from zkern.core import pinned
from zkern.offload.host import host_tensor


class FakeCudart:
    def __init__(self, fail: int = 0):
        self.registered, self.unregistered, self.fail = [], [], fail

    def cudaHostRegister(self, ptr, nbytes, flags):  # noqa: N802 (CUDA's name)
        self.registered.append((ptr, nbytes, flags))
        return self.fail

    def cudaHostUnregister(self, ptr):  # noqa: N802
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = FakeCudart()
    monkeypatch.setattr(pinned, "_cudart", lambda: fake)
    monkeypatch.setattr(pinned, "EXACT_MIN_BYTES", 1 << 20)
    small = []
    monkeypatch.setattr(pinned, "_torch_pinned", lambda n, d: small.append((n, d)) or torch.empty(n, dtype=d))
    fake.small = small
    return fake


def test_a_large_pinned_buffer_is_registered_at_exactly_its_size_and_unregistered_when_freed(cudart):
    numel = 3 * (1 << 20) + 5  # 6 MiB and 10 bytes of bf16: torch's pinned allocator would hold 8 MiB
    t = host_tensor(numel, torch.bfloat16, pin=True)
    assert t.numel() == numel and t.dtype == torch.bfloat16 and not t.any()
    ptr = t.data_ptr()
    assert cudart.registered == [(ptr, numel * 2, 0)] and cudart.small == []
    assert t.untyped_storage().nbytes() == numel * 2
    view = t[10:20]  # chunks view their group's buffer: a view keeps the buffer, and so its registration
    del t
    gc.collect()
    assert cudart.unregistered == [] and view.numel() == 10
    del view
    gc.collect()
    assert cudart.unregistered == [ptr]


def test_small_pinned_buffers_and_pageable_ones_take_torch_s_paths(cudart):
    small = host_tensor(1000, torch.float32, pin=True)
    assert cudart.small == [(1000, torch.float32)] and cudart.registered == []
    assert not small.any()  # host_tensor zeroes what torch's allocator hands out
    plain = host_tensor(4 << 20, torch.float32, pin=False)
    assert cudart.registered == [] and plain.numel() == 4 << 20


def test_a_refused_registration_says_what_to_turn_off(cudart):
    cudart.fail = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="cudaHostRegister error 2.*pin_memory: false"):
        pinned.pinned_empty(1 << 20, torch.float32)
    assert cudart.unregistered == []
