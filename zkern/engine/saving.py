"""When the engine may save or load a checkpoint (the Checkpointer, zkern/checkpoint/checkpointer.py, does the rest).

    python -m pytest tests/checkpoint/test_checkpoint.py -q
"""

from __future__ import annotations

from zkern.engine.counters import Counters


def check_save(counters: Counters, inference: bool) -> None:
    """save_checkpoint needs an engine with an optimizer. Between the micro-steps of an accumulation it saves, as
    DeepSpeed does, the state at the last optimizer step: the gradients held since are not part of it (the
    counters' saved form counts the micro-steps up to that step), and the saving run goes on with them."""
    from zkern.errors import CheckpointError

    if inference:
        raise CheckpointError("save_checkpoint: this engine has no optimizer, so no training state to save; save its "
                              "weights with save_16bit_model(dir) or full_state_dict()")


def check_load(inference: bool, load_module_only: bool) -> None:
    from zkern.errors import CheckpointError

    if inference and not load_module_only:
        raise CheckpointError("load_checkpoint: this engine has no optimizer; load a training checkpoint's weights "
                              "into it with load_module_only=True")
