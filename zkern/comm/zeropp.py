"""ZeRO++ (Wang et al. 2023): quantized weight all-gather (qwZ), hierarchical secondary partition (hpZ), and the
quantized two-hop gradient all-to-all (qgZ) with LoCo error feedback.

    python -m pytest tests/comm/test_zeropp.py -q

qwZ   every rank quantizes its chunk of a unit to int8 (one fp32 scale per WEIGHT_GROUP elements), the ranks
      all-gather one uint8 message each (codes, then the scales' bytes), and every rank dequantizes every
      message, its own included, so that all ranks compute with the same values.
int8 rest (zero_quantized_nontrainable_weights) a unit with nothing to train keeps its chunk as its qwZ message,
      quantized once (FrozenStore); its gathers send the stored message: the frozen base is the int8 weights.
hpZ   after a unit's gather from the primary partition, each rank keeps slice j of the whole unit (j its index
      in its group of k consecutive ranks) as a secondary copy in the working dtype; until the shards change,
      the unit's next gathers (backward's) all-gather those slices inside the group. 2Ψ/k bytes per rank in
      fp16/bf16. Which path a gather takes depends only on state every rank shares (the order of gathers and
      the shard version), so all ranks always choose alike.
qgZ   a reduce-scatter of a rank-major buffer (world sections of S elements, section r for rank r) becomes two
      all-to-alls of int4 codes (one fp32 scale per GRAD_GROUP elements, each section padded to a whole number
      of groups): inside the node, rank (n, j) sends local rank j' the sections of every rank (m, j'); each rank
      dequantizes and sums what it got and re-quantizes it (ops.dequant_sum_requant, one op: one pass in the CUDA
      kernel; with LoCo the sum takes its error first), and across nodes sends node m's peer
      the section of rank (m, j); the second dequantize-and-sum is this rank's reduced section.
LoCo  zeropp_loco_param {err_beta, reset_T}: before each quantization the kept error is added back, and the
      error is then updated as a moving average, e <- err_beta * e + (1 - err_beta) * (h - dequantize(h)), h the
      compensated gradient (the LoCo paper's rule); reset to zero every reset_T optimizer steps. One buffer per
      hop and reduction bucket, in the reduction dtype.

Group sizes (zkern's own keys zeropp_weight_group_size, zeropp_grad_group_size; docs/zeropp.md has
the measurement): int8 weights at 2048 elements per scale cost 0.2% more bytes and trained as plain stage 3 did;
int4 gradients at 64 cost 12.5% more bytes than the bare 4 bits, and at 512 the loss trailed plain stage 3's by
12% after 300 steps where at 64 it came within 2%.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass

import torch

from zkern import ops
from zkern.comm.collectives import Comm, Work
from zkern.core.buffers import aligned_empty
from zkern.core.state import Component, host_copy

WEIGHT_GROUP = 2048  # int8 weights: elements per fp32 scale
GRAD_GROUP = 64  # int4 gradients: elements per fp32 scale
SCALE_BYTES = 4


def _groups(numel: int, group: int) -> int:
    return (numel + group - 1) // group


def weight_message_bytes(chunk: int, group: int = WEIGHT_GROUP) -> int:
    """Bytes of one rank's qwZ message for a chunk of `chunk` elements: int8 codes, then fp32 scales."""
    return chunk + SCALE_BYTES * _groups(chunk, group)


def grad_section_padded(section: int, group: int = GRAD_GROUP) -> int:
    """A qgZ section's elements once padded to whole int4 groups."""
    return _groups(section, group) * group


def grad_message_bytes(numel: int, group: int = GRAD_GROUP) -> int:
    """Bytes of the int4 codes and scales of `numel` elements (a multiple of the group size)."""
    return numel // 2 + SCALE_BYTES * (numel // group)


class Deferred:
    """A collective's Work plus what must run once it has arrived (dequantization); Work's interface."""

    def __init__(self, work: Work, then):
        self.work, self.then = work, then

    def done(self) -> bool:
        return self.work.done()

    def wait(self) -> None:
        if self.then is None:
            return
        self.work.wait()
        then, self.then = self.then, None
        then()

    def abandon(self) -> None:
        self.then = None
        self.work.abandon()


# -- qwZ ----------------------------------------------------------------------------------------------------------
def _pack(codes: torch.Tensor, scales: torch.Tensor, parts: int) -> torch.Tensor:
    """Messages (parts, bytes): each part's codes, then its fp32 scales' bytes (codes and scales split evenly)."""
    return torch.cat([codes.view(torch.uint8).reshape(parts, -1),
                      scales.float().reshape(parts, -1).view(torch.uint8)], dim=1)


