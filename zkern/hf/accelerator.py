"""zkern.hf.Accelerator: accelerate.Accelerator with a zkern engine where Accelerate+DeepSpeed has DeepSpeed's.

    from zkern.hf import Accelerator            # instead of: from accelerate import Accelerator
    accelerator = Accelerator(zkern_config="ds_config.json", gradient_accumulation_steps=2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    torchrun --nproc-per-node 2 examples/accelerate_clm.py      (or accelerate launch with a DEEPSPEED config)
    python -m pytest tests/hf/test_hf_accelerator.py -q

The Accelerator is Accelerate's own, in its DeepSpeed mode (distributed_type DEEPSPEED, a DeepSpeedPlugin holding the
config), so a script behaves as it does under Accelerate+DeepSpeed: the same "auto" filling from the prepared
loaders, DummyOptim and DummyScheduler, the same errors, backward() that steps the engine at the end of an
accumulation, optimizer.step()/zero_grad() and an engine-owned scheduler's step() that do nothing. What DeepSpeed
did, zkern does:

- prepare() builds zkern.Engine from the model, the optimizer (a torch optimizer, or the config's through
  DummyOptim) and the scheduler (a torch scheduler is stepped by Accelerate, as under DeepSpeed; DummyScheduler's is
  the engine's);
- save_state()/load_state(): a zkern checkpoint (any world size, stage or offload resumes it) holding the scheduler,
  dataloader and registered objects' states and every rank's random generators, in JSON and safetensors: nothing
  loaded is unpickled (accelerate_state.py);
- get_state_dict(): the weights in the training dtype, gathered onto the main process at stage 3 one unit at a time;
- init_sharded() and zkern.hf.from_pretrained: models built partitioned (Accelerate's zero3_init_flag).

The config comes from zkern_config= (a dict or a JSON path), else from a DeepSpeedPlugin passed as deepspeed_plugin=,
else from the accelerate config `accelerate launch` exports (deepspeed_config_file, zero_stage, offload_*_device,
zero3_save_16bit_model, zero3_init_flag, gradient_accumulation_steps, gradient_clipping). DeepSpeed need not be
installed.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os

import accelerate
import torch
from accelerate.logging import get_logger
from accelerate.scheduler import AcceleratedScheduler
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType, DummyOptim, DummyScheduler
from accelerate.utils.deepspeed import DeepSpeedSchedulerWrapper

from zkern.config import ConfigError
from zkern.core.generators import rng_state, set_rng_state
from zkern.engine.engine import Engine
from zkern.hf import accelerate_state
from zkern.hf.accelerate_glue import EngineWrapper, OptimizerWrapper, ZkernPlugin
from zkern.hf.auto import AUTO, read_config

# The config schedulers DeepSpeed hands to its engine when the script built one itself (zkern has the same classes).
_CONFIG_SCHEDULERS = ("LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR")
_GATHER_KEY = "stage3_gather_16bit_weights_on_model_save"


class Accelerator(accelerate.Accelerator):
    """accelerate.Accelerator training with zkern: Accelerator(..., zkern_config=path_or_dict). See the module
    docstring; every other argument is Accelerate's. After prepare(), accelerator.engine is the zkern.Engine."""

    def __init__(self, *args, zkern_config: dict | str | os.PathLike | None = None, deepspeed_plugin=None,
                 deepspeed_plugins=None, **kwargs):
        if deepspeed_plugins is not None:
            raise TypeError("zkern.hf.Accelerator trains one model with one config: pass zkern_config= (or one "
                            "deepspeed_plugin=), not deepspeed_plugins=")
        shared = AcceleratorState._shared_state
        existing = shared.get("deepspeed_plugins") if shared.get("distributed_type") == DistributedType.DEEPSPEED \
            else None
        if existing is not None:
            if not isinstance(existing, ZkernPlugin):
                raise RuntimeError("this process already runs an accelerate.Accelerator with DeepSpeed; zkern's "
                                   "Accelerator cannot share its state")
            if zkern_config is not None or deepspeed_plugin is not None:
                raise NotImplementedError(
                    "a second zkern.hf.Accelerator in this process shares the first one's config (as Accelerate "
                    "shares its DeepSpeed plugin); create it without zkern_config=, or start over with "
                    "accelerate.state.AcceleratorState._reset_state(True)")
            plugin = existing
        else:
            plugin = _plugin(zkern_config, deepspeed_plugin)
        # Accelerate's own set-up in its plain distributed mode (DeepSpeed's would import DeepSpeed), then switched to
        # DeepSpeed's mode as Accelerate switches it: no autocast, no GradScaler, precision from the config.
        if "cpu" not in kwargs and not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            # DeepSpeed's mode trains across CPU processes where there is no GPU (as DeepSpeed's CPU accelerator
            # does, and as `accelerate launch` with a DeepSpeed config expects); Accelerate's plain mode would only
            # when told to use the CPU.
            kwargs["cpu"] = True
        saved_env = os.environ.get("ACCELERATE_USE_DEEPSPEED")
        os.environ["ACCELERATE_USE_DEEPSPEED"] = "false"
        if existing is not None:  # Accelerate's plain set-up again, over the first Accelerator's state
            shared["distributed_type"] = PartialState._shared_state["distributed_type"] = _plain_type()
        try:
            super().__init__(*args, **kwargs)
        finally:
            if saved_env is None:
                os.environ.pop("ACCELERATE_USE_DEEPSPEED")
            else:
                os.environ["ACCELERATE_USE_DEEPSPEED"] = saved_env
        self.native_amp = False
        self.scaler = None
        state = self.state
        if existing is None:
            if state._mixed_precision == "fp8":
                raise ValueError("mixed_precision='fp8' is not supported by zkern.hf.Accelerator; use 'bf16' or 'fp16'")
            plugin.set_mixed_precision(state._mixed_precision)  # Accelerate's: fills fp16/bf16, refuses both
            state._mixed_precision = "no"  # as Accelerate does under DeepSpeed: the config says the precision
            plugin.select(_from_accelerator_state=True)
            state.deepspeed_plugins = plugin
        _enter_deepspeed_mode(state)
        if self.state.dynamo_plugin.backend.value != "NO":
            raise ValueError("torch.compile through Accelerate's dynamo settings is not supported by "
                             "zkern.hf.Accelerator: unset dynamo_backend")
        self.deepspeed_engine_wrapped = None

    @property
    def engine(self) -> Engine | None:
        """The zkern.Engine prepare() built (None before)."""
        wrapped = self.deepspeed_engine_wrapped
        return None if wrapped is None else wrapped.engine

    # -- prepare ---------------------------------------------------------------------------------------------
    def _prepare_deepspeed(self, *args):
        """prepare() under DeepSpeed: Accelerate's rules for the config's "auto" values and for what may be passed,
        with zkern.Engine where DeepSpeed's engine was."""
        plugin = self.state.deepspeed_plugin
        loader_type = torch.utils.data.DataLoader
        result = [self._prepare_one(obj, first_pass=True) if isinstance(obj, loader_type) else obj for obj in args]
        micro = self._micro_batch(plugin, [obj for obj in args if isinstance(obj, loader_type)])
        _fill(plugin.deepspeed_config, {"gradient_accumulation_steps": self.gradient_accumulation_steps})
        config_accumulation = plugin.get_value("gradient_accumulation_steps")
        if config_accumulation != self.gradient_accumulation_steps:
            get_logger(__name__).warning(
                f"Gradient accumulation steps mismatch: the Accelerator has {self.gradient_accumulation_steps}, the "
                f"config {config_accumulation}; the config's is used (as under DeepSpeed)", main_process_only=True)
            self.gradient_accumulation_steps = config_accumulation
        fills = {"gradient_clipping": 1.0}
        if micro is not None:
            fills["train_micro_batch_size_per_gpu"] = micro
            fills["train_batch_size"] = micro * config_accumulation * self.num_processes

        model, optimizer, scheduler = _classify(result)
        _check_pairing(plugin.deepspeed_config, optimizer, scheduler)
        if model is None:
            if optimizer is not None or scheduler is not None:
                raise ValueError("zkern.hf.Accelerator builds its engine from the model, its optimizer and scheduler "
                                 "together: pass them to the same prepare() call")
            return tuple(result)
        if optimizer is None and "optimizer" not in plugin.deepspeed_config:
            raise ValueError("prepare() got a model and no optimizer, and the config has no 'optimizer' section: "
                             "zkern's engine trains, so pass the optimizer with the model (or DummyOptim with an "
                             "'optimizer' section in the config)")
        if self.deepspeed_engine_wrapped is not None:
            raise ValueError("this Accelerator already prepared a model; one zkern.hf.Accelerator trains one model "
                             "(as one Accelerator does under DeepSpeed): create another for a second model")
        # The hidden-size "auto" keys (bucket sizes) are zkern's to fill from the model: the same rules, from
        # hidden_size, hidden_sizes, d_model, n_embd or a multimodal model's text_config.
        if isinstance(optimizer, DummyOptim):
            fills.update({"optimizer.params.lr": optimizer.lr, "optimizer.params.weight_decay": optimizer.weight_decay})
            fills.update({f"optimizer.params.{k}": optimizer.kwargs[k] for k in ("betas", "eps")
                          if k in optimizer.kwargs})
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is None:
            defaults = getattr(scheduler.optimizer, "defaults", None)
            max_lr = getattr(scheduler.optimizer, "lr", None) if defaults is None else defaults["lr"]
            fills.update({"scheduler.params.warmup_min_lr": 0, "scheduler.params.warmup_max_lr": max_lr,
                          "scheduler.params.warmup_num_steps": max(1, scheduler.warmup_num_steps)})
            if scheduler.total_num_steps is not None:
                total = scheduler.total_num_steps
                fills["scheduler.params.total_num_steps"] = total if self.split_batches else \
                    math.ceil(total / self.num_processes)
        _fill(plugin.deepspeed_config, fills)
        if isinstance(optimizer, torch.optim.Optimizer):
            plugin.deepspeed_config["zero_allow_untested_optimizer"] = True
        self.deepspeed_config = plugin.deepspeed_config
        config = copy.deepcopy(plugin.deepspeed_config)
        if config.get("steps_per_print") == float("inf"):  # Accelerate's way of silencing DeepSpeed
            config["steps_per_print"] = 0
        if self.project_configuration.save_on_each_node:
            config.setdefault("checkpoint", {})["use_node_local_storage"] = True

        build: dict = {}
        if isinstance(optimizer, DummyOptim):
            build["model_parameters"] = optimizer.params
            if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
                build["lr_scheduler"] = scheduler.lr_scheduler_callable
        elif optimizer is not None:
            build["optimizer"] = optimizer
            if scheduler is not None and type(scheduler).__name__ in _CONFIG_SCHEDULERS:
                build["lr_scheduler"] = scheduler
        engine = Engine(model, config, **build)
        wrapper = EngineWrapper(engine)
        self.deepspeed_engine_wrapped = wrapper
        wrapped_optimizer = None if optimizer is None else OptimizerWrapper(engine.optimizer, wrapper)
        wrapped_scheduler = None
        if scheduler is not None:
            if engine.lr_scheduler is None:  # the script's torch scheduler: Accelerate steps it, as under DeepSpeed
                wrapped_scheduler = AcceleratedScheduler(scheduler, wrapped_optimizer,
                                                         step_with_optimizer=self.step_scheduler_with_optimizer,
                                                         split_batches=self.split_batches)
            else:
                wrapped_scheduler = DeepSpeedSchedulerWrapper(engine.lr_scheduler, wrapped_optimizer)
        for i, obj in enumerate(result):
            if obj is model:
                result[i] = engine
            elif obj is optimizer:
                result[i] = wrapped_optimizer
            elif obj is scheduler:
                result[i] = wrapped_scheduler
        self._models.append(engine)
        if wrapped_optimizer is not None:
            self._optimizers.append(wrapped_optimizer)
        if wrapped_scheduler is not None:
            self._schedulers.append(wrapped_scheduler)
        return tuple(result)

    def skip_first_batches(self, dataloader, num_batches: int = 0):
        """Accelerate's, with one difference: making the skipping loader's iterator leaves the random generators as
        they were. A resumed run then draws (label masking, dropout) exactly what the run that saved drew after its
        save: that run made its iterator at the epoch's start, before the state load_state restored, and a second
        iterator's draw of its base seed would shift every draw after it."""
        return _GeneratorNeutral(super().skip_first_batches(dataloader, num_batches))

    def _micro_batch(self, plugin, loaders: list) -> int | None:
        """train_micro_batch_size_per_gpu: the config's number, or for "auto" the prepared loaders' batch size
        (Accelerate's rule: the largest, or the smallest with is_train_batch_min; divided over the processes with
        split_batches)."""
        if not plugin.is_auto("train_micro_batch_size_per_gpu"):
            return plugin.get_value("train_micro_batch_size_per_gpu")
        if not loaders:
            raise ValueError("the config's train_micro_batch_size_per_gpu is \"auto\": pass the training (or "
                             "evaluation) DataLoader to the same prepare() call as the model, or set a number")
        sizes = [getattr(d, "batch_size", None) for d in loaders]
        if any(s is None for s in sizes):
            raise ValueError("a DataLoader passed to prepare() has batch_size None (a batch_sampler), so the "
                             "config's \"auto\" train_micro_batch_size_per_gpu cannot be derived: set a number")
        if self.split_batches:
            sizes = [s // self.num_processes for s in sizes]
        return min(sizes) if plugin.is_train_batch_min else max(sizes)

    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False):
        """prepare_model() alone would wrap the model in DDP: zkern's engine needs the optimizer too."""
        raise ValueError("zkern.hf.Accelerator builds its engine in prepare(model, optimizer, ...): call prepare() "
                         "with the model and its optimizer instead of prepare_model()")

    # -- the model -------------------------------------------------------------------------------------------
    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, Engine):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper,
                                    keep_torch_compile=keep_torch_compile)

    def get_state_dict(self, model, unwrap: bool = True):
        """The weights in the training dtype (bf16/fp16 under mixed precision, else fp32), with the model's own
        state_dict names, on the host: at stages 0-2 on every process, at stage 3 on the main process only,
        gathered one unit at a time, as DeepSpeed returns them. A collective at stage 3: call it on every process.
        At stage 3 the other processes get an empty dict where DeepSpeed gives None: given None,
        save_pretrained(state_dict=..., is_main_process=False) reads model.state_dict(), which zkern refuses at
        stage 3 rather than hand out empty partitioned tensors. A config that sets
        stage3_gather_16bit_weights_on_model_save to false (or zero3_save_16bit_model: false) refuses, as DeepSpeed
        does."""
        engine = self._engine_of(model)
        if engine is None:
            return (self.unwrap_model(model) if unwrap else model).state_dict()
        zero = engine.config.zero_optimization
        if zero.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
            raise ValueError("get_state_dict at ZeRO stage 3 gathers the whole model onto the main process, which "
                             f"the config forbids (zero_optimization.{_GATHER_KEY} is false, or the accelerate "
                             "config's zero3_save_16bit_model): set it to true, or save the training state with "
                             "accelerator.save_state(dir) and read the weights with "
                             "zkern.checkpoint.load_fp32_state_dict(dir + '/pytorch_model')")
        values = engine.full_working_state_dict(rank0_only=zero.stage == 3)
        return {} if values is None else values

    def _engine_of(self, model) -> Engine | None:
        if isinstance(model, Engine):
            return model
        engine = self.engine
        return engine if engine is not None and model is engine.module else None

    def init_sharded(self):
        """Context in which models are built partitioned over the processes (zkern.init_sharded with this
        Accelerator's config): what Accelerate's zero3_init_flag does for DeepSpeed. A no-op unless the config is
        ZeRO stage 3 with zero3_init_flag on (its default at stage 3); the model is then given to prepare() as it
        is. For pretrained weights, zkern.hf.from_pretrained(cls, path) reads each rank's shards only."""
        from zkern.stage3.sharded_init import init_sharded

        plugin = self.state.deepspeed_plugin
        if not (plugin.zero3_init_flag and plugin.hf_ds_config.is_zero3()):
            return contextlib.nullcontext()
        return init_sharded(sharded_config(plugin))

    # -- checkpoints -----------------------------------------------------------------------------------------
    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True, **save_model_func_kwargs):
        """Save the training state under output_dir (a collective): the zkern checkpoint in output_dir/
        pytorch_model, the states of Accelerate's objects beside it (accelerate_state.py). With a
        ProjectConfiguration's automatic_checkpoint_naming: project_dir/checkpoints/checkpoint_<i>, the oldest
        removed past total_limit. Returns the directory."""
        output_dir = accelerate_state.resolve_save_dir(self, output_dir)
        location = accelerate_state.save(self, output_dir, save_model_func_kwargs)
        self.project_configuration.iteration += 1
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **load_model_func_kwargs):
        """Restore what save_state() saved (a collective), at any world size, stage or offload setting: weights,
        optimizer, schedulers, dataloader positions, registered objects, this process's random generators and the
        accumulation counter. load_model_func_kwargs go to engine.load_checkpoint (load_module_strict,
        load_optimizer_states, load_lr_scheduler_states, load_module_only)."""
        if load_kwargs:
            raise TypeError(f"load_state: load_kwargs {sorted(load_kwargs)} are torch.load's; zkern's checkpoints "
                            f"are not read with torch.load")
        input_dir = accelerate_state.resolve_load_dir(self, input_dir)
        accelerate_state.load(self, input_dir, load_model_func_kwargs)


