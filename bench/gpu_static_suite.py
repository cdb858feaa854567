"""--suite gpu-static: zkern's Triton kernels compiled for sm_80 and sm_90 on a machine without a GPU, and checked.

    python bench/run.py --suite gpu-static --json bench/results/gpu-static.json
    PYTHONPATH=.gate/triton-3.7.1 python bench/run.py --suite gpu-static --json bench/results/gpu-static.json

The record keeps one run per Triton version (save): `make gate` checks the Triton the test environment installs
and the one torch's public wheel pins (GATE_TRITON in the Makefile), installed apart in .gate/.

1. Record: the real launchers (zkern/triton/*.py) run on CPU tensors under TRITON_INTERPRET=1, in a subprocess, on
   the calls the engine makes (a world-1 engine at stages 1-3 in fp16 and bf16 with every op forced onto Triton)
   and on the sizes and offsets it can produce (ragged lengths, sub-ranges that start off a 16-byte boundary).
   Each launch is kept as Triton's JIT would specialise it: argument dtypes, constexprs, and which pointers are
   16-byte aligned and which integers are multiples of 16.
2. Compile each specialisation ahead of time for sm_80 and sm_90 (Triton ships ptxas, cuobjdump, nvdisasm) and
   read registers, shared memory and spills (ptxas -v) and the width of every global load and store (the SASS).
3. Check: every op zkern.ops.OPS sends to Triton launched a kernel in the trace (and every CUDA op's file is
   compiled in step 4); no compile error, no spill; a launch whose pointers are all aligned and whose lengths are
   multiples of 16 ("aligned") moves its data with 128-bit loads and stores only, apart from the per-program
   scalars each kernel declares below (table entries, a block's partial sum). Known failures are listed in
   KNOWN_NARROW with the reason; the gate fails on any other narrow access, so a regression shows, and the list
   shrinks as they are fixed.

4. The CUDA C++ kernels (zkern/cuda/csrc/*.cu) compiled by nvcc for the same archs with zkern.cuda's flags (a spill
   is an error), each kernel read the same way: registers, spills, and its 128-bit loads and stores (each has an
   element-by-element path for unaligned data beside its vector path, so narrow accesses are not counted: a kernel
   fails when it has no 128-bit load or store at all); and csrc/bindings.cpp compiled against torch's headers.

5. Traffic (bench/gpu_traffic.py): each op's launcher run under the interpreter at the engine's sizes, every load
   and store counted in the 32-byte sectors it touches; fails above TRAFFIC_LIMIT times the bytes the operation
   must move.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

ARCHS = (80, 90)
TRAFFIC_LIMIT = 1.05  # bytes moved (32-byte sectors) over the bytes the operation must move
# Narrow (non-128-bit) global accesses a kernel makes by design, per program, whatever the data's alignment.
SCALAR_ACCESSES = {
    "_unscale_and_check_kernel": 2,  # the block's overflow flag and sum of squares
    "_flatten_kernel": 6,  # its table entry: tensor index, start, numel, address, dtype code, flat offset
    "_unflatten_kernel": 6,
    # (de)quantization: a program's group scales, one per group of its tile (GROUPS = 4096 // group: 2 for qwZ's
    # groups of 2048, 64 for qgZ's groups of 64, which dequantize loads in four instructions)
    "_quantize_kernel": 2, "_dequantize_kernel": 4, "_dequant_sum_kernel": 2,
}
# Aligned launches that are not yet fully 128-bit, and why (each entry is a defect to fix). Empty: int4's packed
# bytes were the last (masked with 2 * byte < n, whose constancy the compiler could not prove; now byte < n_bytes).
KNOWN_NARROW: dict[str, str] = {}


# -- 1. recording (runs in a subprocess under TRITON_INTERPRET=1) ---------------------------------------------------
def _arg_type(value) -> tuple[str, bool | None]:
    """(Triton signature type, 16-aligned/divisible) of one launch argument, as Triton's JIT specialises it."""
    import torch

    if isinstance(value, torch.Tensor):
        kind = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8",
                torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64"}[value.dtype]
        return "*" + kind, value.data_ptr() % 16 == 0
    if isinstance(value, bool):
        return "i1", None
    if isinstance(value, int):
        return ("i32" if -2**31 <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", None
    raise TypeError(f"gpu-static: a launch argument of type {type(value).__name__}")


def _record_launches(out_path: str) -> None:
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    seen: dict[str, dict] = {}
    original = InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        options = {k: v for k, v in kwargs.items() if k not in params}  # compile options (enable_fp_fusion)
        bound = inspect.signature(self.fn).bind(*args, **{k: v for k, v in kwargs.items() if k in params}).arguments
        spec = {"module": self.fn.__module__, "kernel": self.fn.__name__, "signature": {}, "constexprs": {},
                "aligned_args": [], "unaligned_args": [], "options": options}
        for name, value in bound.items():
            if "constexpr" in str(params[name].annotation):
                spec["constexprs"][name] = value
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value == 1:
                spec["constexprs"][name] = 1  # Triton specialises an integer 1 to a constant
                continue
            kind, aligned = _arg_type(value)
            spec["signature"][name] = kind
            if aligned is not None:
                spec["aligned_args" if aligned else "unaligned_args"].append(name)
        key = json.dumps(spec, sort_keys=True)
        seen.setdefault(key, {**spec, "launches": 0})["launches"] += 1
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording
    try:
        _drive_launchers(torch)
        _drive_engine(torch)
    finally:
        InterpretedFunction.run = original
    with open(out_path, "w") as f:
        json.dump(sorted(seen.values(), key=lambda s: (s["kernel"], json.dumps(s, sort_keys=True))), f)


def _drive_launchers(torch) -> None:
    """The launchers on the lengths and offsets the engine can hand them: whole buffers (aligned), ragged lengths,
    and sub-ranges of a shard that start off a 16-byte boundary (an optimizer piece param[lo:hi])."""
    from zkern import ops
    from zkern.comm import zeropp

    g = torch.Generator().manual_seed(0)
    for n, start in ((4096, 0), (4099, 0), (4096, 3)):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            x = torch.randn(start + n, generator=g).to(dtype)[start:]
            ops.unscale_and_check_(x.clone() if start == 0 else x, 0.5)
            ops.unscale_and_check_(x, 1.0)
            p = torch.randn(start + n, generator=g)[start:]
            m, v = torch.zeros_like(p), torch.zeros_like(p)
            out = torch.empty(start + n, dtype=torch.bfloat16 if dtype == torch.float32 else dtype)[start:]
            ops.adam_step_(p, x, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw=True,
                           param_out=out)
            ops.adam_step_(p, x, m, v, step=2, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                           adamw=False)
            # bf16 optimizer state (bf16_optimizer_states, bf16_master_weights_and_grads), to nearest and stochastic
            bm, bv = torch.zeros_like(m, dtype=torch.bfloat16), torch.zeros_like(v, dtype=torch.bfloat16)
            ops.adam_step_(p, x, bm, bv, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                           adamw=True, param_out=out)
            ops.adam_step_(p.bfloat16(), x, bm, bv, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                           weight_decay=0.01, adamw=True, param_out=out, sr_seed=7, sr_offset=start)
        for bits, group in ((8, zeropp.WEIGHT_GROUP), (4, zeropp.GRAD_GROUP)):
            x = torch.randn(n, generator=g)
            q, s = ops.quantize(x, bits, group)
            ops.dequantize(q, s, bits, group, n, torch.bfloat16)
            ops.dequant_sum(torch.stack([q, q]), torch.stack([s, s]), bits, group, n)
    # a ragged set (one length not a multiple of 16: the element path) and an aligned one (the 128-bit path)
    for sizes in ((4096, 67, 1024), (4096, 64, 1024)):
        tensors = [torch.randn(k, generator=g) for k in sizes]
        for dtype in (torch.float32, torch.bfloat16):
            flat = ops.flatten(tensors, dtype, align=16)
            ops.unflatten_into_(flat, [t.clone() for t in tensors], align=16)


def _drive_engine(torch) -> None:
    """A world-1 engine with every op on Triton: the views it really passes."""
    import zkern
    from zkern.testing.models import TinyGPT

    for stage, precision in ((1, "fp16"), (2, "bf16"), (3, "bf16")):
        torch.manual_seed(0)
        model = TinyGPT(vocab=67, dim=32, n_layer=2, n_head=2, seq=16)
        config = {"train_batch_size": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                  precision: {"enabled": True}, "zero_optimization": {"stage": stage,
                                                                       "stage3_param_persistence_threshold": 0}}
        engine = zkern.Engine(model, config)
        tokens = torch.randint(0, 67, (2, 17))
        for _ in range(2):
            loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
        engine.destroy()


# -- 2. compiling and reading the machine code ---------------------------------------------------------------------
def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _compile(spec: dict, arch: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    signature = {**spec["signature"], **{k: "constexpr" for k in spec["constexprs"]}}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in spec["aligned_args"]}
    source = ASTSource(kernel, signature, constexprs={(kernel.arg_names.index(k),): v
                                                     for k, v in spec["constexprs"].items()}, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=spec.get("options") or None)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        with open(cubin, "wb") as f:
            f.write(compiled.asm["cubin"])
        # Triton 3.9's PTX is newer than its plain ptxas reads; its Blackwell-era ptxas assembles every target.
        ptxas = _tool("ptxas-blackwell") if os.path.exists(_tool("ptxas-blackwell")) else _tool("ptxas")
        name = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"  # Triton targets sm_90a on Hopper
        verbose = subprocess.run([ptxas, "-v", f"--gpu-name={name}", ptx, "-o", os.path.join(tmp, "v.cubin")],
                                 capture_output=True, text=True)
        if verbose.returncode:
            raise RuntimeError(f"ptxas -v failed: {verbose.stderr.strip()[:300]}")
        sass = subprocess.run([_tool("nvdisasm"), cubin], capture_output=True, text=True, check=True).stdout
    info = verbose.stdout + verbose.stderr
    regs = re.search(r"Used (\d+) registers", info)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", info)]
    widths = {"ld128": len(re.findall(r"\bLDG\.E\.128\b", sass)), "st128": len(re.findall(r"\bSTG\.E\.128\b", sass)),
              "ld": len(re.findall(r"\bLDG\b", sass)), "st": len(re.findall(r"\bSTG\b", sass))}
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": sum(spills),
            "shared_bytes": compiled.metadata.shared, **widths,
            "ptx_fma": len(re.findall(r"\bfma\.rn\.f32\b", compiled.asm["ptx"])),
            "narrow": widths["ld"] + widths["st"] - widths["ld128"] - widths["st128"]}


