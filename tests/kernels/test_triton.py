"""zkern's Triton kernels against zkern.reference. Without a GPU they run under TRITON_INTERPRET=1 (set in
conftest.py before Triton is imported): the same kernels, executed by Triton's interpreter on the CPU.

    python -m pytest tests/kernels/test_triton.py -q
"""

import os

import pytest
import torch

import zkern.triton.adam as tadam
import zkern.triton.flatten as tflat
import zkern.triton.overflow as tover
import zkern.triton.quant as tquant
from zkern import reference
from zkern.testing import (
    TrainSpec,
    adam_drift_bound,
    assert_params_close,
    assert_within,
    engine_run,
    fp32_sum_rtol,
    same_bits_or_nan,
    spawn,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [1, 15, 17, 1000, 2**20 + 3]
BITS_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns, so that equality covers NaN and signed zero."""
    return t.view(BITS_OF[t.dtype]) if t.dtype in BITS_OF else t


def poisoned(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((n,), float("nan"), device=DEVICE).to(dtype)


def with_specials(x: torch.Tensor) -> torch.Tensor:
    """NaN at the first element, +inf in the middle, -inf at the last (as far as x has room)."""
    x = x.clone()
    x[0] = float("nan")
    if x.numel() > 2:
        x[x.numel() // 2] = float("inf")
        x[-1] = float("-inf")
    return x


def randn(n: int, dtype=torch.float32, scale=1.0, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + n)
    return (torch.randn(n, generator=g) * scale).to(dtype).to(DEVICE)


# -- flatten ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
def test_flatten_mixed_dtypes_equals_reference_bit_for_bit(n, out_dtype):
    tensors = [with_specials(randn(n, torch.float32)), randn(n, torch.float16, seed=1),
               randn(n, torch.bfloat16, seed=2)]
    expected = reference.flatten(tensors, out_dtype)
    out = poisoned(expected.numel(), out_dtype)
    got = tflat.flatten(tensors, out_dtype, out=out)
    assert got is out and same_bits_or_nan(got.cpu(), expected.cpu())


def test_flatten_of_many_tensors_with_alignment_and_padding():
    g = torch.Generator().manual_seed(3)
    sizes = torch.randint(1, 300, (300,), generator=g).tolist()
    tensors = [randn(s, DTYPES[i % 3], seed=i).view(-1) for i, s in enumerate(sizes)]
    for align, pad_to in ((1, 1), (8, 1), (16, 1024)):
        expected = reference.flatten(tensors, torch.bfloat16, align=align, pad_to=pad_to)
        got = tflat.flatten(tensors, torch.bfloat16, align=align, pad_to=pad_to,
                            out=poisoned(expected.numel(), torch.bfloat16))
        assert torch.equal(bits(got), bits(expected)), (align, pad_to)
        # and back: every tensor in its own dtype, from poisoned destinations
        back = [torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEVICE) for t in tensors]
        back_ref = [b.clone() for b in back]
        tflat.unflatten_into_(got, back, align=align)
        reference.unflatten_into_(got, back_ref, align=align)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(back, back_ref))


@pytest.mark.parametrize("shift", [0, 3], ids=["aligned", "one-tensor-off-16-bytes"])
def test_flatten_takes_its_aligned_path_exactly_when_every_address_and_length_allows_it(shift):
    """The ALIGNED specialisation (128-bit vectors, tensors addressed from the flat buffer's pointer) is chosen when
    every address is 16-byte aligned and every length and slot a multiple of 16, and both paths give the
    reference's bits in both directions, over mixed dtypes."""
    storage = randn(1024 + 16, torch.float32, seed=5)
    tensors = [storage[shift:shift + 1024].view(32, 32), randn(64, torch.float16, seed=6),
               randn(48, torch.bfloat16, seed=7)]
    expected = reference.flatten(tensors, torch.float32, align=16)
    out = poisoned(expected.numel(), torch.float32)
    assert tflat._aligned(tensors, out, 16) == (shift == 0)
    assert tflat._aligned(tensors, out, 24) is False  # a slot of 1032 elements is not a multiple of 16
    assert same_bits_or_nan(tflat.flatten(tensors, torch.float32, align=16, out=out).cpu(), expected.cpu())
    back = [torch.full(t.shape, float("nan"), dtype=t.dtype, device=DEVICE) for t in tensors]
    tflat.unflatten_into_(out, back, align=16)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(back, tensors))


def test_flatten_edges_empty_list_shapes_and_bad_input():
    assert tflat.flatten([]).numel() == 0
    mats = [randn(12).view(3, 4), randn(5)]
    assert torch.equal(tflat.flatten(mats), reference.flatten(mats))
    assert [t.shape for t in tflat.unflatten(tflat.flatten(mats), mats)] == [(3, 4), (5,)]
    with pytest.raises(ValueError, match="not contiguous"):
        tflat.flatten([randn(12).view(3, 4).t()])
    with pytest.raises(TypeError, match="mixed dtypes"):
        tflat.flatten([randn(2), randn(2, torch.float16)])
    with pytest.raises(TypeError, match="must be"):
        tflat.flatten([torch.zeros(3, dtype=torch.int32, device=DEVICE)])
    with pytest.raises(ValueError, match="at least 17 elements"):
        tflat.unflatten_into_(randn(10), [randn(17)])


def test_flatten_reuses_a_cached_table_only_for_the_same_addresses_lengths_and_dtypes():
    """The table is cached by its exact key: new values at the same addresses are read afresh, a list that differs
    in one tensor's length, dtype or address builds its own table, and the cache stays bounded."""
    base = randn(4096, seed=1)
    tensors = [base[:1000], base[1000:3000], base[3000:]]
    assert torch.equal(tflat.flatten(tensors), reference.flatten(tensors))
    hits = len(tflat._tables_cache)
    base.mul_(-2.0)  # the same addresses, new values
    assert torch.equal(tflat.flatten(tensors), reference.flatten(tensors)) and len(tflat._tables_cache) == hits
    for other in ([base[:999], base[1000:3000], base[3000:]],  # a length
                  [base[:1000], base[1000:3000], base[3000:].to(torch.bfloat16)],  # a dtype
                  [base[1:1001], base[1000:3000], base[3000:]]):  # an address
        assert torch.equal(tflat.flatten(other, torch.float32), reference.flatten(other, torch.float32))
    for k in range(tflat.TABLE_CACHE_SIZE + 3):
        tflat.flatten([randn(5 + k)])
    assert len(tflat._tables_cache) == tflat.TABLE_CACHE_SIZE


# -- unscale_and_check_ -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inv_scale", [0.125, 1.0])
def test_unscale_and_check_equals_reference(n, dtype, inv_scale):
    x = randn(n, dtype, scale=100.0)
    a, b = x.clone(), x.clone()
    found, sq = tover.unscale_and_check_(a, inv_scale)
    found_ref, sq_ref = reference.unscale_and_check_(b, inv_scale)
    assert torch.equal(bits(a), bits(b))  # the unscaled buffer, bit for bit
    assert found.item() == found_ref.item() == 0.0
    # the same fp32 sum in another order: each within fp32_sum_rtol of the exact sum, so within twice that apart
    assert sq.item() == pytest.approx(sq_ref.item(), rel=2 * fp32_sum_rtol(n))
    assert found.device == x.device and sq.device == x.device  # stays on the device: no host sync


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_unscale_and_check_finds_every_non_finite_position(dtype, where, value):
    n = 2**13 + 5  # three programs: the positions fall in the first, second and last
    x = randn(n, dtype)
    x[{"first": 0, "middle": n // 2, "last": n - 1}[where]] = value
    found, _ = tover.unscale_and_check_(x, 0.5)
    assert found.item() == 1.0


def test_unscale_and_check_edges():
    found, sq = tover.unscale_and_check_(torch.empty(0, device=DEVICE), 0.5)
    assert found.item() == 0.0 and sq.item() == 0.0
    with pytest.raises(ValueError, match="not contiguous"):
        tover.unscale_and_check_(randn(20)[::2], 1.0)


# -- quantization -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("bits_", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_quantize_equals_reference_and_rounds_to_nearest(n, bits_, dtype):
    group = 64
    x = randn(n, dtype, scale=3.0)
    q, s = tquant.quantize(x, bits_, group)
    q_ref, s_ref = reference.quantize(x, bits_, group)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    out = tquant.dequantize(q, s, bits_, group, n, out=poisoned(n, torch.float32))
    assert torch.equal(out, reference.dequantize(q_ref, s_ref, bits_, group, n))
    # every element within half a step of its group's scale (round to nearest), plus the fp32 rounding of x * (1 /
    # scale) and of code * scale: a few units in the last place of x
    step = s.repeat_interleave(group)[:n]
    slack = 4 * torch.finfo(torch.float32).eps * x.float().abs()
    assert ((out - x.float()).abs() <= step / 2 + slack).all()


@pytest.mark.parametrize("bits_", [8, 4])
def test_quantize_codes_round_trip_exactly(bits_):
    """Values that are exact multiples of their group's step come back exactly: the int4 nibble packing and
    unpacking (low nibble first, code + 8) loses nothing."""
    qmax, group, n = reference.QMAX[bits_], 32, 32 * 5 + 7
    g = torch.Generator().manual_seed(5)
    codes = torch.randint(-qmax, qmax + 1, (n,), generator=g).float()
    codes[::group] = qmax  # each group's absmax is exactly qmax steps
    step = torch.rand(n // group + 1, generator=g).repeat_interleave(group)[:n] + 0.5
    x = (codes * step).to(DEVICE)
    q, s = tquant.quantize(x, bits_, group)
    assert torch.equal(tquant.dequantize(q, s, bits_, group, n), x)


def test_quantize_zero_groups_short_tails_and_non_finite_groups():
    x = randn(100, scale=2.0)
    x[32:64] = 0.0  # an all-zero group
    x[70] = float("inf")  # group 2 (64..95) is bad
    for bits_ in (8, 4):
        q, s = tquant.quantize(x, bits_, 32)
        q_ref, s_ref = reference.quantize(x, bits_, 32)
        assert torch.equal(q, q_ref) and torch.equal(bits(s), bits(s_ref))
        assert s[1].item() == 0.0 and torch.isnan(s[2]) and s.numel() == 4  # the 4-element tail is a group
        d = tquant.dequantize(q, s, bits_, 32, 100)
        assert (d[32:64] == 0).all() and d[64:96].isnan().all() and torch.isfinite(d[:32]).all()
        assert torch.isfinite(d[96:]).all()
    with pytest.raises(ValueError, match="power of two"):
        tquant.quantize(x, 8, 48)
    with pytest.raises(ValueError, match="8 or 4"):
        tquant.quantize(x, 2, 32)


@pytest.mark.parametrize("bits_", [8, 4])
@pytest.mark.parametrize("n", [17, 1000, 2**16 + 3])
def test_dequant_sum_equals_the_sum_of_dequantized_chunks(bits_, n):
    world, group = 3, 128
    chunks = [tquant.quantize(randn(n, seed=r), bits_, group) for r in range(world)]
    q = torch.stack([c[0] for c in chunks])
    s = torch.stack([c[1] for c in chunks])
    got = tquant.dequant_sum(q, s, bits_, group, n, out=poisoned(n, torch.float32))
    # Bit for bit: the kernel adds the rounded products in rank order, as the reference does (compiled, only with
    # contraction off: LAUNCH_OPTIONS).
    assert torch.equal(got, reference.dequant_sum(q, s, bits_, group, n))


def test_dequant_sum_takes_each_ranks_slice_of_one_message_buffer():
    """qgZ's receive side: codes and scales are the leading bytes and the tail of each rank's row in one buffer,
    so q is a row-strided view (the launcher once refused it: the engine's first multi-rank GPU run would fail)."""
    world, group, n = 2, 64, 1000
    chunks = [tquant.quantize(randn(n, seed=r), 4, group) for r in range(world)]
    codes = chunks[0][0].numel()
    message = torch.cat([torch.cat([c[0], c[1].view(torch.uint8)]).view(1, -1) for c in chunks])
    q = message[:, :codes]
    assert not q.is_contiguous() and q.stride(1) == 1
    s = torch.stack([c[1] for c in chunks])
    got = tquant.dequant_sum(q, s, 4, group, n)
    expected = sum(reference.dequantize(c[0], c[1], 4, group, n) for c in chunks)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="not contiguous"):  # a column-strided q is still refused
        tquant.dequant_sum(message.t().contiguous().t()[:, :codes], s, 4, group, n)


# -- Adam ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_adam_matches_torch_over_5_steps_and_writes_the_copy(n, grad_dtype, adamw):
    lr, wd = 1e-2, 0.1
    p0 = randn(n)
    p, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
    ref = torch.nn.Parameter(p0.clone())
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)([ref], lr=lr, weight_decay=wd, foreach=False)
    out_dtype = torch.bfloat16 if grad_dtype != torch.float16 else torch.float16
    grads = []
    for step in range(1, 6):
        g = randn(n, grad_dtype, seed=step)
        grads.append(g.cpu())
        out = poisoned(n, out_dtype)
        tadam.adam_step_(p, g, m, v, step=step, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, adamw=adamw,
                         param_out=out)
        ref.grad = g.float()
        opt.step()
        assert torch.equal(bits(out), bits(p.to(out_dtype)))
    # within twice the drift the arithmetic allows two correct fp32 Adams (adam_drift_bound's derivation)
    bounds = adam_drift_bound(p0.cpu(), grads, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, adamw=adamw)
    state = opt.state[ref]
    for name, a, e, bound in zip(("param", "exp_avg", "exp_avg_sq"), (p, m, v),
                                 (ref.detach(), state["exp_avg"], state["exp_avg_sq"]), bounds):
        assert_within(a.cpu(), e.cpu(), 2 * bound, f"{name} (n={n})")


@pytest.mark.parametrize("start", [0, 3, 5])
@pytest.mark.parametrize("n", [40, 1000])
def test_sub_ranges_are_split_into_head_aligned_body_and_tail_and_equal_the_reference(start, n):
    """An optimizer piece param[lo:hi] starts off a 16-byte boundary and has a ragged length: the launchers split it
    into a head, a 128-bit body and a tail (three launches); every element is updated once, as the reference."""
    from zkern.reference import aligned_segments

    p0, g = randn(start + n + 7, seed=1), randn(start + n + 7, torch.bfloat16, seed=2)
    got = [p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), poisoned(start + n + 7, torch.bfloat16)]
    want = [p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0), poisoned(start + n + 7, torch.bfloat16)]
    pieces = [t[start:start + n] for t in got]
    segments = aligned_segments(n, [*pieces, g[start:start + n]])
    assert start == 0 or len(segments) == 3  # fp32 and bf16 views both align after 16 - start % 16... elements
    for step in (1, 2):
        tadam.adam_step_(*pieces[:1], g[start:start + n], *pieces[1:3], step=step, lr=1e-2, betas=(0.9, 0.999),
                         eps=1e-8, weight_decay=0.1, adamw=True, param_out=pieces[3])
        reference.adam_step_(want[0][start:start + n], g[start:start + n], want[1][start:start + n],
                             want[2][start:start + n], step=step, lr=1e-2, betas=(0.9, 0.999), eps=1e-8,
                             weight_decay=0.1, adamw=True, param_out=want[3][start:start + n])
    for a, b in zip(got, want):  # outside the piece untouched (NaN stays NaN), inside within the Adam drift
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-6, atol=1e-6, equal_nan=True)
    for where in (0, n // 2, n - 1):  # a non-finite value in the head, the body and the tail is found
        x = randn(start + n, torch.float16)[start:]
        x[where] = float("inf")
        assert tover.unscale_and_check_(x, 0.5)[0].item() == 1.0
    x = randn(start + n, torch.float16, scale=100.0)
    a, b = x[start:].clone(), x[start:].clone()
    found, sq = tover.unscale_and_check_(x[start:], 0.5)
    reference.unscale_and_check_(b, 0.5)
    assert torch.equal(bits(x[start:]), bits(b)) and found.item() == 0.0
    assert sq.item() == pytest.approx(reference.unscale_and_check_(a, 0.5)[1].item(), rel=2 * fp32_sum_rtol(n))


def test_adam_bad_input():
    z = torch.zeros(8, device=DEVICE)
    with pytest.raises(TypeError, match="param must be"):
        tadam.adam_step_(z.half(), z, z, z, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                         adamw=True)
    with pytest.raises(ValueError, match="not contiguous"):
        tadam.adam_step_(torch.zeros(16, device=DEVICE)[::2], z, z, z, step=1, lr=1e-3, betas=(0.9, 0.999),
                         eps=1e-8, weight_decay=0, adamw=True)


# -- the engine on the Triton backend -----------------------------------------------------------------------------
def engine_runs_with_backend(rank, world, backend, specs):
    os.environ["ZKERN_BACKEND"] = backend
    from zkern import ops

    assert ops.backend_for(torch.empty(1), "adam_step_") == backend
    return [engine_run(rank, world, s) for s in specs]


@pytest.mark.dist
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU ranks reach the kernels only under the interpreter, "
                    "which a GPU machine does not set; there the kernels above run compiled")
