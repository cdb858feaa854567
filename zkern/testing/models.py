"""Small models for tests and the bench: TinyGPT (GPT-2 shaped, with the shapes stage 3 must handle), TinyMoE
(routed experts), Hugging Face's GPT-2 at a tiny size, activation checkpointing flavours, and deterministic batches.

    python -c "from zkern.testing import TinyGPT; print(sum(p.numel() for p in TinyGPT().parameters()))"
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, dim: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(dim)
        # No qkv bias: the key bias's gradient is exactly zero in exact arithmetic (softmax ignores a shift shared
        # by all keys), so Adam turns pure rounding noise into lr-sized steps that no two implementations share.
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.fc_out = nn.Linear(4 * dim, dim)

    def attend(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(self.ln1(x))
        return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))


def run_block(block: nn.Module, checkpoint: str, *args):
    """block(*args), under the activation checkpointing flavour named: "" (none), "non_reentrant" (torch's
    default since 2.4), "no_early_stop" (non-reentrant, recomputing every op), "reentrant", or "zkern"
    (zkern.checkpointing.checkpoint, DeepSpeed's API)."""
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    match checkpoint:
        case "":
            return block(*args)
        case "non_reentrant":
            return torch_checkpoint(block, *args, use_reentrant=False)
        case "no_early_stop":
            return torch_checkpoint(block, *args, use_reentrant=False, early_stop=False)
        case "reentrant":
            return torch_checkpoint(block, *args, use_reentrant=True)
        case "zkern":
            import zkern.checkpointing

            return zkern.checkpointing.checkpoint(block, *args)
        case other:
            raise ValueError(f"unknown checkpoint flavour {other!r}")


class ViewTap(nn.Module):
    """Hands its parameters out as views (TinyGPT(views=True)): a transposed view of its `scale` and an expand of its
    `cls` token, and a slice of `cls` kept on itself for its parent to read: what a stage-3 unit's release must not
    free under the views' holders (zkern/stage3/escapes.py). itself=True returns `scale` itself instead (which the
    parent's read then makes stage 3 gather for the parent's whole forward)."""

    def __init__(self, seq: int, dim: int, itself: bool = False):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(dim, seq))
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.itself, self.kept = itself, None

    def forward(self, batch: int, t: int):
        self.kept = self.cls[0, 0]
        return self.scale if self.itself else self.scale.t(), self.cls.expand(batch, t, -1)


# The sentinel (TinyGPT/TinyMoE(sentinel=True), the fuzzer's models): a (4, dim) parameter whose first half of rows
# gets the gradient SENTINEL_GRAD in every element and whose second half gets exactly 0, whatever the data, the ranks
# or the rounding, while the loss keeps its value (the term is x - x.detach(), 0). So its trajectory is a function of
# the optimizer alone, the same in the engine and any reference: the rows without a gradient move by weight decay
# only (lr wd |w| a step), the constant rows by Adam's normalized step (about lr a step, whatever the gradient's
# scale or quantization). A 16-bit or int4 run drifts from its reference everywhere else by far more than a dropped
# weight decay, a 1.5x lr or a stuck bias correction changes (zkern/verify/check.py, sentinel_failures). Each half
# is 2 * dim = 64 elements in the fuzzer: one whole int4 group of qgZ (zkern/comm/zeropp.py GRAD_GROUP), so no
# other parameter's gradient sets the constant half's quantization scale.
SENTINEL_GRAD = 2.0 ** -8


def make_sentinel(dim: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(4, dim))


