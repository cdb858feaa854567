"""Who orthogonalizes each Muon matrix, and how the matrices that span ranks travel (optim/muon.py's plan).

    python -m pytest tests/optim/test_muon.py -q

exchange_ranges tells every rank where every rank's pieces of the Muon matrices lie (once, at set_layout). plan
marks the matrices no rank holds whole, gives each one owner among the ranks holding a piece of it (the largest
first, each to the holder with the least Newton-Schulz work so far, counting the matrices it holds whole; ties to
the holder with the most of it, whose pieces need not travel), and packs them into buckets: in each, every rank
sends its pieces to their owners in one all-to-all, and each owner sends the results back in another. Every rank
computes the same plan from the same table, so every rank issues the same collectives in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zkern.optim.newton_schulz import ns_work

ASSEMBLY_BUCKET = 1 << 24  # elements of the spanning matrices per bucket (a larger matrix goes alone)


@dataclass(frozen=True)
class Ranks:
    """How an optimizer reaches the other ranks: total(t) sums t over them in place; gather(out, inp) puts every rank's
    inp (equal sizes) into out in rank order; exchange(out, inp, out_splits, inp_splits) sends inp's consecutive
    inp_splits[r] elements to rank r and receives out_splits[r] elements from each rank r into out, in rank order
    (an all-to-all)."""

    rank: int
    world: int
    total: Callable[[torch.Tensor], None]
    gather: Callable[[torch.Tensor, torch.Tensor], None]
    exchange: Callable[[torch.Tensor, torch.Tensor, list[int], list[int]], None]


@dataclass
class Bucket:
    """Spanning matrices whose pieces go to their owners in one all-to-all, the owners' results coming back in
    another. send: this rank's pieces of them, (matrix index, first element, numel, offset in the send buffer),
    grouped by owner in rank order; sends[o]: the elements sent to rank o. owned: the matrices this rank owns, each
    with where every rank's pieces land in the receive buffer (first element, numel, offset); receives[r]: the
    elements received from rank r. The results go back the same way reversed: each piece's slice of the result
    lands at the offset the piece was sent from."""

    matrices: list[int]
    send: list[tuple[int, int, int, int]] = field(default_factory=list)
    sends: list[int] = field(default_factory=list)
    owned: dict[int, list[tuple[int, int, int]]] = field(default_factory=dict)
    receives: list[int] = field(default_factory=list)


@dataclass
class Matrix:
    """One Muon parameter: its matrix shape and this rank's pieces of it (group, piece index, first element, numel)."""

    index: int  # the trainable parameter's index (the same on every rank)
    shape: tuple[int, int]
    pieces: list[tuple[int, int, int, int]]
    spans_ranks: bool = False  # no rank holds all of it: assembled at its owner
    owner: int = -1  # the rank that orthogonalizes it, where it spans ranks

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def exchange_ranges(matrices: dict[int, Matrix], ranks: Ranks, device) -> list[list[tuple[int, int, int]]]:
    """Every rank's pieces of the Muon matrices, [rank] -> [(matrix index, first element, numel)] (collective: one
    all-reduce of counts, one all-gather of ranges)."""
    mine = [(m.index, start, numel) for m in matrices.values() for _, _, start, numel in m.pieces if numel]
    counts = torch.zeros(ranks.world, dtype=torch.int64, device=device)
    counts[ranks.rank] = len(mine)
    ranks.total(counts)
    longest = max(int(counts.max()), 1)
    table = torch.full((longest, 3), -1, dtype=torch.int64, device=device)
    if mine:
        table[:len(mine)] = torch.tensor(mine, dtype=torch.int64)
    every = torch.empty(ranks.world * longest * 3, dtype=torch.int64, device=device)
    ranks.gather(every, table.view(-1))
    rows = every.view(ranks.world, longest, 3).tolist()
    return [[tuple(row) for row in rows[r][:int(counts[r])]] for r in range(ranks.world)]


def plan(matrices: dict[int, Matrix], held: list[list[tuple[int, int, int]]], rank: int) -> list[Bucket]:
    """Marks each matrix's spans_ranks and owner, and returns the buckets of the spanning ones with this rank's part
    of each (the module docstring)."""
    world = len(held)
    by_matrix: dict[int, list[list[tuple[int, int]]]] = {j: [[] for _ in held] for j in matrices}
    for r, rows in enumerate(held):
        for j, start, numel in rows:
            by_matrix[j][r].append((start, numel))
    load = [0] * world  # each rank's Newton-Schulz work: the matrices it holds whole, then those it owns
    spanning = []
    for j, m in matrices.items():
        per_rank = [sum(n for _, n in ranges) for ranges in by_matrix[j]]
        if max(per_rank) != m.numel and sum(per_rank) != m.numel:
            raise ValueError(f"Muon: the ranks' pieces of trainable parameter {j} cover {sum(per_rank)} of its "
                             f"{m.numel} elements")
        m.spans_ranks = max(per_rank) < m.numel
        if m.spans_ranks:
            spanning.append((j, per_rank))
        else:
            for r in range(world):
                load[r] += ns_work(m.shape) if per_rank[r] == m.numel else 0
    for j, per_rank in sorted(spanning, key=lambda item: (-ns_work(matrices[item[0]].shape), item[0])):
        m = matrices[j]
        m.owner = min((r for r in range(world) if per_rank[r]), key=lambda r: (load[r], -per_rank[r], r))
        load[m.owner] += ns_work(m.shape)
    buckets: list[Bucket] = []
    size = 0
    for j, _ in spanning:
        if not buckets or size + matrices[j].numel > ASSEMBLY_BUCKET:
            buckets.append(Bucket([]))
            size = 0
        buckets[-1].matrices.append(j)
        size += matrices[j].numel
    for b in buckets:
        b.sends, b.receives = [0] * world, [0] * world
        at = 0
        for owner in range(world):  # what this rank sends each owner: its pieces of the owner's matrices
            for j in (j for j in b.matrices if matrices[j].owner == owner):
                for start, numel in sorted(by_matrix[j][rank]):
                    b.send.append((j, start, numel, at))
                    at += numel
                    b.sends[owner] += numel
        at = 0
        b.owned = {j: [] for j in b.matrices if matrices[j].owner == rank}
        for r in range(world):  # what each rank sends this one, in the order it sends it
            for j in b.owned:
                for start, numel in sorted(by_matrix[j][r]):
                    b.owned[j].append((start, numel, at))
                    at += numel
                    b.receives[r] += numel
    return buckets