def _known(spec: dict) -> str | None:
    name = spec["kernel"]
    bits = spec["constexprs"].get("BITS")
    return KNOWN_NARROW.get(f"{name}/BITS={bits}") if bits is not None else KNOWN_NARROW.get(name)


@functools.cache
def _writes_fma(module: str) -> bool:
    """Whether a kernel module writes a fused multiply-add (tl.fma): the only place zkern's kernels mean one."""
    return "tl.fma(" in inspect.getsource(importlib.import_module(module))


def _is_aligned(spec: dict) -> bool:
    """Every pointer 16-byte aligned, and the length and row strides multiples of 16 elements (counts of groups
    and ranks say nothing about addresses). A kernel that reads its tensors' addresses from a table (flatten)
    says so itself: its ALIGNED constexpr is the launcher's check of every address and length."""
    if "ALIGNED" in spec["constexprs"]:
        return bool(spec["constexprs"]["ALIGNED"])
    return not [a for a in spec["unaligned_args"]
                if spec["signature"][a].startswith("*") or a == "n" or a.endswith("_stride")]


# -- the suite -----------------------------------------------------------------------------------------------------
def run() -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import torch
    import triton

    # The CUDA C++ checks (nvcc and g++) and the traffic count (an interpreter subprocess) run beside the Triton
    # compiles, which hold one core.
    with ThreadPoolExecutor(2) as pool:
        cuda = pool.submit(cuda_kernels)
        traffic = pool.submit(_traffic)
        record = _triton_kernels()
        cuda_entries, cuda_failures = cuda.result()
        record["traffic"] = traffic.result()
    record["cuda_kernels"] = cuda_entries
    record["triton"], record["torch"] = triton.__version__, torch.__version__
    record["failures"] += cuda_failures + [
        f"{t['case']}: {t['bytes_per_element']:.3f} bytes per element moved, {t['ratio']:.3f}x the "
        f"{t['minimum_per_element']:.3f} it must move (at most {TRAFFIC_LIMIT}x)"
        for t in record["traffic"] if t["ratio"] > TRAFFIC_LIMIT]
    return record