def sentinel_term(sentinel: torch.Tensor) -> torch.Tensor:
    """0 in value; its gradient SENTINEL_GRAD on the sentinel's first two rows and 0 on the rest."""
    half = sentinel[: sentinel.shape[0] // 2]
    return SENTINEL_GRAD * (half - half.detach()).float().sum()


class TinyGPT(nn.Module):
    """A GPT-2-shaped model small enough for CI: token embedding tied to the LM head (GPT-2's tied weight), a
    learned position embedding, pre-norm blocks, and an LM-head bias of `vocab` elements (odd by default, so the
    parameter count divides by no world size). `extra_branch` adds a layer used only when forward gets
    use_extra=True (a parameter that gets no gradient in some steps); `freeze_pos` freezes the position embedding;
    `frozen` names Block layers ("qkv", "proj", "fc", "fc_out") frozen in every block (a LoRA-style frozen base).
    Shapes stage 3 must handle: `reuse_first_block` runs blocks[0] a second time after the others (a module
    called twice in one forward); `functional_head` computes the logits in this module's own forward from
    self.tok.weight (a parameter read outside its module's forward); forward(reverse_blocks=True) runs the
    blocks in reverse order (dynamic control flow); `checkpoint` runs each block under activation checkpointing
    (run_block's flavours); `views` adds a ViewTap whose forward hands its parameters out as views; `sentinel` adds
    the fuzzer's sentinel parameter (make_sentinel, created last so the other parameters' values do not change).
    """

    def __init__(self, vocab: int = 67, dim: int = 32, n_layer: int = 2, n_head: int = 2, seq: int = 16,
                 tie: bool = True, extra_branch: bool = False, freeze_pos: bool = False,
                 reuse_first_block: bool = False, functional_head: bool = False, checkpoint: str = "",
                 frozen: tuple[str, ...] = (), views: bool = False, sentinel: bool = False):
        super().__init__()
        self.checkpoint = checkpoint  # activation checkpointing of each block (run_block's flavours)
        self.config = SimpleNamespace(hidden_size=dim, vocab_size=vocab, n_layer=n_layer, seq=seq)
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02, requires_grad=not freeze_pos)
        self.blocks = nn.ModuleList(Block(dim, n_head) for _ in range(n_layer))
        self.taps = nn.ModuleList([ViewTap(seq, dim), ViewTap(seq, dim, itself=True)]) if views else None
        self.extra = nn.Linear(dim, dim) if extra_branch else None
        self.ln_f = nn.LayerNorm(dim)
        self.reuse_first_block = reuse_first_block
        self.functional_head = functional_head
        if functional_head:
            self.head_bias = nn.Parameter(torch.zeros(vocab))
        else:
            self.head = nn.Linear(dim, vocab)
        nn.init.normal_(self.tok.weight, std=0.02)
        if tie and not functional_head:
            self.head.weight = self.tok.weight
        self.register_buffer("position_ids", torch.arange(seq), persistent=True)
        for block in self.blocks:
            for name in frozen:
                getattr(block, name).requires_grad_(False)
        self.sentinel = make_sentinel(dim) if sentinel else None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, use_extra: bool = False,
                reverse_blocks: bool = False):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[self.position_ids[:t]].to(self.tok.weight.dtype)
        for tap in self.taps or ():
            scale, cls = tap(idx.shape[0], t)
            x = x * (scale.t() if tap.itself else scale)[:t] + cls + tap.kept
        for block in (reversed(self.blocks) if reverse_blocks else self.blocks):
            x = run_block(block, self.checkpoint, x)
        if self.reuse_first_block:
            x = self.blocks[0](x)
        if use_extra:
            if self.extra is None:
                raise ValueError("use_extra=True needs TinyGPT(extra_branch=True)")
            x = x + self.extra(x)
        if self.functional_head:
            logits = F.linear(self.ln_f(x), self.tok.weight, self.head_bias)
        else:
            logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss if self.sentinel is None else loss + sentinel_term(self.sentinel)


class Expert(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.fc(x)))


