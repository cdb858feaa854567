"""zkern.testing: public helpers for testing a ZeRO training setup against a plain single-process reference, as
torch.testing is for tensors. zkern's own tests, its benchmark and `python -m zkern.verify` use them; so can yours.
The names in __all__ are a stable API (changed only with a deprecation note in the docs); the submodules behind
them are not.

    python -c "from zkern.testing import TinyGPT; print(sum(p.numel() for p in TinyGPT().parameters()))"

  models    TinyGPT, TinyMoE (routed experts), DeepMLP (many tiny layers), Block, Expert, MoEBlock, hf_gpt2 (a small
            transformers GPT-2),
            make_batches / global_batch (deterministic data, the same global batch for any world size), run_block,
            gpt2_load_peak (load a GPT-2 and measure the resident peak)
  ranks     spawn(fn, world, ...) runs fn on N processes over gloo on 127.0.0.1 with a free port (free_port), and
            returns each rank's result or raises the failing rank's traceback; no rank hangs past its timeout
  runs      TrainSpec (model, precision, optimizer groups, steps), engine_run / reference_run / ddp_run and the
            loops behind them (engine_training_loop, torch_training_loop): the same training under zkern, a
            single-process torch.optim run and DDP; mean_losses (the global loss per step), rank_device,
            init_peer_group and peer_autocast (what a stock peer needs to run beside zkern)
  compare   compare_params / assert_params_close (parameter by parameter), assert_within (an element-wise
            bound), assert_f32_rounding (to float32 rounding), adam_drift_bound, fp32_sum_rtol (tolerances derived
            from the arithmetic, never from one machine's output), same_bits_or_nan
  memory    allocation_peak (every allocation through torch's allocators during a call, replayed: its peak, an
            AllocationPeak), live_tensor_bytes (every live tensor's memory, walked by the garbage collector),
            rss_bytes / peak_rss_bytes / reset_peak_rss / peaks / reset_peaks, model_state_bytes
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
from zkern.testing.memory import (
    AllocationPeak,
    allocation_peak,
    live_tensor_bytes,
    peak_rss_bytes,
    reset_peak_rss,
    rss_bytes,
)
from zkern.testing.models import (
    Block,
    DeepMLP,
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

__all__ = ["AllocationPeak", "allocation_peak", "live_tensor_bytes", "rss_bytes",
           "Block", "DeepMLP", "Expert", "MoEBlock", "TinyGPT", "TinyMoE", "TrainSpec", "adam_drift_bound",
           "assert_within",
           "assert_f32_rounding",
           "assert_params_close", "compare_params", "ddp_run", "engine_run", "engine_training_loop", "fp32_sum_rtol",
           "free_port", "global_batch", "gpt2_load_peak", "hf_gpt2", "init_peer_group", "make_batches", "mean_losses",
           "model_state_bytes", "peak_rss_bytes", "peaks", "peer_autocast", "rank_device", "reference_run",
           "reset_peak_rss", "reset_peaks", "run_block", "same_bits_or_nan", "spawn", "torch_training_loop"]
