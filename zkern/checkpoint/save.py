"""Checkpointer.save: what a rank holds, as ranges of the model's own tensors plus the state components' saved
forms, written atomically.

    python -m pytest tests/checkpoint/test_checkpoint.py -q

The protocol (every rank calls it; the checkpoint group's messages keep ranks in step, none waits forever):
  1. ranks agree on the tag; rank 0 removes what killed saves left (.tmp-* directories) and names a fresh
     temporary directory .tmp-<tag>-<nonce> beside the tags;
  2. each rank writes rank<r>.safetensors there (its master and optimizer ranges, frozen-parameter shards, buffers
     on rank 0), hashing each tensor as it writes, and fsyncs it;
  3. rank 0 gathers every rank's index and per-rank saved forms (its generators), checks each file is visible and
     whole, writes manifest.json, fsyncs the
     directory, renames it to <tag> (a tag saved before is moved aside first and removed after), fsyncs the parent,
     then points `latest` at the tag by writing a temporary file and renaming it;
  4. the outcome goes to every rank: all return, or all raise with the failing rank's reason.
A kill at any moment leaves every complete tag and `latest` as they were, or the new tag complete: nothing is
renamed into place before it is whole and durable.

Asynchronous saves (async_save=True) copy the state into host buffers first (page-locked on CUDA), then run steps
1-4 in a writer thread on the checkpoint's own process group while training goes on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zkern.checkpoint.control import all_gather_json, broadcast_json
from zkern.checkpoint.manifest import (
    FORMAT,
    MANIFEST,
    OLD_PREFIX,
    TMP_PREFIX,
    VERSION,
    aside_tag,
    check_tag,
    entry_key,
    fsync_dir,
    manifest_bytes,
    rank_file,
    write_file_durably,
    write_latest,
)
from zkern.checkpoint.plain import jsonable, plain
from zkern.checkpoint.ranges import byte_view, dtype_name
from zkern.checkpoint.tensorfile import StreamWriter
from zkern.core.pinned import pinned_empty
from zkern.core.shard_groups import working_pieces
from zkern.errors import CheckpointError
from zkern.optim.piece_states import PieceStates

if TYPE_CHECKING:
    from zkern.checkpoint.holdings import Holdings
    from zkern.offload.store import ShardStore

log = logging.getLogger("zkern")


@dataclass
class Snapshot:
    """One rank's part of a checkpoint, ready to write."""

    entries: list[tuple[str, str, int, torch.Tensor]]  # (kind, name, first element, 1-D values)
    scalars: dict[str, dict] = field(default_factory=dict)  # parameter name -> optimizer scalars (e.g. step)
    scalar_types: dict[str, str | None] = field(default_factory=dict)  # scalar key -> tensor dtype, None: a number
    body: dict = field(default_factory=dict)  # the manifest's fields (rank 0's are the ones written)
    rank_state: dict = field(default_factory=dict)  # this rank's own saved forms (component name -> plain data)
    store: ShardStore | None = None  # the engine's: entries that rest in files (ZeRO-Infinity) are read as written

    def in_files(self, t: torch.Tensor) -> bool:
        return self.store is not None and self.store.in_files(t)

    def values(self, kind: str, t: torch.Tensor) -> torch.Tensor:
        """An entry's values on the host (read from its file for states on NVMe: kind "optim.<state>" names it). An
        entry in memory is read as it is: the save settled the host step when it took the snapshot, and an
        asynchronous save's writer thread must not settle it again while training goes on (that would join or
        withdraw the training thread's work in flight)."""
        if self.in_files(t):
            t = self.store.read(t, kind[len("optim."):] if kind.startswith("optim.") else "master")
        t = t.reshape(-1)
        return t if t.device.type == "cpu" else t.cpu()


def optimizer_piece_state(optimizer: torch.optim.Optimizer, group: int, index: int, piece: torch.Tensor) -> dict:
    """The optimizer's state of one shard piece: per-element tensors and scalars."""
    if isinstance(optimizer, PieceStates):
        return optimizer.piece_state(group, index)
    return dict(optimizer.state.get(piece, {}))