class MoEBlock(Block):
    """A block whose MLP is `n_experts` same-shape experts; each sequence goes to one of them (`route`)."""

    def __init__(self, dim: int, n_head: int, n_experts: int):
        super().__init__(dim, n_head)
        del self.fc, self.fc_out
        self.experts = nn.ModuleList(Expert(dim) for _ in range(n_experts))

    def forward(self, x: torch.Tensor, route: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(self.ln1(x))
        h = self.ln2(x)
        out = torch.zeros_like(h)
        for e in sorted(set(route.tolist())):  # only the experts this batch chose run
            rows = (route == e).nonzero().squeeze(1)
            # under torch.autocast an expert computes in 16 bits beside the fp32 residual: added in the residual's dtype
            out = out.index_add(0, rows, self.experts[e](h[rows]).to(out.dtype))
        return x + out


class TinyMoE(nn.Module):
    """TinyGPT with routed experts: a sequence goes to expert (first token mod n_experts) in every block, so ranks
    holding different data run different experts in the same step (the case stage 3 must not get wrong)."""

    def __init__(self, vocab: int = 67, dim: int = 32, n_layer: int = 2, n_head: int = 2, seq: int = 16,
                 n_experts: int = 4, checkpoint: str = "", sentinel: bool = False):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=dim, vocab_size=vocab, n_layer=n_layer, seq=seq)
        self.n_experts, self.checkpoint = n_experts, checkpoint
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(MoEBlock(dim, n_head, n_experts) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.sentinel = make_sentinel(dim) if sentinel else None

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        route = idx[:, 0] % self.n_experts
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = run_block(block, self.checkpoint, x, route)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return loss if self.sentinel is None else loss + sentinel_term(self.sentinel)


class DeepMLP(nn.Module):
    """Many tiny layers (an embedding, `depth` x Linear(width, width) + ReLU, a head): the arithmetic is negligible,
    so a step's time is each framework's per-module bookkeeping (bench/overhead_suite.py). `blocks` holds the layers,
    as TinyGPT's, so FSDP2 wraps each one."""

    def __init__(self, depth: int = 96, width: int = 16, vocab: int = 67, seq: int = 16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, idx, tgt=None, **_):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return logits if tgt is None else F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                          tgt.reshape(-1))


def hf_gpt2(vocab: int = 67, dim: int = 32, n_layer: int = 2, n_head: int = 2, seq: int = 16, checkpoint: str = ""):
    """Hugging Face's GPT2LMHeadModel at a tiny size, built from a config (no download), dropout off so that
    runs compare exactly; `checkpoint` turns on HF's gradient_checkpointing_enable() with torch's non-reentrant
    ("non_reentrant", "no_early_stop") or reentrant ("reentrant") checkpoint."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=dim, n_layer=n_layer, n_head=n_head,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        loss_type="ForCausalLM")
    model = GPT2LMHeadModel(config)
    match checkpoint:
        case "":
            pass
        case "non_reentrant" | "no_early_stop" | "reentrant":
            kwargs = {"use_reentrant": checkpoint == "reentrant"}
            if checkpoint == "no_early_stop":
                kwargs["early_stop"] = False
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        case other:
            raise ValueError(f"unknown checkpoint flavour {other!r} for HF GPT-2")
    return model.train()


def gpt2_load_peak(path: str, zkern_config: dict | None = None):
    """Load the HF GPT-2 saved at path on this rank, with zkern.hf.from_pretrained(zkern_config) or, without a
    config, transformers' own from_pretrained: (model, peak resident growth in bytes, seconds). The gloo group
    (world > 1) and everything the loaders import come first, so the count holds the loading alone."""
    import time

    import torch.distributed as dist
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2 import modeling_gpt2  # noqa: F401

    import zkern.hf.pretrained
    from zkern.testing.memory import peak_rss_bytes, reset_peak_rss

    transformers.utils.logging.set_verbosity_error()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    GPT2Config.from_pretrained(path)
    reset_peak_rss()
    before, start = peak_rss_bytes(), time.perf_counter()
    if zkern_config is None:
        model = GPT2LMHeadModel.from_pretrained(path)
    else:
        model = zkern.hf.pretrained.from_pretrained(GPT2LMHeadModel, path, zkern_config)
    return model, peak_rss_bytes() - before, time.perf_counter() - start


def make_batches(seed: int, steps: int, accumulation: int, world: int, micro_batch: int, seq: int, vocab: int):
    """batches[step][micro][rank] = (idx, targets), LongTensors of shape (micro_batch, seq); deterministic.

    Each sequence counts modulo vocab from a random start with a random stride in 1..4, so the next token is
    learnable from the two before it: the loss falls well below ln(vocab) within a few steps, which makes loss
    curves informative (random tokens leave them flat).
    """
    g = torch.Generator().manual_seed(seed)
    shape = (steps, accumulation, world, micro_batch, 1)
    start = torch.randint(0, vocab, shape, generator=g)
    stride = torch.randint(1, 5, shape, generator=g)
    data = (start + stride * torch.arange(seq + 1)) % vocab
    return [[[(data[s, m, r, :, :-1], data[s, m, r, :, 1:]) for r in range(world)] for m in range(accumulation)]
            for s in range(steps)]


def global_batch(batches, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole global batch of a step (every micro-step of every rank), as one single process sees it."""
    pairs = [pair for micro in batches[step] for pair in micro]
    return torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
