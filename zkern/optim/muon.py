"""Muon with an auxiliary AdamW over a rank's shard pieces, as DeepSpeed's MuonWithAuxAdam: each param group is a Muon
group (use_muon: hidden matrices) or an AdamW group (the rest).

    python -m pytest tests/optim/test_muon.py -q

A Muon group's momentum is element-wise, so each rank keeps it for its own pieces, as Adam's moments. Newton-Schulz
is not: it needs each matrix whole. A flat shard holds most matrices whole on one rank (stages 1-2 cut a flat
group only at the ranks' boundaries; stage 3 cuts every unit into world-many chunks, so there a matrix spans the
few ranks whose chunks cover it). So ownership follows the shard: the ranks that hold a piece of a matrix are its
owners. A matrix one rank holds whole is orthogonalized there with no communication. The matrices that span ranks
are assembled in buckets, one all-gather each: every rank sends its pieces of the bucket's matrices packed end to
end (padded to the longest rank's share), and each holder places every rank's pieces where they belong, then
orthogonalizes the matrix and applies its own slice (the same input on each holder, so the same output). That is
(N - 1) / N of the bucket per rank, half of what an all-reduce of zero-padded matrices sends. A rank never
orthogonalizes a matrix it holds none of: at stages 1-3 the Newton-Schulz work is spread over the ranks, at stage 0
(every rank holds every piece) each rank repeats all of it, as torch's Muon under DDP does. Where every rank's
pieces lie is exchanged once, at set_layout (one all-reduce of counts, one all-gather of ranges), so every rank
issues the same collectives in the same order each step.

The update is torch.optim.Muon's: buf <- lerp(buf, g, 1 - momentum); u = lerp(g, buf, momentum) (Nesterov) or buf;
O = NS(u); w <- w (1 - lr wd) - lr sqrt(max(1, rows / cols)) O. A parameter of more than two dimensions is the
matrix (shape[0], numel / shape[0]), as DeepSpeed views convolution filters. ns_method "standard" is torch's
quintic iteration in bf16; "gram" (DeepSpeed's default) iterates on the Gram matrix of the wider side's rows, in
fp16 on a GPU and fp32 elsewhere. The AdamW groups are torch.optim.AdamW's arithmetic, element-wise on the pieces.
Newton-Schulz runs on `device` (the training device), also when the pieces live on the host (offload_optimizer).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zkern.reference import adam_step_

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")
ASSEMBLY_BUCKET = 1 << 24  # elements of the spanning matrices assembled per all-gather (a larger matrix goes alone)


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The matrix Muon orthogonalizes for a parameter of this shape (2 or more dimensions)."""
    rows = shape[0]
    return rows, math.prod(shape) // rows


def newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """torch.optim.Muon's orthogonalization: the quintic iteration in bf16 on the wide orientation (bf16 result)."""
    x = g.bfloat16()
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    a, b, c = NS_COEFFICIENTS
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def gram_newton_schulz(g: torch.Tensor, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The same quintic map, iterated on the small Gram matrix R = X X^T (n x n, n the short side) and applied to X
    once at the end (DeepSpeed's "gram" method: far fewer flops when the matrix is wide). The accumulated left factor
    Q is applied and the iteration restarted from Q X after two steps, which keeps half precision stable."""
    dtype = torch.float16 if g.is_cuda else torch.float32
    x = g.to(dtype)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x = x / (x.norm() + eps)
    a, b, c = NS_COEFFICIENTS
    n, m = x.shape
    if m <= n:  # square: nothing to gain
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if tall else x
    r, q, restart = x @ x.T, None, 2
    for i in range(steps):
        if i == restart:
            x = q @ x
            r, q = x @ x.T, None
        z = b * r + c * r @ r
        if q is None:
            q = z.clone()
            q.diagonal().add_(a)
        else:
            q = a * q + z @ q
        if i < steps - 1 and i + 1 != restart:
            rz = a * r + z @ r
            r = a * rz + z @ rz
    return (x.T @ q.T) if tall else (q @ x)


@dataclass(frozen=True)
class Ranks:
    """How an optimizer reaches the other ranks: total(t) sums t over them in place; gather(out, inp) puts every rank's
    inp (equal sizes) into out in rank order."""

    rank: int
    world: int
    total: Callable[[torch.Tensor], None]
    gather: Callable[[torch.Tensor, torch.Tensor], None]


@dataclass
class _Bucket:
    """Spanning matrices assembled by one all-gather: `share` elements from each rank; segments[r]: where rank r's
    pieces go, (matrix index, first element, numel, offset in r's share)."""

    matrices: list[int]
    share: int
    segments: list[list[tuple[int, int, int, int]]] = field(default_factory=list)


@dataclass
class _Matrix:
    """One Muon parameter: its matrix shape and this rank's pieces of it (group, piece index, first element, numel)."""

    index: int  # the trainable parameter's index (the same on every rank)
    shape: tuple[int, int]
    pieces: list[tuple[int, int, int, int]]
    spans_ranks: bool = False  # no rank holds all of it: assembled by an all-gather

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


class ShardMuon(torch.optim.Optimizer):
    """Muon for the groups with use_muon, AdamW for the others, over shard pieces (module docstring)."""

    def __init__(self, groups: list[dict], *, device: torch.device | None = None):
        """groups: torch param-group dicts whose params are the pieces; a Muon group has lr, momentum, weight_decay,
        nesterov, ns_method, ns_steps; an AdamW group lr, betas, eps, weight_decay. Each piece is a whole parameter
        until set_layout says otherwise."""
        for g in groups:
            if g.get("use_muon") and g.get("ns_method") not in NS_METHODS:
                raise ValueError(f"Muon's ns_method must be one of {NS_METHODS}, got {g.get('ns_method')!r}")
        super().__init__(groups, {})
        self.device = device
        self.ranks: Ranks | None = None
        self._matrices: dict[int, _Matrix] | None = None  # until set_layout: each param is its own whole matrix
        self._buckets: list[_Bucket] = []

    def _whole_params_layout(self) -> None:
        """Without set_layout (the optimizer over whole parameters, one process): each param is its own matrix."""
        pieces, shapes, muon = [], [], set()
        for g in self.param_groups:
            pieces.append([])
            for p in g["params"]:
                pieces[-1].append((len(shapes), 0))
                if g.get("use_muon"):
                    muon.add(len(shapes))
                shapes.append(p.shape)
        self.set_layout(pieces, shapes, muon, None)

    def set_layout(self, pieces: list[list[tuple[int, int]]], shapes: list[torch.Size], muon: set[int],
                   ranks: Ranks | None) -> None:
        """pieces[group][k]: (trainable parameter index, first element of it the piece holds); shapes: every trainable
        parameter's full shape; muon: the indices of the Muon parameters (the same on every rank); ranks: the other
        ranks (None where every rank holds every piece whole). A collective when ranks is given: every rank learns
        where the others' pieces of each matrix lie."""
        for j in muon:
            if len(shapes[j]) < 2:
                raise ValueError(f"Muon orthogonalizes matrices; trainable parameter {j} has shape "
                                 f"{tuple(shapes[j])}: train it in an AdamW group (use_muon False)")
        self.ranks, self._buckets = ranks, []
        self._matrices = {j: _Matrix(j, matrix_shape(shapes[j]), []) for j in sorted(muon)}
        for gi, g in enumerate(self.param_groups):
            for k, (j, start) in enumerate(pieces[gi]):
                if j in self._matrices:
                    if not g.get("use_muon"):
                        raise ValueError(f"trainable parameter {j} is a Muon parameter in an AdamW group")
                    self._matrices[j].pieces.append((gi, k, start, g["params"][k].numel()))
        if ranks is not None and self._matrices:
            self._plan_assembly(self._exchange_ranges(ranks))

    def _exchange_ranges(self, ranks: Ranks) -> list[list[tuple[int, int, int]]]:
        """Every rank's pieces of the Muon matrices, [rank] -> [(matrix index, first element, numel)]."""
        mine = [(m.index, start, numel) for m in self._matrices.values() for _, _, start, numel in m.pieces if numel]
        counts = torch.zeros(ranks.world, dtype=torch.int64, device=self.device)
        counts[ranks.rank] = len(mine)
        ranks.total(counts)
        longest = max(int(counts.max()), 1)
        table = torch.full((longest, 3), -1, dtype=torch.int64, device=self.device)
        if mine:
            table[:len(mine)] = torch.tensor(mine, dtype=torch.int64)
        every = torch.empty(ranks.world * longest * 3, dtype=torch.int64, device=self.device)
        ranks.gather(every, table.view(-1))
        rows = every.view(ranks.world, longest, 3).tolist()
        return [[tuple(row) for row in rows[r][:int(counts[r])]] for r in range(ranks.world)]

    def _plan_assembly(self, held: list[list[tuple[int, int, int]]]) -> None:
        """Which matrices span ranks (no rank holds all of one), and their buckets: the same plan on every rank."""
        by_matrix: dict[int, list[list[tuple[int, int]]]] = {j: [[] for _ in held] for j in self._matrices}
        for r, rows in enumerate(held):
            for j, start, numel in rows:
                by_matrix[j][r].append((start, numel))
        bucket: _Bucket | None = None
        size = 0
        for j, m in self._matrices.items():
            per_rank = [sum(n for _, n in ranges) for ranges in by_matrix[j]]
            if max(per_rank) != m.numel and sum(per_rank) != m.numel:
                raise ValueError(f"Muon: the ranks' pieces of trainable parameter {j} cover {sum(per_rank)} of its "
                                 f"{m.numel} elements")
            m.spans_ranks = max(per_rank) < m.numel
            if not m.spans_ranks:
                continue
            if bucket is None or size + m.numel > ASSEMBLY_BUCKET:
                bucket, size = _Bucket([], 0, [[] for _ in held]), 0
                self._buckets.append(bucket)
            bucket.matrices.append(j)
            size += m.numel
        for b in self._buckets:
            for r in range(len(held)):
                at = 0
                for j in b.matrices:
                    for start, numel in sorted(by_matrix[j][r]):
                        b.segments[r].append((j, start, numel, at))
                        at += numel
                b.share = max(b.share, at)

    def spanning_numel(self) -> int:
        """Elements of the matrices assembled across ranks each step (what Muon adds to the step's traffic)."""
        return sum(m.numel for m in self._matrices.values() if m.spans_ranks)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("zkern's Muon takes no closure")
        if self._matrices is None:
            self._whole_params_layout()
        updates: dict[tuple[int, int], torch.Tensor] = {}  # (group, piece) -> its NS input
        for gi, g in enumerate(self.param_groups):
            if not g.get("use_muon"):
                self._adamw(g)
                continue
            for k, p in enumerate(g["params"]):
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - g["momentum"])
                updates[(gi, k)] = p.grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
        for m in self._matrices.values():
            if not m.spans_ranks and m.pieces and all((gi, k) in updates for gi, k, _, _ in m.pieces):
                self._apply(m, self._orthogonalized(m, self._whole_here(m, updates)))
        for b in self._buckets:
            self._assemble(b, updates)
        return None

    def _assemble(self, b: _Bucket, updates: dict) -> None:
        """One all-gather of every rank's pieces of b's matrices; each holder orthogonalizes the matrices it holds a
        piece of (with a gradient: a parameter without one on any rank has none on all) and applies its slice."""
        ranks = self.ranks
        share = torch.zeros(b.share, dtype=torch.float32, device=self.device)
        mine = {(m.index, start): (gi, k) for m in (self._matrices[j] for j in b.matrices)
                for gi, k, start, _ in m.pieces}
        for j, start, numel, at in b.segments[ranks.rank]:
            u = updates.get(mine[(j, start)])
            if u is not None:
                share[at:at + numel].copy_(u.reshape(-1))
        every = torch.empty(ranks.world * b.share, dtype=torch.float32, device=self.device)
        ranks.gather(every, share)
        shares = every.view(ranks.world, b.share)
        wanted = [j for j in b.matrices if self._matrices[j].pieces and all(
            (gi, k) in updates for gi, k, _, _ in self._matrices[j].pieces)]
        wholes = {j: torch.empty(self._matrices[j].numel, dtype=torch.float32, device=self.device) for j in wanted}
        for r in range(ranks.world):
            for j, start, numel, at in b.segments[r]:
                if j in wholes:
                    wholes[j][start:start + numel].copy_(shares[r, at:at + numel])
        for j, whole in wholes.items():
            self._apply(self._matrices[j], self._orthogonalized(self._matrices[j], whole))

    def _whole_here(self, m: _Matrix, updates: dict) -> torch.Tensor:
        """The NS input of a matrix this rank holds whole, flat on `device`: the one piece's own update where a
        single piece is the matrix (no copy on the same device), else the pieces put together."""
        if len(m.pieces) == 1:
            gi, k, _, _ = m.pieces[0]
            return updates[(gi, k)].reshape(-1).to(self.device)
        whole = torch.zeros(m.numel, dtype=torch.float32, device=self.device)
        self._add_pieces(m, updates, whole)
        return whole

    @staticmethod
    def _add_pieces(m: _Matrix, updates: dict, whole: torch.Tensor) -> None:
        """This rank's pieces of m's NS input into its place in `whole` (zeros elsewhere); nothing for a piece
        without a gradient (every holder agrees: a parameter without one on any rank has none on all)."""
        for gi, k, start, numel in m.pieces:
            u = updates.get((gi, k))
            if u is not None:
                whole[start:start + numel].copy_(u.reshape(-1))

    def _orthogonalized(self, m: _Matrix, whole: torch.Tensor) -> torch.Tensor:
        g = self.param_groups[m.pieces[0][0]]
        fn = newton_schulz if g["ns_method"] == "standard" else gram_newton_schulz
        return fn(whole.view(m.shape), g["ns_steps"]).reshape(-1)

    @staticmethod
    def lr_factor(shape: tuple[int, int]) -> float:
        """sqrt(max(1, rows / cols)): the update's RMS the same for every shape (torch's adjust_lr_fn "original")."""
        rows, cols = shape
        return math.sqrt(max(1.0, rows / cols))

    def _apply(self, m: _Matrix, ortho: torch.Tensor) -> None:
        """w <- w (1 - lr wd) - lr lr_factor O on each of this rank's pieces of m."""
        for gi, k, start, numel in m.pieces:
            g = self.param_groups[gi]
            p = g["params"][k]
            p.mul_(1 - g["lr"] * g["weight_decay"])
            p.add_(ortho[start:start + numel].to(p.device).view(p.shape), alpha=-g["lr"] * self.lr_factor(m.shape))

    def _adamw(self, g: dict) -> None:
        """torch.optim.AdamW's single-tensor arithmetic (zkern.reference.adam_step_) on each piece with a gradient;
        the step counted as a tensor, as torch counts it, so checkpoints carry over between the two."""
        for p in g["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            adam_step_(p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=int(state["step"]), lr=g["lr"],
                       betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"], adamw=True)
