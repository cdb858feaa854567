"""zkern.hf.from_pretrained: an HF model built for ZeRO stage 3 with each rank reading only its own shards.

    model = zkern.hf.from_pretrained(GPT2LMHeadModel, "path/to/model", "ds_config.json")
    engine = zkern.Engine(model, "ds_config.json")        # or zkern.hf.Trainer(model=model, ...)
    python -m pytest tests/hf/test_hf_pretrained.py -q

transformers' own from_pretrained under DeepSpeed ZeRO-3 loads every tensor whole on every rank and then partitions
it, so a host with 8 ranks reads the model 8 times and holds 8 copies at once. Here the model is built under
zkern.init_sharded with weight initialisation off (the checkpoint provides the values), then for each parameter this
rank seeks to the byte range of its own chunk (the flattened tensor cut as init_sharded cuts it) in the safetensors
file and reads those bytes alone. Parameters the checkpoint lacks are initialised by the model's _init_weights one
module at a time (gathered whole, rank 0's values kept). Peak resident memory per rank: its shards (model bytes /
world) plus the largest module's own parameters while the module is built (allocated, and written only by
initialisers transformers does not switch off), plus Python and allocator overhead; bytes go from the file straight
into the shard when the dtypes agree (one chunk's buffer when they do not).

A checkpoint whose stored names transformers converts on load (its conversion mapping: a Mixtral or Qwen-MoE
checkpoint keeps each expert's matrices apart where the model holds them fused) is read through transformers' own
loader on rank 0, which then hands every rank its shards: correct weights at the cost of one whole copy on rank 0.

Only safetensors files in a local directory are read: a pickled checkpoint (pytorch_model.bin) is refused, never
unpickled.
"""

from __future__ import annotations

import logging
import os

import torch

from zkern.checkpoint.ranges import TORCH_DTYPES, byte_view
from zkern.checkpoint.tensorfile import TensorInfo, read_header
from zkern.config import Config
from zkern.core.partition import shard_range
from zkern.errors import CheckpointError
from zkern.safe_io import confined, parse_json, read_capped
from zkern.stage3.gathered import GatheredParameters
from zkern.stage3.sharded_init import full_shape, init_sharded, is_sharded, sharder_of

log = logging.getLogger("zkern")

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
MAX_INDEX = 256 << 20  # an index lists each tensor once: tens of kB for the largest public models


def checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name -> the safetensors file that holds it, for an HF model directory (one file, or an index)."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"zkern.hf.from_pretrained reads a local model directory; {path!r} is not one "
                                f"(download it first, e.g. huggingface_hub.snapshot_download)")
    single, index = os.path.join(path, SINGLE), os.path.join(path, INDEX)
    if os.path.isfile(index):
        weight_map = parse_json(read_capped(index, MAX_INDEX, "safetensors index"), index, "safetensors index")
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
            raise CheckpointError(f"{index}: not a safetensors index (no 'weight_map' object of tensor names)")
        return {name: confined(path, file, "safetensors index") for name, file in weight_map.items()}
    if os.path.isfile(single):
        return {name: single for name in read_header(single)[0]}
    pickled = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".ckpt"))]
    hint = (f"; it has {pickled}, pickled files zkern never unpickles: convert them to safetensors first"
            if pickled else "")
    raise FileNotFoundError(f"{path!r} has no {SINGLE} or {INDEX}{hint}")


def _read_into(dest: torch.Tensor, path: str, info: TensorInfo, first: int, handles: dict) -> None:
    """dest <- elements [first, first + dest.numel()) of a tensor stored in a safetensors file, read alone: straight
    into dest's memory when the dtypes agree, else through one buffer of that many elements."""
    dtype = TORCH_DTYPES.get(info.dtype)
    if dtype is None:
        raise CheckpointError(f"{path}: dtype {info.dtype} is not one zkern reads")
    f = handles.get(path)
    if f is None:
        f = handles[path] = open(path, "rb")
    size = torch.empty((), dtype=dtype).element_size()
    f.seek(info.begin + first * size)
    target = dest if dest.dtype == dtype and dest.is_contiguous() else torch.empty(dest.numel(), dtype=dtype)
    view = byte_view(target)
    if f.readinto(view) != len(view):
        raise CheckpointError(f"{path}: ended inside a tensor's bytes (truncated?)")
    if target is not dest:
        dest.copy_(target.view(dest.shape))


