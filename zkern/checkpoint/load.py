"""Checkpointer.load: find this rank's shard in a checkpoint written at any world size, stage or offload setting,
read it into staging buffers, verify everything, and only then change the engine's state.

    python -m pytest tests/checkpoint/test_checkpoint.py tests/checkpoint/test_checkpoint_topology.py -q

Each rank asks, for every piece of its own shard (runtime.shard_map), for the elements [start, start + numel) of
that parameter in the checkpoint's entries (ranges.RangeReader): the saver's partition is never replayed. Names and
shapes are checked against the model, every file's size and header and every entry's sha256 against the manifest,
before anything is allocated from the checkpoint's numbers or copied into the engine; every state component the
load restores checks its saved form (core/state.py); then the ranks exchange their outcome, and either all apply or
all raise.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch

from zkern.checkpoint.control import all_gather_json
from zkern.checkpoint.manifest import check_sizes, read_latest, read_manifest, saved_state, tag_dir
from zkern.checkpoint.ranges import TORCH_DTYPES, RangeReader
from zkern.checkpoint.save import loco_layout, loco_reducer
from zkern.checkpoint.save import module_state as held_module_state
from zkern.core.generators import encode
from zkern.core.shard_groups import shares_staging, working_pieces
from zkern.core.state import kinds_a_load_resets
from zkern.errors import CheckpointError
from zkern.optim.piece_states import PieceStates
from zkern.optim.shard_adam import ShardAdam

if TYPE_CHECKING:
    from zkern.checkpoint.holdings import Holdings

log = logging.getLogger("zkern")

# Optimizers whose per-parameter state has the same names and meaning: a checkpoint of one resumes the other.
ADAM_FAMILY = {"ShardAdam", "NvmeAdam", "Adam", "AdamW", "CPUAdam"}
FAMILIES = (ADAM_FAMILY, {"ShardMuon", "NvmeMuon"})


class _Plan:
    """What this rank will apply once every rank has read and verified its part."""

    def __init__(self):
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (live tensor, staged values)
        self.optim: list[tuple[int, int, torch.Tensor, dict]] = []  # (group, piece index, piece, state to set)
        self.rng: dict[str, torch.Tensor] = {}  # "cpu" / "cuda" -> this rank's saved generator state
        self.commit = None  # ShardMap.commit: stores the resting views that are staged copies
        self.hyper: list[dict] = []  # per optimizer param group: the checked hyper-parameters to set
        self.loco: dict[str, torch.Tensor] | None = None  # LoCo's error buffers, where the layout matches
        # a delayed update saved pending: (working view, staged weights the forward computed with) per piece
        self.trailing: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.forms: dict[str, object] = {}  # component name -> its checked saved form, to restore
        self.absent: list[str] = []  # components the load restores that the checkpoint holds nothing of
        self.unknown: list[str] = []  # saved forms no component of this engine takes


def restored_kinds(*, load_module_only: bool, load_lr_scheduler_states: bool) -> tuple[str, ...]:
    """The kinds of plain-data state (saved forms) a load with these flags restores."""
    if load_module_only:
        return ()
    return ("training", "lr_scheduler") if load_lr_scheduler_states else ("training",)


def load(h: Holdings, ctrl, load_dir, tag, *, strict: bool, load_optimizer_states: bool,
         load_lr_scheduler_states: bool, load_module_only: bool):
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
            plan = _stage(h, manifest, path, strict=strict, optimizer=load_optimizer_states and not load_module_only,
                          kinds=restored_kinds(load_module_only=load_module_only,
                                               load_lr_scheduler_states=load_lr_scheduler_states))
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
        if h.rank == 0:
            log.warning("zkern: %s", next(s["missing"] for s in statuses if "missing" in s))
        return None, None
    _apply(h, manifest, plan, load_module_only=load_module_only,
           load_optimizer_states=load_optimizer_states, load_lr_scheduler_states=load_lr_scheduler_states)
    return path, manifest["client_state"]


def _stage(h: Holdings, manifest: dict, path: str, *, strict: bool, optimizer: bool, kinds: tuple[str, ...]) -> _Plan:
    rt = h.runtime
    smap = rt.shard_map()
    where = os.path.join(path, "manifest.json")
    saved_params, saved_module, aliases = manifest["params"], manifest["module"], manifest["aliases"]
    module_state = held_module_state(h)
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
    if missing and h.rank == 0:
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
        _check_optimizer(h.optimizer, manifest, where)
        plan.hyper = _checked_hyper_parameters(h.optimizer, manifest["optimizer"]["param_groups"], where)
    plan.trailing = [] if optimizer and manifest.get("pending_update") and _resumes_pending(h) else None
    for gi, group in enumerate(rt.shard_groups):
        working = working_pieces(group) if plan.trailing is not None else []
        for k, piece in enumerate(group.pieces):
            index, start, _ = smap.pieces[gi][k]
            name = source[index]
            if name is None:
                continue
            if plan.trailing is not None and working[k] is not None and reader.has("working", name):
                trailing = torch.empty(piece.numel(), dtype=working[k].dtype)
                reader.request("working", name, start, trailing)
                plan.trailing.append((working[k], trailing))
            kind = "master" if name in saved_params else "module"
            staged = torch.empty(piece.numel(), dtype=torch.float32)
            reader.request(kind, name, start, staged)
            plan.copies.append((piece.reshape(-1), staged))
            if optimizer:
                plan.optim.append((gi, k, piece, _stage_optimizer(h.optimizer, reader, manifest, name, start, piece)))
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
            # rounding, as a step writes them; so does a master slice that stands for a working shard not kept
            rounded = (id(t), start) in smap.resting_rounded
            staged = torch.empty(live.numel(), dtype=torch.float32 if master is not None else
                                 t.dtype if rounded else live.dtype)
            reader.request(kind, found, start, staged)
            plan.copies.append((live, staged))
            if master is not None:
                plan.copies.append((master, staged))
    rank_name = f"rank{h.rank}"
    for e in manifest["tensors"]:  # versions 1-2: the torch generators as tensor entries
        if e["name"] == rank_name and e["kind"] in ("rng.cpu", "rng.cuda"):
            plan.rng[e["kind"][4:]] = staged = torch.empty(e["numel"], dtype=torch.uint8)
            reader.request(e["kind"], rank_name, 0, staged)
    if optimizer:
        plan.loco = _stage_loco(h, manifest, reader, where)
    reader.check_files()
    reader.run()
    _stage_forms(h, manifest, plan, kinds, where)
    return plan


def _own_forms(h: Holdings, manifest: dict, plan: _Plan) -> dict:
    """This rank's own saved forms ({} when the checkpoint was saved by fewer ranks)."""
    if manifest["version"] >= 3:
        return manifest["rank_state"].get(f"rank{h.rank}", {})
    if "cpu" not in plan.rng:
        return {}
    generators: dict = {"cpu": encode(plan.rng["cpu"])}
    if "cuda" in plan.rng and h.device.type == "cuda":  # the saving rank's device's: this rank's device takes it
        index = h.device.index if h.device.index is not None else torch.cuda.current_device()
        generators["cuda"] = [None] * index + [encode(plan.rng["cuda"])]
    return {"generators": generators}


