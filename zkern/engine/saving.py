"""When the engine may save or load a checkpoint (the Checkpointer, zkern/checkpoint/checkpointer.py, does the rest).

    python -m pytest tests/checkpoint/test_checkpoint.py -q
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zkern.engine.engine import Engine


def check_save(engine: Engine) -> None:
    """save_checkpoint only where a checkpoint holds the whole training state: an engine with an optimizer, after
    the step() that ends an accumulation."""
    from zkern.errors import CheckpointError

    if engine.inference:
        raise CheckpointError("save_checkpoint: this engine has no optimizer, so no training state to save; save its "
                              "weights with save_16bit_model(dir) or full_state_dict()")
    if engine.pending_micro_steps or engine.backward_unstepped:
        where = (f"micro-step {engine.pending_micro_steps} of an accumulation of {engine.gradient_accumulation_steps}"
                 if engine.pending_micro_steps else "a backward whose engine.step() has not run")
        raise CheckpointError(f"save_checkpoint after {where}: the gradients held since the last optimizer step are "
                              f"not part of a checkpoint; save after the engine.step() that ends an accumulation")


def check_load(engine: Engine, load_module_only: bool) -> None:
    from zkern.errors import CheckpointError

    if engine.inference and not load_module_only:
        raise CheckpointError("load_checkpoint: this engine has no optimizer; load a training checkpoint's weights "
                              "into it with load_module_only=True")