def _plain_type() -> DistributedType:
    return DistributedType.NO if torch.distributed.get_world_size() == 1 else (
        DistributedType.MULTI_GPU if torch.cuda.is_available() else DistributedType.MULTI_CPU)


def _enter_deepspeed_mode(state) -> None:
    """Both of Accelerate's states say DEEPSPEED, as under DeepSpeed (each AcceleratorState() re-reads
    PartialState's type). Accelerate's collectives (gather, reduce, wait_for_everyone) then need a process group
    even for one process; DeepSpeed makes one, and so does this, in memory."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and state.num_processes != launched:
        hint = "" if torch.cuda.is_available() else (": on a machine without a GPU Accelerate trains across "
                                                     "processes only when told to use the CPU (Accelerator(cpu=True), "
                                                     "ACCELERATE_USE_CPU=1, or accelerate launch --cpu)")
        raise RuntimeError(f"the launcher started {launched} processes (WORLD_SIZE) but Accelerate set up "
                           f"{state.num_processes} per group, so each would train its own model{hint}")
    if not torch.distributed.is_initialized():
        backend = "nccl" if state.device.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    PartialState._shared_state["distributed_type"] = DistributedType.DEEPSPEED
    state.distributed_type = DistributedType.DEEPSPEED


def _plugin(zkern_config, deepspeed_plugin) -> ZkernPlugin:
    """The plugin from zkern_config, a DeepSpeedPlugin the script built, or the accelerate config in the
    environment (`accelerate launch`)."""
    if zkern_config is not None and deepspeed_plugin is not None:
        raise TypeError("zkern_config and deepspeed_plugin are both given; pass one")
    fields: dict = {}
    if deepspeed_plugin is not None:
        if isinstance(deepspeed_plugin, dict):
            raise TypeError("zkern.hf.Accelerator trains one model with one config: pass one DeepSpeedPlugin")
        config = copy.deepcopy(deepspeed_plugin.deepspeed_config)
        for name in ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                     "offload_param_device", "offload_optimizer_nvme_path", "offload_param_nvme_path",
                     "zero3_save_16bit_model", "zero3_init_flag", "is_train_batch_min", "transformer_moe_cls_names"):
            fields[name] = getattr(deepspeed_plugin, name)
    elif zkern_config is not None:
        config = read_config(zkern_config)
    elif os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
        config = None if path == "none" else read_config(path)
    else:
        raise TypeError("zkern.hf.Accelerator needs zkern_config=: a DeepSpeed-style config dict or JSON path (or "
                        "launch with an accelerate config whose distributed_type is DEEPSPEED)")
    if config is not None:
        if not isinstance(config.get("zero_optimization", {}), dict):
            raise ConfigError("the config's 'zero_optimization' must be a section (a JSON object)")
        zero = config.setdefault("zero_optimization", {"stage": 0})  # Accelerate refuses a config without one
        if _GATHER_KEY not in zero and "gather_16bit_weights_on_model_save" not in zero:
            # zkern gathers stage 3's weights for get_state_dict one unit at a time onto the host, so unlike
            # DeepSpeed it allows that unless told not to.
            zero[_GATHER_KEY] = AUTO
        fields["hf_ds_config"] = config
    if fields.get("zero3_save_16bit_model") is None \
            and "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL" not in os.environ:
        fields["zero3_save_16bit_model"] = True  # fills the "auto" above (Accelerate's default would be false)
    return ZkernPlugin(**fields)


def sharded_config(plugin) -> dict:
    """The config to partition with before prepare(): the batch keys' "auto" are not needed to partition."""
    config = copy.deepcopy(plugin.deepspeed_config)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if config.get(key) == AUTO:
            config[key] = None if key != "gradient_accumulation_steps" else 1
    if config.get("steps_per_print") == float("inf"):
        config["steps_per_print"] = 0
    return {k: v for k, v in config.items() if v is not None}


