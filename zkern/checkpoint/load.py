"""engine.load_checkpoint: find this rank's shard in a checkpoint written at any world size, stage or offload
setting, read it into staging buffers, verify everything, and only then change the engine's state.

    python -m pytest tests/test_checkpoint.py tests/test_checkpoint_topology.py -q

Each rank asks, for every piece of its own shard (runtime.shard_map), for the elements [start, start + numel) of
that parameter in the checkpoint's entries (ranges.RangeReader): the saver's partition is never replayed. Names and
shapes are checked against the model, every file's size and header and every entry's sha256 against the manifest,
before anything is allocated from the checkpoint's numbers or copied into the engine; then the ranks exchange
their outcome, and either all apply or all raise.
"""

from __future__ import annotations

import logging
import os

import torch

from zkern.checkpoint.control import all_gather_json
from zkern.checkpoint.manifest import check_sizes, read_latest, read_manifest, tag_dir
from zkern.checkpoint.ranges import TORCH_DTYPES, RangeReader
from zkern.checkpoint.save import loco_layout, loco_reducer
from zkern.checkpoint.save import module_state as engine_module_state
from zkern.core.state import kinds_a_load_resets
from zkern.errors import CheckpointError
from zkern.optim.shard_adam import ShardAdam

log = logging.getLogger("zkern")

# Optimizers whose per-parameter state is exp_avg, exp_avg_sq and step with the same meaning: a checkpoint of one
# resumes the other.
ADAM_FAMILY = {"ShardAdam", "NvmeAdam", "Adam", "AdamW", "CPUAdam"}


class _Plan:
    """What this rank will apply once every rank has read and verified its part."""

    def __init__(self):
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live tensor, staged values)
        self.optim: list[tuple[int, int, torch.Tensor, dict]] = []  # (group, piece index, piece, state to set)
        self.rng: dict[str, torch.Tensor] = {}  # "cpu" / "cuda" -> this rank's saved generator state
        self.commit = None  # ShardMap.commit: stores the resting views that are staged copies
        self.hyper: list[dict] = []  # per optimizer param group: the checked hyper-parameters to set
        self.loco: dict[str, torch.Tensor] | None = None  # LoCo's error buffers, where the layout matches


def load(engine, ctrl, load_dir, tag, *, strict: bool, load_optimizer_states: bool, load_lr_scheduler_states: bool,
         load_module_only: bool):
    load_dir = os.fspath(load_dir)
    status, manifest, path, plan = {}, None, None, None
    try:
        wanted = tag if tag is not None else read_latest(load_dir)
        path = None if wanted is None else tag_dir(load_dir, str(wanted))
        if wanted is None:
            status["missing"] = (f"no 'latest' file in {load_dir!r}: nothing to load (pass tag= to load a "
                                 f"particular checkpoint)")
        elif path is None:
            if tag is None:
                raise CheckpointError(f"{os.path.join(load_dir, 'latest')} names tag {wanted!r}, which is not in "
                                      f"{load_dir!r}: the directory was changed by hand")
            status["missing"] = f"no checkpoint tagged {wanted!r} in {load_dir!r}: nothing to load"
        else:
            manifest = read_manifest(path)
            check_sizes(manifest, os.path.join(path, "manifest.json"))
            plan = _stage(engine, manifest, path, strict=strict,
                          optimizer=load_optimizer_states and not load_module_only)
            if load_lr_scheduler_states and not load_module_only:
                _check_scheduler_state(engine, manifest, os.path.join(path, "manifest.json"))
    except (CheckpointError, OSError) as e:
        status["error"] = str(e)
    except Exception as e:  # anything else a damaged checkpoint provokes still reaches every rank as an error
        status["error"] = f"{path or load_dir}: the checkpoint cannot be read ({type(e).__name__}: {e})"
    statuses = all_gather_json(ctrl, status, "checkpoint load: every rank's outcome")
    errors = [(r, s["error"]) for r, s in enumerate(statuses) if "error" in s]
    if errors:
        own = status.get("error")
        others = "; ".join(f"rank {r}: {e}" for r, e in errors if e != own)
        raise CheckpointError(f"load_checkpoint({load_dir!r}, tag={tag!r}) failed; the engine is unchanged. "
                              f"{own or ''}{' | other ranks: ' + others if others else ''}")
    if any("missing" in s for s in statuses):
        if engine.rank == 0:
            log.warning("zkern: %s", next(s["missing"] for s in statuses if "missing" in s))
        return None, None
    _apply(engine, manifest, plan, load_module_only=load_module_only,
           load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states)
    return path, manifest["client_state"]


