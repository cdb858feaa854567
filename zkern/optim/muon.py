"""Muon with an auxiliary AdamW over a rank's shard pieces, as DeepSpeed's MuonWithAuxAdam: each param group is a Muon
group (use_muon: hidden matrices) or an AdamW group (the rest).

    python -m pytest tests/optim/test_muon.py -q

A Muon group's momentum is element-wise, so each rank keeps it for its own pieces, as Adam's moments. Newton-Schulz
is not: it needs each matrix whole. A flat shard holds most matrices whole on one rank (stages 1-2 cut a flat
group only at the ranks' boundaries; stage 3 cuts every unit into world-many chunks, so there a matrix spans the
few ranks whose chunks cover it). A matrix one rank holds whole is orthogonalized there with no communication.
Each matrix that spans ranks gets one owner among the ranks holding a piece of it (muon_owners.py says which). In
buckets, every rank sends its pieces of the bucket's matrices to their owners (one
all-to-all), each owner orthogonalizes its matrices once, and sends each holder its slices of the result (one
all-to-all back, in the iteration's own dtype: bf16 for "standard", so the values are exact). A rank sends each
element of its pieces it does not own once and receives each slice once, where an all-gather would hand every rank
the whole bucket; and each matrix is orthogonalized once, where every holder would repeat it. At stage 0 every rank
holds every piece and repeats all of it, as torch's Muon under DDP does. Where every rank's pieces lie is exchanged
once, at set_layout (one all-reduce of counts, one all-gather of ranges), and the owners follow from it the same on
every rank, so every rank issues the same collectives in the same order each step.

The step goes matrix by matrix (bucket by bucket for the spanning ones): a piece's momentum is stepped, its update
used and dropped before the next, so the step's transient memory is one matrix or one bucket, never the shard.

The update is torch.optim.Muon's: buf <- lerp(buf, g, 1 - momentum); u = lerp(g, buf, momentum) (Nesterov) or buf;
O = NS(u); w <- w (1 - lr wd) - lr sqrt(max(1, rows / cols)) O. A parameter of more than two dimensions is the
matrix (shape[0], numel / shape[0]), as DeepSpeed views convolution filters. ns_method "standard" is torch's
quintic iteration in bf16; "gram" (DeepSpeed's default) iterates on the Gram matrix of the wider side's rows, in
fp16 on a GPU and fp32 elsewhere. The AdamW groups are torch.optim.AdamW's arithmetic, element-wise on the pieces.
Newton-Schulz runs on `device` (the training device), also when the pieces live on the host (offload_optimizer).
"""

from __future__ import annotations

import math

import torch

from zkern.core.shard_groups import ShardGroup
from zkern.optim.muon_owners import Bucket, Matrix, Ranks, exchange_ranges, plan
from zkern.optim.newton_schulz import NS_METHODS, gram_newton_schulz, matrix_shape, newton_schulz, ns_dtype
from zkern.reference import adam_step_


