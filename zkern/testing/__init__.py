"""Helpers shared by tests and bench: small models, deterministic batches, an N-rank spawner over gloo, a plain
single-process torch reference run, and the parameter comparison zkern's equivalence tests use. Examples for users
define their own models and never import it.

    python -c "from zkern.testing import TinyGPT; print(sum(p.numel() for p in TinyGPT().parameters()))"
"""

from zkern.testing.compare import (
    adam_drift_bound,
    assert_f32_rounding,
    assert_params_close,
    assert_within,
    compare_params,
    fp32_sum_rtol,
    same_bits_or_nan,
)
from zkern.testing.memory import peak_rss_bytes, reset_peak_rss
from zkern.testing.models import (
    Block,
    Expert,
    MoEBlock,
    TinyGPT,
    TinyMoE,
    global_batch,
    gpt2_load_peak,
    hf_gpt2,
    make_batches,
    run_block,
)
from zkern.testing.ranks import free_port, spawn
from zkern.testing.runs import (
    TrainSpec,
    ddp_run,
    engine_run,
    engine_training_loop,
    init_peer_group,
    mean_losses,
    model_state_bytes,
    peaks,
    peer_autocast,
    rank_device,
    reference_run,
    reset_peaks,
    torch_training_loop,
)

__all__ = ["Block", "Expert", "MoEBlock", "TinyGPT", "TinyMoE", "TrainSpec", "adam_drift_bound", "assert_within",
           "assert_f32_rounding",
           "assert_params_close", "compare_params", "ddp_run", "engine_run", "engine_training_loop", "fp32_sum_rtol",
           "free_port", "global_batch", "gpt2_load_peak", "hf_gpt2", "init_peer_group", "make_batches", "mean_losses",
           "model_state_bytes", "peak_rss_bytes", "peaks", "peer_autocast", "rank_device", "reference_run",
           "reset_peak_rss", "reset_peaks", "run_block", "same_bits_or_nan", "spawn", "torch_training_loop"]
