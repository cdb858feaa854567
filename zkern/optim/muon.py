"""Muon with an auxiliary AdamW over a rank's shard pieces, as DeepSpeed's MuonWithAuxAdam: each param group is a Muon
group (use_muon: hidden matrices) or an AdamW group (the rest).

    python -m pytest tests/optim/test_muon.py -q

A Muon group's momentum is element-wise, so each rank keeps it for its own pieces, as Adam's moments. Newton-Schulz
is not: it needs each matrix whole. A flat shard holds most matrices whole on one rank (stages 1-2 cut a flat
group only at the ranks' boundaries; stage 3 cuts every unit into world-many chunks, so there a matrix spans the
few ranks whose chunks cover it). So ownership follows the shard: the ranks that hold a piece of a matrix are its
owners. A matrix one rank holds whole is orthogonalized there with no communication; one that spans ranks is
assembled on each of its holders by one all-reduce per bucket of such matrices (each rank adds its pieces into a
zeroed bucket: the sum over disjoint pieces is exact), and each holder orthogonalizes it and applies its own
slice (the same input on each holder, so the same output). A rank never orthogonalizes a matrix it holds none of:
at stage 3 the Newton-Schulz work is spread over the ranks, at stage 0 (every rank holds every piece) each rank
repeats all of it, as torch's Muon under DDP does. Which matrices span ranks is agreed once, at set_layout (one
all-reduce), so every rank issues the same collectives in the same order each step.

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
from dataclasses import dataclass

import torch

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_METHODS = ("gram", "standard")
ASSEMBLY_BUCKET = 1 << 24  # elements of the spanning matrices assembled per all-reduce (a larger matrix goes alone)


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


@dataclass
class _Matrix:
    """One Muon parameter: its matrix shape and this rank's pieces of it (group, piece index, first element, numel)."""

    index: int  # the trainable parameter's index (the same on every rank)
    shape: tuple[int, int]
    pieces: list[tuple[int, int, int, int]]
    spans_ranks: bool = False  # some rank holds only part of it: assembled by the all-reduce

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
        self.reduce: Callable[[torch.Tensor], None] | None = None
        self._matrices: dict[int, _Matrix] | None = None  # until set_layout: each param is its own whole matrix

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
                   reduce: Callable[[torch.Tensor], None] | None) -> None:
        """pieces[group][k]: (trainable parameter index, first element of it the piece holds); shapes: every trainable
        parameter's full shape; muon: the indices of the Muon parameters (the same on every rank); reduce: sums a
        tensor over the ranks in place (None where every rank holds every piece whole). A collective when reduce is
        given: the ranks agree which matrices span ranks."""
        for j in muon:
            if len(shapes[j]) < 2:
                raise ValueError(f"Muon orthogonalizes matrices; trainable parameter {j} has shape "
                                 f"{tuple(shapes[j])}: train it in an AdamW group (use_muon False)")
        self.reduce = reduce
        self._matrices = {j: _Matrix(j, matrix_shape(shapes[j]), []) for j in sorted(muon)}
        for gi, g in enumerate(self.param_groups):
            for k, (j, start) in enumerate(pieces[gi]):
                if j in self._matrices:
                    if not g.get("use_muon"):
                        raise ValueError(f"trainable parameter {j} is a Muon parameter in an AdamW group")
                    self._matrices[j].pieces.append((gi, k, start, g["params"][k].numel()))
        if reduce is None or not self._matrices:
            return
        partial = torch.tensor([float(0 < sum(p[3] for p in m.pieces) < m.numel) for m in self._matrices.values()],
                               dtype=torch.float32, device=self.device)
        reduce(partial)
        for m, flag in zip(self._matrices.values(), partial.tolist()):
            m.spans_ranks = flag > 0

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
        spanning: list[_Matrix] = []
        for m in self._matrices.values():
            if m.spans_ranks:
                spanning.append(m)
            elif m.pieces and all((gi, k) in updates for gi, k, _, _ in m.pieces):
                whole = torch.zeros(m.numel, dtype=torch.float32, device=self.device)
                self._add_pieces(m, updates, whole)
                self._apply(m, self._orthogonalized(m, whole))
        for bucket in self._buckets(spanning):
            flat = torch.zeros(sum(m.numel for m in bucket), dtype=torch.float32, device=self.device)
            at = 0
            for m in bucket:
                self._add_pieces(m, updates, flat[at:at + m.numel])
                at += m.numel
            self.reduce(flat)  # each holder now has every matrix of the bucket whole
            at = 0
            for m in bucket:
                if m.pieces and all((gi, k) in updates for gi, k, _, _ in m.pieces):
                    self._apply(m, self._orthogonalized(m, flat[at:at + m.numel]))
                at += m.numel
        return None

    @staticmethod
    def _buckets(spanning: list[_Matrix]) -> list[list[_Matrix]]:
        """The spanning matrices, in index order, in buckets of at most ASSEMBLY_BUCKET elements (a larger one
        alone): the same on every rank."""
        out: list[list[_Matrix]] = []
        size = 0
        for m in spanning:
            if not out or size + m.numel > ASSEMBLY_BUCKET:
                out.append([])
                size = 0
            out[-1].append(m)
            size += m.numel
        return out

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
        """torch.optim.AdamW's single-tensor arithmetic on each piece with a gradient (step counted as a tensor,
        as torch counts it, so checkpoints carry over between the two)."""
        b1, b2 = g["betas"]
        for p in g["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = state["step"].item()
            m, v = state["exp_avg"], state["exp_avg_sq"]
            p.mul_(1 - g["lr"] * g["weight_decay"])
            m.lerp_(p.grad, 1 - b1)
            v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
            denom = (v.sqrt() / math.sqrt(1 - b2 ** step)).add_(g["eps"])
            p.addcdiv_(m, denom, value=-g["lr"] / (1 - b1 ** step))