def from_pretrained(model_class, path: str | os.PathLike, zkern_config=None, *, config=None, **kwargs):
    """model_class (a transformers PreTrainedModel class, an Auto class such as AutoModelForCausalLM, or either's
    name) from the local directory path, partitioned for ZeRO stage 3 as zkern_config (dict, JSON path or
    zkern.Config; `config=` is the same argument) says, each rank reading only its shards (a collective).
    zkern_config None: the config of this process's zkern.hf.Accelerator (stage 3 with zero3_init_flag on).
    kwargs: model config attributes to override (as transformers' from_pretrained takes them)."""
    from transformers.initialization import no_init_weights

    if config is not None and zkern_config is not None:
        raise TypeError("zkern.hf.from_pretrained: zkern_config and config are the same argument; pass one")
    zkern_config = config if zkern_config is None else zkern_config
    path = os.fspath(path)
    model_class = _concrete_class(model_class, path)
    cfg = Config.load(zkern_config if zkern_config is not None else _accelerator_config())
    files = checkpoint_files(path)
    model_config, unused = model_class.config_class.from_pretrained(path, return_unused_kwargs=True, **kwargs)
    if unused:
        raise TypeError(f"zkern.hf.from_pretrained: {sorted(unused)} are not attributes of "
                        f"{model_class.config_class.__name__}; it takes config overrides only (the engine sets the "
                        f"device and dtype from the zkern config)")
    with init_sharded(cfg, broadcast=False), no_init_weights():
        model = model_class(model_config)
    model.tie_weights()  # as transformers' from_pretrained does after building (lm_head shares the embedding)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if _needs_conversion(model, list(files)):
        _load_through_transformers(model_class, path, model_config, model, rank)
        return model
    headers: dict[str, dict[str, TensorInfo]] = {}
    handles: dict = {}
    loaded, missing = set(), []
    try:
        for p, aliases in _tensors_and_names(model):
            name, stored = aliases[0], next((n for n in aliases if n in files), None)
            if stored is None:
                missing.append(name)
                continue
            file = files[stored]
            if file not in headers:
                headers[file] = read_header(file)[0]
            info = headers[file].get(stored)
            if info is None:
                raise CheckpointError(f"{file}: the index names {stored!r} but the file does not hold it")
            shape = tuple(full_shape(p))
            if tuple(info.shape) != shape:
                raise CheckpointError(f"{file}: {stored!r} has shape {list(info.shape)}, the model's {name!r} has "
                                      f"{list(shape)}: the checkpoint is for another configuration")
            with torch.no_grad():
                if is_sharded(p):  # this rank's chunk, cut as init_sharded cuts it
                    comm = sharder_of(p).comm
                    first, size = shard_range(info.numel, comm.rank, comm.world)
                    count = max(0, min(size, info.numel - first))
                    _read_into(p._zkern_shard[:count], file, info, first, handles)
                    p._zkern_shard[count:].zero_()  # the padding of the last chunk
                else:  # buffers (and any parameter left whole) are read whole
                    _read_into(p.data, file, info, 0, handles)
            loaded.update(aliases)
    finally:
        for f in handles.values():
            f.close()
    unexpected = sorted(set(files) - loaded)
    if unexpected and rank == 0:
        log.warning("zkern: %s holds tensors the model does not use: %s", path, unexpected[:20])
    if missing:
        _init_missing(model, missing, rank)
    return model


