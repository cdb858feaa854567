"""zkern.hf.Accelerator's save_state/load_state: Accelerate's checkpoint contents without its pickles.

    output_dir/
      pytorch_model/            the engine's checkpoint (the tag Accelerate gives DeepSpeed's): weights, optimizer,
                                an engine-owned scheduler, loss scale, counters; client state: what is below
      latest                    names that tag
      accelerate_state.safetensors   tensors held by the objects below, if any (written by the main process)

The client state holds Accelerate's own state as JSON: the accumulation counter (accelerator.step), the states of
schedulers Accelerate steps itself (a torch scheduler beside a torch optimizer), of the prepared dataloaders (a
seedable sampler's epoch, a stateful loader's position), of every object given to register_for_checkpointing, and
each rank's random generators (restored by load_state and once more at the engine's next forward, past whatever
the resuming loop draws first). Those state dicts are encoded as a typed tree (tuples, int keys, non-finite floats and
tensors survive; tensors go to the safetensors file, whose SHA-256 the tree records). Loading reads JSON and
safetensors only: nothing in the directory can run code, where Accelerate would torch.load pickles.
"""

from __future__ import annotations

import math
import os
import re
import shutil

import numpy as np
import torch
from accelerate.logging import get_logger
from accelerate.scheduler import AcceleratedScheduler
from accelerate.utils.deepspeed import DeepSpeedSchedulerWrapper

from zkern.checkpoint.manifest import rank_forms
from zkern.checkpoint.tensorfile import file_sha256
from zkern.core.generators import check_rng_state, set_rng_state
from zkern.errors import CheckpointError

TAG = "pytorch_model"  # Accelerate's tag for the first model's DeepSpeed checkpoint
TENSORS = "accelerate_state.safetensors"
KEY = "zkern.hf.Accelerator"  # the client-state entry
log = get_logger(__name__)


# -- where --------------------------------------------------------------------------------------------------------
def _number(folder: str) -> int:
    found = re.findall(r"(\d+)(?=[^/\\]*$)", folder)
    if not found:
        raise ValueError(f"{folder!r} in the checkpoints folder has no iteration number in its name: automatic "
                         f"checkpoint naming keeps only checkpoint_<i> folders there")
    return int(found[0])