def save(path: str, record: dict) -> None:
    """Write record into path beside the runs of other Triton versions it holds ({"suite", "runs": [...]}, one run
    per version, the oldest first): the gate runs under the Triton zkern's test environment installs and under the
    one torch's public wheel pins, and the record keeps both."""
    runs = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        runs = old.get("runs", [old] if "triton" in old else [])
    runs = [r for r in runs if r.get("triton") != record["triton"]] + [record]
    runs.sort(key=lambda r: tuple(int(x) if x.isdigit() else 0 for x in r["triton"].split(".")))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"suite": "gpu-static", "runs": runs}, f, indent=2)


def _traffic() -> list[dict]:
    """bench/gpu_traffic.py's count, in an interpreter subprocess of its own."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "TRITON_INTERPRET": "1", "ZKERN_BACKEND": "triton",
           "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    done = subprocess.run([sys.executable, "-c", "import json, bench.gpu_traffic as t; print(json.dumps(t.measure()))"],
                          env=env, cwd=root, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _triton_kernels() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "launches.json")
        env = {**os.environ, "TRITON_INTERPRET": "1", "ZKERN_BACKEND": "triton"}
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        subprocess.run([sys.executable, "-c", f"import bench.gpu_static_suite as s; s._record_launches({path!r})"],
                       env=env, cwd=root, check=True)
        with open(path) as f:
            specs = json.load(f)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("--suite gpu-static compiles the kernels for NVIDIA targets: run it without "
                           "TRITON_INTERPRET=1 (it interprets the launchers in a subprocess of its own)")
    kernels, failures = [], op_table_gaps({spec["module"] for spec in specs})
    for spec in specs:
        label = f"{spec['kernel']}({', '.join(f'{k}={v}' for k, v in spec['signature'].items() if '*' in v)}; " \
                f"{', '.join(f'{k}={v}' for k, v in spec['constexprs'].items())})" \
                f"{'' if _is_aligned(spec) else ' unaligned'}"
        entry = {"kernel": spec["kernel"], "label": label, "launches": spec["launches"], "aligned": _is_aligned(spec),
                 "unaligned_args": spec["unaligned_args"],
                 "spec_id": hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12], "archs": {}}
        for arch in ARCHS:
            try:
                got = _compile(spec, arch)
            except Exception as e:  # noqa: BLE001 - a compile error is a finding, with its message
                entry["archs"][f"sm_{arch}"] = {"error": str(e).splitlines()[0][:300]}
                failures.append(f"{label} sm_{arch}: compile error: {e}")
                continue
            entry["archs"][f"sm_{arch}"] = got
            if got["spill_bytes"]:
                failures.append(f"{label} sm_{arch}: spills {got['spill_bytes']} bytes")
            if got["ptx_fma"] and not _writes_fma(spec["module"]):
                failures.append(f"{label} sm_{arch}: {got['ptx_fma']} fma.rn.f32 in the PTX of a kernel that writes "
                                f"no tl.fma: a * b + c contracted (launch it with LAUNCH_OPTIONS)")
            allowed = SCALAR_ACCESSES.get(spec["kernel"], 0)
            if entry["aligned"] and got["narrow"] > allowed:
                reason = _known(spec)
                if reason is None:
                    failures.append(f"{label} sm_{arch}: an aligned launch makes {got['narrow']} narrow global "
                                    f"accesses (allowed {allowed}): not 128-bit")
                else:
                    entry["known_narrow"] = reason
        kernels.append(entry)
    return {"suite": "gpu-static", "archs": [f"sm_{a}" for a in ARCHS], "kernels": kernels, "failures": failures,
            "known_narrow": KNOWN_NARROW}


def table(record: dict) -> str:
    out = [f"{'kernel (pointer dtypes; constexprs)':<96} {'arch':>6} {'regs':>5} {'spill':>6} {'128b':>5} "
           f"{'narrow':>6}"]
    for k in record["kernels"]:
        for arch, got in k["archs"].items():
            if "error" in got:
                out.append(f"{k['label'][:96]:<96} {arch:>6} ERROR {got['error'][:60]}")
                continue
            flag = "" if not k["aligned"] else (" known" if "known_narrow" in k and got["narrow"] else "")
            out.append(f"{k['label'][:96]:<96} {arch:>6} {got['registers']!s:>5} {got['spill_bytes']:>6} "
                       f"{got['ld128'] + got['st128']:>5} {got['narrow']:>6}{flag}")
    if record.get("traffic"):
        out.append(f"\n{'traffic (32-byte sectors, interpreter)':<60} {'B/elem':>8} {'minimum':>8} {'ratio':>7}")
        for t in record["traffic"]:
            out.append(f"{t['case']:<60} {t['bytes_per_element']:>8.3f} {t['minimum_per_element']:>8.3f} "
                       f"{t['ratio']:>7.3f}")
    if record.get("cuda_kernels"):
        out.append(f"\n{'CUDA C++ kernel (zkern/cuda/csrc)':<96} {'arch':>6} {'regs':>5} {'spill':>6} {'ld128':>5} "
                   f"{'st128':>6}")
        for k in record["cuda_kernels"]:
            label = f"{k['source']}: {k['kernel']}"
            out.append(f"{label[:96]:<96} {k['arch']:>6} {k['registers']!s:>5} {k['spill_bytes']:>6} "
                       f"{k.get('ld128', 0):>5} {k.get('st128', 0):>6}")
    out += [f"FAIL: {line}" for line in record["failures"]] or ["gpu-static: every check holds"]
    return "\n".join(out)


# -- the CUDA C++ kernels (zkern/cuda/csrc) --------------------------------------------------------------------------
def _cuda_compile(source: str, arch: int) -> dict:
    """nvcc one kernel file for one arch with zkern.cuda's flags (a spill is an error); per kernel: registers,
    spills and the 128-bit loads and stores in its SASS."""
    from zkern import cuda

    with tempfile.TemporaryDirectory() as tmp:
        cubin = os.path.join(tmp, "k.cubin")
        done = subprocess.run([cuda.nvcc(), *cuda.NVCC_FLAGS, "-Xptxas=-v", "-cubin", f"-arch=sm_{arch}",
                               os.path.join(cuda.CSRC, source), "-o", cubin], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(done.stderr.strip()[-600:])
        sass = subprocess.run([_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True).stdout
    kernels: dict[str, dict] = {}
    current = None
    for line in (done.stdout + done.stderr).splitlines():  # ptxas -v: per entry function, in order
        if m := re.search(r"Compiling entry function '([^']+)'", line):
            current = kernels.setdefault(m.group(1), {"registers": None, "spill_bytes": 0})
        elif current is not None and (m := re.search(r"Used (\d+) registers", line)):
            current["registers"] = int(m.group(1))
        elif current is not None:
            current["spill_bytes"] += sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", line))
    for name, body in re.findall(r"Function : (\S+)\n(.*?)(?=\n\s*Function : |\Z)", sass, flags=re.S):
        entry = kernels.setdefault(name, {"registers": None, "spill_bytes": 0})
        entry.update(ld128=len(re.findall(r"\bLDG\.E\.128\b", body)), st128=len(re.findall(r"\bSTG\.E\.128\b", body)),
                     ld=len(re.findall(r"\bLDG\b", body)), st=len(re.findall(r"\bSTG\b", body)),
                     ffma=len(re.findall(r"\bFFMA\b", body)))
    return kernels


def _demangle(names: list[str]) -> dict[str, str]:
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
        return dict(zip(names, out.splitlines()))
    except (OSError, subprocess.CalledProcessError):
        return {n: n for n in names}


def _bindings_check() -> str | None:
    """csrc/bindings.cpp compiled (syntax and types) against this torch's headers, whose CPU build lacks only the
    build-generated c10/cuda/impl/cuda_cmake_macros.h (a stub stands in). None: it compiles; else the error."""
    import sysconfig

    import torch.utils.cpp_extension as ext

    from zkern import cuda

    # nvcc names its own include directories (it may be a wrapper script far from the toolkit)
    dry = subprocess.run([cuda.nvcc(), "--dryrun", "-x", "cu", "-c", os.devnull], capture_output=True, text=True)
    cuda_includes = re.findall(r'-I"?([^"\s]+)', " ".join(line for line in dry.stderr.splitlines()
                                                        if "INCLUDES=" in line))
    with tempfile.TemporaryDirectory() as tmp:
        stub = os.path.join(tmp, "c10", "cuda", "impl")
        os.makedirs(stub)
        with open(os.path.join(stub, "cuda_cmake_macros.h"), "w") as f:
            f.write("#pragma once\n")
        includes = [cuda.CSRC, cuda.SHARED, tmp, *cuda_includes, *ext.include_paths(),
                    sysconfig.get_paths()["include"]]
        done = subprocess.run(["g++", "-fsyntax-only", "-std=c++20", "-DTORCH_EXTENSION_NAME=zkern_cuda_ext",
                               *[f"-I{i}" for i in includes], os.path.join(cuda.CSRC, "bindings.cpp")],
                              capture_output=True, text=True)
    return None if done.returncode == 0 else done.stderr.strip()[-600:]


def op_table_gaps(traced_modules: set[str]) -> list[str]:
    """Failures for an op of zkern.ops.OPS whose Triton file launched no kernel in the trace, or whose CUDA file is
    not among the sources zkern.cuda compiles: the gate checks every kernel the table dispatches to."""
    from zkern import cuda, ops

    gaps = []
    for op, homes in ops.OPS.items():
        if "triton" in homes and f"zkern.triton.{homes['triton']}" not in traced_modules:
            gaps.append(f"{op}: zkern/triton/{homes['triton']}.py launched no kernel in the trace (drive it in "
                        f"_drive_launchers)")
        if "cuda" in homes and f"{homes['cuda']}.cu" not in cuda.KERNEL_SOURCES:
            gaps.append(f"{op}: zkern/cuda/csrc/{homes['cuda']}.cu is not in zkern.cuda.KERNEL_SOURCES")
    return gaps


def cuda_kernels() -> tuple[list[dict], list[str]]:
    """Every CUDA C++ kernel for every arch: (entries, failures). A kernel fails on a compile error, a spill, or a
    missing 128-bit load or store (each kernel moves its data in 16-byte vectors when its pointers are aligned,
    with an element-by-element path beside for the rest, so narrow accesses are expected and not counted)."""
    from concurrent.futures import ThreadPoolExecutor

    from zkern import cuda

    if cuda.nvcc() is None:
        return [], ["nvcc not found: the CUDA C++ kernels cannot be checked (pip install nvidia-cuda-nvcc, or set "
                    "CUDA_HOME)"]
    jobs = [(source, arch) for source in cuda.KERNEL_SOURCES for arch in cuda.ARCHS]
    with ThreadPoolExecutor(2) as pool:
        bindings = pool.submit(_bindings_check)
        results = list(pool.map(lambda job: _try(_cuda_compile, *job), jobs))
        bindings_error = bindings.result()
    entries, failures = [], []
    if bindings_error:
        failures.append(f"zkern/cuda/csrc/bindings.cpp does not compile against torch's headers: {bindings_error}")
    for (source, arch), (kernels, error) in zip(jobs, results):
        if error:
            failures.append(f"{source} sm_{arch}: compile error (spills are errors): {error}")
            continue
        names = _demangle(list(kernels))
        for name, got in kernels.items():
            label = f"{source}: {names[name]}"
            entries.append({"kernel": names[name], "source": source, "arch": f"sm_{arch}", **got})
            if got["spill_bytes"]:
                failures.append(f"{label} sm_{arch}: spills {got['spill_bytes']} bytes")
            if not got.get("ld128") or not got.get("st128"):
                failures.append(f"{label} sm_{arch}: no 128-bit global {'load' if not got.get('ld128') else 'store'}")
            # qgZ's sum alone (no requantization, so no IEEE division, whose routine is made of FFMAs) has nothing
            # to fuse: an FFMA there is nvcc contracting code * scale + sum, which the reference rounds twice.
            if re.search(r"dequant_sum_requant_kernel<\d+, 0>", names[name]) and got.get("ffma"):
                failures.append(f"{label} sm_{arch}: {got['ffma']} FFMA in the sum of code * scale products "
                                f"(nvcc contracted them: build with --fmad=false)")
    return entries, failures


def _try(fn, *args):
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - a compile error is a finding, with its message
        return None, str(e)
