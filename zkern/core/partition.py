"""Shard arithmetic and flat-buffer layout: pure functions of sizes, no communication.

    python -c "from zkern.core.partition import plan_layout; print(plan_layout([10, 7, 3], world=4, bucket_numel=12))"

The layout every stage uses: the trainable parameters of one group are packed, in order, into buckets of at most
`bucket_numel` elements (a larger parameter gets a bucket to itself), each parameter at a multiple of ALIGN
elements from its bucket's start. Each bucket is padded to a multiple of ALIGN * world and split into `world` equal
chunks; rank r owns chunk r of every bucket. So every collective is an even reduce-scatter / all-gather over one
contiguous bucket, every rank's shard has the same size, and a rank's shard is the concatenation of its chunks:

    flat buffer (world=2):  | b0: c0 c1 | b1: c0 c1 |        shard of rank 1:  | b0.c1 | b1.c1 |

Every chunk is therefore a multiple of ALIGN (128) elements, and so is every bucket, chunk, shard and parameter
offset, and the start of every piece of a parameter in a shard. In a buffer that starts ALIGN_BYTES (256) aligned
(core/buffers.py allocates them so), every parameter view the model is handed, every gradient view and every chunk
starts at a multiple of 256 bytes in the 16-bit dtypes (512 in fp32, 128 in int8), as torch's own allocator
places each parameter: cuBLAS, cuDNN and Triton choose their vectorised and TMA paths by that alignment. The price:
at most ALIGN - 1 elements after each parameter and ALIGN * world - 1 at a bucket's end (docs/benchmark.md says
what it comes to on the benchmark's presets).

Padding elements are zero, never belong to a parameter and never change the math. Depends on torch alone
(and not even that, for the arithmetic).
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 128  # elements every parameter, chunk and bucket offset is a multiple of: 256 bytes of fp16/bf16, 512 of fp32


def bucket_multiple(world: int) -> int:
    """What a bucket's padded size is a multiple of: ALIGN elements for each of the world's chunks."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    return ALIGN * world


def padded_numel(numel: int, world: int) -> int:
    """numel rounded up to a multiple of world."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    return -(-numel // world) * world


def shard_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    """(start, size) of rank's equal chunk of a buffer of numel elements once padded to a multiple of world."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is outside world size {world}")
    size = padded_numel(numel, world) // world
    return rank * size, size


@dataclass(frozen=True)
class Bucket:
    """One unit of communication: params [first, last) of the group, packed from `offset` in the flat buffer."""

    index: int
    offset: int  # flat offset of the bucket
    numel: int  # elements up to the end of its last parameter's ALIGN-rounded slot: parameters and the gaps between
    padded: int  # numel rounded up to a multiple of bucket_multiple(world)
    first: int  # first parameter index in the bucket
    last: int  # one past the last parameter index
    shard_offset: int  # where this bucket's chunk starts in every rank's shard
    world: int

    @property
    def chunk(self) -> int:
        """Elements each rank owns in this bucket."""
        return self.padded // self.world


@dataclass(frozen=True)
class Piece:
    """The part of parameter `param` that lies in one rank's chunk of one bucket."""

    param: int  # parameter index in the group
    param_start: int  # first element of the parameter covered (in its flattened order)
    numel: int
    bucket: int
    chunk_start: int  # position inside the rank's chunk of the bucket
    shard_start: int  # position inside the rank's shard


@dataclass(frozen=True)
class Layout:
    world: int
    numels: tuple[int, ...]
    offsets: tuple[int, ...]  # flat offset of each parameter
    buckets: tuple[Bucket, ...]
    total: int  # padded flat-buffer size
    shard_numel: int  # every rank's shard size

    @property
    def numel(self) -> int:
        """Elements that belong to parameters (no padding)."""
        return sum(self.numels)

    @property
    def padding(self) -> int:
        return self.total - self.numel

    def bucket_of(self, param: int) -> Bucket:
        for b in self.buckets:
            if b.first <= param < b.last:
                return b
        raise IndexError(f"parameter {param} is not in the layout ({len(self.numels)} parameters)")

    def chunk_range(self, bucket: Bucket, rank: int) -> tuple[int, int]:
        """(flat start, size) of rank's chunk of bucket."""
        return bucket.offset + rank * bucket.chunk, bucket.chunk

    def pieces(self, rank: int) -> list[Piece]:
        """Every parameter part that rank owns, in shard order."""
        out = []
        for b in self.buckets:
            lo, size = self.chunk_range(b, rank)
            hi = lo + size
            for p in range(b.first, b.last):
                start, end = max(lo, self.offsets[p]), min(hi, self.offsets[p] + self.numels[p])
                if start < end:
                    out.append(Piece(param=p, param_start=start - self.offsets[p], numel=end - start, bucket=b.index,
                                     chunk_start=start - lo, shard_start=b.shard_offset + start - lo))
        return out