def _needs_conversion(model, names: list[str]) -> bool:
    """Whether transformers converts some of this checkpoint's tensors on load (its conversion mapping for the model
    matches a stored name): a Mixtral or Qwen-MoE checkpoint stores each expert's matrices apart, under other names,
    where the model holds them fused, so reading tensors by name would leave the experts at their initial values."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:  # a transformers without conversions stores what its models hold
        return False
    return any(t.rename_source_key(name)[1] is not None for t in get_model_conversion_mapping(model) for name in names)


def _load_through_transformers(model_class, path: str, model_config, model, rank: int) -> None:
    """The checkpoint through transformers' own loader, conversions included, on rank 0 only (its host holds the model
    whole once, as transformers' loader would on every rank), handed out module by module (_rank0_writes). Persistent
    buffers go out by broadcast."""
    whole = None
    if rank == 0:
        log.warning("zkern: %s stores tensors that transformers converts on load (%s's conversion mapping): rank 0 "
                    "loads the model whole through transformers and hands each rank its shards", path,
                    model_class.__name__)
        whole = model_class.from_pretrained(path, config=model_config).state_dict()

    def copy_in(module, prefix: str) -> None:
        for name, p in module.named_parameters(recurse=False):
            p.copy_(whole[prefix + name])

    _rank0_writes(model, rank, copy_in)
    persistent = model.state_dict(keep_vars=True)  # the checkpoint's buffers; the others the model computes
    for name, buf in model.named_buffers():
        if name in persistent:
            if rank == 0:
                buf.copy_(whole[name])
            if torch.distributed.is_initialized():
                torch.distributed.broadcast(buf, src=0)


def _rank0_writes(model, rank: int, write, owners: set[str] | None = None) -> None:
    """For each module (those named in owners, else every one), its own parameters gathered whole with rank 0 as the
    writer: write(module, prefix) runs on rank 0 under no_grad, and every rank keeps its shard of what it wrote."""
    for module_name, module in model.named_modules():
        if owners is not None and module_name not in owners:
            continue
        with GatheredParameters(list(module.parameters(recurse=False)), modifier_rank=0):
            if rank == 0:
                with torch.no_grad():
                    write(module, f"{module_name}." if module_name else "")


def _tensors_and_names(model: torch.nn.Module) -> list[tuple[torch.Tensor, list[str]]]:
    """Each distinct parameter and persistent buffer with all its state_dict names (tied weights have several)."""
    by_id: dict[int, tuple[torch.Tensor, list[str]]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(t), (t, []))[1].append(name)
    return list(by_id.values())


def _init_missing(model, missing: list[str], rank: int) -> None:
    """The model's own _init_weights for each module that owns a missing tensor, one module at a time (_rank0_writes).
    _init_weights sets every tensor of the module, so the ones the checkpoint did provide are put back afterwards
    (transformers' loader keeps them too)."""
    if rank == 0:
        log.warning("zkern: %d tensors are not in the checkpoint and are initialised: %s", len(missing), missing[:20])
    missing_set = set(missing)

    def initialise(module, prefix: str) -> None:
        loaded = {name: t.detach().clone() for name, t in [*module.named_parameters(recurse=False),
                                                            *module.named_buffers(recurse=False)]
                  if f"{prefix}{name}" not in missing_set}
        model._init_weights(module)
        for name, values in loaded.items():
            getattr(module, name).copy_(values)

    _rank0_writes(model, rank, initialise, owners={name.rpartition(".")[0] for name in missing})


def _concrete_class(cls_or_name, path: str):
    """The PreTrainedModel class to build: the class given, the transformers class of that name, or for an Auto
    class the one its mapping names for the checkpoint's config.json."""
    import transformers

    cls = cls_or_name
    if isinstance(cls, str):
        cls = getattr(transformers, cls_or_name, None)
        if not isinstance(cls, type):
            raise TypeError(f"zkern.hf.from_pretrained: {cls_or_name!r} is not a transformers model class name (e.g. "
                            f"'GPT2LMHeadModel' or 'AutoModelForCausalLM'); the checkpoint's directory is the second "
                            f"argument")
    mapping = getattr(cls, "_model_mapping", None)
    if mapping is None:
        return cls
    model_config = transformers.AutoConfig.from_pretrained(path)
    if type(model_config) not in mapping:
        raise ValueError(f"zkern.hf.from_pretrained: {cls.__name__} has no model for {type(model_config).__name__} "
                         f"(the config.json in {path}); name the model class instead")
    return mapping[type(model_config)]


def _accelerator_config() -> dict:
    """The config of the zkern.hf.Accelerator this process created, when it asks for sharded construction."""
    from accelerate.state import AcceleratorState

    from zkern.hf.accelerate_glue import ZkernPlugin
    from zkern.hf.accelerator import sharded_config

    plugin = AcceleratorState._shared_state.get("deepspeed_plugins")
    if not isinstance(plugin, ZkernPlugin):
        raise TypeError("zkern.hf.from_pretrained needs zkern_config= (a stage-3 config), or a zkern.hf.Accelerator "
                        "created first whose config it then uses")
    if not (plugin.zero3_init_flag and plugin.hf_ds_config.is_zero3()):
        raise ValueError("zkern.hf.from_pretrained partitions for ZeRO stage 3; this process's zkern.hf.Accelerator "
                         f"has stage {plugin.zero_stage} with zero3_init_flag {plugin.zero3_init_flag}: load with "
                         "transformers' from_pretrained instead, or pass zkern_config=")
    return sharded_config(plugin)
