"""zkern.hf.Trainer: Hugging Face's Trainer with a zkern engine in place of DDP or DeepSpeed.

    torchrun --nproc-per-node 2 examples/hf_trainer.py
    python -m pytest tests/hf/test_hf_trainer.py -q

Everything HF's Trainer does stays its own (data, loss and its normalisation over accumulation and ranks, logging,
evaluation, callbacks, checkpoint rotation, trainer state); the engine takes the backward, the reduction, the
optimizer step and the scheduler, as DeepSpeed's engine does under HF:

- the engine is built when training starts (the number of steps is known then), from zkern_config with its "auto"
  values filled from TrainingArguments (zkern/hf/auto.py); with no 'optimizer' section the optimizer is the
  Trainer's own (create_optimizer: AdamW with decay/no-decay groups), with one it is zkern's fused Adam over the
  same decay/no-decay groups; with no 'scheduler' section the scheduler is the Trainer's (lr_scheduler_type);
- accelerate's backward is routed to engine.backward + engine.step; the Trainer's optimizer and scheduler are
  stand-ins whose step() does nothing (the engine stepped), and the learning rate and gradient norm logged are the
  ones the engine's step used;
- accelerate does no autocast or loss scaling: the engine casts the model and keeps fp32 masters itself;
- save_steps checkpoints hold a zkern checkpoint (`zkern/` in the checkpoint folder, any world size or stage
  resumes it) with the RNG states HF would pickle kept as JSON in its client state, the model in HF's format
  (safetensors, loadable without zkern) and HF's trainer_state.json; train(resume_from_checkpoint=...) resumes it.
"""

from __future__ import annotations

import os

import torch
import transformers

from zkern.config import ConfigError
from zkern.core.generators import set_rng_state
from zkern.engine.engine import Engine
from zkern.hf.auto import fill_auto, read_config
from zkern.hf.reference_models import check_reference_models, shard_reference_models

# The Trainer methods zkern.hf.Trainer overrides; transformers 5.23-5.x has them all.
_HOOKS = ("_build_accelerator_args", "create_optimizer", "create_scheduler", "_wrap_model", "_clip_grad_norm",
          "_get_grad_norm", "_get_learning_rate", "_save", "_save_optimizer_and_scheduler", "_save_scaler",
          "_save_rng_state", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler",
          "_load_rng_state")
_missing = [h for h in _HOOKS if not hasattr(transformers.Trainer, h)]
if _missing:
    raise ImportError(f"zkern.hf.Trainer needs transformers>=5.23,<6 (this is {transformers.__version__}, whose "
                      f"Trainer lacks {_missing}): pip install 'zkern[hf]'")

CHECKPOINT_TAG = "zkern"  # the zkern checkpoint's folder inside HF's checkpoint-<step> folder


