"""Kernels suite: each zkern Triton kernel against the stock-PyTorch way of doing the same thing, next to its
physical limit (bytes it must move at the measured device copy bandwidth).

    python bench/run.py --suite kernels                       # on a CUDA machine
    TRITON_INTERPRET=1 python bench/run.py --suite kernels --interpret   # CPU: checks the harness only

  flatten     1,000 mixed-size fp32 tensors -> one bf16 buffer: ops.flatten vs
              torch._utils._flatten_dense_tensors(...).to(bf16)
  unscale     bf16 gradient buffer: ops.unscale_and_check_ vs isfinite().all() + mul_ + torch.linalg.vector_norm
              (GradScaler's fused unscale takes no bf16); unscale_fp16: an fp16 buffer against that fused
              torch._amp_foreach_non_finite_check_and_unscale_ + vector_norm
  quantize    int8, groups of 128: ops.quantize vs zkern.reference.quantize (the torch composition)
  adam        fp32 master, bf16 gradient, bf16 copy out: ops.adam_step_ vs torch.optim.AdamW(fused=True) on the
              upcast gradient + the bf16 cast
  *_cuda      where zkern/cuda's kernels can be built: the CUDA C++ quantize and Adam against the Triton ones (the
              rows that decide whether CUDA C++ goes before Triton in zkern.ops.ON_CUDA)

Times: median and p20/p80 from triton.testing.do_bench. Under the interpreter (--interpret, tiny sizes) the
numbers mean nothing and the record says so; only the plumbing is exercised.
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
import time

import torch

import zkern
from bench.engine_suite import _git_sha
from zkern import ops, reference

# Buffer sizes on a GPU: every memory-bound kernel on 256 MB or more (64M fp32 elements).
GPU_NUMEL = 64 * 2**20
INTERPRET_NUMEL = 2**14


def _bench(fn, cuda: bool) -> dict[str, float]:
    if cuda:
        import triton.testing

        median, p20, p80 = triton.testing.do_bench(fn, warmup=25, rep=200, quantiles=[0.5, 0.2, 0.8])
        return {"median_s": median / 1e3, "p20_s": p20 / 1e3, "p80_s": p80 / 1e3}
    fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"median_s": statistics.median(times), "p20_s": times[0], "p80_s": times[-1]}


def _mixed_sizes(total: int, count: int, gen: torch.Generator) -> list[int]:
    weights = torch.rand(count, generator=gen) ** 3 + 1e-3  # many small, a few large, as in a real model
    sizes = (weights / weights.sum() * total).long().clamp(min=1)
    return sizes.tolist()


def run(numel: int | None = None, interpret: bool = False, progress=None) -> dict:
    cuda = torch.cuda.is_available()
    if not cuda and not interpret:
        raise SystemExit("bench: the kernels suite measures Triton kernels on a CUDA device and this machine has "
                         "none (under TRITON_INTERPRET=1 their timings mean nothing); pass --interpret to check "
                         "the harness on tiny sizes")
    if not cuda:
        if "triton" not in ops.AVAILABLE:
            raise SystemExit("bench: --interpret needs Triton installed and TRITON_INTERPRET=1 set before it loads")
        os.environ["ZKERN_BACKEND"] = "triton"  # CPU tensors reach the kernels only when forced
    progress = progress or (lambda line: print(f"[bench] {line}", file=sys.stderr, flush=True))
    device = torch.device("cuda" if cuda else "cpu")
    n = numel or (INTERPRET_NUMEL if interpret else GPU_NUMEL)
    gen = torch.Generator().manual_seed(0)

    # Device copy bandwidth: read + write of a buffer the size of the largest operand.
    src = torch.randn(n, generator=gen).to(device)
    dst = torch.empty_like(src)
    copy = _bench(lambda: dst.copy_(src), cuda)
    copy_bw = 2 * src.numel() * 4 / copy["median_s"]

    results = {}

    def record(name: str, zkern_fn, stock_fn, stock_name: str, bytes_moved: int):
        progress(f"kernels: {name}")
        z, s = _bench(zkern_fn, cuda), _bench(stock_fn, cuda)
        results[name] = {"zkern": z, "stock": s, "stock_is": stock_name, "bytes": bytes_moved,
                         "zkern_bw_fraction": bytes_moved / z["median_s"] / copy_bw,
                         "speedup_over_stock": s["median_s"] / z["median_s"]}

    # Each case in its own function, so that its buffers are freed before the next one allocates.
    def flatten_case():  # 1,000 tensors (20 interpreted) summing to n elements
        tensors = [torch.randn(k, generator=gen).to(device)
                   for k in _mixed_sizes(n, 20 if interpret else 1000, gen)]
        total = sum(t.numel() for t in tensors)
        record("flatten", lambda: ops.flatten(tensors, torch.bfloat16),
               lambda: torch._utils._flatten_dense_tensors(tensors).to(torch.bfloat16),
               "_flatten_dense_tensors + .to(bf16)", total * (4 + 2))

    def unscale_case():  # a 16-bit buffer of 2n elements (4n bytes), read and written once
        inv = torch.full((1,), 1.0, device=device)  # 1.0 keeps the buffer's values across repetitions
        # bf16, the usual: torch's fused unscale (GradScaler's) takes no bf16, so its twin is the composition.
        grad = torch.randn(2 * n, generator=gen).to(device, torch.bfloat16)

        def stock_bf16():
            found = ~torch.isfinite(grad).all()
            grad.mul_(inv)
            return found, torch.linalg.vector_norm(grad, dtype=torch.float32)

        record("unscale", lambda: ops.unscale_and_check_(grad, 0.999999), stock_bf16,
               "isfinite().all() + mul_ + vector_norm (torch's fused unscale takes no bf16)", grad.numel() * 2 * 2)
        # fp16, where GradScaler's own kernel applies.
        half = torch.randn(2 * n, generator=gen).to(device, torch.float16)
        found = torch.zeros(1, device=device)

        def stock_fp16():
            torch._amp_foreach_non_finite_check_and_unscale_([half], found, inv)
            return torch.linalg.vector_norm(half, dtype=torch.float32)

        record("unscale_fp16", lambda: ops.unscale_and_check_(half, 0.999999), stock_fp16,
               "_amp_foreach_non_finite_check_and_unscale_ + vector_norm", half.numel() * 2 * 2)

    def quantize_case():  # int8 codes of n fp32 values, groups of 128
        x = torch.randn(n, generator=gen).to(device)
        record("quantize_int8", lambda: ops.quantize(x, 8, 128), lambda: reference.quantize(x, 8, 128),
               "zkern.reference.quantize (torch ops)", n * 4 + n + (n // 128) * 4)

    def adam_case():  # n fp32 parameters, bf16 gradient, bf16 copy out: 28 bytes per parameter
        p, m, v = torch.randn(n, generator=gen).to(device), torch.zeros(n, device=device), torch.zeros(n, device=device)
        g16 = torch.randn(n, generator=gen).to(device, torch.bfloat16)
        out = torch.empty(n, dtype=torch.bfloat16, device=device)
        tp = torch.nn.Parameter(p.clone())
        topt = torch.optim.AdamW([tp], lr=1e-3, weight_decay=0.01, fused=True if cuda else None)
        tout = torch.empty_like(out)

        def stock():
            tp.grad = g16.float()
            topt.step()
            tout.copy_(tp.detach())

        record("adam_bf16_copy", lambda: ops.adam_step_(p, g16, m, v, step=10, lr=1e-3, betas=(0.9, 0.999),
                                                         eps=1e-8, weight_decay=0.01, adamw=True, param_out=out),
               stock, "AdamW(fused=True) + bf16 copy", n * 28)

    def cuda_case():  # zkern/cuda's kernels against the Triton ones they would replace (DESIGN.md: only where faster)
        from zkern import cuda as cuda_kernels
        from zkern.triton import adam as triton_adam
        from zkern.triton import quant as triton_quant

        x = torch.randn(n, generator=gen).to(device)
        record("quantize_int8_cuda", lambda: cuda_kernels.quantize(x, 8, 128), lambda: triton_quant.quantize(x, 8, 128),
               "the Triton kernel", n * 4 + n + (n // 128) * 4)
        p, m, v = torch.randn(n, generator=gen).to(device), torch.zeros(n, device=device), torch.zeros(n, device=device)
        g16 = torch.randn(n, generator=gen).to(device, torch.bfloat16)
        out = torch.empty(n, dtype=torch.bfloat16, device=device)
        hyper = dict(step=10, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw=True, param_out=out)
        record("adam_bf16_copy_cuda", lambda: cuda_kernels.adam_step_(p, g16, m, v, **hyper),
               lambda: triton_adam.adam_step_(p, g16, m, v, **hyper), "the Triton kernel", n * 28)

    cases = [flatten_case, unscale_case, quantize_case, adam_case]
    if "cuda" in ops.AVAILABLE:  # the CUDA C++ kernels can be built here (torch with CUDA, nvcc, ninja)
        cases.append(cuda_case)
    for case in cases:
        case()

    ratios = {f"{k}_speedup": r["speedup_over_stock"] for k, r in results.items()}
    ratios.update({f"{k}_bw_fraction": r["zkern_bw_fraction"] for k, r in results.items()})
    import triton

    return {
        "suite": "kernels",
        "device": device.type,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter: timings meaningless)",
        "interpreted": not cuda,
        "numel": n,
        "copy": {**copy, "gb_per_s": copy_bw / 1e9},
        "versions": {"zkern": zkern.__version__, "torch": torch.__version__, "triton": triton.__version__,
                     "python": platform.python_version()},
        "git_sha": _git_sha(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "ops": results,
        "ratios": ratios,
    }


def table(record: dict) -> str:
    out = [f"kernels suite: {record['device_name']}, {record['numel']} elements per operand, copy bandwidth "
           f"{record['copy']['gb_per_s']:.1f} GB/s", ""]
    if record["interpreted"]:
        out.append("(interpreter run: the harness is checked, the timings mean nothing)\n")
    out += ["| op | zkern median [p20-p80] | stock median | stock is | x stock | of copy bandwidth |",
            "|---|---|---|---|---|---|"]
    for name, r in record["ops"].items():
        z, s = r["zkern"], r["stock"]
        out.append(f"| {name} | {z['median_s'] * 1e3:.3f} ms [{z['p20_s'] * 1e3:.3f}-{z['p80_s'] * 1e3:.3f}] | "
                   f"{s['median_s'] * 1e3:.3f} ms | {r['stock_is']} | x{r['speedup_over_stock']:.2f} | "
                   f"{r['zkern_bw_fraction'] * 100:.0f}% |")
    return "\n".join(out)
