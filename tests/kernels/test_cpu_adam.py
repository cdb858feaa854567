"""The fused CPU Adam (zkern.cpu) against torch.optim.AdamW / Adam, on every ISA path this machine has.

    python -m pytest tests/kernels/test_cpu_adam.py -q

"To float32 rounding" here means: every element within 8 units in the last place of the larger of its
expected value and the scale of the terms that formed it (lr times the steps taken for a parameter, since each
update is about lr in size and carries its own rounding; the gradient's magnitude for exp_avg, whose lerp can
cancel), because fused multiply-adds
and a reciprocal square root of the bias correction round differently from torch's separate ops.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import zkern
import zkern.cpu
from zkern import reference
from zkern.cpu import _ext
from zkern.testing import adam_drift_bound, assert_f32_rounding, assert_within, same_bits_or_nan


def test_the_extension_is_built_and_has_a_vector_path():
    """`pip install -e .` builds it; a missing build fails here rather than skipping the tests below."""
    assert _ext.available(), f"{_ext.LOAD_ERROR}; {_ext.BUILD_HINT}"
    assert "scalar" in _ext.SUPPORTED

SIZES = [1, 15, 16, 17, 1000, 2**20 + 3]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def run_both(n: int, grad_dtype: torch.dtype, adamw: bool, isa: str, *, steps: int = 10, grad_scale: float = 1.0,
             threads: int | None = None):
    """(zkern tensors, torch optimizer state) after `steps` steps from the same start and gradients."""
    gen = torch.Generator().manual_seed(n)
    start = torch.randn(n, generator=gen)
    grads = [torch.randn(n, generator=gen).to(grad_dtype) for _ in range(steps)]
    lr, wd = 1e-2, 0.1
    p, m, v = start.clone(), torch.zeros(n), torch.zeros(n)
    for s, g in enumerate(grads, 1):
        _ext.adam_step_(p, g, m, v, step=s, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, adamw=adamw,
                        grad_scale=grad_scale, isa=isa, threads=threads)
    tp = torch.nn.Parameter(start.clone())
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls([tp], lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, foreach=False)
    for g in grads:
        tp.grad = g.float() * grad_scale
        opt.step()
    return (p, m, v), (tp.detach(), opt.state[tp]["exp_avg"], opt.state[tp]["exp_avg_sq"]), grads


@pytest.mark.parametrize("isa", _ext.SUPPORTED)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def assert_adam_close(zkern_state, torch_state, grads, adamw: bool, grad_scale: float, what: str) -> None:
    """Within twice adam_drift_bound: the drift the arithmetic allows between two correct fp32 Adams."""
    start = torch.randn(zkern_state[0].numel(), generator=torch.Generator().manual_seed(zkern_state[0].numel()))
    bounds = adam_drift_bound(start, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, adamw=adamw,
                              grad_scale=grad_scale)
    for name, a, e, bound in zip(("param", "exp_avg", "exp_avg_sq"), zkern_state, torch_state, bounds):
        assert_within(a, e, 2 * bound, f"{name} ({what})")


@pytest.mark.parametrize("isa", _ext.SUPPORTED)
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
def test_ten_steps_match_torch(n, grad_dtype, adamw, isa):
    zkern_state, torch_state, grads = run_both(n, grad_dtype, adamw, isa)
    assert_adam_close(zkern_state, torch_state, grads, adamw, 1.0, f"{isa}, n={n}")


@pytest.mark.parametrize("isa", _ext.SUPPORTED)
def test_grad_scale_is_applied_to_the_upcast_gradient(isa):
    zkern_state, torch_state, grads = run_both(1000, torch.bfloat16, True, isa, grad_scale=0.37)
    assert_adam_close(zkern_state, torch_state, grads, True, 0.37, isa)


def test_the_drift_bound_fails_a_wrong_adam():
    """The comparison is not vacuous: leaving out the weight decay, or one step's bias correction, fails it."""
    zkern_state, torch_state, grads = run_both(1000, torch.float32, True, "scalar")
    start = torch.randn(1000, generator=torch.Generator().manual_seed(1000))
    bound = adam_drift_bound(start, grads, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, adamw=True)[0]
    no_decay = torch_state[0] + 1e-2 * 0.1 * torch_state[0]  # about what 10 steps of decay moved
    with pytest.raises(AssertionError, match="beyond its bound"):
        assert_within(zkern_state[0], no_decay, 2 * bound, "param")
    assert (2 * bound).max() < 1e-4  # far below lr, the size of one Adam step


