"""The engine's side of a checkpoint save: the client state copied and checked, the snapshot taken, the write run now
or in the background, and the checkpoints' own process group (zkern/checkpoint/ does the files).

    python -m pytest tests/test_checkpoint.py -q
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import torch

from zkern.checkpoint.control import control_comm
from zkern.checkpoint.manifest import check_plain
from zkern.checkpoint.save import AsyncSave, checked_tag, snapshot, write

if TYPE_CHECKING:
    from zkern.engine.engine import Engine


def write_checkpoint(engine: Engine, save_dir, tag, client_state, save_latest: bool, exclude_frozen_parameters: bool,
                     async_save: bool = False) -> str | None:
    """save_checkpoint without its refusal mid-accumulation: zkern.hf.Accelerator saves there as DeepSpeed does
    (the pending gradients are not saved; it warns)."""
    engine.wait_checkpoint()
    tag = checked_tag(tag, engine.global_steps)
    client_state = {} if client_state is None else client_state
    check_plain(client_state, "client_state")
    # A copy, taken now: an asynchronous save writes the manifest later, and the caller's dict may change by then
    # (the epoch counter of the loop that saved).
    client_state = json.loads(json.dumps(client_state))
    ctrl = checkpoint_group(engine)
    snap = snapshot(engine, client_state=client_state, exclude_frozen=exclude_frozen_parameters, copy=async_save)
    save_dir = os.fspath(save_dir)
    mode, local = engine.config.checkpoint.tag_validation, engine.config.checkpoint.use_node_local_storage
    if async_save:
        engine._pending_save = AsyncSave(lambda: write(ctrl, snap, save_dir, tag, save_latest, mode, local),
                                         f"save_checkpoint of tag {tag!r} to {save_dir!r}")
        return None
    return write(ctrl, snap, save_dir, tag, save_latest, mode, local)


def checkpoint_group(engine: Engine):
    """The checkpoints' own process group (gloo, for their JSON and control messages), made at the first save or
    load."""
    if engine._checkpoint_comm is None:
        engine._checkpoint_comm = control_comm(engine.comm)
    return engine._checkpoint_comm


def checkpoint_in_flight(engine: Engine) -> bool:
    """Whether an asynchronous save is still writing on any rank: the same answer on every rank (a collective,
    so every rank must ask it at the same point). A rank asking only its own writer may see it finish a step
    before another rank does, and ranks that branch on that take different numbers of steps."""
    mine = engine._pending_save is not None and not engine._pending_save.done()
    if engine.world_size == 1:
        return mine
    flag = torch.tensor([1.0 if mine else 0.0], device=engine.device)
    engine.comm.all_reduce(flag, "checkpoint_in_flight: whether any rank's asynchronous save still writes",
                           kind="control", op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


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
