"""The engine's training counters and where an accumulation stands: one object the step, the checkpoint's
components and DeepSpeed's accessors share (engine.global_steps and the rest read from it).

    python -m pytest tests/engine/test_engine.py -q -k "accumulation or counters"
"""

from __future__ import annotations

from dataclasses import dataclass


class Count(int):
    """An int DeepSpeed exposes as a method: `engine.gradient_accumulation_steps` reads as the count zkern's own
    code uses and `engine.gradient_accumulation_steps()` calls as DeepSpeed's engine does."""

    def __call__(self) -> int:
        return int(self)


@dataclass(eq=False)
class Counters:
    accumulation_steps: Count  # micro-steps per optimizer step (gradient_accumulation_steps)
    micro_steps: int = 0
    pending_micro_steps: int = 0  # micro-steps accumulated since the last optimizer step
    backward_unstepped: bool = False  # a backward ran whose step() has not (its gradients are held)
    boundary: bool | None = None  # set_gradient_accumulation_boundary's word, else the count decides
    global_steps: int = 0
    skipped_steps: int = 0
    last_grad_norm: float | None = None
    step_applied: bool = False  # was_step_applied(): the last step() updated the parameters

    def at_boundary(self) -> bool:
        """True when the next step() will update the parameters."""
        if self.boundary is not None:
            return self.boundary
        return self.pending_micro_steps + 1 == self.accumulation_steps

    def holding_gradients(self) -> bool:
        """Gradients are held since the last optimizer step (micro-steps accumulated, or a backward not stepped)."""
        return bool(self.pending_micro_steps or self.backward_unstepped)

    def micro_step(self) -> bool:
        """step() was called: count it; True when it ends the accumulation (the optimizer steps)."""
        boundary = self.at_boundary()
        self.step_applied = False
        self.backward_unstepped = False
        self.micro_steps += 1
        self.pending_micro_steps = 0 if boundary else self.pending_micro_steps + 1
        return boundary

    def reset_accumulation(self) -> None:
        """No micro-step accumulated, and the accumulation boundary back to counting (the registry's reset)."""
        self.pending_micro_steps = 0
        self.boundary = None
        self.backward_unstepped = False

    def reset_training(self) -> None:
        """A fresh engine's step counts (what a load that holds none of them leaves)."""
        self.global_steps = self.skipped_steps = self.micro_steps = 0
        self.last_grad_norm = None
