"""The pieces of Accelerate's DeepSpeed integration that zkern.hf.Accelerator puts a zkern engine behind.

- ZkernPlugin: accelerate's DeepSpeedPlugin itself (its fields, the ACCELERATE_* environment variables `accelerate
  launch` sets, its "auto" filling), holding the config zkern trains with. It never points transformers at
  DeepSpeed: Accelerate's plugin registers the config with transformers, whose from_pretrained would then import
  DeepSpeed for ZeRO-3 construction; zkern's sharded construction is zkern.init_sharded / zkern.hf.from_pretrained.
- EngineWrapper: what accelerator.backward() calls, as Accelerate's DeepSpeedEngineWrapper does for DeepSpeed's
  engine (the engine steps when the accumulation ends).
- OptimizerWrapper: the optimizer the script holds: step() and zero_grad() do nothing (the engine stepped and
  cleared), step_was_skipped says whether the engine's last step was skipped (fp16 overflow, a non-finite norm).
"""

from __future__ import annotations

import contextlib

from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DeepSpeedPlugin

from zkern.config import ConfigError


class ZkernPlugin(DeepSpeedPlugin):
    """accelerate.utils.DeepSpeedPlugin for zkern's engine (see the module docstring)."""

    def set_deepspeed_weakref(self):
        pass  # transformers must not see a DeepSpeed config: its loaders would import DeepSpeed

    def select(self, _from_accelerator_state: bool = False):
        self._set_selected(True)

    def set_moe_leaf_modules(self, model):
        names = self.transformer_moe_cls_names
        if names:
            raise ConfigError(f"transformer_moe_cls_names / ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES ({names!r}) asks "
                              f"DeepSpeed to gather those layers whole; zkern's stage 3 gathers a module's experts as "
                              f"they run and follows routing that changes between steps, so it needs no such list: "
                              f"leave it unset")

    @contextlib.contextmanager
    def zero3_init_context_manager(self, enable: bool = False):
        """As Accelerate's: zero3_init_flag is `enable` inside the block (zkern.hf.Accelerator.init_sharded and
        zkern.hf.from_pretrained read it)."""
        old = self.zero3_init_flag
        self.zero3_init_flag = enable
        try:
            yield
        finally:
            self.zero3_init_flag = old


class EngineWrapper:
    """accelerator.backward(loss) -> the engine's backward, and its step at the end of an accumulation."""

    def __init__(self, engine):
        self.engine = engine
        self.last_step_skipped = False

    def backward(self, loss, sync_gradients: bool = True, **kwargs) -> None:
        if kwargs:
            raise TypeError(f"accelerator.backward: zkern's engine takes no backward arguments ({sorted(kwargs)}); "
                            f"retain_graph and friends are not supported")
        engine = self.engine
        engine.set_gradient_accumulation_boundary(bool(sync_gradients))
        engine.backward(loss)
        skipped = engine.skipped_steps
        # Every micro-step: between boundaries step() only counts the micro-step (what zero_grad and a save ask).
        engine.step()
        if sync_gradients:
            self.last_step_skipped = engine.skipped_steps > skipped

    def get_global_grad_norm(self) -> float | None:
        return self.engine.last_grad_norm


class OptimizerWrapper(AcceleratedOptimizer):
    """The script's optimizer: the engine's param groups (a scheduler that writes their lr steers the engine)."""

    def __init__(self, optimizer, engine_wrapper: EngineWrapper):
        super().__init__(optimizer, device_placement=False, scaler=None)
        self._engine_wrapper = engine_wrapper

    def zero_grad(self, set_to_none=None):
        pass  # the engine cleared the gradients it applied; mid-accumulation they must stay

    def step(self, closure=None):
        pass  # the engine stepped in accelerator.backward()

    @property
    def step_was_skipped(self) -> bool:
        return self._engine_wrapper.last_step_skipped