def test_results_do_not_depend_on_the_thread_count():
    one, _, _ = run_both(2**20 + 3, torch.bfloat16, True, _ext.SUPPORTED[0], steps=2, threads=1)
    two, _, _ = run_both(2**20 + 3, torch.bfloat16, True, _ext.SUPPORTED[0], steps=2, threads=2)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def _special_values(n: int) -> torch.Tensor:
    """Random bit patterns (every class: subnormals, huge values, NaN payloads) plus NaN/inf at both ends and
    the middle, and the fp16/bf16 rounding edges."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randint(-(2**31), 2**31 - 1, (n,), generator=gen, dtype=torch.int64).to(torch.int32).view(torch.float32)
    x = x.clone()
    edges = torch.tensor([65504.0, 65519.996, 65520.0, -65520.0, 2.0**-24, 2.0**-25, 1.5 * 2.0**-25, 2.0**-14,
                          1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11, 1.0 + 2.0**-8, 3.0e38, -0.0, 0.0])
    x[1:1 + edges.numel()] = edges[: max(0, min(edges.numel(), n - 1))]
    for i, value in ((0, float("nan")), (n // 2, float("inf")), (n - 1, float("-inf"))):
        x[i] = value
    return x


@pytest.mark.parametrize("isa", _ext.SUPPORTED)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("out_offset", [0, 1], ids=["aligned", "unaligned"])
@pytest.mark.parametrize("n", [17, 1000, 2**16 + 5])
def test_low_precision_copy_is_torch_cast_bit_for_bit(n, out_offset, out_dtype, isa):
    """Aligned outputs take the streaming stores, an output one element off alignment the plain ones. Bit for bit
    with torch's cast, a NaN's payload aside (torch's own differs by CPU: same_bits_or_nan)."""
    p = _special_values(n)
    for grad_dtype in GRAD_DTYPES:
        # poisoned: every element must be written
        out = torch.full((n + out_offset,), float("nan")).to(out_dtype)[out_offset:]
        # A zero gradient with lr 0 leaves every value in place (NaN quieted), so the copy sees them all.
        _ext.adam_step_(p, torch.zeros(n, dtype=grad_dtype), torch.zeros(n), torch.zeros(n), step=1, lr=0.0,
                        betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True, param_out=out, isa=isa)
        expected = p.to(out_dtype)
        bits = torch.int32 if out_dtype == torch.float32 else torch.int16
        assert same_bits_or_nan(out, expected), (
            f"{isa}: {(out.view(bits) != expected.view(bits)).sum()} of {n} elements differ from p.to({out_dtype})")


@pytest.mark.parametrize("isa", _ext.SUPPORTED)
def test_nan_and_inf_gradients_propagate_as_in_torch(isa):
    n = 33
    g = torch.randn(n)
    g[0], g[16], g[32] = float("nan"), float("inf"), float("-inf")
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    tp = torch.nn.Parameter(p.clone())
    _ext.adam_step_(p, g, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True, isa=isa)
    opt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=0.0)
    tp.grad = g.clone()
    opt.step()
    assert torch.equal(p.isnan(), tp.detach().isnan())
    finite = ~p.isnan()
    assert_f32_rounding(p[finite], tp.detach()[finite], 1e-3, "finite params")


def _train(opt, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


@pytest.mark.parametrize("adamw", [True, False], ids=["adamw", "adam"])
def test_state_dict_moves_between_cpu_adam_and_torch_both_ways(adamw):
    torch_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    shapes = [(7, 5), (17,), (3, 4, 2)]
    start = [torch.randn(s) for s in shapes]
    hyper = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-7, weight_decay=0.05)

    def fresh():
        return [torch.nn.Parameter(t.clone()) for t in start]

    # zkern -> torch: 3 steps in CPUAdam, then both continue 3 steps from CPUAdam's state.
    a, b = fresh(), fresh()
    za = zkern.cpu.CPUAdam(a, adamw_mode=adamw, **hyper)
    _train(za, a, 3, seed=1)
    for pa, pb in zip(a, b):
        pb.data.copy_(pa.data)
    tb = torch_cls(b, **hyper)
    tb.load_state_dict(copy.deepcopy(za.state_dict()))  # as through a checkpoint file: torch's
    # loader keeps tensors that already fit, so without a copy both optimizers would step one set of moments
    _train(za, a, 3, seed=2)
    _train(tb, b, 3, seed=2)
    for pa, pb in zip(a, b):
        assert_f32_rounding(pa.detach(), pb.detach(), hyper["lr"] * 6, "zkern -> torch")
        assert float(za.state[pa]["step"]) == float(tb.state[pb]["step"]) == 6.0

    # torch -> zkern.
    c, d = fresh(), fresh()
    tc = torch_cls(c, **hyper)
    _train(tc, c, 3, seed=3)
    for pc, pd in zip(c, d):
        pd.data.copy_(pc.data)
    zd = zkern.cpu.CPUAdam(d, **hyper)  # the loaded groups bring torch's decoupled_weight_decay with them
    zd.load_state_dict(copy.deepcopy(tc.state_dict()))
    assert zd.param_groups[0]["decoupled_weight_decay"] is adamw
    _train(tc, c, 3, seed=4)
    _train(zd, d, 3, seed=4)
    for pc, pd in zip(c, d):
        assert_f32_rounding(pd.detach(), pc.detach(), hyper["lr"] * 6, "torch -> zkern")
    assert set(zd.state_dict()["param_groups"][0]) == set(tc.state_dict()["param_groups"][0])


