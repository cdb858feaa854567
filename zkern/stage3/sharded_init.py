"""Sharded construction for stage 3: no rank ever holds the whole model.

    with zkern.init_sharded(config):
        model = MyModel()                       # each module's parameters are partitioned as it is built
    engine = zkern.Engine(model, config)        # stage 3 takes the shards as they are

Inside the context every nn.Module subclass's __init__ is wrapped: when a module's outermost __init__ returns,
each of its own parameters is made equal on every rank (rank 0's values are broadcast) and cut to this rank's
chunk (the flattened parameter padded to a multiple of the world size); .data becomes an empty tensor. A later
torch call on a partitioned parameter (a parent module re-initialising a child's weight, weight tying by
copy) gathers it whole for that call and partitions it again afterwards, so no initialisation is silently
lost; shape queries are answered without a gather. Peak memory while building: this rank's shards plus the
largest module's own parameters.

A module built on the meta device (`torch.nn.utils.skip_init`, `device="meta"`) holds no values to partition; it is
partitioned when `to_empty()` gives it storage (rank 0's uninitialised values everywhere, so the ranks agree).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from zkern.comm.collectives import Comm, backend_for, device_from_config, init_distributed
from zkern.config import Config
from zkern.core.buffers import aligned_empty
from zkern.stage3 import ds_attributes

_SHAPE_QUERIES = {"shape", "size", "dim", "ndim", "numel", "dtype", "device", "requires_grad", "is_leaf"}


def is_sharded(p: torch.Tensor) -> bool:
    """A parameter partitioned by init_sharded and still at rest."""
    return hasattr(p, "_zkern_shard")


def sharder_of(p: torch.Tensor) -> _Sharder:
    return p._zkern_sharder


def forget_sharding(p: torch.Tensor) -> None:
    """p is whole again, or zkern.Engine took over its partition."""
    del p._zkern_shard, p._zkern_shape, p._zkern_sharder


def full_shape(p: torch.Tensor) -> torch.Size:
    return p._zkern_shape if is_sharded(p) else p.shape


def gather_built(p: torch.nn.Parameter, comm: Comm, purpose: str) -> torch.Tensor:
    """A parameter partitioned by init_sharded, whole (a collective: every rank calls it in the same order)."""
    shard, shape = p._zkern_shard, p._zkern_shape
    out = aligned_empty(shard.numel() * comm.world, shard.dtype, shard.device)  # whole views start aligned
    comm.all_gather(out, shard, purpose)
    return out[:shape.numel()].view(shape)


class _Sharder:
    def __init__(self, comm: Comm):
        self.comm = comm
        self.ids = itertools.count()  # ds_id in creation order, as DeepSpeed's zero.Init numbers its parameters

    def shard(self, p: torch.nn.Parameter, src: int | None = 0) -> None:
        """Rank src's values everywhere (src None: the ranks' values are equal already), then keep this rank's
        chunk; .data becomes empty."""
        with torch.no_grad():
            data = p.data.contiguous()
            if src is not None:
                self.comm.broadcast(data, "init_sharded: a parameter's values", src=src)
            flat = data.reshape(-1)
            chunk = math.ceil(flat.numel() / self.comm.world) if flat.numel() else 0
            lo = min(self.comm.rank * chunk, flat.numel())
            mine = torch.zeros(chunk, dtype=flat.dtype, device=flat.device)
            mine[:min(flat.numel(), lo + chunk) - lo].copy_(flat[lo:lo + chunk])
            p.data = torch.empty(0, dtype=data.dtype, device=data.device)  # before it counts as partitioned
            p._zkern_shard = mine
            p._zkern_shape = data.shape
            p._zkern_sharder = self
            # DeepSpeed's attributes, as zero.Init sets them at construction: frameworks count parameters with
            # ds_numel before any engine exists (the engine sets them again for its own layout)
            p.ds_shape, p.ds_numel, p.ds_tensor = data.shape, data.numel(), mine
            if not hasattr(p, "ds_id"):
                p.ds_id = next(self.ids)
            ds_attributes.mark([p], "NOT_AVAILABLE")

    def materialize(self, p: torch.nn.Parameter) -> None:
        full = gather_built(p, self.comm, "init_sharded: a partitioned parameter, whole for one call")
        forget_sharding(p)
        p.data = full
        ds_attributes.mark([p], "AVAILABLE")


class _WholeForOneCall(TorchFunctionMode):
    """While building: a torch call on a partitioned parameter sees it whole, then it is partitioned again."""

    def __init__(self, sharder: _Sharder):
        super().__init__()
        self.sharder = sharder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sharded = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) and is_sharded(t)]
        if not sharded:
            return func(*args, **kwargs)
        name = getattr(getattr(func, "__self__", None), "__name__", None) or getattr(func, "__name__", "")
        if name == "data":  # zkern's own reads and writes of .data
            return func(*args, **kwargs)
        if name in _SHAPE_QUERIES and len(args) >= 1 and args[0] is sharded[0]:
            shape = sharded[0]._zkern_shape
            match name:
                case "shape":
                    return shape
                case "size":
                    dim = args[1] if len(args) > 1 else kwargs.get("dim")
                    return shape if dim is None else shape[dim]
                case "dim" | "ndim":
                    return len(shape)
                case "numel":
                    return shape.numel()
                case _:
                    return func(*args, **kwargs)
        unique = list({id(t): t for t in sharded}.values())
        for p in unique:
            self.sharder.materialize(p)
        try:
            return func(*args, **kwargs)
        finally:
            for p in unique:
                self.sharder.shard(p)


def _shard_whole(params, sharder: _Sharder, src: int | None) -> None:
    """Partition the parameters not yet partitioned; those on the meta device have no values yet and wait for
    to_empty()."""
    # A user's parameter built without storage, not a shard kept in a file (those are the store's to ask about).
    whole = [p for p in params if not is_sharded(p) and p.device.type != "meta"]
    for p in whole:
        sharder.shard(p, src=src)
    if whole:
        del whole
        release_freed_memory()


def release_freed_memory() -> None:
    """Hand freed heap memory back to the OS (glibc). Without it, glibc's dynamic mmap threshold keeps the
    freed whole parameters of earlier modules in the heap and the process's resident size never shrinks
    (measured: a 64 MiB model built at world 4 peaked at 63 MiB resident instead of 25)."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")