def _fill(config: dict, values: dict) -> None:
    """Each dotted key whose value in config is "auto" takes values[key]; any other value stays (Accelerate's
    fill under DeepSpeed: the config wins, no contradiction is an error)."""
    for dotted, value in values.items():
        *sections, key = dotted.split(".")
        node = config
        for s in sections:
            node = node.get(s) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(key) == AUTO:
            node[key] = value


def _classify(objects: list) -> tuple:
    model = optimizer = scheduler = None
    for obj in objects:
        if isinstance(obj, (OptimizerWrapper, AcceleratedScheduler, Engine)):
            raise ValueError(f"prepare() was given a {type(obj).__name__} that this Accelerator already prepared")
        if isinstance(obj, torch.nn.Module):
            model = obj
        elif isinstance(obj, (torch.optim.Optimizer, DummyOptim)):
            optimizer = obj
        elif isinstance(obj, (torch.optim.lr_scheduler.LRScheduler, DummyScheduler)) \
                or type(obj).__name__ in _CONFIG_SCHEDULERS:
            scheduler = obj
    return model, optimizer, scheduler


def _check_pairing(config: dict, optimizer, scheduler) -> None:
    """Accelerate's rules: an optimizer (scheduler) is either the config's, through DummyOptim (DummyScheduler), or
    the script's, never both; DummyScheduler only with DummyOptim."""
    if optimizer is not None:
        if "optimizer" in config and not isinstance(optimizer, DummyOptim):
            raise ValueError("the config has an 'optimizer' section and the script passes an optimizer: remove the "
                             "section, or pass accelerate.utils.DummyOptim(params, lr=...)")
        if "optimizer" not in config and isinstance(optimizer, DummyOptim):
            raise ValueError("DummyOptim stands for the config's optimizer, and the config has no 'optimizer' "
                             "section: add one, or pass a torch optimizer")
    if scheduler is not None:
        if "scheduler" in config and not isinstance(scheduler, DummyScheduler):
            raise ValueError("the config has a 'scheduler' section and the script passes a scheduler: remove the "
                             "section, or pass accelerate.utils.DummyScheduler(optimizer, ...)")
        if "scheduler" not in config and isinstance(scheduler, DummyScheduler) \
                and scheduler.lr_scheduler_callable is None:
            raise ValueError("DummyScheduler stands for the config's scheduler, and the config has no 'scheduler' "
                             "section: add one, or pass DummyScheduler(optimizer, lr_scheduler_callable=...)")
    if isinstance(optimizer, DummyOptim) and scheduler is not None and not isinstance(scheduler, DummyScheduler):
        raise ValueError("with DummyOptim the scheduler must be a DummyScheduler (the optimizer only exists inside "
                         "the engine)")


class _GeneratorNeutral:
    """A loader whose iterator is made without moving the random generators (Accelerator.skip_first_batches); every
    other attribute is the wrapped loader's. (A dataset whose items draw at random would see its first batch's
    draws undone too: the saving run had drawn those before its save.)"""

    def __init__(self, loader):
        self._loader = loader

    def __iter__(self):
        # Accelerate's loaders make their inner iterator (and draw its base seed) at the first next(), and fetch the
        # first batch then: that call, not iter(), is the one to keep neutral.
        iterator = iter(self._loader)
        state = rng_state()
        try:
            first = next(iterator)
        except StopIteration:
            return
        finally:
            set_rng_state(state)
        yield first
        yield from iterator

    def __len__(self) -> int:
        return len(self._loader)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)