def resolve_save_dir(acc, output_dir) -> str:
    """Accelerate's rule: output_dir, or with automatic_checkpoint_naming project_dir/checkpoints/checkpoint_<i>
    after removing the oldest folders past total_limit (main process)."""
    project = acc.project_configuration
    if not project.automatic_checkpoint_naming:
        if output_dir is None:
            raise ValueError("save_state needs output_dir (or a ProjectConfiguration with "
                             "automatic_checkpoint_naming=True)")
        output_dir = os.fspath(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        return output_dir
    root = os.path.join(acc.project_dir, "checkpoints")
    os.makedirs(root, exist_ok=True)
    folders = sorted((os.path.join(root, f) for f in os.listdir(root)), key=_number)
    if project.total_limit is not None and len(folders) + 1 > project.total_limit and acc.is_main_process:
        for folder in folders[:len(folders) + 1 - project.total_limit]:
            shutil.rmtree(folder)
    output_dir = os.path.join(root, f"checkpoint_{acc.save_iteration}")
    if os.path.exists(output_dir):
        raise ValueError(f"checkpoint directory {output_dir} ({acc.save_iteration}) already exists: set "
                         f"accelerator.project_configuration.iteration to the iteration to start from")
    acc.wait_for_everyone()
    os.makedirs(output_dir, exist_ok=True)
    return output_dir


def resolve_load_dir(acc, input_dir) -> str:
    if input_dir is not None:
        input_dir = os.path.expanduser(os.fspath(input_dir))
        if not os.path.isdir(input_dir):
            raise ValueError(f"load_state: {input_dir!r} is not a directory")
        return input_dir
    if not acc.project_configuration.automatic_checkpoint_naming:
        raise ValueError("load_state needs input_dir (or a ProjectConfiguration with automatic_checkpoint_naming)")
    root = os.path.join(acc.project_dir, "checkpoints")
    folders = sorted((os.path.join(root, f) for f in os.listdir(root)), key=_number) if os.path.isdir(root) else []
    if not folders:
        raise ValueError(f"load_state: no checkpoint in {root!r}")
    return folders[-1]


# -- typed trees: state dicts as JSON + tensors -------------------------------------------------------------------
def encode(value, tensors: dict[str, torch.Tensor], where: str):
    """value as JSON data that decode() turns back into an equal value: plain str/int/bool/None stay, every
    container and special value is a one-key object ({"l": [...]}, {"t": [...]}, {"d": {...}}, {"dk": [[k, v]]},
    {"f": "nan"}, {"tensor": name}, {"ndarray": name})."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"f": repr(value)}
    if isinstance(value, torch.Tensor):
        name = f"{len(tensors)}"
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
        return {"tensor": name}
    if isinstance(value, np.ndarray):
        name = f"{len(tensors)}"
        tensors[name] = torch.from_numpy(np.ascontiguousarray(value)).clone()
        return {"ndarray": name}
    if isinstance(value, np.generic):
        return encode(value.item(), tensors, where)
    if isinstance(value, (list, tuple)):
        items = [encode(v, tensors, f"{where}[{i}]") for i, v in enumerate(value)]
        return {"t": items} if isinstance(value, tuple) else {"l": items}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            return {"d": {k: encode(v, tensors, f"{where}[{k!r}]") for k, v in value.items()}}
        return {"dk": [[encode(k, tensors, where), encode(v, tensors, f"{where}[{k!r}]")] for k, v in value.items()]}
    raise CheckpointError(f"{where} holds a {type(value).__name__}, which save_state cannot store without pickling: "
                          f"a state_dict() for checkpointing may hold tensors, numbers, strings, None, lists, tuples "
                          f"and dicts")


def decode(value, tensors: dict[str, torch.Tensor]):
    if value is None or isinstance(value, (bool, int, str, float)):
        return value
    if isinstance(value, dict) and len(value) == 1:
        (kind, body), = value.items()
        if kind == "f":
            return float(body)
        if kind in ("tensor", "ndarray"):
            if body not in tensors:
                raise CheckpointError(f"the saved state names tensor {body!r}, which {TENSORS} lacks")
            return tensors[body] if kind == "tensor" else tensors[body].numpy()
        if kind in ("l", "t") and isinstance(body, list):
            items = [decode(v, tensors) for v in body]
            return tuple(items) if kind == "t" else items
        if kind == "d" and isinstance(body, dict):
            return {k: decode(v, tensors) for k, v in body.items()}
        if kind == "dk" and isinstance(body, list):
            return {decode(k, tensors): decode(v, tensors) for k, v in body}
    raise CheckpointError(f"the saved Accelerate state has a value zkern did not write: {str(value)[:120]!r}")


# -- save ---------------------------------------------------------------------------------------------------------
def _accelerate_schedulers(acc) -> list:
    """The schedulers Accelerate steps itself (an engine-owned one is in the engine's checkpoint)."""
    return [s for s in acc._schedulers if isinstance(s, AcceleratedScheduler)
            and not isinstance(s, DeepSpeedSchedulerWrapper)]


def _loader_state(loader) -> dict:
    from accelerate.data_loader import SeedableRandomSampler

    state = {}
    sampler = loader.get_sampler() if hasattr(loader, "get_sampler") else None
    if isinstance(sampler, SeedableRandomSampler):
        state["sampler"] = {"epoch": sampler.epoch, "initial_seed": sampler.initial_seed}
    if getattr(loader, "use_stateful_dataloader", False):
        state["loader"] = loader.state_dict()
    return state


def save(acc, output_dir: str, kwargs: dict) -> str:
    from zkern.checkpoint.control import all_gather_json

    unknown = set(kwargs) - {"exclude_frozen_parameters"}
    if unknown:
        raise TypeError(f"save_state: {sorted(unknown)} are not save arguments zkern takes (it takes "
                        f"exclude_frozen_parameters, as DeepSpeed's save_checkpoint)")
    engine = acc.engine
    if engine is None:
        raise ValueError("save_state before prepare(): there is no engine to save yet")
    for hook in acc._save_model_state_pre_hook.values():
        hook(acc._models, [], output_dir)  # under DeepSpeed the weights list is empty: they are in the checkpoint
    tensors: dict[str, torch.Tensor] = {}
    own = {"step": acc.step,
           "schedulers": [encode(s.scheduler.state_dict(), tensors, f"scheduler {i}")
                          for i, s in enumerate(_accelerate_schedulers(acc))],
           "dataloaders": [encode(_loader_state(d), tensors, f"dataloader {i}")
                           for i, d in enumerate(acc._dataloaders)],
           "custom": [encode(obj.state_dict(), tensors, f"registered object {i} ({type(obj).__name__})")
                      for i, obj in enumerate(acc._custom_objects)]}
    path = os.path.join(output_dir, TENSORS)
    if tensors:
        own["tensors_sha256"] = _write_tensors(path, tensors) if acc.is_main_process else None
    elif acc.is_main_process and os.path.lexists(path):
        os.remove(path)  # a stale file from an earlier save to this directory would be mistaken for this one's
    group = engine.checkpointer.group
    # The digest is the main process's (it wrote the file); every rank's generators are kept (one entry per rank).
    own["tensors_sha256"] = all_gather_json(group, own.get("tensors_sha256"), "the saved tensors' digest")[0]
    # Every rank's generators are in the engine's checkpoint already (its "generators" component, per rank).
    if engine.pending_micro_steps:
        log.warning(f"save_state at micro-step {engine.pending_micro_steps} of an accumulation of "
                    f"{engine.gradient_accumulation_steps}: the gradients accumulated since the last optimizer step "
                    f"are not saved (as under DeepSpeed); a run resumed from {output_dir} starts that accumulation "
                    f"over from zero gradients", main_process_only=True)
    engine.checkpointer.save(output_dir, TAG, {KEY: own}, save_latest=True,
                             exclude_frozen_parameters=kwargs.get("exclude_frozen_parameters", False))
    return output_dir


def _write_tensors(path: str, tensors: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file

    tmp = f"{path}.tmp-{os.getpid()}"
    save_file(tensors, tmp)
    os.replace(tmp, path)
    return file_sha256(path)


# -- load ---------------------------------------------------------------------------------------------------------
def load(acc, input_dir: str, kwargs: dict) -> None:
    """The engine loader's protocol for the whole of it: Accelerate's part read, checked and decoded on every rank
    and agreed first, then the engine's checkpoint (which verifies and agrees in turn), then everything applied. A
    damaged entry is a CheckpointError on every rank with nothing changed (it was decoded after the engine's weights
    had been replaced, and at world N a rank whose own generator entry was bad raised alone)."""
    from zkern.checkpoint.control import all_gather_json
    from zkern.checkpoint.manifest import read_manifest, tag_dir

    allowed = {"load_module_strict", "load_optimizer_states", "load_lr_scheduler_states", "load_module_only"}
    unknown = set(kwargs) - allowed - {"map_location"}
    if unknown:
        raise TypeError(f"load_state: {sorted(unknown)} are not load arguments zkern takes ({sorted(allowed)})")
    engine = acc.engine
    if engine is None:
        raise ValueError("load_state before prepare(): prepare the model, optimizer and scheduler first, then load")
    for hook in acc._load_model_state_pre_hook.values():
        hook([], input_dir)
    status, staged = {}, None
    try:
        path = tag_dir(input_dir, TAG) if os.path.isdir(input_dir) else None
        if path is None:
            status["missing"] = True
        else:
            staged = _stage(acc, read_manifest(path), path, input_dir)
    except (CheckpointError, OSError) as e:
        status["error"] = str(e)
    except Exception as e:  # whatever else a damaged entry provokes reaches every rank as an error
        status["error"] = f"{input_dir}: the Accelerate state cannot be read ({type(e).__name__}: {e})"
    statuses = all_gather_json(engine.checkpointer.group, status, "load_state: every rank's outcome")
    errors = [f"rank {r}: {st['error']}" for r, st in enumerate(statuses) if "error" in st]
    if errors:
        raise CheckpointError(f"load_state({input_dir!r}) failed; nothing was changed. {'; '.join(errors)}")
    if any("missing" in st for st in statuses):
        raise FileNotFoundError(f"load_state: {input_dir!r} holds no zkern checkpoint ({TAG}/ is missing); "
                                f"zkern.hf.Accelerator loads what its save_state wrote")
    engine.load_checkpoint(input_dir, tag=TAG, **{k: v for k, v in kwargs.items() if k in allowed})
    _apply(acc, staged, input_dir)


def _stage(acc, manifest: dict, path: str, input_dir: str) -> dict:
    """Accelerate's part of the checkpoint, checked and decoded, nothing applied."""
    own = (manifest.get("client_state") or {}).get(KEY)
    if not isinstance(own, dict):
        raise CheckpointError(f"{path}: a zkern checkpoint, but not one zkern.hf.Accelerator.save_state wrote (its "
                              f"client state has no {KEY!r} entry)")
    for key, kind in (("schedulers", list), ("custom", list), ("dataloaders", list), ("step", int)):
        if not isinstance(own.get(key), kind) or isinstance(own.get(key), bool):
            raise CheckpointError(f"{path}: its Accelerate state's {key!r} is missing or not a {kind.__name__}")
    tensors = _read_tensors(os.path.join(input_dir, TENSORS), own.get("tensors_sha256"))
    schedulers = _accelerate_schedulers(acc)
    _expect(len(own["schedulers"]), len(schedulers), "schedulers Accelerate steps", input_dir)
    _expect(len(own["custom"]), len(acc._custom_objects), "objects registered for checkpointing", input_dir)
    _expect(len(own["dataloaders"]), len(acc._dataloaders), "prepared dataloaders", input_dir)
    loaders = [decode(state, tensors) for state in own["dataloaders"]]
    for state in loaders:
        if not isinstance(state, dict) or ("sampler" in state and not (
                isinstance(state["sampler"], dict) and {"epoch", "initial_seed"} <= set(state["sampler"]))):
            raise CheckpointError(f"{path}: a saved dataloader state is not one zkern wrote: {str(state)[:120]!r}")
    rank = acc.process_index
    if "rng" in own:  # saves before 2026-11-27 kept a copy of every rank's generators here
        if not isinstance(own["rng"], list):
            raise CheckpointError(f"{path}: its Accelerate state's 'rng' is not a list")
        rng, saved = (own["rng"][rank] if rank < len(own["rng"]) else None), len(own["rng"])
    else:  # the engine's own record of them: this rank's "generators" form
        rng, saved = (rank_forms(manifest, rank) or {}).get("generators"), manifest.get("world_size")
    if rng is not None:
        check_rng_state(rng, f"{path}: process {rank}'s random generators")
    return {"step": own["step"], "schedulers": [decode(st, tensors) for st in own["schedulers"]], "loaders": loaders,
            "custom": [decode(st, tensors) for st in own["custom"]], "rng": rng, "saved_processes": saved}


def _apply(acc, staged: dict, input_dir: str) -> None:
    for scheduler, state in zip(_accelerate_schedulers(acc), staged["schedulers"]):
        scheduler.scheduler.load_state_dict(state)
    for loader, state in zip(acc._dataloaders, staged["loaders"]):
        if "sampler" in state:
            sampler = loader.get_sampler()
            sampler.epoch, sampler.initial_seed = state["sampler"]["epoch"], state["sampler"]["initial_seed"]
        if "loader" in state:
            loader.load_state_dict(state["loader"])
    acc.step = staged["step"]
    if staged["rng"] is not None:
        # Once, here, as Accelerate does: whatever the script draws from now on (label masking, augmentation,
        # dropout) is what the saving run drew after its save. (An iterator made by skip_first_batches leaves the
        # generators as they are: accelerator.py.)
        set_rng_state(staged["rng"])
    else:
        log.warning(f"the checkpoint {input_dir} was saved by {staged['saved_processes']} processes; process "
                    f"{acc.process_index}'s random generators continue from where they are", main_process_only=False)
    for obj, state in zip(acc._custom_objects, staged["custom"]):
        obj.load_state_dict(state)


def _expect(saved: int, here: int, what: str, where: str) -> None:
    if saved != here:
        raise CheckpointError(f"{where} holds the states of {saved} {what}, this run has {here}: prepare and register "
                              f"the same objects as the run that saved it")


def _read_tensors(path: str, digest: str | None) -> dict[str, torch.Tensor]:
    if digest is None:
        return {}
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} is missing; the checkpoint's Accelerate state refers to it")
    if file_sha256(path) != digest:
        raise CheckpointError(f"{path} does not match the digest the checkpoint recorded: it is damaged, or from "
                              f"another save to this directory")
    from safetensors.torch import load_file

    return load_file(path)
