"""The engine's checkpoints, behind one object: what a rank's checkpoint is made of (holdings.py), the checkpoints'
own process group, and the asynchronous save in flight. Engine.save_checkpoint / load_checkpoint and zkern.hf's
savers call it; nothing here reads the engine.

    python -m pytest tests/checkpoint/test_checkpoint.py tests/checkpoint/test_checkpoint_compat.py -q
"""

from __future__ import annotations

import json
import os

import torch

from zkern.checkpoint.control import control_comm
from zkern.checkpoint.holdings import Holdings
from zkern.checkpoint.manifest import check_plain
from zkern.checkpoint.save import AsyncSave, snapshot, write


class Checkpointer:
    """Saves and loads one engine's checkpoints (collectives: every rank calls them)."""

    def __init__(self, holdings: Holdings):
        self.holdings = holdings
        self._group = None
        self.pending: AsyncSave | None = None  # an asynchronous save in flight

    @property
    def group(self):
        """The checkpoints' own process group (gloo, for their JSON and control messages), made at the first use
        (a collective)."""
        if self._group is None:
            self._group = control_comm(self.holdings.comm)
        return self._group

    def save(self, save_dir, tag: str, client_state: dict | None, *, save_latest: bool = True,
             exclude_frozen_parameters: bool = False, async_save: bool = False) -> str | None:
        """Write the training state under save_dir/tag; returns the tag's directory (None for an asynchronous save,
        whose path wait() gives). No refusal mid-accumulation: the engine refuses there, zkern.hf.Accelerator
        saves there as DeepSpeed does (the pending gradients are not saved)."""
        self.wait()
        # the host step's work in flight ends, landing nothing: a delayed update stays pending (the snapshot keeps the
        # weights the forward computes with beside the masters), so a save never changes the run that saves
        self.holdings.store.settle()
        client_state = {} if client_state is None else client_state
        check_plain(client_state, "client_state")
        # A copy, taken now: an asynchronous save writes the manifest later, and the caller's dict may change by then
        # (the epoch counter of the loop that saved).
        client_state = json.loads(json.dumps(client_state))
        ctrl = self.group
        snap = snapshot(self.holdings, client_state=client_state, exclude_frozen=exclude_frozen_parameters,
                        copy=async_save)
        save_dir = os.fspath(save_dir)
        settings = self.holdings.config.checkpoint
        mode, local = settings.tag_validation, settings.use_node_local_storage
        if async_save:
            self.pending = AsyncSave(lambda: write(ctrl, snap, save_dir, tag, save_latest, mode, local),
                                     f"save_checkpoint of tag {tag!r} to {save_dir!r}")
            return None
        return write(ctrl, snap, save_dir, tag, save_latest, mode, local)

    def load(self, load_dir, tag: str | None, *, strict: bool, load_optimizer_states: bool,
             load_lr_scheduler_states: bool, load_module_only: bool) -> tuple[str | None, dict | None]:
        from zkern.checkpoint.load import load

        self.wait()
        # the host step's work in flight ends first (a delayed update lands, a speculative step's guess is withdrawn):
        # else it would write the state the load is about to set (or, withdrawn later, restore what it replaced)
        self.holdings.store.land_update()
        return load(self.holdings, self.group, load_dir, tag, strict=strict,
                    load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states,
                    load_module_only=load_module_only)

    def wait(self) -> str | None:
        """Wait for the asynchronous save in flight, if any; returns its directory, or raises its error."""
        pending, self.pending = self.pending, None
        return None if pending is None else pending.wait()

    def in_flight(self) -> bool:
        """Whether an asynchronous save is still writing on any rank: the same answer on every rank (a collective,
        so every rank must ask it at the same point). A rank asking only its own writer may see it finish a step
        before another rank does, and ranks that branch on that take different numbers of steps."""
        mine = self.pending is not None and not self.pending.done()
        comm = self.holdings.comm
        if comm.world == 1:
            return mine
        flag = torch.tensor([1.0 if mine else 0.0], device=self.holdings.device)
        comm.all_reduce(flag, "checkpoint_in_flight: whether any rank's asynchronous save still writes",
                        kind="control", op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())