class Trainer(transformers.Trainer):
    """transformers.Trainer that trains with zkern: Trainer(model, args, ..., zkern_config=path_or_dict).

    After training starts, trainer.engine is the zkern.Engine (also trainer.model_wrapped)."""

    def __init__(self, *args, zkern_config: dict | str | os.PathLike | None = None, **kwargs):
        if zkern_config is None:
            raise TypeError("zkern.hf.Trainer needs zkern_config=: a DeepSpeed-style config dict or JSON path "
                            "(\"auto\" values are filled from the TrainingArguments)")
        self.zkern_config = read_config(zkern_config)
        self.engine: Engine | None = None
        self._lr_used: list[float] | None = None
        self._resumed_rng: dict | None = None
        super().__init__(*args, **kwargs)
        for name in ("deepspeed", "fsdp"):
            if getattr(self.args, name, None):
                raise ValueError(f"TrainingArguments.{name} is set; zkern.hf.Trainer shards the model itself: "
                                 f"leave {name} unset and put the config in zkern_config")

    # -- accelerate: no autocast, no loss scaling (the engine owns precision) -----------------------------------
    def _build_accelerator_args(self, **kwargs):
        built = super()._build_accelerator_args(**kwargs)
        built["mixed_precision"] = "no"
        return built

    # -- the engine ---------------------------------------------------------------------------------------------
    def create_optimizer(self, model=None):
        if self.engine is not None:
            return self.optimizer
        steps = self.state.max_steps
        _check_world(self.args)
        config = fill_auto(self.zkern_config, self.args, self.args.world_size, steps)
        check_reference_models(self, config)
        client_optimizer, groups = None, None
        if "optimizer" in config:
            if self.optimizer is not None:
                raise ConfigError("an optimizer is given twice: in zkern_config's 'optimizer' section and as "
                                  "Trainer(optimizers=...); keep one")
            groups = self._decay_groups()
        else:
            client_optimizer = super().create_optimizer(model)  # the Trainer's own, over the whole parameters
        scheduler = self.lr_scheduler
        if scheduler is None and "scheduler" not in config:
            def scheduler(optimizer):
                return transformers.get_scheduler(self.args.lr_scheduler_type, optimizer=optimizer,
                                                  num_warmup_steps=self.args.get_warmup_steps(steps),
                                                  num_training_steps=steps,
                                                  scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)
        self.engine = Engine(self.model, config, optimizer=client_optimizer, lr_scheduler=scheduler,
                             model_parameters=groups)
        shard_reference_models(self, config)  # TRL's ref_model / teacher_model: engines without an optimizer
        self.optimizer = _OptimizerStandIn(self.engine)
        self.lr_scheduler = _SchedulerStandIn(self)
        self.accelerator.backward = self._engine_backward
        return self.optimizer

    def _decay_groups(self) -> list[dict]:
        """HF's weight-decay split (no decay for biases and norms) for the config's optimizer; its weight_decay
        comes from the config."""
        decay = set(self.get_decay_parameter_names(self.model))
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        with_decay = [p for n, p in named if n in decay]
        without = [p for n, p in named if n not in decay]
        return [g for g in ({"params": with_decay}, {"params": without, "weight_decay": 0.0}) if g["params"]]

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.engine is None:
            return super().create_scheduler(num_training_steps, optimizer)
        if not isinstance(self.lr_scheduler, _SchedulerStandIn):
            self.lr_scheduler = _SchedulerStandIn(self)
        return self.lr_scheduler

    def _wrap_model(self, model, training: bool = True, dataloader=None):
        if self.engine is not None:
            return self.engine
        from zkern.stage3.sharded_init import is_sharded

        if any(is_sharded(p) for p in self.model.parameters()):
            raise RuntimeError("this model was built sharded (zkern.hf.from_pretrained or zkern.init_sharded) and "
                               "has no engine yet; the engine is built by train(): call train() before evaluate() "
                               "or predict()")
        return model

    def _engine_backward(self, loss: torch.Tensor, **kwargs) -> None:
        """accelerate's backward, routed to the engine. The Trainer has normalised loss over the accumulation
        (by the micro-step count or the tokens of the whole accumulation) and over ranks as it does for DDP, so the
        wanted gradient is the sum over micro-steps of grad(loss), averaged over ranks; engine.backward divides by
        gradient_accumulation_steps, hence the factor. The Trainer says where an accumulation ends (an epoch's last
        one may be short)."""
        engine = self.engine
        boundary = bool(self.accelerator.sync_gradients)
        engine.set_gradient_accumulation_boundary(boundary)
        engine.backward(loss * engine.gradient_accumulation_steps)
        if boundary:
            self._lr_used = [g["lr"] for g in engine.optimizer.param_groups]  # the LR this step applies
        engine.step()

    def _clip_grad_norm(self, model):
        return self.engine.last_grad_norm  # the engine clipped inside its step; this is the norm before clipping

    def _get_grad_norm(self, model, grad_norm=None):
        return self.engine.last_grad_norm if grad_norm is None else grad_norm

    def _get_learning_rate(self) -> float:
        if self.engine is None:
            return super()._get_learning_rate()
        return self.lr_scheduler.get_last_lr()[0]

    # -- saving -------------------------------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The model as an HF model directory (safetensors, config): the fp32 master weights gathered onto the main
        process, one bucket at a time (a collective: every rank calls it, as Trainer.save_model is called)."""
        if self.engine is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        state = self.engine.full_state_dict(rank0_only=True)
        if self.args.should_save:
            self._save(output_dir, state_dict=state)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # Every rank's generators are in the checkpoint already (the engine's "generators" component, per rank).
        self.engine.save_checkpoint(output_dir, tag=CHECKPOINT_TAG, save_latest=False)

    def _save_scaler(self, output_dir: str) -> None:
        pass  # the loss scaler is in the zkern checkpoint

    def _save_rng_state(self, output_dir: str) -> None:
        pass  # every rank's generators are in the zkern checkpoint (JSON, never unpickled)

    # -- resuming -----------------------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Called before the engine exists: check the checkpoint is zkern's; the weights load with the engine."""
        path = os.path.join(resume_from_checkpoint, CHECKPOINT_TAG)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"{resume_from_checkpoint!r} has no zkern checkpoint ({path!r} is missing): "
                                    f"zkern.hf.Trainer resumes from checkpoints it saved itself")

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The engine's load restores every state, this rank's generators included; HF's loop then skips the batches
        already trained, which may draw from them, so _load_rng_state applies the saved generators once more."""
        from zkern.checkpoint.manifest import rank_forms, read_manifest

        if checkpoint is None:
            return
        path, client_state = self.engine.load_checkpoint(checkpoint, tag=CHECKPOINT_TAG)
        if path is None:  # nothing to load (the engine warned)
            return
        older = (client_state or {}).get("hf_rng")  # checkpoints saved before 2026-11-27 kept a copy here
        if older is not None:
            rank = self.engine.rank
            self._resumed_rng = older[rank] if rank < len(older) else None
        else:
            forms = rank_forms(read_manifest(path), self.engine.rank)
            self._resumed_rng = (forms or {}).get("generators")
        # (a rank the saving run did not have keeps its generators as they are; the engine's load said so)

    def _load_scaler(self, checkpoint: str | None) -> None:
        pass  # restored with the engine's checkpoint

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """HF restores the RNG after skipping the batches already trained (the skip may draw from it)."""
        if checkpoint is not None and self._resumed_rng is not None:
            set_rng_state(self._resumed_rng)


def _check_world(args) -> None:
    """The Trainer shards the data over args.world_size ranks; the engine over torch.distributed's. They must agree."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if args.world_size != world:
        hint = (" (on a host without CUDA, transformers trains distributed only with TrainingArguments(use_cpu=True))"
                if not torch.cuda.is_available() else "")
        raise RuntimeError(f"the TrainingArguments see a world of {args.world_size} rank(s) (parallel mode "
                           f"{args.parallel_mode}) but torch.distributed has {world}: the Trainer would not split the "
                           f"data as the engine splits the model{hint}")


