"""How a draw's training loop reaches zkern: the engine's own calls (forward, engine.backward, engine.step,
save_checkpoint/load_checkpoint), or a script written for Accelerate+DeepSpeed run on zkern.hf.Accelerator
(accelerate(), accelerator.backward, optimizer.step, scheduler.step, optimizer.zero_grad, save_state/load_state), as
a user of each writes it. runner.py drives either through the same few calls, so every draw's events run on both.

    python -m zkern.verify.fuzz --draw '{"frontend": "accelerator", "stage": 3, "save_at": 1}'
"""

from __future__ import annotations

import torch


class EngineLoop:
    """zkern.Engine driven directly."""

    def __init__(self, engine):
        self.engine = engine

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.engine(idx.to(self.engine.device), tgt.to(self.engine.device))

    def train_micro_step(self, idx, tgt, poison: float | None, before_step=None) -> float:
        """One micro-step's forward, backward and step (an update at the accumulation boundary); poison multiplies
        the loss before backward (an overflow); before_step() runs between backward and step(). Returns the loss."""
        loss = self.forward(idx, tgt)
        value = loss.item()
        self.engine.backward(loss if poison is None else loss * poison)
        if before_step is not None:
            before_step()
        self.engine.step()
        return value

    def stray_micro_step(self, idx, tgt, accumulation: int) -> None:
        """A micro-step a load must discard: its backward, and the step that counts it mid-accumulation."""
        self.engine.backward(self.forward(idx, tgt) * 3.0)
        if accumulation > 1:
            self.engine.step()

    def save(self, path: str, async_save: bool) -> None:
        self.engine.save_checkpoint(path, async_save=async_save)

    def wait(self) -> None:
        self.engine.wait_checkpoint()

    def load(self, path: str, flags: dict) -> None:
        self.engine.load_checkpoint(path, **flags)

    def destroy(self) -> None:
        self.engine.destroy()


class AcceleratorLoop:
    """The same model, config, optimizer and scheduler prepared by zkern.hf.Accelerator: the config's optimizer and
    scheduler through DummyOptim/DummyScheduler (a client optimizer as the torch optimizer it is), every micro-step
    inside accelerator.accumulate(), checkpoints through save_state/load_state."""

    def __init__(self, model: torch.nn.Module, cfg: dict, params, client):
        from accelerate.state import AcceleratorState, GradientState
        from accelerate.utils import DummyOptim, DummyScheduler

        from zkern.hf import Accelerator

        # A rank process runs many draws: each starts from a fresh Accelerate state, as a new script would.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        self.accelerator = Accelerator(zkern_config=cfg, gradient_accumulation_steps=cfg["gradient_accumulation_steps"])
        trainable = params or [p for p in model.parameters() if p.requires_grad]
        optimizer = client if client is not None else DummyOptim(trainable)
        objects = [model, optimizer] + ([DummyScheduler(optimizer)] if "scheduler" in cfg else [])
        prepared = self.accelerator.prepare(*objects)
        self.model, self.optimizer = prepared[0], prepared[1]
        self.scheduler = prepared[2] if len(prepared) > 2 else None
        self.engine = self.accelerator.engine

    def forward(self, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        return self.model(idx.to(self.engine.device), tgt.to(self.engine.device))

    def train_micro_step(self, idx, tgt, poison: float | None, before_step=None) -> float:
        if before_step is not None:
            raise ValueError("an Accelerate script has no call between backward and step (its backward steps)")
        with self.accelerator.accumulate(self.model):
            loss = self.forward(idx, tgt)
            value = loss.item()
            self.accelerator.backward(loss if poison is None else loss * poison)
            self.optimizer.step()
            if self.scheduler is not None:
                self.scheduler.step()
            self.optimizer.zero_grad()
        return value

    def stray_micro_step(self, idx, tgt, accumulation: int) -> None:
        """A micro-step a load must discard (with accumulation 1 the Accelerator's backward steps: the load undoes
        that step)."""
        self.train_micro_step(idx, tgt, 3.0)

    def save(self, path: str, async_save: bool) -> None:
        self.accelerator.save_state(path)

    def wait(self) -> None:
        pass

    def load(self, path: str, flags: dict) -> None:
        self.accelerator.load_state(path, **flags)  # load_model_func_kwargs: the engine's load flags

    def destroy(self) -> None:
        self.engine.destroy()
