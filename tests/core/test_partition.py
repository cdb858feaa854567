import pytest

import zkern
from zkern.core.partition import ALIGN, bucket_multiple, padded_numel, plan_layout, plan_unit_layout, shard_range
from zkern.testing import TrainSpec, engine_run, spawn


def test_shard_range_and_padding():
    assert padded_numel(10, 4) == 12 and padded_numel(12, 4) == 12 and padded_numel(1, 1) == 1
    assert [shard_range(10, r, 4) for r in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 3)]
    with pytest.raises(ValueError, match="rank 4 is outside world size 4"):
        shard_range(10, 4, 4)


@pytest.mark.parametrize("numels, world, bucket", [
    ([10, 7, 3], 4, 12), ([1], 4, 100), ([5, 5, 5, 5], 3, 5), ([1000, 17, 15, 1], 2, 64), ([7], 1, 3),
])
def test_layout_pieces_cover_every_element_exactly_once(numels, world, bucket):
    layout = plan_layout(numels, world, bucket)
    assert layout.total == sum(b.padded for b in layout.buckets)
    assert all(b.padded % bucket_multiple(world) == 0 and b.numel <= b.padded for b in layout.buckets)
    assert all(b.numel <= bucket or b.last - b.first == 1 for b in layout.buckets)  # only a lone big param overflows
    assert layout.shard_numel * world == layout.total
    seen = {p: [0] * n for p, n in enumerate(numels)}
    for rank in range(world):
        shard_used = 0
        for piece in layout.pieces(rank):
            for k in range(piece.param_start, piece.param_start + piece.numel):
                seen[piece.param][k] += 1
            b = layout.buckets[piece.bucket]
            # the piece sits where the flat layout says, inside the rank's chunk
            flat_start = layout.offsets[piece.param] + piece.param_start
            lo, size = layout.chunk_range(b, rank)
            assert lo <= flat_start and flat_start + piece.numel <= lo + size
            assert piece.shard_start == b.shard_offset + flat_start - lo
            shard_used += piece.numel
        assert shard_used <= layout.shard_numel
    assert all(count == 1 for counts in seen.values() for count in counts)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_chunk_and_shard_offset_is_256_byte_aligned(world):
    """Chunks start at multiples of ALIGN elements in the flat buffer, the shard and the optimizer's compact
    moments, so a whole-chunk kernel call on a 256-byte aligned buffer is 256-byte aligned in the 16-bit dtypes and
    fp32 (16-byte in int4); and the padding that buys it stays under one ALIGN per chunk."""
    assert ALIGN * 2 % 256 == 0 and ALIGN // 2 % 16 == 0  # 16-bit bytes of one ALIGN: whole 256-byte lines
    for layout in (plan_layout([10, 7, 3, 1000, 1, 129], world, 200),
                   plan_unit_layout([[3], [64, 1], [5, 5, 5], [4096]], world)):
        for b in layout.buckets:
            assert b.offset % ALIGN == 0 and b.shard_offset % ALIGN == 0 and b.chunk % ALIGN == 0
            assert all(layout.chunk_range(b, r)[0] % ALIGN == 0 for r in range(world))
            assert b.padded - b.numel < bucket_multiple(world)
        assert layout.shard_numel % ALIGN == 0


def test_estimate_memory_matches_the_zero_paper():
    # The paper's example: 7.5B parameters, 64 ranks, mixed-precision Adam (K = 12).
    psi, n = 7_500_000_000, 64
    expected_gb = {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.875}
    for stage, gb in expected_gb.items():
        total = zkern.estimate_memory(psi, n, stage)["total"]
        assert total / 1e9 == pytest.approx(gb, rel=5e-3)
    fp32 = zkern.estimate_memory(1000, 4, 1, precision="fp32")
    assert fp32 == {"params": 4000, "grads": 4000, "optimizer_states": 2000, "total": 10000, "host": 0}
    off = zkern.estimate_memory(1000, 4, 3, offload_optimizer=True, offload_param=True)
    assert off["optimizer_states"] == 0 and off["params"] == 0 and off["host"] == 3000 + 500
    assert zkern.estimate_memory(1000, 4, 3, offload_optimizer="cpu", offload_param=True) == off
    # NVMe: the optimizer's bytes (master and moments) go to the files, the parameter shard stays on the host
    nvme = zkern.estimate_memory(1000, 4, 3, offload_optimizer="nvme", offload_param=True)
    assert {k: nvme[k] for k in ("host", "nvme", "total")} == {"host": 500, "nvme": 3000, "total": off["total"]}
    nvme32 = zkern.estimate_memory(1000, 4, 2, offload_optimizer="nvme", precision="fp32")
    assert (nvme32["host"], nvme32["nvme"]) == (0, 2000 + 1000)  # moments + the fp32 master the files hold
    both = zkern.estimate_memory(1000, 4, 3, offload_optimizer="nvme", offload_param="nvme")
    assert (both["host"], both["nvme"]) == (0, 3000 + 500)
    params_only = zkern.estimate_memory(1000, 4, 3, offload_optimizer="cpu", offload_param="nvme")
    assert (params_only["host"], params_only["nvme"]) == (3000, 500)
    with pytest.raises(ValueError, match="offload_optimizer must be"):
        zkern.estimate_memory(1000, 4, 2, offload_optimizer="disk")
    with pytest.raises(ValueError, match="offload_param needs ZeRO stage 3"):
        zkern.estimate_memory(1000, 4, 2, offload_param=True)


def _adam_calls(rank: int, world: int, specs: list) -> list[list[tuple[int, list[int]]]]:
    """Per spec: every ops.adam_step_ call of two engine steps, as (elements, [address % 16 of each tensor])."""
    import zkern.ops

    real, calls = zkern.ops.adam_step_, []

    def recording(param, grad, exp_avg, exp_avg_sq, *, param_out=None, **kw):
        tensors = [t for t in (param, grad, exp_avg, exp_avg_sq, param_out) if t is not None]
        calls[-1].append((param.numel(), [t.data_ptr() % 16 for t in tensors], [t.element_size() for t in tensors]))
        return real(param, grad, exp_avg, exp_avg_sq, param_out=param_out, **kw)

    zkern.ops.adam_step_ = recording
    try:
        for s in specs:
            calls.append([])
            engine_run(rank, world, s)
    finally:
        zkern.ops.adam_step_ = real
    return calls


@pytest.mark.dist
def test_the_engines_optimizer_calls_are_16_byte_aligned():
    """Stages 1-3 in bf16 with decay/no-decay groups, world 2: at stages 1 and 2 every fused Adam call's tensors (the
    fp32 master, the bf16 gradient and copy, the moments) start on 16-byte boundaries; at stage 3, where a group's
    range may start inside a unit, they are all in one phase of 16 bytes (the same element offset modulo 16 bytes'
    worth), so a GPU launcher aligns all of them with one short head."""
    specs = [TrainSpec(stage=stage, precision="bf16", steps=2, config_groups=True) for stage in (1, 2, 3)]
    for per_spec in spawn(_adam_calls, 2, specs):
        for stage, calls in zip((1, 2, 3), per_spec):
            assert calls, stage
            for n, offsets, sizes in calls:
                if stage < 3:
                    assert offsets == [0] * len(offsets), (stage, n, offsets)
                else:  # one element count h brings every tensor to a 16-byte boundary
                    assert any(all((o + h * e) % 16 == 0 for o, e in zip(offsets, sizes)) for h in range(16)), (
                        stage, n, offsets, sizes)
