"""The equivalence tests on CUDA at world size 1 inside an nccl process group (skipped without a GPU).

At world size 1 zkern issues no collectives, so these check the CUDA path of the engine (device placement,
mixed precision on the GPU, the step) rather than nccl itself; multi-GPU runs belong to the benchmark.
"""

import dataclasses

import pytest
import torch

from zkern.testing import TrainSpec, assert_params_close, engine_run, mean_losses, reference_run, spawn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def nccl_engine_run(rank, world, spec):
    import torch.distributed as dist

    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    return engine_run(rank, world, spec)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_on_cuda_equals_single_process_adamw(stage):
    spec = TrainSpec(stage=stage, accumulation=2, clip=0.05, device="cuda")
    result = spawn(nccl_engine_run, 1, spec, subprocess=True)[0]
    ref_state, _ = reference_run(spec, 1)
    assert_params_close(result["state"], ref_state, lr=spec.lr, steps=spec.steps)


@pytest.mark.parametrize("precision, tolerance", [("bf16", 4 * 2**-8), ("fp16", 4 * 2**-11)])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_16_bit_on_cuda_follows_the_fp32_curve(stage, precision, tolerance):
    spec = TrainSpec(stage=stage, precision=precision, accumulation=2, lr=1e-2, device="cuda")
    result = spawn(nccl_engine_run, 1, spec, subprocess=True)
    _, ref_losses = reference_run(dataclasses.replace(spec, precision="fp32"), 1)
    gaps = [abs(a - b) / b for a, b in zip(mean_losses(result), ref_losses)]
    assert max(gaps) <= tolerance, gaps
    assert result[0]["skipped"] == 0


@pytest.mark.parametrize("stage, zero", [
    (2, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    (3, {"offload_optimizer": {"device": "cpu", "pin_memory": True},
         "offload_param": {"device": "cpu", "pin_memory": True}}),
])
def test_offload_on_cuda_matches_no_offload(stage, zero):
    """The side-stream copies (gradients down, parameters up, stage-3 shards up per gather) on a real GPU."""
    spec = TrainSpec(stage=stage, precision="bf16", accumulation=2, device="cuda", zero=zero)
    off = spawn(nccl_engine_run, 1, spec, subprocess=True)[0]
    plain = spawn(nccl_engine_run, 1, dataclasses.replace(spec, zero={}), subprocess=True)[0]
    assert_params_close(off["state"], plain["state"], lr=spec.lr, steps=spec.steps)
    assert off["memory"]["host"]["optimizer"] > 0 and off["memory"]["cuda"]["optimizer"] == 0


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_engine_suite_on_cuda_measures_allocated_memory_tflops_and_mfu(precision):
    """The benchmark's CUDA path: nccl peers on one GPU per rank, CUDA max allocated, TFLOPS and MFU."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from bench import engine_suite

    rec = engine_suite.run([0, 1, 2, 3], None, "tiny", steps=4, device="cuda", precision=precision,
                           progress=lambda line: None)
    assert rec["device"] == "cuda" and rec["world"] == torch.cuda.device_count()
    assert rec["matmul_tflops"] > 1
    for st in rec["stages"]:
        assert 0.99 <= st["ratios"]["model_state_over_formula"] <= 1.10  # the tiny model's 256-byte slots: 7.9%
        for s in st["systems"]:
            states = s["model_state_bytes_per_rank"]  # None: a peer measured from outside cannot say
            assert s["peak_cuda_bytes_per_rank"] > 0 and (states is None or s["peak_cuda_bytes_per_rank"] >= states)
            assert s["tflops_per_rank"] > 0 and s["mfu_of_matmul"] > 0
            assert (s["mfu"] is None) == (rec["peak_tflops"] is None)
    assert "MFU" in engine_suite.table(rec)