def module_state(h: Holdings) -> dict[str, torch.Tensor]:
    """model.state_dict(keep_vars=True): the names and the tensor objects (stage-3 parameters at rest are empty, and
    the runtime's guard against reading them steps aside for this walk over names and ids)."""
    with h.runtime.unguarded():
        return h.module.state_dict(keep_vars=True)


def snapshot(h: Holdings, *, client_state, exclude_frozen: bool, copy: bool) -> Snapshot:
    """What this rank writes. copy: values are copied into fresh host buffers (an asynchronous save), else the
    entries are views of the live state (written before the call returns)."""
    rt, opt = h.runtime, h.optimizer
    smap = rt.shard_map()
    snap = Snapshot(entries=[])
    # checkpoint.use_node_local_storage: each node's disk must hold what its ranks read back at the same layout, so
    # every rank writes what it holds whole (buffers, stage 0's pieces), not only the rank that writes it otherwise
    node_local = h.config.checkpoint.use_node_local_storage
    # ZeRO-Infinity: master, moments or working shard on disk; each range is read as it is written
    snap.store = h.store
    # A delayed update stepped and not landed: the masters hold it, the forward's weights not yet. Those are saved
    # too ("working"), so a resume computes its next forward with them and lands the update at its next step, as
    # the run that saved does (the save lands nothing: it must not change that run).
    pending = h.store.update_pending()
    for gi, group in enumerate(rt.shard_groups):
        working = working_pieces(group) if pending else []
        for i, piece in enumerate(group.pieces):
            index, start, mine = smap.pieces[gi][i]
            if not mine and not node_local:  # node-local: every rank keeps what it holds (its node may be alone)
                continue
            name = rt.names[index]
            snap.entries.append(("master", name, start, piece.reshape(-1)))
            if pending and working[i] is not None:
                snap.entries.append(("working", name, start, working[i]))
            for key, value in optimizer_piece_state(opt, gi, i, piece).items():
                # One value per element: shaped like the piece (a 0-dim parameter's state is 0-dim too, but its
                # step count, like every optimizer's step, is a scalar).
                per_element = isinstance(value, torch.Tensor) and value.numel() == piece.numel() and \
                    (value.dim() > 0 or (piece.dim() == 0 and key != "step"))
                if per_element:
                    snap.entries.append((f"optim.{key}", name, start, value.reshape(-1)))
                elif isinstance(value, torch.Tensor) and value.dim() == 0:
                    snap.scalars.setdefault(name, {})[key] = value.item()
                    snap.scalar_types[key] = dtype_name(value.dtype)
                elif isinstance(value, (int, float)) and not isinstance(value, bool):
                    snap.scalars.setdefault(name, {})[key] = value
                    snap.scalar_types[key] = None
                else:
                    raise CheckpointError(f"optimizer state {key!r} of {name!r} is {type(value).__name__} "
                                          f"{tuple(getattr(value, 'shape', ()))}: neither one value per element nor "
                                          f"a scalar, so it cannot be saved by element range")
    resting = {id(p): (p, shape, []) for p, shape, _, _ in smap.resting}
    for p, _, start, view in smap.resting:
        if view.numel():
            resting[id(p)][2].append((start, view))
    params, module, aliases, order, seen = {}, {}, {}, [], {}
    for i, name in enumerate(rt.names):
        params[name] = {"shape": list(smap.shapes[i])}
        seen[id(rt.params[i])] = name
    for name, t in module_state(h).items():
        order.append(name)
        if id(t) in seen:
            if seen[id(t)] != name:
                aliases[name] = seen[id(t)]
            continue
        seen[id(t)] = name
        frozen = isinstance(t, torch.nn.Parameter)
        if frozen and exclude_frozen:
            continue
        if id(t) in resting:
            p, shape, ranges = resting[id(t)]
            module[name] = {"shape": list(shape), "dtype": dtype_name(p.dtype), "frozen": True}
            snap.entries.extend(("module", name, start, view.to(p.dtype) if (id(p), start) in smap.resting_rounded
                                 else view) for start, view in ranges)
        else:
            module[name] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "frozen": frozen}
            if h.rank == 0 or node_local:
                snap.entries.append(("module", name, 0, t.detach().reshape(-1)))
    quantizer = loco_reducer(rt)
    if quantizer is not None:  # per rank, hop and bucket: they carry over to this layout only (load._stage_loco)
        snap.entries.extend((f"loco.{name}", f"rank{h.rank}", 0, e.reshape(-1))
                            for name, e in quantizer.error_entries())
    if copy:
        snap.entries = _to_host(snap, pin=h.device.type == "cuda")
    # Counters, loss scaler, LR scheduler, data-loader epoch: rank 0's forms; generators: every rank's own.
    snap.rank_state = plain(h.registry.saved_forms(per_rank=True), "this rank's saved state")
    cfg = h.config
    zero = cfg.zero_optimization
    snap.body = {
        "format": FORMAT, "version": VERSION, "world_size": h.world_size,
        "stage": zero.stage, "precision": cfg.precision, "offload_optimizer": zero.offload_optimizer_device,
        "offload_param": zero.offload_param_device, "saved_at": time.time(), "torch": torch.__version__,
        "state": plain(h.registry.saved_forms(per_rank=False), "the saved state"),
        "optimizer": {"type": type(opt).__name__,
                      "param_groups": [plain({k: v for k, v in g.items() if k != "params"}, f"param_groups[{gi}]")
                                       for gi, g in enumerate(opt.param_groups)]},
        "client_state": client_state,
        "params": params, "module": module, "aliases": aliases, "order": order,
        "excluded_frozen": bool(exclude_frozen),
        "pending_update": pending,
        "loco": None if quantizer is None else {"steps": quantizer.steps, "layout": loco_layout(h)},
        "config": plain(jsonable(cfg.to_dict()), "the config"),
    }
    return snap


