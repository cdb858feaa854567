"""zkern.reference against torch itself: these ops are the ground truth every backend is tested against."""

import pytest
import torch

from zkern import ops, reference
from zkern.testing import fp32_sum_rtol

SIZES = [1, 15, 17, 1000, 2**20 + 3]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_flatten_unflatten_round_trip(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g) for s in (1, 15, 17, 3)] + [torch.randn(2, 3, generator=g)]
    flat = ops.flatten(tensors, dtype)
    assert flat.dtype == dtype and flat.numel() == sum(t.numel() for t in tensors)
    back = ops.unflatten(torch.cat([flat, torch.full((5,), float("nan"), dtype=dtype)]), tensors)
    for b, t in zip(back, tensors):
        assert b.shape == t.shape
        torch.testing.assert_close(b, t.to(dtype), atol=0, rtol=0)
    assert ops.flatten([]).numel() == 0
    with pytest.raises(TypeError, match="mixed dtypes"):
        ops.flatten([torch.ones(2), torch.ones(2, dtype=torch.float16)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("size", SIZES)
def test_unscale_and_check(dtype, size):
    g = torch.Generator().manual_seed(size)
    x = (torch.randn(size, generator=g) * 100).to(dtype)
    expect = x.float() * 0.125
    y = x.clone()
    found, sq = ops.unscale_and_check_(y, 0.125)
    assert found.item() == 0.0
    torch.testing.assert_close(y, expect.to(dtype), atol=0, rtol=0)
    exact = (expect.double() ** 2).sum()
    assert abs(sq.double() - exact) <= fp32_sum_rtol(size) * exact  # fp32 sum in torch's order (fp32_sum_rtol)
    for pos in {0, size // 2, size - 1}:
        for bad in (float("inf"), float("-inf"), float("nan")):
            z = x.clone()
            z[pos] = bad
            assert ops.unscale_and_check_(z, 1.0)[0].item() == 1.0


def test_check_flags_only_non_finite_elements():
    huge = torch.full((8,), 1e20)  # finite, but the fp32 sum of squares overflows
    found, sq = ops.unscale_and_check_(huge, 1.0)
    assert found.item() == 0.0 and sq.item() == float("inf")
    found, sq = ops.unscale_and_check_(torch.empty(0), 1.0)
    assert found.item() == 0.0 and sq.item() == 0.0


@pytest.mark.parametrize("grad_scale", [1.0, 0.5])
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("grad_dtype", DTYPES)
def test_adam_matches_torch_over_5_steps(adamw, grad_dtype, grad_scale):
    """grad_scale 1: torch's formulas bit for bit. Folded scale: float32 rounding (a few units in the last place of
    the moments; after 5 steps of lr 1e-2 the parameters agree to ~1e-7 absolute)."""
    exact = grad_scale == 1.0
    g = torch.Generator().manual_seed(7)
    p0 = torch.randn(1000, generator=g)
    ref = p0.clone().requires_grad_(True)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([ref], lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
    p, m, v = p0.clone(), torch.zeros(1000), torch.zeros(1000)
    out = torch.full((1000,), float("nan"), dtype=torch.bfloat16)
    for step in range(1, 6):
        grad = torch.randn(1000, generator=g).to(grad_dtype)
        ref.grad = grad.float() * grad_scale
        opt.step()
        reference.adam_step_(p, grad, m, v, step=step, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1,
                             adamw=adamw, grad_scale=grad_scale, param_out=out)
        torch.testing.assert_close(p, ref.detach(), atol=0 if exact else 1e-6, rtol=0 if exact else 1e-6)
        torch.testing.assert_close(out, p.to(torch.bfloat16), atol=0, rtol=0)


def test_adam_rejects_bad_input():
    z = torch.zeros(4)
    with pytest.raises(TypeError, match="param must be float32"):
        reference.adam_step_(z.half(), z, z, z, step=1, lr=1, betas=(0.9, 0.9), eps=1e-8, weight_decay=0, adamw=True)
    with pytest.raises(ValueError, match="step counts from 1"):
        reference.adam_step_(z, z, z, z, step=0, lr=1, betas=(0.9, 0.9), eps=1e-8, weight_decay=0, adamw=True)
    with pytest.raises(TypeError, match="flat_grad must be float32, float16 or bfloat16"):
        reference.unscale_and_check_(torch.zeros(3, dtype=torch.int32), 1.0)


def test_forcing_a_missing_backend_is_an_error(monkeypatch):
    from zkern import cuda

    # as on a machine whose torch has CUDA but no nvcc: the CUDA C++ kernels cannot be built, and the error says why
    monkeypatch.delitem(ops.AVAILABLE, "cuda", raising=False)
    monkeypatch.setattr(cuda, "why_unavailable", lambda: "nvcc is not installed (pip install nvidia-cuda-nvcc)")
    monkeypatch.setenv("ZKERN_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match=r"no cuda kernels here \(nvcc is not installed"):
        ops.flatten([torch.ones(2)])
    monkeypatch.delitem(ops.AVAILABLE, "triton", raising=False)  # as on a machine without Triton or a GPU
    monkeypatch.setenv("ZKERN_BACKEND", "triton")
    with pytest.raises(RuntimeError, match="no triton kernels here"):
        ops.flatten([torch.ones(2)])
    monkeypatch.setenv("ZKERN_BACKEND", "nope")
    with pytest.raises(ValueError, match="not a backend"):
        ops.flatten([torch.ones(2)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_buffers_sum_of_squares_is_as_accurate_as_a_short_ones(dtype):
    """A gradient bucket of 2^26 elements (a 7B model's buckets hold 2e8): a CPU torch.dot adds each vector lane
    sequentially in fp32, and its sum came out 1.3e-3 low here in fp32 and 7e-4 for bf16 values (0.8% at 2e8), so
    zkern's gradient norm and its clipping were off on a CPU. Partials of NORM_CHUNK elements are held to
    fp32_sum_rtol(NORM_CHUNK), whatever the length."""
    g = torch.Generator().manual_seed(26)
    x = torch.randn(1 << 26, generator=g).to(dtype)
    exact = float(x.double().square().sum())
    bound = fp32_sum_rtol(reference.NORM_CHUNK)
    _, sq = ops.unscale_and_check_(x, 1.0)
    assert abs(float(sq) - exact) <= bound * exact, (float(sq) / exact - 1, bound)
    assert abs(float(reference.sum_of_squares(x)) - exact) <= bound * exact
