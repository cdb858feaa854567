"""ShardStore: where the bytes of this rank's shards live, and the one place that tells a resident tensor from a
stand-in for bytes that are elsewhere.

    python -m pytest tests/offload/test_store.py tests/offload/test_nvme_engine.py -q

A shard (the fp32 master, the working copy, the gradient shard, an optimizer moment) rests in one of four homes:

  device     an ordinary tensor on the training device (the GPU; the CPU in a CPU run)
  host       an ordinary tensor in host memory, page-locked when a GPU copies it (ZeRO-Offload)
  nvme       a file (ZeRO-Infinity): the runtimes hold a *meta* stand-in whose slices carry the shapes and storage
             offsets of ranges of the file but no data, so a read by code that does not know about files fails
             loudly instead of returning stale memory. nvme.NvmeShard holds the master and moments of every runtime,
             nvme_params.NvmeParams stage 3's working shard.
  split      partial offload (offload_optimizer.ratio < 1): the fp32 master's first elements on the device and the
             rest on the host (SplitShard); the runtimes hold a meta stand-in as for a file, read() and write() go to
             whichever part holds a range, and resident() gives the real slice of a range one part holds (the
             optimizer's pieces and chunks, which never straddle the split)
  int8       stage 3's units with nothing to train under zero_quantized_nontrainable_weights: their resting chunks
             are codes and scales (comm/zeropp.FrozenStore, kept here as `int8`), reached per unit: in_int8(unit),
             read_unit(unit, ...); their dense slices do not exist

Code that reads or writes a range of a shard (a step, a load, a checkpoint, GatheredParameters, full_state_dict)
passes the tensor it holds to read()/write() and never asks which home it is; code that counts memory asks
resident_bytes(). tests/house/test_layout.py holds that no other module asks `is_meta`.
"""

from __future__ import annotations

import contextlib

import torch

from zkern.comm.zeropp import FrozenStore
from zkern.core.buffers import aligned_zeros
from zkern.offload.host import HostStep, host_tensor
from zkern.offload.nvme import NvmeShard
from zkern.offload.nvme_params import NvmeParams

HOMES = ("device", "host", "nvme")  # what allocate() places; int8 chunks are made by keep_int8; split by allocate_split


class SplitShard:
    """A shard whose elements [0, split) rest on the device and [split, numel) on the host (partial offload), behind
    one meta stand-in whose slices name ranges of it."""

    def __init__(self, numel: int, split: int, dtype: torch.dtype, device: torch.device, *, pin: bool):
        if not 0 <= split <= numel:
            raise ValueError(f"SplitShard: split {split} outside [0, {numel}]")
        self.split = split
        self.device_part = aligned_zeros(split, dtype, device)
        self.host_part = host_tensor(numel - split, dtype, pin=pin)
        self.stand_in = torch.empty(numel, dtype=dtype, device="meta")

    def owns(self, t: torch.Tensor) -> bool:
        return t.is_meta and (t._base if t._base is not None else t) is self.stand_in

    def _range(self, t: torch.Tensor) -> tuple[int, int]:
        if not t.is_contiguous():
            raise ValueError("SplitShard: a range of the shard must be contiguous")
        lo = t.storage_offset()
        return lo, lo + t.numel()

    def resident(self, t: torch.Tensor) -> torch.Tensor:
        """The real slice t stands for; it must lie in one part."""
        lo, hi = self._range(t)
        if hi <= self.split:
            return self.device_part[lo:hi].view(t.shape)
        if lo >= self.split:
            return self.host_part[lo - self.split:hi - self.split].view(t.shape)
        raise ValueError(f"SplitShard: elements [{lo}, {hi}) straddle the device/host split at {self.split}")

    def read(self, t: torch.Tensor) -> torch.Tensor:
        lo, hi = self._range(t)
        if hi <= self.split or lo >= self.split:
            return self.resident(t)
        device = self.device_part[lo:]
        return torch.cat([device, self.host_part[:hi - self.split].to(device.device)]).view(t.shape)

    def write(self, t: torch.Tensor, values: torch.Tensor) -> None:
        lo, hi = self._range(t)
        flat = values.reshape(-1)
        cut = min(max(self.split - lo, 0), hi - lo)
        if cut:
            self.device_part[lo:lo + cut].copy_(flat[:cut])
        if cut < hi - lo:
            self.host_part[max(lo - self.split, 0):hi - self.split].copy_(flat[cut:])

    def nbytes(self) -> tuple[int, int]:
        """(device bytes, host bytes)."""
        return (self.device_part.numel() * self.device_part.element_size(),
                self.host_part.numel() * self.host_part.element_size())