def _subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.append(sub)
                todo.append(sub)
    return out


@contextlib.contextmanager
def init_sharded(config: Config | dict | str, *, broadcast: bool = True):
    """Build a model with its parameters partitioned as they are created (ZeRO stage 3 only).

    broadcast=False: the values the modules build are placeholders that a loader overwrites shard by shard
    (zkern.hf.from_pretrained), so they are not made equal across ranks: no rank touches a whole tensor's pages."""
    cfg = Config.load(config)
    if cfg.zero_optimization.stage != 3:
        raise ValueError(f"init_sharded partitions parameters for ZeRO stage 3; the config says stage "
                         f"{cfg.zero_optimization.stage}")
    # The group is made for the device the engine will train on (nccl and gloo on a GPU): modules build their
    # parameters on the host, which gloo broadcasts, and the engine's own group, made from this one, needs nccl.
    device = device_from_config(cfg.device)
    group, rank, world = init_distributed(device, cfg.comm_timeout_s)
    sharder = _Sharder(Comm(group, rank, world, cfg.comm_timeout_s, backend_for(device)))
    built_src = 0 if broadcast else None  # None: each rank keeps its chunk of its own placeholder values
    depth: dict[int, int] = {}
    wrapped: dict[type, object] = {}

    def wrap(cls: type) -> None:
        if "__init__" not in cls.__dict__ or cls in wrapped:
            return
        original = cls.__dict__["__init__"]
        wrapped[cls] = original

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            depth[id(self)] = depth.get(id(self), 0) + 1
            try:
                original(self, *args, **kwargs)
            finally:
                depth[id(self)] -= 1
            if depth[id(self)] == 0:
                del depth[id(self)]
                _shard_whole(self.parameters(recurse=False), sharder, built_src)

        cls.__init__ = __init__

    for cls in [torch.nn.Module, *_subclasses(torch.nn.Module)]:
        wrap(cls)
    original_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

    def init_subclass(cls, **kwargs):
        super(torch.nn.Module, cls).__init_subclass__(**kwargs)
        wrap(cls)

    torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
    original_to_empty = torch.nn.Module.to_empty

    @functools.wraps(original_to_empty)
    def to_empty(self, *, device, recurse: bool = True):
        out = original_to_empty(self, device=device, recurse=recurse)
        _shard_whole(self.parameters(recurse=recurse), sharder, built_src)  # meta parameters given storage
        return out

    torch.nn.Module.to_empty = to_empty
    mode = _WholeForOneCall(sharder)
    try:
        with mode:
            yield
    finally:
        torch.nn.Module.to_empty = original_to_empty
        for cls, original in wrapped.items():
            cls.__init__ = original
        if original_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = original_init_subclass