def plan_layout(numels: list[int], world: int, bucket_numel: int) -> Layout:
    """Pack parameters (in the given order) into buckets of at most bucket_numel elements, each padded to a
    multiple of bucket_multiple(world)."""
    if bucket_numel < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_numel}")
    if any(n < 0 for n in numels):
        raise ValueError(f"parameter sizes must be >= 0, got {numels}")
    groups: list[tuple[int, int]] = []  # (first, last) parameter index per bucket
    first, filled = 0, 0
    for i, n in enumerate(numels):
        n = aligned_numel(n)  # the slot it takes
        if filled and filled + n > bucket_numel:
            groups.append((first, i))
            first, filled = i, 0
        filled += n
    if first < len(numels):
        groups.append((first, len(numels)))
    return _layout(numels, world, groups)


def plan_unit_layout(unit_numels: list[list[int]], world: int) -> Layout:
    """One bucket per unit (stage 3: a fetch unit is gathered and reduced as one): unit_numels[u] lists the
    sizes of unit u's parameters, which are numbered consecutively across units."""
    if any(not sizes for sizes in unit_numels):
        raise ValueError("every unit needs at least one parameter")
    bounds, first = [], 0
    for sizes in unit_numels:
        bounds.append((first, first + len(sizes)))
        first += len(sizes)
    return _layout([n for sizes in unit_numels for n in sizes], world, bounds)