class ShardStore:
    """The homes of one engine's shards: its device, its host memory and, with ZeRO-Infinity, its files."""

    def __init__(self, device: torch.device, *, nvme: NvmeShard | None = None):
        """nvme: the optimizer's files when offload_optimizer.device is "nvme" (masters and moments)."""
        self.device = device
        self.nvme = nvme
        self.params: NvmeParams | None = None  # stage 3's working shard in a file (offload_param.device "nvme")
        self.int8: FrozenStore | None = None  # stage 3's units that rest as int8 codes
        # The delayed update (offload_optimizer.delayed_update): its host Adam may be writing masters and moments in
        # the background; a read waits for it, a write lands it first (host.py). The speculative step's host step
        # too: a read or write withdraws its guess first (speculative.py)
        self.delayed: HostStep | None = None
        self.splits: list[SplitShard] = []  # partial offload's masters (allocate_split)

    # -- where ------------------------------------------------------------------------------------------------
    def allocate(self, numel: int, dtype: torch.dtype, home: str, *, pin: bool = False) -> torch.Tensor:
        """A zeroed shard of numel elements in `home`; for "nvme" (masters only) a region of the optimizer's
        files, returned as its stand-in."""
        match home:
            case "device":
                return aligned_zeros(numel, dtype, self.device)
            case "host":
                return host_tensor(numel, dtype, pin=pin)
            case "nvme":
                if self.nvme is None or dtype != self.nvme.dtypes["master"]:
                    raise ValueError(f"ShardStore: an NVMe shard needs the optimizer's files and their master dtype "
                                     f"({'no files' if self.nvme is None else self.nvme.dtypes['master']}), got "
                                     f"{dtype}")
                return self.nvme.add_region(numel)
            case _:
                raise ValueError(f"ShardStore: home must be one of {HOMES}, got {home!r}")

    def allocate_split(self, numel: int, split: int, dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
        """A zeroed shard of numel elements whose first `split` rest on the device and the rest on the host (partial
        offload); returns its stand-in. The runtime chooses split where no piece of a parameter straddles it."""
        shard = SplitShard(numel, split, dtype, self.device, pin=pin)
        self.splits.append(shard)
        return shard.stand_in

    def resident(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor holding t's values in memory: t itself, or the part of a split shard holding the range t
        names (the optimizer's pieces and chunks step those in place). A range in a file stays its stand-in."""
        split = self.split_of(t)
        return t if split is None else split.resident(t)

    def split_parts(self, t: torch.Tensor | None) -> list[torch.Tensor]:
        """The device and host parts behind a split shard's stand-in (what the state registry counts and moves); []
        for anything else."""
        split = None if t is None else self.split_of(t)
        return [] if split is None else [split.device_part, split.host_part]

    def split_bytes(self, t: torch.Tensor | None) -> tuple[int, int]:
        """(device bytes, host bytes) of a split shard's stand-in; (0, 0) for anything else."""
        split = None if t is None else self.split_of(t)
        return (0, 0) if split is None else split.nbytes()

    def split_of(self, t: torch.Tensor) -> SplitShard | None:
        """The split shard t is a range of (partial offload), else None."""
        if not t.is_meta:
            return None
        return next((s for s in self.splits if s.owns(t)), None)

    def attach_param_file(self, params: NvmeParams) -> torch.Tensor:
        """Stage 3's working shard moves to a file: returns the stand-in the runtime holds instead."""
        self.params = params
        return params.stand_in

    def keep_int8(self, int8: FrozenStore) -> None:
        """Stage 3's units with nothing to train rest as int8 codes in `int8` from now on, not in the dense shards."""
        self.int8 = int8

    def in_int8(self, unit: int) -> bool:
        """Stage 3's unit `unit` rests as int8 codes."""
        return self.int8 is not None and unit in self.int8

    @staticmethod
    def in_files(t: torch.Tensor) -> bool:
        """t (or the shard it is a slice of) is a stand-in: it rests in a file, or in the two parts of a split shard;
        either way its values are reached through read() and write(), not through t."""
        return t.is_meta

    @staticmethod
    def resident_bytes(t: torch.Tensor | None) -> int:
        """Memory t holds (a stand-in holds none)."""
        return 0 if t is None or t.is_meta else t.numel() * t.element_size()

    # -- values -----------------------------------------------------------------------------------------------
    def land_update(self) -> None:
        """The delayed update, if one is pending, reaches the working parameters (a checkpoint save does this
        first, so that a run resumed from it continues exactly as the run that saved)."""
        if self.delayed is not None:
            self.delayed.land()

    def settle(self) -> None:
        """The host step's work in flight ends without landing anything: a delayed update's Adam finishes (its
        update stays pending, and lands at the next step as it would have), a speculative step's guess is withdrawn
        (redone exactly at the step). What a save does first: it changes nothing the run computes."""
        if self.delayed is not None:
            self.delayed.settle()

    def update_pending(self) -> bool:
        """A delayed update is stepped and not yet sent to the working parameters (they trail the masters)."""
        return self.delayed is not None and self.delayed.pending()

    def landed_view(self):
        """A context in which the working parameters include a delayed update in flight, restored after it
        (DelayedUpdate.landed_view); a wait for the host step otherwise."""
        if self.delayed is None:
            return contextlib.nullcontext()
        if not self.delayed.pending():
            self.settle()
            return contextlib.nullcontext()
        return self.delayed.landed_view()

    def trained_view(self, modifier_rank: int | None) -> contextlib.ExitStack:
        """A GatheredParameters context that may write (a modifier rank) shows the trained model: a delayed update in
        flight is landed in view (landed_view) until the returned stack is closed, so the values a rank writes are
        compared with the weights the update gives them (writing the value an element held before the update
        writes it). The context closes it before a write lands the update for real, and a context that changed
        nothing leaves the run as it was. Collective, as landed_view is."""
        stack = contextlib.ExitStack()
        if modifier_rank is not None and self.update_pending():
            stack.enter_context(self.landed_view())
        return stack

    def read(self, t: torch.Tensor, state: str = "master") -> torch.Tensor:
        """The values of t: t itself when it is in memory; else read from the file its stand-in names (the
        parameter file for the working shard's slices, else the optimizer's `state` file: master, exp_avg,
        exp_avg_sq)."""
        if self.delayed is not None:
            self.delayed.settle()
        if not t.is_meta:
            return t
        if self._in_param_file(t):
            return self.params.read(t)
        split = self.split_of(t)
        if split is not None:
            return split.read(t)
        return self._optimizer_files().read(state, t)

    def write(self, t: torch.Tensor, values: torch.Tensor, state: str = "master") -> None:
        """t <- values, in memory or in the file t stands for."""
        if self.delayed is not None:
            self.delayed.land()  # else its parameters, going up later, would overwrite what is written here
        if not t.is_meta:
            t.copy_(values)
        elif self._in_param_file(t):
            self.params.write(t, values)
        elif (split := self.split_of(t)) is not None:
            split.write(t, values)
        else:
            self._optimizer_files().write(state, t, values)

    def read_unit(self, unit: int, dense: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A stage-3 unit's resting chunk: its codes dequantized into dtype where it rests as int8, else the values
        of `dense` (the caller's slice of the shard that holds it)."""
        if self.in_int8(unit):
            return self.int8.get(unit, dtype)
        return self.read(dense)

    def _in_param_file(self, t: torch.Tensor) -> bool:
        return self.params is not None and self.params.owns(t)

    def _optimizer_files(self) -> NvmeShard:
        """The files behind every stand-in that is not the parameter file's."""
        if self.nvme is None:
            raise RuntimeError("ShardStore: a stand-in tensor with no file behind it (was the engine destroyed?)")
        return self.nvme