def test_fallback_without_the_extension_warns_once_and_steps_as_torch(monkeypatch):
    import zkern.cpu.adam as cpu_adam

    monkeypatch.setattr(_ext, "EXT", None)
    monkeypatch.setattr(_ext, "LOAD_ERROR", "zkern.cpu._adam_ext is not importable (test)")
    monkeypatch.setattr(cpu_adam, "_warned_fallback", False)
    start = torch.randn(100)
    a, b = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    za, tb = zkern.cpu.CPUAdam([a], lr=1e-2), torch.optim.AdamW([b], lr=1e-2, foreach=False)
    with pytest.warns(UserWarning, match="pip install -e") as caught:
        for _ in range(3):
            a.grad = b.grad = torch.randn(100)
            za.step()
            tb.step()
    assert len([w for w in caught if "CPUAdam" in str(w.message)]) == 1
    assert torch.equal(a.detach(), b.detach())  # zkern.reference is torch's formulas bit for bit
    assert not zkern.cpu.status()["extension"]


def test_env_report_names_the_fallback_when_the_extension_cannot_load():
    code = ("import sys; sys.modules['zkern.cpu._adam_ext'] = None\n"
            "from zkern import env_report, ops\n"
            "r = env_report.report()\n"
            "print(r['cpu_adam']['extension'], r['cpu_adam']['active'], r['backends']['adam_step_ on CPU tensors'])\n"
            "print(r['cpu_adam']['reason'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.splitlines()[0] == "False torch fallback reference"
    assert "not importable" in out


def test_forcing_an_isa(monkeypatch):
    monkeypatch.setenv("ZKERN_CPU_ISA", "scalar")
    assert zkern.cpu.active_isa() == "scalar"
    assert zkern.cpu.status()["why"] == "forced by ZKERN_CPU_ISA"
    monkeypatch.setenv("ZKERN_CPU_ISA", "sse9")
    with pytest.raises(ValueError, match="ZKERN_CPU_ISA='sse9' is not a path"):
        zkern.cpu.active_isa()
    if "avx512" not in _ext.SUPPORTED:
        monkeypatch.setenv("ZKERN_CPU_ISA", "avx512")
        with pytest.raises(RuntimeError, match="cannot run it"):
            zkern.cpu.active_isa()


def test_ops_dispatches_host_adam_to_the_extension(monkeypatch):
    from zkern import ops

    assert ops.backend_for(torch.empty(1), "adam_step_") == "cpu"
    assert ops.backend_for(torch.empty(1), "flatten") == "reference"
    monkeypatch.setenv("ZKERN_BACKEND", "reference")
    assert ops.backend_for(torch.empty(1), "adam_step_") == "reference"


@pytest.mark.parametrize("bad, error, match", [
    (dict(param=torch.zeros(8, dtype=torch.float16)), TypeError, "param must be torch.float32"),
    (dict(grad=torch.zeros(8, dtype=torch.int32)), TypeError, "grad must be"),
    (dict(grad=torch.zeros(9)), ValueError, "grad has 9 elements"),
    (dict(exp_avg=torch.zeros(16)[::2]), ValueError, "exp_avg is not contiguous"),
    (dict(param_out=torch.zeros(8, dtype=torch.int8)), TypeError, "param_out must be"),
    (dict(step=0), ValueError, "step counts from 1"),
])
def test_bad_input_is_refused_with_a_reason(bad, error, match):
    args = dict(param=torch.zeros(8), grad=torch.zeros(8), exp_avg=torch.zeros(8), exp_avg_sq=torch.zeros(8),
                step=1, param_out=None)
    args.update(bad)
    with pytest.raises(error, match=match):
        _ext.adam_step_(args.pop("param"), args.pop("grad"), args.pop("exp_avg"), args.pop("exp_avg_sq"), lr=1e-3,
                        betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True, **args)


def test_reference_and_extension_agree_through_ops():
    """ops.adam_step_ (the engine's door) on host tensors equals the reference to float32 rounding."""
    n = 5000
    p, g = torch.randn(n), torch.randn(n).bfloat16()
    p2, m, v, m2, v2 = p.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    zkern.ops.adam_step_(p, g, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw=True,
                         grad_scale=0.5, param_out=out)
    reference.adam_step_(p2, g, m2, v2, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw=True,
                         grad_scale=0.5)
    assert_f32_rounding(p, p2, 1e-3, "param")
    assert torch.equal(out, p.bfloat16())


@pytest.mark.parametrize("isa", [*_ext.SUPPORTED, "shared"])
@pytest.mark.parametrize("master, state", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                           (torch.bfloat16, torch.bfloat16)], ids=["fp32", "bf16-state", "bf16"])
@pytest.mark.parametrize("n", [13, 2**16 + 5])
def test_a_saving_step_keeps_the_values_before_it_and_steps_as_one_that_does_not(n, master, state, isa):
    """save= (the speculative offloaded step's rollback): the master and moments as read, stored in the same pass,
    bit for bit; the step itself, stochastic rounding included, unchanged; across the body and the tail."""
    torch.manual_seed(0)
    p, m, v = torch.randn(n).to(master), torch.randn(n).to(state), torch.rand(n).to(state)
    g, out = torch.randn(n).bfloat16(), torch.empty(n, dtype=torch.bfloat16)
    before = [t.clone() for t in (p, m, v)]
    plain = [t.clone() for t in (p, m, v)]
    saves = [torch.full_like(t, float("nan")) for t in (p, m, v)]
    hyper = dict(step=3, lr=0.1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, adamw=True, grad_scale=0.5,
                 sr_seed=7 if torch.bfloat16 in (master, state) else None, isa=isa)
    _ext.adam_step_(p, g, m, v, param_out=out, save=tuple(saves), **hyper)
    _ext.adam_step_(*plain[:1], g, *plain[1:], **hyper)
    assert all(map(torch.equal, saves, before))
    assert all(map(torch.equal, (p, m, v), plain))
    assert not torch.equal(p, before[0])


