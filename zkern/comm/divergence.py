"""Stage 3 across ranks: every rank must issue the same all-gathers in the same order. This file says what each
rank is about to do (a tag), checks that the ranks agree, and works out what to gather together when they do not.

    python -m pytest tests/stage3/test_stage3_moe.py -q

Two checks, one cheap and one exact:
  - verifying passes (a step's first pass, passes after the gather order changed, and every pass after a
    mismatch until the next merge): before each gather, the ranks exchange a tag (kind, unit, module) of three
    int64 and compare them on the host. A mismatch is found before any data moves.
  - every pass: each rank folds the units it gathers into a running signature (a polynomial hash modulo
    SIGNATURE_PRIME, pure host arithmetic), which the step's existing control all-reduce compares
    (engine.py); a mismatch there discards the step before any rank applies it.

Tags: (GATHER, unit, requesting module) before a gather; (END_FORWARD|END_BACKWARD, -1, -1) when a pass ends;
(ATTACH, module, -1) to agree on the module a merge is attached to; (PIN, unit, modifier rank) for
GatheredParameters. Module and unit numbers are positions in named_modules() and the unit plan, equal on every
rank.
"""

from __future__ import annotations

import enum

import torch

from zkern.comm.collectives import Comm

# 2**19 - 1 is prime. With signatures below 2**19 and at most 2**13 ranks, the sums and sums of squares the
# control all-reduce forms stay below 2**53, so float64 carries them exactly.
SIGNATURE_PRIME = 524287
MAX_SIGNATURE_WORLD = 8192


class TagKind(enum.IntEnum):
    GATHER = 1
    END_FORWARD = 2
    END_BACKWARD = 3
    ATTACH = 4
    PIN = 5


Tag = tuple[int, int, int]


def exchange_tags(comm: Comm, tag: Tag, device: torch.device) -> list[Tag]:
    """Every rank's tag, by rank (a collective; one host synchronisation). World size 1: just this one."""
    if comm.world == 1:
        return [tag]
    mine = torch.tensor(tag, dtype=torch.int64, device=device)
    out = torch.empty(3 * comm.world, dtype=torch.int64, device=device)
    comm.all_gather(out, mine, "stage-3 agreement on the next collective", kind="control")
    values = out.tolist()
    return [tuple(values[3 * r:3 * r + 3]) for r in range(comm.world)]


def fold_signature(signature: int, unit: int) -> int:
    """The running signature after gathering `unit` (order-sensitive)."""
    return (signature * 1000003 + unit + 1) % SIGNATURE_PRIME


def signatures_differ(total: float, total_sq: float, mine: int, world: int) -> bool:
    """Did any rank's signature differ, given the sum and the sum of squares over ranks? sum (s_r - s)^2 = 0
    exactly when every s_r equals s; every term is an integer below 2**53, so the float64 arithmetic is exact
    and every rank reaches the same answer."""
    return total_sq - 2 * mine * total + world * mine * mine != 0


def path_under(path: str, prefix: str) -> bool:
    """Is module path `path` the module `prefix` or inside it ("" is the root)?"""
    return prefix == "" or path == prefix or path.startswith(prefix + ".")


def common_prefix(paths: list[str]) -> str:
    """The deepest module path that contains every path (by whole components)."""
    parts = [p.split(".") if p else [] for p in paths]
    out = []
    for column in zip(*parts):
        if any(c != column[0] for c in column):
            break
        out.append(column[0])
    return ".".join(out)


def describe_tag(tag: Tag, unit_names: list[str], module_names: list[str]) -> str:
    kind, a, b = tag
    match kind:
        case TagKind.GATHER:
            by = module_names[b] if 0 <= b < len(module_names) else "zkern"
            return f"all-gather unit '{unit_names[a] or '<root>'}' for module '{by or '<root>'}'"
        case TagKind.END_FORWARD:
            return "end its forward pass"
        case TagKind.END_BACKWARD:
            return "end its backward pass"
        case TagKind.ATTACH:
            return f"gather a merged group in module '{module_names[a] or '<root>'}'"
        case TagKind.PIN:
            return f"gather unit '{unit_names[a] or '<root>'}' for GatheredParameters"
        case _:
            return f"an unknown collective {tag}"


def describe_mismatch(tags: list[Tag], unit_names: list[str], module_names: list[str]) -> str:
    return "; ".join(f"rank {r} was about to {describe_tag(t, unit_names, module_names)}" for r, t in enumerate(tags))
