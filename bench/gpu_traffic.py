"""The bytes each Triton kernel moves, counted per 32-byte sector under the interpreter (part of --suite gpu-static).

    TRITON_INTERPRET=1 ZKERN_BACKEND=triton python -c "import bench.gpu_traffic as t; print(t.measure())"

A GPU moves global memory in 32-byte sectors: an access instruction costs every sector its active lanes touch, once
per instruction. Under TRITON_INTERPRET=1 each tl.load / tl.store of a program is one call over the whole block, so
the interpreter's builder is wrapped to count, per call, the distinct sectors its unmasked addresses fall in (the
interpreter checks every address against its tensor's bounds as it goes). Traffic is 32 bytes times that sum; the
operation's minimum is the distinct bytes it reads plus the distinct bytes it writes over the whole launch (what it
must move at least once). Each case runs the real launcher (zkern.ops with the Triton backend forced) at sizes the
engine uses, on 16-byte-aligned buffers; a ratio above 1.05 is a kernel that reads or writes something twice or
touches sectors it does not need.
"""

from __future__ import annotations

import contextlib

import numpy as np

SECTOR = 32
NUMEL = 65_536
GROUP = 2048


class _Count:
    def __init__(self):
        self.traffic = 0
        self.loaded: list[np.ndarray] = []  # byte addresses each access touched
        self.stored: list[np.ndarray] = []

    def add(self, addrs: np.ndarray, itemsize: int, into: list) -> None:
        if addrs.size == 0:
            return
        self.traffic += SECTOR * np.unique(addrs // SECTOR).size
        # every byte of every element (itemsize 1-8), so that distinct bytes count exactly
        into.append((addrs[:, None] + np.arange(itemsize, dtype=np.uint64)[None, :]).reshape(-1))

    def minimum(self) -> int:
        return sum(np.unique(np.concatenate(x)).size for x in (self.loaded, self.stored) if x)


def _named(fn, names: tuple[str, ...]):
    """fn's signature, checked to have the parameters the counter reads (by name: their positions and the others'
    names differ between Triton versions, 3.6 to 3.9 alone changed the cache arguments twice)."""
    import inspect

    import triton

    sig = inspect.signature(fn)
    missing = [n for n in names if n not in sig.parameters]
    if missing:
        raise RuntimeError(f"bench/gpu_traffic.py: Triton {triton.__version__}'s interpreter has no "
                           f"{', '.join(missing)} in {fn.__qualname__}{sig}; the traffic counter reads the pointer, "
                           f"mask and value arguments by name and does not support this version")
    return sig


@contextlib.contextmanager
def _counting():
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    load, store = builder.create_masked_load, builder.create_masked_store
    load_sig, store_sig = _named(load, ("self", "ptrs", "mask")), _named(store, ("self", "ptrs", "value", "mask"))
    count = _Count()

    def counted_load(*args, **kwargs):
        a = load_sig.bind(*args, **kwargs).arguments
        ptrs, mask = a["ptrs"], a["mask"]
        itemsize = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        count.add(np.asarray(ptrs.data, dtype=np.uint64)[np.asarray(mask.data, dtype=bool)], itemsize, count.loaded)
        return load(*args, **kwargs)

    def counted_store(*args, **kwargs):
        a = store_sig.bind(*args, **kwargs).arguments
        ptrs, mask = a["ptrs"], a["mask"]
        itemsize = np.asarray(a["value"].data).dtype.itemsize
        count.add(np.asarray(ptrs.data, dtype=np.uint64)[np.asarray(mask.data, dtype=bool)], itemsize, count.stored)
        return store(*args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
    try:
        yield count
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store


def _cases(torch, ops):
    """(label, elements, call) for every op the engine sends to Triton."""
    gen = torch.Generator().manual_seed(0)
    n = NUMEL
    parts = [torch.randn(1024, generator=gen) for _ in range(n // 1024)]
    flat16 = ops.flatten(parts, torch.bfloat16)
    grads = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(n, generator=gen)
    cases = [("flatten fp32 -> bf16, 64 tensors", n, lambda: ops.flatten(parts, torch.bfloat16)),
             ("unflatten_into_ bf16 -> fp32, 64 tensors", n, lambda: ops.unflatten_into_(flat16, parts)),
             ("unscale_and_check_ bf16", n, lambda: ops.unscale_and_check_(grads, 0.5))]
    for bits in (8, 4):
        q, s = ops.quantize(x, bits, GROUP)
        two_q, two_s = torch.stack([q, q]), torch.stack([s, s])
        cases += [(f"quantize fp32 -> int{bits}", n, lambda bits=bits: ops.quantize(x, bits, GROUP)),
                  (f"dequantize int{bits} -> fp32", n,
                   lambda q=q, s=s, bits=bits: ops.dequantize(q, s, bits, GROUP, n)),
                  (f"dequant_sum int{bits}, 2 ranks", n,
                   lambda q=two_q, s=two_s, bits=bits: ops.dequant_sum(q, s, bits, GROUP, n))]
    for label, master, state in (("fp32 states", torch.float32, torch.float32),
                                 ("bf16 moments", torch.float32, torch.bfloat16),
                                 ("bf16 master and moments", torch.bfloat16, torch.bfloat16)):
        p, m, v = torch.randn(n).to(master), torch.zeros(n, dtype=state), torch.zeros(n, dtype=state)
        out = torch.empty(n, dtype=torch.bfloat16)
        cases.append((f"adam_step_ bf16 grad, {label}, bf16 copy", n, lambda p=p, m=m, v=v, out=out: ops.adam_step_(
            p, grads, m, v, step=1, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, adamw=True,
            param_out=out)))
    return cases


def measure() -> list[dict]:
    """Each case's traffic, minimum and their ratio (run under TRITON_INTERPRET=1 with ZKERN_BACKEND=triton)."""
    import torch

    from zkern import ops

    out = []
    for label, numel, call in _cases(torch, ops):
        with _counting() as count:
            call()
        minimum = count.minimum()
        out.append({"case": label, "numel": numel, "traffic_bytes": count.traffic, "minimum_bytes": minimum,
                    "bytes_per_element": count.traffic / numel, "minimum_per_element": minimum / numel,
                    "ratio": count.traffic / minimum})
    return out