def _stage_forms(h: Holdings, manifest: dict, plan: _Plan, kinds: tuple[str, ...], where: str) -> None:
    """The saved form of every component of the restored kinds, checked by the component itself."""
    shared, own = saved_state(manifest), _own_forms(h, manifest, plan)
    taken = set()
    for c in h.registry:
        if c.save is None:
            continue
        taken.add(c.name)
        if c.kind not in kinds:
            continue
        forms = own if c.per_rank else shared
        if c.name not in forms:
            plan.absent.append(c.name)
            continue
        try:
            if c.check is not None:
                c.check(forms[c.name])
        except (ValueError, TypeError, KeyError, IndexError, CheckpointError) as e:
            raise CheckpointError(f"{where}: the saved {c.name!r} cannot be restored: {e}") from None
        plan.forms[c.name] = forms[c.name]
    plan.unknown = sorted((set(shared) | set(own)) - taken) if kinds else []


def _check_optimizer(optimizer, manifest: dict, where: str) -> None:
    saved = manifest["optimizer"]
    mine = type(optimizer).__name__
    if saved["type"] != mine and not any({saved["type"], mine} <= family for family in FAMILIES):
        raise CheckpointError(f"{where}: the checkpoint's optimizer is {saved['type']}, the engine's {mine}: their "
                              f"states do not correspond; pass load_optimizer_states=False to load the weights only")
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"{where}: the checkpoint's optimizer has {len(saved['param_groups'])} parameter "
                              f"groups, the engine's {len(optimizer.param_groups)}; pass "
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


def _stage_loco(h: Holdings, manifest: dict, reader: RangeReader, where: str) -> dict[str, torch.Tensor] | None:
    """This rank's LoCo error buffers, when the checkpoint's layout is this engine's (errors are per rank, hop and
    bucket); None, with a log line, when they cannot carry over and restart at zero."""
    quantizer = loco_reducer(h.runtime)
    if quantizer is None:
        return None
    saved = manifest.get("loco")
    if not isinstance(saved, dict) or saved.get("layout") != loco_layout(h):
        if h.rank == 0:
            log.warning("zkern: load_checkpoint: %s LoCo error buffers for this layout (world size, ranks per node, "
                        "stage, buckets); they restart at zero, as at a reset_T boundary",
                        "the checkpoint has no" if not isinstance(saved, dict) else "the checkpoint's are not")
        return None
    if not isinstance(saved.get("steps"), int):
        raise CheckpointError(f"{where}: loco.steps is missing or not an integer")
    out = {}
    rank_name = f"rank{h.rank}"
    for e in manifest["tensors"]:
        if e["name"] == rank_name and e["kind"].startswith("loco."):
            staged = torch.empty(e["numel"], dtype=TORCH_DTYPES[e["dtype"]])
            reader.request(e["kind"], rank_name, 0, staged)
            out[e["kind"][len("loco."):]] = staged
    return out