def test_a_saving_step_through_ops_saves_on_every_backend(monkeypatch):
    from zkern import ops

    for backend in ("cpu", "reference"):
        monkeypatch.setenv("ZKERN_BACKEND", backend)
        p, m, v, g = torch.randn(100), torch.randn(100), torch.rand(100), torch.randn(100)
        before, saves = [t.clone() for t in (p, m, v)], tuple(torch.zeros(100) for _ in range(3))
        ops.adam_step_(p, g, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True,
                       save=saves)
        assert all(map(torch.equal, saves, before)), backend
        assert not torch.equal(p, before[0]), backend


def test_saves_go_together_and_match_their_buffers():
    args = dict(step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adamw=True)
    with pytest.raises(TypeError, match="save\\[1\\] must be"):
        _ext.adam_step_(torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.zeros(8),
                        save=(torch.zeros(8), torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8)), **args)
    with pytest.raises(ValueError, match="all three buffers or none"):
        _ext.EXT.adam_step("scalar", *(torch.zeros(8).data_ptr(), 0) * 2, torch.zeros(8).data_ptr(),
                           torch.zeros(8).data_ptr(), 0, 0, -1, 8, 1, 1e-3, 0.9, 0.999, 1e-8, 0.0, True, 1.0, False,
                           0, 0, 1, torch.zeros(8).data_ptr(), 0, 0)


def test_the_thread_count_comes_from_the_cores_this_process_may_use(monkeypatch):
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv("ZKERN_CPU_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # as under torchrun (OMP_NUM_THREADS=1): not used
    assert _ext.cpu_threads() == cores
    if cores == os.cpu_count():  # unpinned ranks of one node share the cores
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores + 1))
        assert _ext.cpu_threads() == 1
    monkeypatch.setenv("ZKERN_CPU_THREADS", "3")
    assert _ext.cpu_threads() == 3
    monkeypatch.setenv("ZKERN_CPU_THREADS", "three")
    with pytest.raises(ValueError, match="ZKERN_CPU_THREADS must be a whole number"):
        _ext.cpu_threads()