def loco_reducer(runtime):
    """The runtime's qgZ reduction when it keeps LoCo error buffers, else None."""
    quantizer = runtime.quantized
    return quantizer if quantizer is not None and quantizer.loco is not None else None


def loco_layout(h: Holdings) -> dict:
    """What LoCo's per-rank error buffers depend on: a checkpoint's carry over only to an engine where this is equal."""
    cfg = h.config
    zero = cfg.zero_optimization
    return {"world_size": h.world_size, "ranks_per_node": h.comm.node_size, "stage": zero.stage,
            "reduce_bucket_size": zero.reduce_bucket_size, "allgather_bucket_size": zero.allgather_bucket_size,
            "group_size": zero.zeropp_grad_group_size, "trainable": list(h.runtime.names),
            "precision": cfg.precision, "communication_data_type": cfg.communication_data_type}


def _to_host(snap: Snapshot, *, pin: bool):
    out = []
    for kind, name, start, t in snap.entries:
        buf = pinned_empty(t.numel(), t.dtype) if pin else torch.empty(t.numel(), dtype=t.dtype)
        buf.copy_(snap.values(kind, t) if snap.in_files(t) else t.reshape(-1), non_blocking=pin)
        out.append((kind, name, start, buf))
    if pin:
        torch.cuda.synchronize()
    return out


def _write_rank_file(directory: str, rank: int, snap: Snapshot) -> dict:
    name = rank_file(rank)
    path = os.path.join(directory, name)
    keys = [entry_key(k, n, s) for k, n, s, _ in snap.entries]
    writer = StreamWriter(path, [(key, dtype_name(t.dtype), (t.numel(),)) for key, (_, _, _, t) in
                                 zip(keys, snap.entries)], {"format": FORMAT, "rank": str(rank)})
    try:
        for key, (kind, _, _, t) in zip(keys, snap.entries):
            host = snap.values(kind, t)
            writer.begin(key)
            writer.write(byte_view(host.contiguous()))
        writer.close(fsync=True)
    except BaseException:
        writer.abort()
        raise
    tensors = [{"file": name, "kind": k, "name": n, "start": s, "numel": t.numel(), "dtype": dtype_name(t.dtype),
                "sha256": writer.hashes[key]} for key, (k, n, s, t) in zip(keys, snap.entries)]
    return {"file": name, "bytes": writer.nbytes, "header_sha256": writer.header_sha256, "tensors": tensors}


