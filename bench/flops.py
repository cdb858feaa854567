"""Model FLOPs for the engine suite's TFLOPS and MFU: what a TinyGPT training step must compute, the GPU's
datasheet peak, and the bf16 matrix-product rate this GPU actually reaches.

    python -c "from bench.flops import *; print(train_flops_per_token(dict(dim=64, n_layer=2, seq=16, vocab=67)))"

Counted as model FLOPs (PaLM's MFU convention): the matrix products of forward and backward (backward costs
twice the forward), attention's two products over the full sequence (no causal halving), the tied LM head.
Embedding lookups, norms, activations and the optimizer are not counted. Activation recomputation would not be
either: MFU counts what the model needs, not what the implementation spends.
"""

from __future__ import annotations

import torch

# Dense (no sparsity) datasheet peaks in TFLOP/s per GPU: (name fragment, bf16/fp16 tensor cores, plain fp32).
# Checked in order, so the PCIe and NVL parts come before the plain name. Leads, not measurements: the suite
# also measures a bf16 matrix product (matmul_tflops) and reports MFU against both.
PEAK_TFLOPS = [
    ("H100 PCIe", 756.0, 51.2),
    ("H100 NVL", None, None),  # rates differ by SKU; pass --peak-tflops
    ("H100", 989.4, 66.9),  # SXM: torch names it "NVIDIA H100 80GB HBM3"
    ("H200 NVL", None, None),
    ("H200", 989.4, 66.9),  # SXM: the H100's arithmetic with more memory
    ("A100", 312.0, 19.5),
]


def train_flops_per_token(model: dict) -> int:
    """Forward + backward FLOPs per token of a TinyGPT (its kwargs: dim, n_layer, seq, vocab)."""
    d, layers, seq, vocab = model["dim"], model["n_layer"], model["seq"], model["vocab"]
    per_layer = 2 * d * (3 * d + d + 4 * d + 4 * d) + 2 * 2 * seq * d  # qkv, proj, fc, fc_out; q.k and attn.v
    forward = layers * per_layer + 2 * d * vocab  # + the LM head
    return 3 * forward


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The datasheet's dense peak for this GPU and training precision, or None when it is not in the table."""
    for fragment, half, fp32 in PEAK_TFLOPS:
        if fragment in device_name:
            return half if precision in ("bf16", "fp16") else fp32
    return None


def measure_matmul_tflops(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """The bf16 rate of an n x n x n matrix product on random data (zeros run faster and would flatter MFU):
    the mean of `reps` products after three warm-ups, timed with CUDA events."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3 / reps
    return 2 * n**3 / seconds / 1e12