class _OptimizerStandIn:
    """What the Trainer (and accelerate) hold as the optimizer: the engine's param groups; step and zero_grad do
    nothing because the engine stepped when the accumulation's last backward ran."""

    def __init__(self, engine: Engine):
        self.engine = engine

    @property
    def param_groups(self):
        return self.engine.optimizer.param_groups

    @property
    def state(self):
        return self.engine.optimizer.state

    @property
    def defaults(self):
        return self.engine.optimizer.defaults

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True):
        return None

    def state_dict(self) -> dict:
        return {"zkern": "the optimizer state is saved in zkern checkpoints"}

    def load_state_dict(self, state: dict) -> None:
        if state != self.state_dict():
            raise ValueError("zkern.hf.Trainer's optimizer state loads from zkern checkpoints "
                             "(train(resume_from_checkpoint=...)), not from an optimizer state_dict")


class _SchedulerStandIn:
    """The Trainer's scheduler: the engine steps its own; get_last_lr() is the LR the last step applied (HF logs
    the LR read after the optimizer's step and before the scheduler's)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer

    def step(self, *args, **kwargs):
        return None

    def get_last_lr(self) -> list[float]:
        if self.trainer._lr_used is not None:
            return list(self.trainer._lr_used)
        return [g["lr"] for g in self.trainer.engine.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"zkern": "the scheduler state is saved in zkern checkpoints"}

    def load_state_dict(self, state: dict) -> None:
        if state != self.state_dict():
            raise ValueError("zkern.hf.Trainer's scheduler state loads from zkern checkpoints")