def _stage(engine, manifest: dict, path: str, *, strict: bool, optimizer: bool) -> _Plan:
    rt = engine.runtime
    smap = rt.shard_map()
    where = os.path.join(path, "manifest.json")
    saved_params, saved_module, aliases = manifest["params"], manifest["module"], manifest["aliases"]
    module_state = engine_module_state(engine)
    trainable = {id(p) for p in rt.params}
    # Names: the model's (state_dict) against the checkpoint's, tied names resolved through either side's aliases.
    model_names = set(module_state)
    saved_names = set(saved_params) | set(saved_module) | set(aliases)
    frozen_excluded = manifest["excluded_frozen"]
    missing = sorted(n for n, t in module_state.items() if n not in saved_names
                     and not (frozen_excluded and isinstance(t, torch.nn.Parameter) and id(t) not in trainable))
    unexpected = sorted(n for n in saved_names if n not in model_names)
    if strict and (missing or unexpected):
        raise CheckpointError(f"{where}: does not match the model (load_module_strict=True): missing from the "
                              f"checkpoint {missing[:20]}{' ...' if len(missing) > 20 else ''}, in the checkpoint "
                              f"but not the model {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}")
    if missing and engine.rank == 0:
        log.warning("zkern: load_checkpoint: %d tensors of the model are not in the checkpoint and keep their "
                    "values: %s", len(missing), missing[:20])

    def saved_name(name: str) -> str | None:
        """The checkpoint's name for the model's tensor `name` (through tied aliases)."""
        if name in saved_params or name in saved_module:
            return name
        return aliases.get(name)

    # The model's name for each trainable parameter, found through every name it has in state_dict.
    names_of: dict[int, list[str]] = {}
    for name, t in module_state.items():
        names_of.setdefault(id(t), []).append(name)
    reader = RangeReader(path, manifest)
    plan = _Plan()
    source: dict[int, str | None] = {}
    for i, p in enumerate(rt.params):
        found = next((saved_name(n) for n in names_of.get(id(p), [rt.names[i]]) if saved_name(n)), None)
        source[i] = found
        if found is None:
            continue
        table = saved_params if found in saved_params else saved_module
        if list(table[found]["shape"]) != list(smap.shapes[i]):
            raise CheckpointError(f"{where}: {found!r} has shape {table[found]['shape']}, the model's "
                                  f"{rt.names[i]!r} has {list(smap.shapes[i])}")
    if optimizer:
        _check_optimizer(engine, manifest, where)
        plan.hyper = _checked_hyper_parameters(engine.optimizer, manifest["optimizer"]["param_groups"], where)
    for gi, group in enumerate(rt.shard_groups):
        for k, piece in enumerate(group.pieces):
            index, start, _ = smap.pieces[gi][k]
            name = source[index]
            if name is None:
                continue
            kind = "master" if name in saved_params else "module"
            staged = torch.empty(piece.numel(), dtype=torch.float32)
            reader.request(kind, name, start, staged)
            plan.copies.append((piece.reshape(-1), staged))
            if optimizer:
                plan.optim.append((gi, k, piece, _stage_optimizer(engine, reader, manifest, name, start, piece)))
    resting = {id(p): [] for p, _, _, _ in smap.resting}
    for p, _, start, view in smap.resting:
        if view.numel():
            resting[id(p)].append((start, view))
    plan.commit = smap.commit
    done: set[int] = set()
    for name, t in module_state.items():
        if id(t) in trainable or id(t) in done:
            continue
        found = saved_name(name)
        if found is None:
            continue
        # A tensor frozen here may have been trained when saved: then its values are the saved master (fp32),
        # rounded to this engine's working dtype as the optimizer's own copy-out rounds them.
        kind = "master" if found in saved_params else "module"
        done.add(id(t))
        shape = (saved_params if kind == "master" else saved_module)[found]["shape"]
        full = next((s for p, s, _, _ in smap.resting if p is t), t.shape)
        if list(shape) != list(full):
            raise CheckpointError(f"{where}: {found!r} has shape {shape}, the model's {name!r} has {list(full)}")
        for start, live in resting.get(id(t), [(0, t.detach().reshape(-1))]):
            master = smap.resting_masters.get((id(t), start))
            # the master's copy (stage 3 keeps frozen pieces in it too) takes the fp32 values, the working view their
            # rounding, as a step writes them
            staged = torch.empty(live.numel(), dtype=torch.float32 if master is not None else live.dtype)
            reader.request(kind, found, start, staged)
            plan.copies.append((live, staged))
            if master is not None:
                plan.copies.append((master, staged))
    rank_name = f"rank{engine.rank}"
    for e in manifest["tensors"]:
        if e["name"] == rank_name and e["kind"] in ("rng.cpu", "rng.cuda"):
            plan.rng[e["kind"][4:]] = staged = torch.empty(e["numel"], dtype=torch.uint8)
            reader.request(e["kind"], rank_name, 0, staged)
    if optimizer:
        plan.loco = _stage_loco(engine, manifest, reader, where)
    reader.check_files()
    reader.run()
    return plan


