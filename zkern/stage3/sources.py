"""Where a stage-3 unit's all-gather takes this rank's bytes from, and which collective gathers them: the working
shard on the device, its host copy (offload_param "cpu", prefetches going up on a side stream: uploads.py), its
file (offload_param "nvme", nvme_params.py), or the int8 codes of a unit that rests as int8; gathered plainly, with
qwZ's int8, or from hpZ's secondary partition. The gatherer (gatherer.py) decides when and which units; this says how.

    python -m pytest tests/stage3/test_stage3.py tests/stage3/test_uploads.py -q
"""

from __future__ import annotations

import torch

from zkern.comm.collectives import Comm
from zkern.comm.zeropp import FrozenStore, Secondary, quantized_all_gather
from zkern.stage3.lifecycle import Unit
from zkern.stage3.uploads import Uploads


class UnitSources:
    def __init__(self, units: list[Unit], comm: Comm, *, param_shard: torch.Tensor, params_on_host: bool,
                 quantize_weights: int, secondary: Secondary | None, frozen: FrozenStore | None, param_store,
                 uploads: Uploads | None):
        """param_shard: the shard gathers read (the working shard, or the fp32 master they cast from: shards.source);
        quantize_weights: qwZ's group size (0: off); secondary: hpZ's secondary partition; frozen: the units
        resting as int8 (zeropp.py); param_store: the parameter file (offload_param "nvme"); uploads: where
        prefetched units' host chunks go up off the compute stream (offload_param "cpu")."""
        self.comm, self.param_shard, self.params_on_host = comm, param_shard, params_on_host
        self.quantize_weights, self.secondary, self.frozen = quantize_weights, secondary, frozen
        self.param_store, self.uploads = param_store, uploads
        self._unquantized: set[int] = set()  # units whose gather in flight is exact where qwZ quantizes the others
        self.paths = [self._path_of(u) for u in units]  # per unit: its gather path (ZeRO++ chosen here, once)
        # per unit: whether its prefetch copies its host chunk off the compute stream. Only on the plain path, whose
        # one device operation after the copy is the all-gather (qwZ's quantization, hpZ's secondary copy and the
        # int8 units launch kernels whose temporaries the compute stream would then share with the side stream).
        plain = uploads is not None and not quantize_weights and secondary is None
        self.ahead_ok = [plain and (frozen is None or u.index not in frozen) for u in units]

    def own_chunk(self, u: Unit, buffer: torch.Tensor) -> torch.Tensor:
        """This rank's chunk of u, where the gather reads it (with offload_param, or cast from the master: already
        in its slot)."""
        b = u.bucket
        own = self.param_shard[b.shard_offset:b.shard_offset + b.chunk]
        if self.param_store is not None:  # on NVMe: cached, read ahead, or read now
            own = self.param_store.unit(u.index)
        if own.dtype != buffer.dtype:
            # the fp32 master (no working shard kept): cast into this rank's own slot, gathered in place, as FSDP2
            # casts its shard into the all-gather's input; qwZ quantizes the cast values, as it would a working shard
            return buffer[self.comm.rank * b.chunk:(self.comm.rank + 1) * b.chunk].copy_(own)
        if self.params_on_host:
            # Copied up into this rank's own slot of the gather buffer, then gathered in place: no extra buffer.
            slot = buffer[self.comm.rank * b.chunk:(self.comm.rank + 1) * b.chunk]
            own = slot.copy_(own, non_blocking=own.is_pinned()) if self.uploads is None else \
                self.uploads.copy(slot, own)
        return own

    def launch(self, u: Unit, buffer: torch.Tensor, purpose: str, *, async_op: bool, exact: bool, version: int,
               ahead: bool = False):
        """The all-gather of u into buffer, by the path every rank chooses alike from shared state: hpZ's secondary
        partition while it holds this version (never for exact gathers: persistent units, GatheredParameters),
        else the unit's own path, chosen once at construction (_path_of). ahead: a prefetch, whose host chunk goes
        up off the compute stream where the path allows (ahead_ok)."""
        exact = exact or u.persistent or u.pins > 0
        if self.secondary is not None and not exact and self.secondary.fresh(u.index, version):
            return self.secondary.gather(u.index, buffer, purpose, async_op=async_op)
        # qwZ: an exact gather's values are not the int8 path's; hpZ's secondary copy must not keep them (gathered),
        # or a training step's arithmetic would depend on whether a generation ran before it.
        (self._unquantized.add if self.quantize_weights and exact else self._unquantized.discard)(u.index)
        path = self.paths[u.index]
        if ahead and self.ahead_ok[u.index]:
            with self.uploads.ahead(u.index):
                return path(u, buffer, purpose, async_op, exact)
        return path(u, buffer, purpose, async_op, exact)

    def _path_of(self, u: Unit):
        """How u is gathered from the primary partition, fixed for its life: from its stored int8 codes when it rests
        as int8 (exact: the codes are its values), with qwZ's int8 when configured (plain for exact gathers), or the
        plain all-gather of the working dtype."""
        if self.frozen is not None and u.index in self.frozen:
            def from_codes(u: Unit, buffer, purpose, async_op, exact):
                return self.frozen.gather(self.comm, u.index, buffer, purpose, async_op=async_op)
            return from_codes

        def plain(u: Unit, buffer, purpose, async_op, exact):
            return self.comm.all_gather(buffer, self.own_chunk(u, buffer), purpose, async_op=async_op)

        if not self.quantize_weights:
            return plain

        def int8(u: Unit, buffer, purpose, async_op, exact):
            if exact:
                return plain(u, buffer, purpose, async_op, exact)
            return quantized_all_gather(self.comm, buffer, self.own_chunk(u, buffer), purpose, async_op=async_op,
                                        group=self.quantize_weights)
        return int8

    def arriving(self, u: Unit) -> None:
        """u's buffer is about to be read, released or gathered again: the compute stream waits for its upload."""
        if self.uploads is not None:
            self.uploads.wait(u.index)

    def gathered(self, u: Unit) -> None:
        """u's all-gather has arrived: one from the primary partition refreshes hpZ's secondary slice of u (a gather
        whose unit has no fresh slice read the primary partition: launch's choice)."""
        if self.secondary is not None and u.index not in self._unquantized and \
                not self.secondary.fresh(u.index, u.version):
            self.secondary.keep(u.index, u.buffer, u.version)