def _split(msg: torch.Tensor, code_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of messages (..., code_bytes + 4 * groups). The scales' bytes start at code_bytes, which need
    not be a multiple of 4 (an odd chunk: world 1, or an odd unit), so they are copied before being read as fp32 (a
    slice of a single message counts as contiguous and contiguous() would not copy it); 4 bytes per group."""
    scales = msg[..., code_bytes:]
    fresh = torch.empty(scales.shape, dtype=torch.uint8, device=scales.device)  # row-major, offset 0
    fresh.copy_(scales)
    return msg[..., :code_bytes], fresh.view(torch.float32)


def weight_message(own: torch.Tensor, group: int = WEIGHT_GROUP) -> torch.Tensor:
    """One rank's qwZ message for its chunk: int8 codes, then the fp32 scales' bytes (uint8, flat)."""
    return _pack(*ops.quantize(own, 8, group), 1).view(-1)


def quantized_all_gather(comm: Comm, buffer: torch.Tensor, own: torch.Tensor, purpose: str, *,
                         async_op: bool, group: int = WEIGHT_GROUP) -> Deferred:
    """buffer (world * chunk,) <- every rank's own (chunk,) through int8: the values every rank gets are the
    dequantized codes, this rank's own chunk included."""
    return gather_messages(comm, buffer, weight_message(own, group), purpose, async_op=async_op, group=group)


def gather_messages(comm: Comm, buffer: torch.Tensor, message: torch.Tensor, purpose: str, *, async_op: bool,
                    group: int = WEIGHT_GROUP) -> Deferred:
    """buffer (world * chunk,) <- every rank's qwZ message (weight_message), dequantized into buffer's dtype."""
    chunk = buffer.numel() // comm.world
    message = message.to(buffer.device, non_blocking=message.is_pinned())
    gathered = torch.empty(comm.world * message.numel(), dtype=torch.uint8, device=buffer.device)
    work = comm.all_gather(gathered, message, f"{purpose}, int8", async_op=async_op)

    def decode() -> None:
        codes, scales = _split(gathered.view(comm.world, -1), chunk)
        for r in range(comm.world):
            buffer[r * chunk:(r + 1) * chunk].copy_(
                ops.dequantize(codes[r].view(torch.int8), scales[r], 8, group, chunk, buffer.dtype))

    out = Deferred(work, decode)
    if not async_op:
        out.wait()
    return out


class FrozenStore:
    """zero_quantized_nontrainable_weights: this rank's resting chunk of every frozen unit (no trainable parameter)
    kept as its qwZ message, int8 codes and an fp32 scale per group, quantized once from the initial values (and
    again only when a GatheredParameters write or a checkpoint load changes them). Its gathers all-gather the
    stored messages as they are: the weights every rank computes with are the dequantized codes, every time."""

    def __init__(self, chunks: dict[int, int], group: int, device: torch.device, pin: bool = False):
        """chunks: unit index -> elements of this rank's chunk (the same on every rank)."""
        self.group = group
        self.chunks = dict(chunks)
        self.offsets, total = {}, 0
        for ui, chunk in chunks.items():
            self.offsets[ui] = total
            total += weight_message_bytes(chunk, group)
        self.store = torch.zeros(total, dtype=torch.uint8, device=device)
        if pin:
            self.store = self.store.pin_memory()

    def __contains__(self, ui: int) -> bool:
        return ui in self.offsets

    def message(self, ui: int) -> torch.Tensor:
        off = self.offsets[ui]
        return self.store[off:off + weight_message_bytes(self.chunks[ui], self.group)]

    def put(self, ui: int, values: torch.Tensor) -> None:
        """Quantize values (chunk,) into unit ui's message."""
        self.message(ui).copy_(weight_message(values.float(), self.group))

    def get(self, ui: int, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
        """Unit ui's chunk as the gathers see it: the dequantized codes, in dtype."""
        msg = self.message(ui).to(device or self.store.device)
        codes, scales = _split(msg, self.chunks[ui])
        return ops.dequantize(codes.view(torch.int8), scales, 8, self.group, self.chunks[ui], dtype)

    def write(self, ui: int, values: torch.Tensor) -> int:
        """Store values (chunk,) for unit ui: the groups where they differ from what the unit holds (compared in
        values' dtype) are quantized afresh; the others keep their codes, since re-quantizing values that went
        through a 16-bit copy could move a code. Returns the number of groups written."""
        chunk, group = self.chunks[ui], self.group
        held = self.get(ui, values.dtype, values.device)
        groups = (chunk + group - 1) // group
        changed = torch.zeros(groups * group, dtype=torch.bool, device=values.device)
        changed[:chunk] = values != held
        changed = changed.view(groups, group).any(dim=1).to(self.store.device)
        if not bool(changed.any()):
            return 0
        msg = self.message(ui)
        codes, scales = _split(msg, chunk)
        new_codes, new_scales = ops.quantize(values.to(self.store.device, torch.float32), 8, group)
        per_element = changed.repeat_interleave(group)[:chunk]
        codes.copy_(torch.where(per_element, new_codes.view(torch.uint8), codes))
        scales = torch.where(changed, new_scales, scales)
        msg[chunk:].copy_(scales.view(torch.uint8))
        return int(changed.sum())

    def gather(self, comm: Comm, ui: int, buffer: torch.Tensor, purpose: str, *, async_op: bool) -> Deferred:
        return gather_messages(comm, buffer, self.message(ui), f"{purpose} (frozen, stored int8)",
                               async_op=async_op, group=self.group)

    def memory(self) -> dict[str, int]:
        """{"frozen_int8": bytes of the stored codes and scales} (memory_report's key; counted in params too)."""
        return {"frozen_int8": self.store.numel()}


# -- hpZ ----------------------------------------------------------------------------------------------------------
class Secondary:
    """hpZ's secondary partition: per unit, this rank's slice of the whole unit over its group of k ranks, and the
    shard version it was taken at."""

    def __init__(self, comm: Comm, k: int, sizes: dict[int, int], dtype: torch.dtype, device: torch.device):
        """sizes: unit index -> padded elements (divisible by the world size, so by k)."""
        self.comm = comm.node_group(k)  # a collective: every rank builds its Secondary
        self.k = k
        self.offsets, total = {}, 0
        for ui, padded in sizes.items():
            self.offsets[ui] = (total, padded // k)
            total += padded // k
        self.store = aligned_empty(total, dtype, device)  # hpZ's copies: each unit's slice starts aligned
        self.versions: dict[int, int] = {}

    def fresh(self, ui: int, version: int) -> bool:
        return self.versions.get(ui) == version

    def _slice(self, ui: int) -> torch.Tensor:
        off, n = self.offsets[ui]
        return self.store[off:off + n]

    def keep(self, ui: int, whole: torch.Tensor, version: int) -> None:
        """After a gather from the primary partition: keep this rank's slice of the whole unit."""
        if ui not in self.offsets:
            return
        mine = self._slice(ui)
        mine.copy_(whole[self.comm.rank * mine.numel():(self.comm.rank + 1) * mine.numel()])
        self.versions[ui] = version

    def forget(self, ui: int) -> None:
        """The unit's shards were written (GatheredParameters with a modifier rank): its slice is stale."""
        self.versions.pop(ui, None)

    def gather(self, ui: int, buffer: torch.Tensor, purpose: str, *, async_op: bool) -> Work:
        return self.comm.all_gather(buffer, self._slice(ui), f"{purpose}, from the secondary partition",
                                    async_op=async_op)

    def memory(self) -> dict[str, int]:
        """{"hpz_secondary": bytes} (memory_report's key)."""
        return {"hpz_secondary": self.store.numel() * self.store.element_size()}


# -- qgZ ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Loco:
    err_beta: float
    reset_t: int


class QuantizedReduce:
    """qgZ: Comm.reduce_scatter's contract (out <- the sum over ranks of their section [rank]) through two int4
    all-to-all hops, inside the node and across nodes; with LoCo, error feedback per hop and bucket."""

    def __init__(self, comm: Comm, node_size: int, loco: Loco | None, group: int = GRAD_GROUP):
        self.comm, self.k, self.group = comm, node_size, group
        self.nodes = comm.world // node_size
        self.node = comm.node_group(node_size)  # collectives: every rank builds its QuantizedReduce
        self.peers = comm.peer_group(node_size)
        self.loco = loco
        self.errors: dict[object, tuple[torch.Tensor, torch.Tensor]] = {}
        self.steps = 0
        # Second hops launch in the order of their first hops on every rank (they pair up by order on the peer group):
        # several reducers share this object (one per parameter group at stage 2), each retiring its own buckets at
        # times that depend on the rank's backward (routed experts), so the order cannot be left to them.
        self.seconds_due: deque[_TwoHop] = deque()

    @staticmethod
    def from_config(comm: Comm, zero) -> QuantizedReduce | None:
        """The config's qgZ (and LoCo) over comm's nodes, or None when zero_quantized_gradients is off."""
        if not zero.zero_quantized_gradients:
            return None
        loco = None if zero.loco_err_beta is None else Loco(zero.loco_err_beta, zero.loco_reset_t)
        return QuantizedReduce(comm, comm.node_size, loco, zero.zeropp_grad_group_size)

    def bucket(self, key: object) -> _Bucket:
        """Comm.reduce_scatter's signature for one reduction bucket (key: which LoCo error buffers are its own)."""
        return _Bucket(self, key)

    def after_step(self) -> None:
        self.steps += 1
        if self.loco is not None and self.steps % self.loco.reset_t == 0:
            for e1, e2 in self.errors.values():
                e1.zero_()
                e2.zero_()

    def skipped_step(self) -> None:
        """The step these reductions fed was skipped (an fp16 overflow, a non-finite gradient): the errors the
        skipped step's micro-steps left are made of the gradients that overflowed, and carrying them into the next
        steps would add them back (LoCo restarts here, as at a reset_T boundary; reset_T's count is not moved)."""
        self.reset_errors()

    def rescale_errors(self, factor: float) -> None:
        """The loss scale changed by factor: the errors, kept in the scaled gradients' units, change with it."""
        for e1, e2 in self.errors.values():
            e1.mul_(factor)
            e2.mul_(factor)

    def reset_errors(self) -> None:
        for e1, e2 in self.errors.values():
            e1.zero_()
            e2.zero_()

    def state_components(self) -> list[Component]:
        """LoCo's error buffers and its step count (optimizer state: a load of the optimizer's state restores
        them where the checkpoint's layout matches this engine's); nothing without LoCo."""
        if self.loco is None:
            return []

        def reset() -> None:
            self.errors.clear()
            self.steps = 0

        return [Component("loco", "optimizer", reset=reset,
                          snapshot=lambda: host_copy({"steps": self.steps, "errors": {
                              str(k): list(v) for k, v in self.errors.items()}}),
                          tensors=lambda: [t for pair in self.errors.values() for t in pair])]

    def error_entries(self) -> list[tuple[str, torch.Tensor]]:
        """(name, buffer) of every error buffer, named by hop and bucket (what a checkpoint stores per rank)."""
        return [(f"{hop}.{_key_name(key)}", e) for key, pair in sorted(self.errors.items(), key=lambda kv: str(kv[0]))
                for hop, e in zip(("err1", "err2"), pair)]

    def load_errors(self, saved: dict[str, torch.Tensor], steps: int, device: torch.device) -> None:
        """Restore error buffers saved by error_entries() (the caller checked the checkpoint's layout is this
        engine's: same world, nodes, stage, buckets)."""
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        for name, values in saved.items():
            hop, _, key = name.partition(".")
            pairs.setdefault(key, {})[hop] = values
        self.errors = {_key_of(k): tuple(v[hop].reshape(-1).to(device) for hop in ("err1", "err2"))
                       for k, v in pairs.items() if set(v) == {"err1", "err2"}}
        self.steps = steps

    def ensure_errors(self, key: object, world_numel: int, node_numel: int, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The error buffers of one bucket, made zero at its first use."""
        if key not in self.errors:
            self.errors[key] = (torch.zeros(world_numel, dtype=dtype, device=device),
                                torch.zeros(node_numel, dtype=dtype, device=device))
        return self.errors[key]

    def _quantize(self, h: torch.Tensor, err: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes, scales) of h + err; err updated by LoCo's moving average."""
        if err is not None:
            h = h + err
        codes, scales = ops.quantize(h, 4, self.group)
        if err is not None:
            seen = ops.dequantize(codes, scales, 4, self.group, h.numel())
            beta = self.loco.err_beta
            # A group with a NaN or inf dequantizes to NaN: the step will be skipped, the error must not keep it.
            err.mul_(beta).add_(torch.nan_to_num(h - seen, nan=0.0, posinf=0.0, neginf=0.0).to(err.dtype),
                                alpha=1 - beta)
        return codes, scales

    def reduce_scatter(self, out: torch.Tensor, data: torch.Tensor, purpose: str, *, key: object,
                       async_op: bool) -> _TwoHop:
        """out (S,) <- sum over ranks of data (world * S,)'s section [rank], through int4 both hops."""
        world, k, nodes = self.comm.world, self.k, self.nodes
        section = out.numel()
        padded = grad_section_padded(section, self.group)
        err1 = err2 = None
        if self.loco is not None:
            err1, err2 = self.ensure_errors(key, world * padded, nodes * padded, data.dtype, data.device)
        # (node m, local j) rows -> send order (local j' major, node m minor), each section padded to whole groups,
        # so that local rank j' gets one message: the codes and scales of every node's rank j'.
        x = torch.zeros(nodes, k, padded, dtype=torch.float32, device=data.device)
        x[:, :, :section] = data.view(nodes, k, section)
        msg = _pack(*self._quantize(x.transpose(0, 1).reshape(-1), err1), k)  # (k, grad_message_bytes(N * S'))
        recv1 = torch.empty_like(msg)
        work1 = self.node.all_to_all(recv1.view(-1), msg.view(-1), f"{purpose}, int4 inside the node",
                                     async_op=async_op)

        def second_hop() -> Deferred:
            codes, scales = _split(recv1, nodes * padded // 2)
            if err2 is None:  # the node's sum, by node m, and its int4 codes for the next hop, in one op
                _, codes2, scales2 = ops.dequant_sum_requant(codes, scales, 4, self.group, nodes * padded, 4)
            else:  # LoCo adds its error to the sum before quantizing it again
                partial = ops.dequant_sum(codes, scales, 4, self.group, nodes * padded)
                codes2, scales2 = self._quantize(partial, err2)
            msg2 = _pack(codes2, scales2, nodes)  # (nodes, grad_message_bytes(S'))
            recv2 = torch.empty_like(msg2)
            work2 = self.peers.all_to_all(recv2.view(-1), msg2.view(-1), f"{purpose}, int4 across nodes",
                                          async_op=async_op)

            def finish() -> None:
                codes, scales = _split(recv2, padded // 2)
                out.copy_(ops.dequant_sum(codes, scales, 4, self.group, padded)[:section])

            return Deferred(work2, finish)

        hop = _TwoHop(work1, second_hop, self.seconds_due)
        self.seconds_due.append(hop)
        return hop

    def memory(self) -> dict[str, int]:
        """{"loco_error": bytes of the error buffers} with LoCo, else nothing (memory_report's key)."""
        if self.loco is None:
            return {}
        return {"loco_error": sum(e.numel() * e.element_size() for pair in self.errors.values() for e in pair)}


def _key_name(key: object) -> str:
    """A bucket key (an int, or a tuple of ints) as a name: 3 -> "3", (0, 2) -> "0-2"."""
    return "-".join(map(str, key)) if isinstance(key, tuple) else str(key)


def _key_of(name: str) -> object:
    """_key_name's inverse."""
    parts = name.split("-")
    return tuple(int(p) for p in parts) if len(parts) > 1 else int(name)


class _Bucket:
    def __init__(self, reduce: QuantizedReduce, key: object):
        self.reduce, self.key = reduce, key

    def reduce_scatter(self, out: torch.Tensor, data: torch.Tensor, purpose: str, *, async_op: bool) -> _TwoHop:
        return self.reduce.reduce_scatter(out, data, purpose, key=self.key, async_op=async_op)


class _TwoHop:
    """Work's interface over the two hops. The second hop is launched once the first has arrived, and only after
    every earlier two-hop reduction's (due: the queue of those not yet launched, in first-hop order, shared by every
    reducer of one QuantizedReduce): the same order on every rank, whichever reducer asks first. done() never
    waits: it launches what is due only when every first hop up to this one has arrived."""

    def __init__(self, first: Work, launch_second, due: deque):
        """launch_second() -> Deferred: the second hop, launched once the first has arrived."""
        self.first, self.launch_second, self.second, self.due = first, launch_second, None, due

    def _launch_through(self) -> None:
        """Launch the second hops due up to and including this one, oldest first (waiting for their first hops)."""
        while self.second is None:
            hop = self.due.popleft()
            hop.first.wait()
            hop.second = hop.launch_second()

    def done(self) -> bool:
        if self.second is None:
            earlier = itertools.takewhile(lambda h: h is not self, self.due)
            if not (self.first.done() and all(h.first.done() for h in earlier)):
                return False
            self._launch_through()
        return self.second.done()

    def wait(self) -> None:
        self._launch_through()
        self.second.wait()

    def abandon(self) -> None:
        """Forget it (a backward that raised): out of the queue if its second hop was never launched; nothing of
        either hop's result is used."""
        if self.second is None:
            self.due.remove(self)
            self.first.abandon()
        else:
            self.second.abandon()
