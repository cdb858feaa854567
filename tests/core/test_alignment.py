"""Every view zkern hands the model starts at a multiple of 256 bytes, as torch's own allocator places each
parameter (cuBLAS, cuDNN and Triton choose their vectorised and TMA paths by the operands' alignment): the
parameters a module's forward reads (seen by a forward pre-hook that runs after zkern's own), every .grad zkern
keeps, at stages 0-3, in fp32, bf16 and fp16, at worlds 1-4, with ZeRO++ and both offloads, and the whole weights
its exports build. The model's sizes are odd (a vocabulary of 37, Linear(24, 37)), where packing parameters end to
end put every view after the first 2 bytes past a boundary.

    python -m pytest tests/core/test_alignment.py -q
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import zkern
from zkern.core.buffers import ALIGN_BYTES, aligned_empty, aligned_zeros, release, restore
from zkern.core.partition import ALIGN, plan_layout, plan_unit_layout
from zkern.testing import spawn


class Odd(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(37, 24)
        self.up = nn.Linear(24, 37)
        self.mid = nn.Linear(37, 37)
        self.norm = nn.LayerNorm(37)
        self.head = nn.Linear(37, 37)

    def forward(self, idx):
        return self.head(self.norm(torch.relu(self.mid(torch.relu(self.up(self.emb(idx)))))))


def _misaligned(t: torch.Tensor) -> int:
    return t.data_ptr() % ALIGN_BYTES if t.numel() else 0


def _train(rank: int, world: int, cases: list[tuple[int, str, dict]], root: str) -> list[list[str]]:
    out = []
    for stage, precision, zero in cases:
        torch.manual_seed(0)
        found: list[str] = []

        def seen(module, args, found=found):
            for name, p in module.named_parameters(recurse=False):
                if _misaligned(p):
                    found.append(f"{type(module).__name__}.{name} in forward: {_misaligned(p)} bytes past")
        zero = {**zero}
        for key in ("offload_optimizer", "offload_param"):
            if zero.get(key, {}).get("device") == "nvme":
                zero[key] = {**zero[key], "nvme_path": f"{root}/{key}{rank}"}
        top = {"ranks_per_node": zero.pop("ranks_per_node")} if "ranks_per_node" in zero else {}
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "device": "cpu",
               "optimizer": {"type": "AdamW"}, **top,
               "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                     "reduce_bucket_size": 2000, "stage3_gather_16bit_weights_on_model_save": True,
                                     **zero}}
        if precision != "fp32":
            cfg[precision] = {"enabled": True}
        engine = zkern.Engine(Odd(), cfg)
        for m in engine.module.modules():
            m.register_forward_pre_hook(seen)  # after zkern's own: the views the forward computes with
        idx = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(rank))
        for _ in range(3):  # a stage-3 unit regathered into a released and restored storage stays aligned
            engine.backward(engine(idx).float().square().mean())
            found += [f"{n}.grad: {_misaligned(p.grad)} bytes past" for n, p in engine.module.named_parameters()
                      if p.grad is not None and _misaligned(p.grad)]
            engine.step()
        if stage == 3:
            with zkern.GatheredParameters(list(engine.module.parameters())):
                found += [f"{n} in GatheredParameters" for n, p in engine.module.named_parameters() if _misaligned(p)]
        exported = engine.full_working_state_dict()
        found += [f"{n} in full_working_state_dict" for n, t in exported.items() if _misaligned(t)]
        found += [f"{n} in stream_full_weights" for b in engine.stream_full_weights() for n, t in b if _misaligned(t)]
        engine.destroy()
        out.append([f"stage {stage} {precision} {zero}: {f}" for f in found])
    return out


WORLD_1 = [(stage, precision, {}) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16", "fp16")]
WORLD_2 = [
    (1, "bf16", {}), (2, "fp16", {}), (3, "bf16", {}),
    (3, "bf16", {"zero_quantized_weights": True, "zero_hpz_partition_size": 2, "ranks_per_node": 1}),
    (2, "bf16", {"offload_optimizer": {"device": "cpu"}}),
    (3, "bf16", {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}),
    (3, "fp16", {"offload_optimizer": {"device": "nvme"}, "offload_param": {"device": "nvme"}}),
]
WORLD_3_4 = [(1, "fp32", {}), (2, "bf16", {}), (3, "bf16", {}), (3, "bf16", {"zero_quantized_gradients": True})]


def _check(per_rank: list[list[list[str]]]) -> None:
    bad = [f for rank in per_rank for case in rank for f in case]
    assert not bad, f"{len(bad)} views start off a {ALIGN_BYTES}-byte boundary:\n  " + "\n  ".join(bad[:20])


def test_every_view_is_aligned_at_world_1(tmp_path):
    _check(spawn(_train, 1, WORLD_1, str(tmp_path)))


@pytest.mark.dist
def test_every_view_is_aligned_at_world_2_with_zeropp_and_both_offloads(tmp_path):
    _check(spawn(_train, 2, WORLD_2, str(tmp_path)))


@pytest.mark.dist
@pytest.mark.parametrize("world", [3, 4])
def test_every_view_is_aligned_at_worlds_3_and_4(world, tmp_path):
    _check(spawn(_train, world, WORLD_3_4, str(tmp_path)))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_parameter_and_chunk_offset_is_a_multiple_of_align(world):
    sizes = [1, 37, 24 * 37, 127, 128, 129, 5000, 3]
    for layout in (plan_layout(sizes, world, 600), plan_unit_layout([sizes[:3], sizes[3:5], sizes[5:]], world)):
        assert all(off % ALIGN == 0 for off in layout.offsets)
        assert all(b.offset % ALIGN == 0 and b.chunk % ALIGN == 0 for b in layout.buckets)
        for rank in range(world):
            assert all(p.shard_start % ALIGN == 0 or p.param_start > 0 for p in layout.pieces(rank))
            # a piece that starts inside its parameter starts a chunk: a multiple of ALIGN too
            assert all(p.chunk_start % ALIGN == 0 for p in layout.pieces(rank))
        # nothing of a parameter lies in another's slot: they end before the next one starts
        ends = [o + n for o, n in zip(layout.offsets, layout.numels)]
        assert all(end <= nxt for end, nxt in zip(ends, layout.offsets[1:]))


def test_buffers_start_aligned_and_restore_aligned_at_the_same_offset():
    for numel in (1, 7, 1000, 1 << 18):
        for dtype in (torch.float32, torch.bfloat16, torch.int8):
            t = aligned_zeros(numel, dtype, "cpu")
            view = t[numel // 2:]  # a view taken before a release sees the values after a restore
            assert _misaligned(t) == 0 and t.storage_offset() == 0
            for value in (1, 2, 3):
                release(t)
                assert t.untyped_storage().nbytes() == 0
                restore(t, zero=True)
                assert _misaligned(t) == 0 and int(t.abs().sum()) == 0
                t.fill_(value)
                assert int(view[-1]) == value
    assert _misaligned(aligned_empty(5, torch.float16, "cpu")) == 0