def _check_optimizer(engine, manifest: dict, where: str) -> None:
    saved = manifest["optimizer"]
    mine = type(engine.optimizer).__name__
    if saved["type"] != mine and not {saved["type"], mine} <= ADAM_FAMILY:
        raise CheckpointError(f"{where}: the checkpoint's optimizer is {saved['type']}, the engine's {mine}: their "
                              f"states do not correspond; pass load_optimizer_states=False to load the weights only")
    if len(saved["param_groups"]) != len(engine.optimizer.param_groups):
        raise CheckpointError(f"{where}: the checkpoint's optimizer has {len(saved['param_groups'])} parameter "
                              f"groups, the engine's {len(engine.optimizer.param_groups)}; pass "
                              f"load_optimizer_states=False to load the weights only")


def _checked_hyper_parameters(optimizer, saved_groups: list, where: str) -> list[dict]:
    """Each saved param group's hyper-parameters, only those the live group has (never 'params'), each of the live
    value's type: a checkpoint cannot add keys to the optimizer or set one to something it does not take."""
    out = []
    for gi, (group, saved) in enumerate(zip(optimizer.param_groups, saved_groups)):
        if not isinstance(saved, dict):
            raise CheckpointError(f"{where}: optimizer param_groups[{gi}] is a {type(saved).__name__}, not a dict")
        values = {}
        for key, live in group.items():
            if key == "params" or key not in saved:
                continue
            value = saved[key]
            if isinstance(live, bool) or live is None:
                ok = value is None or isinstance(value, bool) if live is None else isinstance(value, bool)
            elif isinstance(live, (int, float)):
                ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            elif isinstance(live, (tuple, list)):
                ok = isinstance(value, list) and len(value) == len(live) and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
                value = tuple(value) if ok and isinstance(live, tuple) else value
            elif isinstance(live, str):
                ok = isinstance(value, str)
            else:
                continue  # an object the checkpoint cannot describe (kept as it is)
            if not ok:
                raise CheckpointError(f"{where}: optimizer param_groups[{gi}][{key!r}] is {value!r}, the engine's "
                                      f"optimizer holds a {type(live).__name__} there")
            values[key] = value
        out.append(values)
    return out


