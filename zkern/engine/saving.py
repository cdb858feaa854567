"""When the engine may save or load a checkpoint (the Checkpointer, zkern/checkpoint/checkpointer.py, does the rest).

    python -m pytest tests/checkpoint/test_checkpoint.py -q
"""

from __future__ import annotations

from zkern.engine.counters import Counters


def check_save(counters: Counters, inference: bool) -> None:
    """save_checkpoint only where a checkpoint holds the whole training state: an engine with an optimizer, after
    the step() that ends an accumulation."""
    from zkern.errors import CheckpointError

    if inference:
        raise CheckpointError("save_checkpoint: this engine has no optimizer, so no training state to save; save its "
                              "weights with save_16bit_model(dir) or full_state_dict()")
    if counters.holding_gradients():
        where = (f"micro-step {counters.pending_micro_steps} of an accumulation of {counters.accumulation_steps}"
                 if counters.pending_micro_steps else "a backward whose engine.step() has not run")
        raise CheckpointError(f"save_checkpoint after {where}: the gradients held since the last optimizer step are "
                              f"not part of a checkpoint; save after the engine.step() that ends an accumulation")


def check_load(inference: bool, load_module_only: bool) -> None:
    from zkern.errors import CheckpointError

    if inference and not load_module_only:
        raise CheckpointError("load_checkpoint: this engine has no optimizer; load a training checkpoint's weights "
                              "into it with load_module_only=True")
