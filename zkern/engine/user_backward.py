"""loss.backward() instead of engine.backward(loss) (DeepSpeed 0.19's user backward: its TestZeroUserBackwardBasic).

    python -m pytest tests/engine/test_user_backward.py -q

The engine's forward hands out its outputs through an entry node (BackwardEntry): an alias forward, and in backward
the first place a gradient coming from the loss reaches. When engine.backward(loss) runs the pass, the node passes
the gradient on as it is (the loss was scaled already). When the user's own loss.backward() reaches it, the node
opens the pass as engine.backward would (the stage's reductions, the offloaded step's copies), multiplies the
gradient by engine.backward's factor (the loss scale, over the accumulation steps and the predivide factor: the
same numbers, up to rounding where the factor is not a power of two), and queues the pass's end at the end of
autograd's run (its reductions waited for and folded). A gradient that reaches a parameter without passing an
output of the engine (a regulariser on the parameters themselves) is refused by the runtimes, naming
engine.backward(loss).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._pytree import tree_map


class UserBackward:
    """The entry nodes' shared state: whether engine.backward runs the pass, whether a user's pass is open."""

    def __init__(self, begin: Callable[[], float], end: Callable[[], None], abort: Callable[[], None]):
        """begin(): opens a pass, returns engine.backward's factor; end(): closes it; abort(): drops a pass that
        never ended (its backward raised)."""
        self.begin, self.end, self.abort = begin, end, abort
        self.engine_backward = False  # engine.backward(loss) runs the pass: the entry nodes pass gradients on
        self.factor: float | None = None  # a user's pass is open: its gradients' factor

    def before_forward(self) -> None:
        """A user's backward that raised never ended: its pass is dropped before a new forward."""
        if self.factor is not None:
            self.factor = None
            self.abort()

    def outputs(self, out):
        """out with every tensor that requires a gradient behind an entry node (a new alias of it)."""
        return tree_map(lambda t: BackwardEntry.apply(t, self)
                        if isinstance(t, torch.Tensor) and t.requires_grad else t, out)

    def reached(self, grad: torch.Tensor) -> torch.Tensor:
        if self.engine_backward:
            return grad
        if self.factor is None:
            self.factor = self.begin()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        return grad if self.factor == 1.0 else grad * self.factor

    def _finish(self) -> None:
        self.factor = None
        self.end()


class BackwardEntry(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, state: UserBackward) -> torch.Tensor:
        ctx.state = state
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.state.reached(grad), None