def aligned_numel(numel: int) -> int:
    """numel rounded up to a multiple of ALIGN: the slot a parameter takes in a bucket."""
    return -(-numel // ALIGN) * ALIGN


def _layout(numels: list[int], world: int, groups: list[tuple[int, int]]) -> Layout:
    buckets, offsets = [], []
    flat, shard = 0, 0
    for index, (lo, hi) in enumerate(groups):
        numel = sum(aligned_numel(n) for n in numels[lo:hi])  # ops.flatten(..., align=ALIGN)'s length
        padded = padded_numel(max(numel, 1), bucket_multiple(world))
        at = flat
        for p in range(lo, hi):
            offsets.append(at)
            at += aligned_numel(numels[p])
        buckets.append(Bucket(index=index, offset=flat, numel=numel, padded=padded, first=lo, last=hi,
                              shard_offset=shard, world=world))
        flat += padded
        shard += padded // world
    return Layout(world=world, numels=tuple(numels), offsets=tuple(offsets), buckets=tuple(buckets), total=flat,
                  shard_numel=shard)


def estimate_memory(num_params: int, world_size: int, stage: int, offload_optimizer: bool | str = False,
                    offload_param: bool | str = False, optimizer_bytes_per_param: int | None = None,
                    precision: str = "mixed", hpz_partition_size: int = 1, bf16_optimizer_states: bool = False,
                    bf16_master_weights_and_grads: bool = False) -> dict[str, int]:
    """Model-state bytes per device by the ZeRO paper's formulas (Psi = num_params, N = world_size).

    precision "mixed": 2-byte parameters and gradients, K = optimizer_bytes_per_param (default 12: fp32 master,
    exp_avg, exp_avg_sq): baseline (2+2+K)Psi, stage 1 4Psi+K*Psi/N, stage 2 2Psi+(2+K)Psi/N, stage 3 (4+K)Psi/N.
    precision "fp32": 4-byte parameters and gradients, no master copy (default K = 8, Adam's two moments).
    offload_optimizer (stages 1-3; True or "cpu") moves the K*Psi/N optimizer bytes to "host" (in fp32 plus the
    host's own 4*Psi/N copy of the shard, which the optimizer steps); "nvme" moves the same bytes to "nvme" (the
    files; the host keeps only tile buffers, a config choice not counted here); offload_param (stage 3; True or
    "cpu") moves the parameter shard to "host", "nvme" to "nvme" (less the host cache, max_in_cpu, not counted).
    hpz_partition_size k > 1 (ZeRO++ hpZ, stage 3): a secondary copy of the working weights over groups of k ranks,
    width * Psi / k more per device, under "hpz_secondary".
    bf16_optimizer_states (mixed only): Adam's moments in bf16, K 12 -> 8. bf16_master_weights_and_grads: the master
    in bf16, which on the device is the working copy itself (K loses all 4 master bytes) and offloaded a 2-byte copy.
    Returns {"params", "grads", "optimizer_states", ["hpz_secondary",] "total", "host"[, "nvme"]}.
    """
    if offload_optimizer not in (False, True, "none", "cpu", "nvme"):
        raise ValueError(f"offload_optimizer must be False, True, 'cpu' or 'nvme', got {offload_optimizer!r}")
    if offload_param not in (False, True, "none", "cpu", "nvme"):
        raise ValueError(f"offload_param must be False, True, 'cpu' or 'nvme', got {offload_param!r}")
    nvme = offload_optimizer == "nvme"
    params_nvme = offload_param == "nvme"
    offload_optimizer = offload_optimizer not in (False, "none")
    offload_param = offload_param not in (False, "none")
    if (bf16_optimizer_states or bf16_master_weights_and_grads) and (
            precision != "mixed" or optimizer_bytes_per_param is not None):
        raise ValueError("bf16_optimizer_states / bf16_master_weights_and_grads describe mixed-precision bf16 training "
                         "with zkern's Adam: use precision='mixed' and leave optimizer_bytes_per_param unset")
    match precision:
        case "mixed":
            master = (2 if offload_optimizer not in (False, "none") else 0) if bf16_master_weights_and_grads else 4
            width, k = 2, (master + (4 if bf16_optimizer_states else 8) if optimizer_bytes_per_param is None
                           else optimizer_bytes_per_param)
        case "fp32":
            width, k = 4, 8 if optimizer_bytes_per_param is None else optimizer_bytes_per_param
        case _:
            raise ValueError(f"precision must be 'mixed' or 'fp32', got {precision!r}")
    if world_size < 1 or num_params < 0:
        raise ValueError(f"need world_size >= 1 and num_params >= 0, got {world_size} and {num_params}")
    n = world_size
    match stage:
        case 0:
            params, grads, opt = width * num_params, width * num_params, k * num_params
        case 1:
            params, grads, opt = width * num_params, width * num_params, k * num_params / n
        case 2:
            params, grads, opt = width * num_params, width * num_params / n, k * num_params / n
        case 3:
            params, grads, opt = width * num_params / n, width * num_params / n, k * num_params / n
        case _:
            raise ValueError(f"stage must be 0, 1, 2 or 3, got {stage}")
    if offload_optimizer and stage == 0:
        raise ValueError("offload_optimizer needs ZeRO stage 1, 2 or 3")
    if offload_param and stage != 3:
        raise ValueError("offload_param needs ZeRO stage 3")
    host = 0.0
    if offload_optimizer:
        host, opt = host + opt, 0.0
        if precision == "fp32":  # the host steps its own fp32 copy of the shard; the device keeps its parameters
            host += 4 * num_params / n
    if hpz_partition_size < 1 or n % hpz_partition_size:
        raise ValueError(f"hpz_partition_size ({hpz_partition_size}) must be >= 1 and divide the world size ({n})")
    if hpz_partition_size > 1 and stage != 3:
        raise ValueError("hpz_partition_size (hpZ) needs ZeRO stage 3")
    params_host = params
    if offload_param:
        host, params = host + params, 0.0
    out = {"params": params, "grads": grads, "optimizer_states": opt}
    if hpz_partition_size > 1:
        out["hpz_secondary"] = width * num_params / hpz_partition_size
    out = {key: int(round(v)) for key, v in out.items()}
    out["total"] = sum(out.values())
    if nvme or params_nvme:  # what sits in the files; the host keeps the rest
        on_disk = (host - (params_host if offload_param else 0) if nvme else 0) + (params_host if params_nvme else 0)
        out["host"] = int(round(host - on_disk))
        out["nvme"] = int(round(on_disk))
        return out
    out["host"] = int(round(host))
    return out