def write(ctrl, snap: Snapshot, save_dir: str, tag: str, save_latest: bool, tag_validation: str = "FAIL",
          node_local: bool = False) -> str:
    """Steps 1-4 of the protocol; returns the tag's directory. Raises CheckpointError on every rank if any failed.
    tag_validation (the config's checkpoint.tag_validation): when ranks passed different tags, FAIL raises, WARN
    warns and saves under rank 0's tag, IGNORE saves under rank 0's tag and says so at INFO. node_local
    (checkpoint.use_node_local_storage): save_dir is each node's own disk; every node's first rank checks its own
    ranks' files and publishes the tag there with the whole manifest (a load then finds, on each node, the files
    its ranks read at the same layout; another node count needs the files gathered onto one file system)."""
    save_dir = os.fspath(save_dir)
    rank = ctrl.rank
    leader = rank == 0 or (node_local and rank % ctrl.node_size == 0)
    plan: dict = {"tag": tag}
    if leader:
        try:
            os.makedirs(save_dir, exist_ok=True)
            _sweep(save_dir)
            plan["tmp"] = f"{TMP_PREFIX}{tag}-{secrets.token_hex(4)}"
        except OSError as e:
            plan["error"] = f"rank {rank} cannot prepare {save_dir!r}: {e}"
    plans = all_gather_json(ctrl, plan, "checkpoint: the tag and the temporary directory")
    tags = [p["tag"] for p in plans]
    if len(set(tags)) > 1:
        message = (f"save_checkpoint: the ranks passed different tags {tags}: every rank must save the same tag "
                   f"(pass tag=None for global_step<N>)")
        if tag_validation == "FAIL":
            raise CheckpointError(f"{message}; checkpoint.tag_validation is \"Fail\"")
        if rank == 0:
            log.log(logging.WARNING if tag_validation == "WARN" else logging.INFO,
                    "zkern: %s; saving under rank 0's tag %r (checkpoint.tag_validation is %r)", message, tags[0],
                    tag_validation)
        tag = tags[0]
    errors = [p["error"] for p in plans if "error" in p]
    if errors:
        raise CheckpointError(f"save_checkpoint: {'; '.join(errors)}")
    tmp = os.path.join(save_dir, plans[0]["tmp"])
    try:
        os.makedirs(tmp, exist_ok=True)
        status = {"ok": True, "index": _write_rank_file(tmp, rank, snap), "scalars": snap.scalars,
                  "scalar_types": snap.scalar_types, "rank_state": snap.rank_state}
    except (OSError, CheckpointError, ValueError) as e:
        status = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    statuses = all_gather_json(ctrl, status, "checkpoint: every rank's file index")
    body: dict = {}
    if rank == 0:
        failed = [f"rank {r}: {s['error']}" for r, s in enumerate(statuses) if not s["ok"]]
        try:
            if failed:
                raise CheckpointError("; ".join(failed))
            body = {"manifest": _manifest(tag, snap.body, statuses)}
        except CheckpointError as e:
            body = {"error": f"{e}"}
    if node_local:  # every node's first rank publishes the same manifest on its own disk
        body = broadcast_json(ctrl, body, "checkpoint: the manifest")
    outcome: dict = {}
    if leader and "error" not in body:
        mine = [r for r in range(ctrl.world) if not node_local or r // ctrl.node_size == rank // ctrl.node_size]
        try:
            outcome["path"] = _publish(save_dir, tmp, tag, body["manifest"], statuses, mine, save_latest)
        except (OSError, CheckpointError) as e:
            shutil.rmtree(tmp, ignore_errors=True)
            outcome["error"] = f"{e}"
    elif leader:
        shutil.rmtree(tmp, ignore_errors=True)
        outcome["error"] = body["error"]
    outcomes = all_gather_json(ctrl, outcome, "checkpoint: the outcome")
    failures = [f"rank {r}: {o['error']}" for r, o in enumerate(outcomes) if "error" in o]
    if failures:
        raise CheckpointError(f"save_checkpoint({save_dir!r}, tag={tag!r}) failed, nothing was committed and "
                              f"'latest' is unchanged: {'; '.join(failures)}")
    return outcomes[0]["path"] if not node_local else os.path.join(save_dir, tag)


def _sweep(save_dir: str) -> None:
    """Remove what killed saves left: temporary directories, and tags moved aside whose replacement is in place."""
    for name in os.listdir(save_dir):
        path = os.path.join(save_dir, name)
        if name.startswith(TMP_PREFIX) and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        elif aside_tag(name) is not None and os.path.isdir(path):
            if os.path.isfile(os.path.join(save_dir, aside_tag(name), MANIFEST)):
                shutil.rmtree(path, ignore_errors=True)


def _manifest(tag: str, body: dict, statuses: list[dict]) -> dict:
    """The manifest: rank 0's body with every rank's files, entries, optimizer scalars and own saved forms."""
    files, tensors, scalars, scalar_types, rank_state = {}, [], {}, {}, {}
    for r, s in enumerate(statuses):
        index = s["index"]
        files[index["file"]] = {"bytes": index["bytes"], "header_sha256": index["header_sha256"], "rank": r}
        tensors.extend(index["tensors"])
        for name, values in s["scalars"].items():
            if scalars.setdefault(name, values) != values:
                raise CheckpointError(f"optimizer scalars of {name!r} differ between ranks ({scalars[name]} and "
                                      f"{values} on rank {r}): the ranks' optimizers are out of step")
        scalar_types.update(s["scalar_types"])
        rank_state[f"rank{r}"] = s["rank_state"]
    body = {**body, "tag": tag, "files": files, "tensors": tensors, "rank_state": rank_state}
    body["optimizer"] = {**body["optimizer"], "scalars": scalars, "scalar_types": scalar_types}
    return body


def _publish(save_dir: str, tmp: str, tag: str, body: dict, statuses: list[dict], ranks: list[int],
             save_latest: bool) -> str:
    """Check the files of `ranks` are whole here, write the manifest, rename the tag into place, point `latest`."""
    me = ranks[0]
    for r in ranks:
        index = statuses[r]["index"]
        path = os.path.join(tmp, index["file"])
        size = os.path.getsize(path) if os.path.exists(path) else None
        if size != index["bytes"]:
            raise CheckpointError(f"rank {r}'s file {path} is {'not visible' if size is None else f'{size} bytes'} "
                                  f"from rank {me} (rank {r} wrote {index['bytes']} bytes): save_dir must be one file "
                                  f"system every rank sees (a shared mount), or set checkpoint.use_node_local_storage "
                                  f"where each node has its own")
    write_file_durably(os.path.join(tmp, MANIFEST), manifest_bytes(body))
    fsync_dir(tmp)
    final = os.path.join(save_dir, tag)
    if os.path.exists(final):  # a tag saved again: the old one stays loadable (manifest.tag_dir) until the swap ends
        aside = os.path.join(save_dir, f"{OLD_PREFIX}{tag}-{os.path.basename(tmp).rsplit('-', 1)[1]}")
        os.rename(final, aside)
        os.rename(tmp, final)
        fsync_dir(save_dir)
        shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(save_dir)
    if save_latest:
        write_latest(save_dir, tag)
    return final


class AsyncSave:
    """A save running in a writer thread; wait() returns its path or raises its error (once)."""

    def __init__(self, fn, what: str):
        self.what, self.path, self.error = what, None, None
        self.started = time.perf_counter()
        self.seconds: float | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), name="zkern-checkpoint-writer", daemon=False)
        self.thread.start()

    def _run(self, fn) -> None:
        # The writer yields the CPU to training: on a host whose cores the ranks' compute fills, the save takes
        # longer and the steps around it are slowed less (Linux nices a thread by its own id).
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            self.path = fn()
        except BaseException as e:  # surfaces at the next save, load or wait_checkpoint, and in the log now
            self.error = e
            log.error("zkern: asynchronous %s failed: %s", self.what, e)
        self.seconds = time.perf_counter() - self.started

    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> str:
        self.thread.join()
        if self.error is not None:
            error, self.error = self.error, None
            raise CheckpointError(f"the asynchronous {self.what} failed: {error}") from error
        return self.path


def checked_tag(tag, global_steps: int) -> str:
    return check_tag(f"global_step{global_steps}" if tag is None else str(tag))