def test_engine_on_the_triton_backend_equals_the_reference_backend():
    # The views the engine hands the kernels (optimizer pieces, bucket slices, qgZ's received messages) meet the
    # launchers' checks here: qgZ's row-strided codes once failed on the Triton path only.
    specs = [TrainSpec(stage=2, steps=5, reduce_bucket_size=5000), TrainSpec(stage=3, steps=5, precision="bf16"),
             TrainSpec(stage=1, steps=4, precision="fp16"),
             TrainSpec(stage=3, steps=4, zero={"zero_quantized_gradients": True, "zero_quantized_weights": True,
                                               "stage3_param_persistence_threshold": 0})]
    triton_runs = spawn(engine_runs_with_backend, 2, "triton", specs)
    reference_runs = spawn(engine_runs_with_backend, 2, "reference", specs)
    for i, spec in enumerate(specs):
        # fp32: float32 rounding. bf16: a last-place difference in an fp32 master can flip the bf16 rounding of that
        # parameter, which the next forward sees, so the bar there is bf16's precision.
        rtol = 1e-5 if spec.precision == "fp32" else 2**-8 if spec.precision == "bf16" else 2**-10
        # qgZ/qwZ: a last-place difference upstream (the two Adams round apart) can flip one int4/int8 code, which
        # moves that gradient element by a whole quantization step; Adam moves an element by about lr per step
        # whatever its gradient, so runs that agree stay within lr per step (lr_units=1) and no closer.
        quantized = bool(spec.zero)
        assert_params_close(triton_runs[0][i]["state"], reference_runs[0][i]["state"], lr=spec.lr, steps=spec.steps,
                            rtol=rtol, lr_units=1.0 if quantized else 1e-3)
        assert triton_runs[0][i]["losses"] == pytest.approx(reference_runs[0][i]["losses"],
                                                            rel=1e-3 if quantized else rtol)