class ShardMuon(torch.optim.Optimizer):
    """Muon for the groups with use_muon, AdamW for the others, over shard pieces (module docstring)."""

    def __init__(self, groups: list[dict], *, device: torch.device | None = None):
        """groups: torch param-group dicts whose params are the pieces; a Muon group has lr, momentum, weight_decay,
        nesterov, ns_method, ns_steps; an AdamW group lr, betas, eps, weight_decay. Each piece is a whole parameter
        until set_layout says otherwise."""
        methods = {g.get("ns_method") for g in groups if g.get("use_muon")}
        if not methods <= set(NS_METHODS) or len(methods) > 1:
            raise ValueError(f"Muon's ns_method must be one of {NS_METHODS}, the same in every group, got "
                             f"{sorted(map(str, methods))}")
        self.ns_method = methods.pop() if methods else "gram"  # what an owner's results travel back in (ns_dtype)
        super().__init__(groups, {})
        self.device = device
        self.ranks: Ranks | None = None
        self._matrices: dict[int, Matrix] | None = None  # until set_layout: each param is its own whole matrix
        self._buckets: list[Bucket] = []
        self._bound: tuple[dict, dict] | None = None  # step_shard's (gradient, out) views by (group, piece)

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
        self._matrices = {j: Matrix(j, matrix_shape(shapes[j]), []) for j in sorted(muon)}
        for gi, g in enumerate(self.param_groups):
            for k, (j, start) in enumerate(pieces[gi]):
                if j in self._matrices:
                    if not g.get("use_muon"):
                        raise ValueError(f"trainable parameter {j} is a Muon parameter in an AdamW group")
                    self._matrices[j].pieces.append((gi, k, start, g["params"][k].numel()))
        if ranks is not None and self._matrices:
            self._buckets = plan(self._matrices, exchange_ranges(self._matrices, ranks, self.device), ranks.rank)

    def spanning_numel(self) -> int:
        """Elements of the matrices assembled across ranks each step."""
        return sum(m.numel for m in self._matrices.values() if m.spans_ranks)

    def assembly_numel(self) -> tuple[int, int]:
        """What this rank sends each step for the spanning matrices: (elements of its pieces that go to other ranks'
        owners, elements of its own matrices' results that go back to their other holders)."""
        me = self.ranks.rank if self.ranks is not None else 0
        return (sum(sum(b.sends) - b.sends[me] for b in self._buckets),
                sum(sum(b.receives) - b.receives[me] for b in self._buckets))

    def owners(self) -> dict[int, int | None]:
        """Each Muon matrix (by trainable parameter index): the rank that orthogonalizes it where it spans ranks,
        None where each rank holding it holds it whole (and orthogonalizes it there)."""
        return {j: m.owner if m.spans_ranks else None for j, m in self._matrices.items()}

    # -- where a piece's values live (NvmeMuon keeps them in files) ---------------------------------------------
    def _load(self, p: torch.Tensor, name: str) -> torch.Tensor:
        """The values `name` ("master", "momentum_buffer", "exp_avg", "exp_avg_sq") of piece p, to update in place:
        the master is p itself; a state is p's own tensor in self.state, zeros until its first step."""
        if name == "master":
            return p
        state = self.state[p]
        if name not in state:
            state[name] = torch.zeros_like(p)
        return state[name]

    def _store(self, gi: int, k: int, p: torch.Tensor, name: str, values: torch.Tensor) -> None:
        """values (from _load, updated) are back where they belong: in memory they never left."""

    def _grad(self, gi: int, k: int, p: torch.Tensor) -> torch.Tensor | None:
        """Piece k of group gi's gradient in fp32: p.grad, or the chunk's slice step_shard bound (upcast and
        scaled here, one piece at a time)."""
        if self._bound is None:
            return p.grad
        view = self._bound[0].get((gi, k))
        if view is None:
            return None
        grad, scale = view
        return grad.float() * scale if grad.dtype != torch.float32 or scale != 1.0 else grad

    # -- the step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """One step over the pieces' .grad (or the gradients step_shard bound): AdamW on the AdamW groups' pieces,
        then each matrix this rank holds whole, then the spanning matrices bucket by bucket. A matrix's momentum
        and Newton-Schulz input exist only while it is updated, so the step's transient memory is one matrix, or
        one bucket of spanning ones, never the whole shard's."""
        if closure is not None:
            raise ValueError("zkern's Muon takes no closure")
        if self._matrices is None:
            self._whole_params_layout()
        for gi, g in enumerate(self.param_groups):
            if not g.get("use_muon"):
                self._adamw(gi, g)
        for m in self._matrices.values():
            if not m.spans_ranks and m.pieces:
                updates = self._updates(m)
                if self._stepped(m, updates):
                    self._apply(m, self._orthogonalized(m, self._whole_here(m, updates)))
        for b in self._buckets:
            self._assemble(b)
        return None

    @torch.no_grad()
    def step_shard(self, groups: list[ShardGroup], *, grad_scale: float, active: list[list[bool]]) -> None:
        """The engine's step over its shard groups (this optimizer's param groups are their pieces): each active
        piece's gradient is its slice of the chunk's gradient, times grad_scale (upcast one piece at a time, as
        the piece is updated), and each chunk's working copy (out) then takes the new values."""
        grads, outs = {}, {}
        for gi, g in enumerate(groups):
            for chunk in g.chunks:
                for index, start, numel in chunk.pieces:
                    if active[gi][index]:
                        grads[(gi, index)] = (chunk.grad[start:start + numel].view(g.pieces[index].shape),
                                              grad_scale)
                    if chunk.out is not None:
                        outs[(gi, index)] = chunk.out[start:start + numel]
        self._bound = (grads, outs)
        try:
            self.step()
        finally:
            self._bound = None
        self._refresh_outs(groups)

    def _refresh_outs(self, groups: list[ShardGroup]) -> None:
        """Each chunk's working copy <- its master (the whole chunk, padding included)."""
        for g in groups:
            for chunk in g.chunks:
                if chunk.out is not None:
                    chunk.out.copy_(chunk.param)

    def _updates(self, m: Matrix) -> dict[tuple[int, int], torch.Tensor]:
        """Each of this rank's pieces of m with a gradient: its momentum stepped (buf <- lerp(buf, g, 1 - momentum))
        and its Newton-Schulz input (Nesterov: lerp(g, buf, momentum); else buf), by (group, piece)."""
        out = {}
        for gi, k, _, _ in m.pieces:
            g = self.param_groups[gi]
            p = g["params"][k]
            grad = self._grad(gi, k, p)
            if grad is None:
                continue
            buf = self._load(p, "momentum_buffer")
            buf.lerp_(grad, 1 - g["momentum"])
            out[(gi, k)] = grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
            self._store(gi, k, p, "momentum_buffer", buf)
        return out

    def _assemble(self, b: Bucket) -> None:
        """b's spanning matrices: every rank sends its pieces of each to the matrix's owner (one all-to-all); each
        owner puts its matrices together, orthogonalizes them, and sends every holder its slices of the result (one
        all-to-all back, in the iteration's output dtype); each holder applies its slices. A matrix without a gradient
        (none on any rank: a parameter without one on any rank has none on all) is neither orthogonalized nor
        applied."""
        ranks = self.ranks
        updates = {}
        for j in b.matrices:
            updates.update(self._updates(self._matrices[j]))
        mine = {(m.index, start): (gi, k) for m in (self._matrices[j] for j in b.matrices)
                for gi, k, start, _ in m.pieces}
        send = torch.zeros(sum(b.sends), dtype=torch.float32, device=self.device)
        for j, start, numel, at in b.send:
            u = updates.get(mine[(j, start)])
            if u is not None:
                send[at:at + numel].copy_(u.reshape(-1))
        received = torch.empty(sum(b.receives), dtype=torch.float32, device=self.device)
        ranks.exchange(received, send, b.receives, b.sends)
        del send
        results = torch.zeros(sum(b.receives), dtype=ns_dtype(self.ns_method, self.device), device=self.device)
        for j, places in b.owned.items():
            m = self._matrices[j]
            if not self._stepped(m, updates):
                continue
            whole = torch.empty(m.numel, dtype=torch.float32, device=self.device)
            for start, numel, at in places:
                whole[start:start + numel].copy_(received[at:at + numel])
            ortho = self._orthogonalized(m, whole)
            for start, numel, at in places:
                results[at:at + numel].copy_(ortho[start:start + numel])
        del received
        back = torch.empty(sum(b.sends), dtype=results.dtype, device=self.device)
        ranks.exchange(back, results, b.sends, b.receives)
        for j, start, numel, at in b.send:
            m = self._matrices[j]
            if self._stepped(m, updates):
                gi, k = mine[(j, start)]
                self._apply_piece(gi, k, m.shape, back[at:at + numel])

    @staticmethod
    def _stepped(m: Matrix, updates: dict) -> bool:
        """Every piece of m this rank holds has its update (so every rank's has: see _assemble)."""
        return bool(m.pieces) and all((gi, k) in updates for gi, k, _, _ in m.pieces)

    def _whole_here(self, m: Matrix, updates: dict) -> torch.Tensor:
        """The NS input of a matrix this rank holds whole (every piece with its update), flat on `device`: the one
        piece's own update where a single piece is the matrix (no copy on the same device), else the pieces put
        together."""
        if len(m.pieces) == 1:
            gi, k, _, _ = m.pieces[0]
            return updates[(gi, k)].reshape(-1).to(self.device)
        whole = torch.zeros(m.numel, dtype=torch.float32, device=self.device)
        for gi, k, start, numel in m.pieces:
            whole[start:start + numel].copy_(updates[(gi, k)].reshape(-1))
        return whole

    def _orthogonalized(self, m: Matrix, whole: torch.Tensor) -> torch.Tensor:
        fn = newton_schulz if self.ns_method == "standard" else gram_newton_schulz
        return fn(whole.view(m.shape), self.param_groups[m.pieces[0][0]]["ns_steps"]).reshape(-1)

    @staticmethod
    def lr_factor(shape: tuple[int, int]) -> float:
        """sqrt(max(1, rows / cols)): the update's RMS the same for every shape (torch's adjust_lr_fn "original")."""
        rows, cols = shape
        return math.sqrt(max(1.0, rows / cols))

    def _apply(self, m: Matrix, ortho: torch.Tensor) -> None:
        """Each of this rank's pieces of m takes its slice of the orthogonalized update O (m's whole, flat)."""
        for gi, k, start, numel in m.pieces:
            self._apply_piece(gi, k, m.shape, ortho[start:start + numel])

    def _apply_piece(self, gi: int, k: int, shape: tuple[int, int], ortho: torch.Tensor) -> None:
        """w <- w (1 - lr wd) - lr lr_factor O for piece k of group gi, whose slice of O is `ortho`."""
        g = self.param_groups[gi]
        p = g["params"][k]
        w = self._load(p, "master")
        w.mul_(1 - g["lr"] * g["weight_decay"])
        w.add_(ortho.to(w.device).view(w.shape), alpha=-g["lr"] * self.lr_factor(shape))
        self._store(gi, k, p, "master", w)

    def _adamw(self, gi: int, g: dict) -> None:
        """torch.optim.AdamW's single-tensor arithmetic (zkern.reference.adam_step_) on each piece with a gradient;
        the step counted as a tensor, as torch counts it, so checkpoints carry over between the two."""
        for k, p in enumerate(g["params"]):
            grad = self._grad(gi, k, p)
            if grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.tensor(0.0)
            state["step"] += 1
            values = {name: self._load(p, name) for name in ("master", "exp_avg", "exp_avg_sq")}
            adam_step_(values["master"], grad, values["exp_avg"], values["exp_avg_sq"], step=int(state["step"]),
                       lr=g["lr"], betas=g["betas"], eps=g["eps"], weight_decay=g["weight_decay"], adamw=True)
            for name, v in values.items():
                self._store(gi, k, p, name, v)
