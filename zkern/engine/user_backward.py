"""loss.backward() instead of engine.backward(loss) (DeepSpeed 0.19's user backward: its TestZeroUserBackwardBasic).

    python -m pytest tests/engine/test_user_backward.py -q

A forward hook on the model, ahead of every other (stage 3's among them), puts a gradient hook on each of its outputs
that requires one: the first place a gradient coming from the loss reaches. When engine.backward(loss) runs the pass,
the hook leaves the gradient as it is (the loss was scaled already). When the user's own loss.backward() reaches it,
the hook opens the pass as engine.backward would (the stage's reductions, the offloaded step's copies), multiplies
the gradient by engine.backward's factor (the loss scale, over the accumulation steps and the predivide factor: the
same numbers, up to rounding where the factor is not a power of two), and queues the pass's end at the end of
autograd's run (its reductions waited for and folded). The outputs stay the model's own tensors (an in-place
`loss *= k` on them, as the HF Trainer does, is fine). A gradient that reaches a parameter without passing an output
of the model (a regulariser on the parameters themselves) is refused by the runtimes, naming engine.backward(loss).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_leaves

from zkern.core.owners import weak_tensor_hook


class UserBackward:
    """The output hooks' shared state: whether engine.backward runs the pass, whether a user's pass is open."""

    def __init__(self, begin: Callable[[], float], end: Callable[[], None], abort: Callable[[], None],
                 active: Callable[[], bool]):
        """begin(): opens a pass, returns engine.backward's factor; end(): closes it; abort(): drops a pass that
        never ended (its backward raised); active(): whether a forward now builds a graph the engine trains."""
        self.begin, self.end, self.abort, self.active = begin, end, abort, active
        self.engine_backward = False  # engine.backward(loss) runs the pass: the hooks leave gradients as they are
        self.factor: float | None = None  # a user's pass is open: its gradients' factor

    def before_forward(self) -> None:
        """A user's backward that raised never ended: its pass is dropped before a new forward."""
        if self.factor is not None:
            self.factor = None
            self.abort()

    def forward_hook(self, module, args, out) -> None:
        """The model's forward hook (registered first, so its tensor hooks run before any other's)."""
        if not self.active():
            return
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(weak_tensor_hook(self.reached))  # a kept output must not keep the engine

    def reached(self, grad: torch.Tensor) -> torch.Tensor | None:
        if self.engine_backward:
            return None
        if self.factor is None:
            self.factor = self.begin()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        return None if self.factor == 1.0 else grad * self.factor

    def _finish(self) -> None:
        self.factor = None
        self.end()