def _resumes_pending(h: Holdings) -> bool:
    """A checkpoint saved with a delayed update pending resumes it where this engine delays its updates too; else its
    masters' values (the update landed) are the weights from the load on, said once."""
    delayed = h.store.delayed
    if delayed is not None and delayed.delayed:
        return True
    if h.rank == 0:
        log.info("zkern: load_checkpoint: the checkpoint was saved with a delayed update pending; this engine does not "
                 "delay its updates, so it computes with the updated weights from the first step (the run that "
                 "saved landed them one step later)")
    return False


def _stage_optimizer(optimizer, reader: RangeReader, manifest: dict, name: str, start: int,
                     piece: torch.Tensor) -> dict:
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
    if isinstance(optimizer, ShardAdam) and state and not {"exp_avg", "exp_avg_sq", "step"} <= set(state):
        raise CheckpointError(f"the checkpoint's optimizer state of {name!r} has {sorted(state)}; zkern's Adam "
                              f"needs exp_avg, exp_avg_sq and step")
    return state


def _apply(h: Holdings, manifest: dict, plan: _Plan, *, load_module_only: bool, load_optimizer_states: bool,
           load_lr_scheduler_states: bool) -> None:
    rt, opt, store = h.runtime, h.optimizer, h.store
    # What this load does not restore goes back to a fresh engine's value first (gradients accumulated since the last
    # step always; the optimizer, scheduler, scaler and counters by the flags): the engine then equals a fresh engine
    # loaded from the same checkpoint, whenever the load comes.
    h.registry.reset(*kinds_a_load_resets(load_module_only=load_module_only,
                                          load_optimizer_states=load_optimizer_states,
                                          load_lr_scheduler_states=load_lr_scheduler_states))
    with torch.no_grad():
        for live, staged in plan.copies:
            store.write(live, staged)  # in memory, or in the file of a master or working shard on NVMe
        if plan.commit is not None:
            plan.commit()
        # The working-dtype copies follow the masters (as the optimizer's own step writes them).
        for g in [*rt.shard_groups, *h.host_groups]:
            for chunk in g.chunks:
                if chunk.out is not None and not shares_staging(chunk):
                    store.write(chunk.out, store.read(chunk.param))
        if load_optimizer_states and not load_module_only:
            for gi, k, piece, state in plan.optim:
                _set_optimizer_state(opt, gi, k, piece, state)
            for group, values in zip(opt.param_groups, plan.hyper):
                group.update(values)
            if plan.loco is not None:
                loco_reducer(rt).load_errors(plan.loco, manifest["loco"]["steps"], h.device)
        if plan.trailing is not None:  # the update the save left pending lands at this engine's next step
            for live, staged in plan.trailing:
                store.write(live, staged)
            store.delayed.resume_pending()
    h.registry.reset("derived")  # hpZ's slices no longer stand for the shards
    rt.refresh()  # every whole copy (stage 1-2 buckets, stage 3 persistent units) from the loaded shards
    _restore_forms(h, manifest, plan)


def _restore_forms(h: Holdings, manifest: dict, plan: _Plan) -> None:
    """Counters, loss scaler, scheduler, data-loader epoch, generators: each component takes its checked form back;
    one the checkpoint holds nothing of starts from a fresh engine's value."""
    for c in h.registry:
        if c.name in plan.forms:
            c.restore(plan.forms[c.name])
        elif c.name in plan.absent:
            if c.reset is not None:
                c.reset()
            if c.per_rank:
                log.warning("zkern: rank %d: the checkpoint was saved by %d ranks and holds no %s of this rank; it "
                            "continues from where it is", h.rank, manifest["world_size"], c.name)
            elif h.rank == 0:
                log.warning("zkern: load_checkpoint: the checkpoint holds no %s state; it starts from a fresh "
                            "engine's value", c.name)
    if plan.unknown and h.rank == 0:
        log.warning("zkern: load_checkpoint: the checkpoint holds %s state, which this engine has no place for; "
                    "it is not loaded", ", ".join(plan.unknown))


def _set_optimizer_state(opt, gi: int, k: int, piece: torch.Tensor, state: dict) -> None:
    if isinstance(opt, PieceStates):
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