def _same_kind(saved, live) -> bool:
    """Plain JSON `saved` can stand where the live value is (numbers for numbers, lists for lists and tuples, ...)."""
    if live is None or saved is None:
        return True
    if isinstance(live, bool) or isinstance(saved, bool):
        return isinstance(live, bool) and isinstance(saved, bool)
    if isinstance(live, (int, float)):
        return isinstance(saved, (int, float))
    if isinstance(live, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(live) and all(map(_same_kind, saved, live))
    if isinstance(live, dict):
        return isinstance(saved, dict) and all(_same_kind(saved[k], live[k]) for k in saved.keys() & live.keys())
    return isinstance(saved, type(live))


def _check_scheduler_state(engine, manifest: dict, where: str) -> None:
    """The saved scheduler state has the live scheduler's keys, each of the live value's kind: loading it cannot
    fail half-way or plant a key the scheduler never had."""
    saved, live = manifest["lr_scheduler"], engine.lr_scheduler
    if saved is None or live is None:
        return
    mine = live.state_dict()
    if set(saved) != set(mine) or not all(_same_kind(saved[k], mine[k]) for k in mine):
        raise CheckpointError(f"{where}: the saved {manifest.get('lr_scheduler_type')} state (keys "
                              f"{sorted(saved)[:10]}) does not fit this engine's {type(live).__name__} (keys "
                              f"{sorted(mine)[:10]}); pass load_lr_scheduler_states=False to keep the scheduler as "
                              f"it is")


def _stage_loco(engine, manifest: dict, reader: RangeReader, where: str) -> dict[str, torch.Tensor] | None:
    """This rank's LoCo error buffers, when the checkpoint's layout is this engine's (errors are per rank, hop and
    bucket); None, with a log line, when they cannot carry over and restart at zero."""
    quantizer = loco_reducer(engine)
    if quantizer is None:
        return None
    saved = manifest.get("loco")
    if not isinstance(saved, dict) or saved.get("layout") != loco_layout(engine):
        if engine.rank == 0:
            log.warning("zkern: load_checkpoint: %s LoCo error buffers for this layout (world size, ranks per node, "
                        "stage, buckets); they restart at zero, as at a reset_T boundary",
                        "the checkpoint has no" if not isinstance(saved, dict) else "the checkpoint's are not")
        return None
    if not isinstance(saved.get("steps"), int):
        raise CheckpointError(f"{where}: loco.steps is missing or not an integer")
    out = {}
    rank_name = f"rank{engine.rank}"
    for e in manifest["tensors"]:
        if e["name"] == rank_name and e["kind"].startswith("loco."):
            staged = torch.empty(e["numel"], dtype=TORCH_DTYPES[e["dtype"]])
            reader.request(e["kind"], rank_name, 0, staged)
            out[e["kind"][len("loco."):]] = staged
    return out


def _stage_optimizer(engine, reader: RangeReader, manifest: dict, name: str, start: int, piece: torch.Tensor) -> dict:
    """This piece's optimizer state from the checkpoint, staged; {} when the checkpoint has none for it (it never
    stepped): the state is then reset, as for a fresh parameter."""
    opt = manifest["optimizer"]
    state: dict = {}
    for kind in sorted(k for k in reader.kinds_of.get(name, ()) if k.startswith("optim.")):
        staged = torch.empty(piece.numel(), dtype=torch.float32)
        reader.request(kind, name, start, staged)
        state[kind[len("optim."):]] = staged
    for key, value in opt["scalars"].get(name, {}).items():
        dtype = opt["scalar_types"].get(key)
        state[key] = value if dtype is None else torch.tensor(value, dtype=TORCH_DTYPES[dtype])
    if isinstance(engine.optimizer, ShardAdam) and state and not {"exp_avg", "exp_avg_sq", "step"} <= set(state):
        raise CheckpointError(f"the checkpoint's optimizer state of {name!r} has {sorted(state)}; zkern's Adam "
                              f"needs exp_avg, exp_avg_sq and step")
    return state


def _apply(engine, manifest: dict, plan: _Plan, *, load_module_only: bool, load_optimizer_states: bool,
           load_lr_scheduler_states: bool) -> None:
    rt, opt = engine.runtime, engine.optimizer
    # What this load does not restore goes back to a fresh engine's value first (gradients accumulated since the last
    # step always; the optimizer, scheduler, scaler and counters by the flags): the engine then equals a fresh engine
    # loaded from the same checkpoint, whenever the load comes.
    engine.state.reset(*kinds_a_load_resets(load_module_only=load_module_only,
                                            load_optimizer_states=load_optimizer_states,
                                            load_lr_scheduler_states=load_lr_scheduler_states))
    with torch.no_grad():
        for live, staged in plan.copies:
            engine.store.write(live, staged)  # in memory, or in the file of a master or working shard on NVMe
        if plan.commit is not None:
            plan.commit()
        # The working-dtype copies follow the masters (as the optimizer's own step writes them).
        groups = [*rt.shard_groups, *(engine.host_step.host_groups if engine.host_step is not None else [])]
        for g in groups:
            for chunk in g.chunks:
                if chunk.out is not None:
                    engine.store.write(chunk.out, engine.store.read(chunk.param))
        if load_optimizer_states and not load_module_only:
            for gi, k, piece, state in plan.optim:
                _set_optimizer_state(opt, gi, k, piece, state)
            for group, values in zip(opt.param_groups, plan.hyper):
                group.update(values)
            if plan.loco is not None:
                loco_reducer(engine).load_errors(plan.loco, manifest["loco"]["steps"], engine.device)
    engine.state.reset("derived")  # hpZ's slices no longer stand for the shards
    rt.refresh()  # every whole copy (stage 1-2 buckets, stage 3 persistent units) from the loaded shards
    if load_module_only:
        return
    # the scale a loss-scaling run reached (fp16, or torch_autocast in fp16; older manifests say fp16 only)
    if manifest.get("loss_scaled", manifest["precision"] == "fp16") and engine.scaler.loss_scaled:
        engine.scaler.load_state_dict(manifest["loss_scaler"])
    saved_sched = manifest["lr_scheduler"]
    if load_lr_scheduler_states and saved_sched is not None:
        if engine.lr_scheduler is None:
            log.warning("zkern: the checkpoint has a %s state but the engine has no lr scheduler; it is not loaded",
                        manifest["lr_scheduler_type"])
        else:
            engine.lr_scheduler.load_state_dict(saved_sched)
    engine.global_steps = manifest["global_steps"]
    engine.skipped_steps = manifest["skipped_steps"]
    engine.micro_steps = manifest["micro_steps"]
    loader = next((c for c in engine.state if c.name == "dataloader"), None)
    saved_loader = manifest.get("dataloader")
    if loader is not None and isinstance(saved_loader, dict) and isinstance(saved_loader.get("epoch"), int):
        loader.restore(saved_loader)
    norm = manifest.get("last_grad_norm")
    engine.last_grad_norm = float(norm) if isinstance(norm, (int, float)) and not isinstance(norm, bool) else None
    _restore_rng(engine, manifest, plan)


def _set_optimizer_state(opt, gi: int, k: int, piece: torch.Tensor, state: dict) -> None:
    if isinstance(opt, ShardAdam):
        opt.set_piece_state(gi, k, state)
        return
    new = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            value = value.to(piece.device).view(piece.shape)
        elif key == "step" and not isinstance(value, torch.Tensor):  # zkern's Adam counts in ints, torch's in tensors
            value = torch.tensor(float(value))
        new[key] = value
    if new:
        opt.state[piece] = new
    else:
        opt.state.pop(piece, None)


def _restore_rng(engine, manifest: dict, plan: _Plan) -> None:
    if "cpu" not in plan.rng:
        log.warning("zkern: rank %d: the checkpoint was saved by %d ranks and holds no generator state for this "
                    "rank; its torch RNG continues from where it is", engine.rank, manifest["world_size"])
        return
    torch.set_rng_state(plan.rng["cpu"])
    if "cuda" in plan.rng and engine.device.type == "cuda":
        torch.cuda.set_rng_state(plan.rng["cuda"], engine.device)
