"""Helpers shared by tests and bench: a tiny GPT, deterministic batches, an N-rank spawner over gloo, a plain
single-process torch reference run, and the parameter comparison zkern's equivalence tests use.

    python -c "from zkern.testing import TinyGPT; print(sum(p.numel() for p in TinyGPT().parameters()))"
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import socket
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------------------------
# The model


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


class TinyGPT(nn.Module):
    """A GPT-2-shaped model small enough for CI: token embedding tied to the LM head (GPT-2's tied weight), a
    learned position embedding, pre-norm blocks, and an LM-head bias of `vocab` elements (odd by default, so the
    parameter count divides by no world size). `extra_branch` adds a layer used only when forward gets
    use_extra=True (a parameter that gets no gradient in some steps); `freeze_pos` freezes the position embedding.
    Shapes stage 3 must handle: `reuse_first_block` runs blocks[0] a second time after the others (a module
    called twice in one forward); `functional_head` computes the logits in this module's own forward from
    self.tok.weight (a parameter read outside its module's forward); forward(reverse_blocks=True) runs the
    blocks in reverse order (dynamic control flow); `checkpoint` runs each block under activation checkpointing
    (run_block's flavours).
    """

    def __init__(self, vocab: int = 67, dim: int = 32, n_layer: int = 2, n_head: int = 2, seq: int = 16,
                 tie: bool = True, extra_branch: bool = False, freeze_pos: bool = False,
                 reuse_first_block: bool = False, functional_head: bool = False, checkpoint: str = ""):
        super().__init__()
        self.checkpoint = checkpoint  # activation checkpointing of each block (run_block's flavours)
        self.config = SimpleNamespace(hidden_size=dim, vocab_size=vocab, n_layer=n_layer, seq=seq)
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02, requires_grad=not freeze_pos)
        self.blocks = nn.ModuleList(Block(dim, n_head) for _ in range(n_layer))
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

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, use_extra: bool = False,
                reverse_blocks: bool = False):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[self.position_ids[:t]].to(self.tok.weight.dtype)
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
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


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
            out = out.index_add(0, rows, self.experts[e](h[rows]))
        return x + out


class TinyMoE(nn.Module):
    """TinyGPT with routed experts: a sequence goes to expert (first token mod n_experts) in every block, so ranks
    holding different data run different experts in the same step (the case stage 3 must not get wrong)."""

    def __init__(self, vocab: int = 67, dim: int = 32, n_layer: int = 2, n_head: int = 2, seq: int = 16,
                 n_experts: int = 4, checkpoint: str = ""):
        super().__init__()
        self.config = SimpleNamespace(hidden_size=dim, vocab_size=vocab, n_layer=n_layer, seq=seq)
        self.n_experts, self.checkpoint = n_experts, checkpoint
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(MoEBlock(dim, n_head, n_experts) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        route = idx[:, 0] % self.n_experts
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = run_block(block, self.checkpoint, x, route)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


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


# ----------------------------------------------------------------------------------------------------------------
# A training run, described once for both zkern and the reference


@dataclass(frozen=True)
class TrainSpec:
    stage: int = 0
    steps: int = 10
    accumulation: int = 1
    micro_batch: int = 2
    precision: str = "fp32"  # fp32 | bf16 | fp16
    clip: float = 0.0
    lr: float = 1e-3
    weight_decay: float = 0.01
    optimizer: str = "AdamW"
    seed: int = 1234
    model: dict = field(default_factory=dict)  # TinyGPT kwargs
    extra_every: int = 0  # > 0: forward uses the extra branch on steps where step % extra_every == extra_phase
    extra_phase: int = 0  # 1 or more: the extra branch's parameters get no gradient in the first step
    reverse_at: tuple[int, ...] = ()  # steps whose forward runs the blocks in reverse order
    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    zero: dict = field(default_factory=dict)  # more zero_optimization keys
    fp16: dict = field(default_factory=dict)  # more fp16 keys
    device: str = "cpu"  # "cuda" for the gpu-marked tests
    arch: str = "tiny"  # "tiny" (TinyGPT), "moe" (TinyMoE) or "hf_gpt2" (Hugging Face GPT-2); `model` holds kwargs
    param_groups: bool = False  # a client AdamW with HF Trainer's groups: decay on matrices, none on biases/norms
    # moe: {step: [expert per rank]}: that step, every sequence of rank r goes to expert list[r] (the first token
    # picks the expert); other steps route by the data
    forced_routes: dict = field(default_factory=dict)
    extra_config: dict = field(default_factory=dict)  # more top-level config sections (activation_checkpointing)

    def config(self, world: int) -> dict:
        cfg = {
            "train_micro_batch_size_per_gpu": self.micro_batch,
            "gradient_accumulation_steps": self.accumulation,
            "gradient_clipping": self.clip,
            "zero_optimization": {"stage": self.stage, "reduce_bucket_size": self.reduce_bucket_size,
                                  "overlap_comm": self.overlap_comm, **self.zero},
            "steps_per_print": 0,
            "comm_timeout_s": 120,
            "device": self.device,
        }
        if not self.param_groups:  # else the engine takes client_optimizer's groups
            cfg["optimizer"] = {"type": self.optimizer, "params": {"lr": self.lr, "weight_decay": self.weight_decay}}
        if self.stage == 3:
            # Every unit of the tiny model is below DeepSpeed's 1e5 persistence threshold: keep only LayerNorm-sized
            # units whole, so that stage 3 really partitions and gathers.
            cfg["zero_optimization"].setdefault("stage3_param_persistence_threshold", 100)
        if self.precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        elif self.precision == "fp16":
            cfg["fp16"] = {"enabled": True, **self.fp16}
        return {**cfg, **self.extra_config}

    def make_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        match self.arch:
            case "tiny":
                return TinyGPT(**self.model)
            case "moe":
                return TinyMoE(**self.model)
            case "hf_gpt2":
                return hf_gpt2(**self.model)
            case other:
                raise ValueError(f"unknown arch {other!r}")

    def client_optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        """param_groups: HF Trainer's two AdamW groups (decay on matrices and embeddings, none on biases and
        norms); else None (the config's optimizer)."""
        if not self.param_groups:
            return None
        decay = [p for p in model.parameters() if p.dim() >= 2 and p.requires_grad]
        rest = [p for p in model.parameters() if p.dim() < 2 and p.requires_grad]
        return torch.optim.AdamW([{"params": decay, "weight_decay": self.weight_decay},
                                  {"params": rest, "weight_decay": 0.0}], lr=self.lr)

    def loss(self, model, idx: torch.Tensor, tgt: torch.Tensor, step: int) -> torch.Tensor:
        """The model's loss on one batch, as each arch computes it (HF GPT-2 shifts its labels itself)."""
        match self.arch:
            case "hf_gpt2":
                return model(input_ids=idx, labels=idx).loss
            case "moe":
                return model(idx, tgt)
            case _:
                return model(idx, tgt, **self.forward_kwargs(step))

    def num_params(self) -> int:
        """The model's parameter count, built on the meta device: nothing is allocated or initialised (the bench's
        1b and 7b presets would take gigabytes and seconds to build just to be counted)."""
        with torch.device("meta"):
            model = TinyGPT(**self.model)
        return sum(p.numel() for p in model.parameters())

    def batches(self, world: int):
        vocab = self.model.get("vocab", 67)
        seq = self.model.get("seq", 16)
        batches = make_batches(self.seed + 1, self.steps, self.accumulation, world, self.micro_batch, seq, vocab)
        n = self.model.get("n_experts", 4)
        for step, experts in self.forced_routes.items():
            for micro in batches[step]:
                for (idx, _), expert in zip(micro, experts):
                    idx[:, 0] = idx[:, 0] - idx[:, 0] % n + expert
        return batches

    def uses_extra(self, step: int) -> bool:
        return self.extra_every > 0 and step % self.extra_every == self.extra_phase

    def forward_kwargs(self, step: int) -> dict:
        return {"use_extra": self.uses_extra(step), "reverse_blocks": step in self.reverse_at}


def reference_run(spec: TrainSpec, world: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain single-process torch: the same model, the whole global batch per step, torch.optim.AdamW (with the
    spec's param groups), torch.nn.utils.clip_grad_norm_. Returns (final state_dict in fp32, loss per step).
    A model with activation checkpointing is trained without it here: checkpointing must not change the math."""
    device = torch.device("cuda" if spec.device == "cuda" else "cpu")
    model = replace(spec, model={**spec.model, "checkpoint": ""}).make_model().to(device)
    batches = spec.batches(world)
    params = [p for p in model.parameters() if p.requires_grad]
    # DeepSpeed's (and so zkern's) "Adam" decouples weight decay like AdamW unless adam_w_mode is false.
    opt = spec.client_optimizer(model) or torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)
    losses = []
    for step in range(spec.steps):
        opt.zero_grad()
        idx, tgt = global_batch(batches, step)
        loss = spec.loss(model, idx.to(device), tgt.to(device), step)
        loss.backward()
        if spec.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, spec.clip)
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}, losses


def engine_run(rank: int, world: int, spec: TrainSpec) -> dict:
    """Train spec with zkern.Engine on this rank; returns losses (this rank's mean per step), the final
    full_state_dict (rank 0), memory_report, comm_stats after construction and at the end, counters."""
    import logging

    import zkern

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("zkern")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    model = spec.make_model()
    engine = zkern.Engine(model, spec.config(world), optimizer=spec.client_optimizer(model))
    comm_start = engine.comm_stats()
    gathered_after_forward = []

    def after_forward() -> None:
        if hasattr(engine.runtime, "gathered_units"):  # stage 3: what the hooks hold between fwd and bwd
            gathered_after_forward.append(engine.runtime.gathered_units())

    losses, times = engine_training_loop(spec, rank, world, engine, after_forward)
    peak = peaks(engine.device)  # the training's, before full_state_dict's gather
    comm_end = engine.comm_stats()  # before full_state_dict's own gather
    state = engine.full_state_dict(rank0_only=True)
    state = None if state is None else {k: v.cpu() for k, v in state.items()}
    logger.removeHandler(handler)
    logger.setLevel(level)
    return {"losses": losses, "state": state, "memory": engine.memory_report(), **peak,
            "comm_start": comm_start,
            "comm_end": comm_end, "skipped": engine.skipped_steps, "global_steps": engine.global_steps,
            "log": messages, "gathered_after_forward": gathered_after_forward,
            "peak_live": getattr(engine.runtime, "peak_live", None),
            "loss_scale": engine.loss_scale, "grad_norm": engine.last_grad_norm, "step_times": times,
            "spec": asdict(spec)}


def engine_training_loop(spec: TrainSpec, rank: int, world: int, engine, after_forward=None) -> tuple[list, list]:
    """The DeepSpeed-style loop (zkern and DeepSpeed engines alike): per micro-batch forward, backward, step; the
    engine accumulates and steps at the boundary. Returns (loss per step, seconds per step); resets the peak
    memory counts first (peaks() reads them)."""
    batches = spec.batches(world)
    losses, times = [], []
    reset_peaks(engine.device)
    for step in range(spec.steps):
        start = time.perf_counter()
        total = 0.0
        for micro in range(spec.accumulation):
            idx, tgt = batches[step][micro][rank]
            loss = spec.loss(engine, idx.to(engine.device), tgt.to(engine.device), step)
            if after_forward is not None:
                after_forward()
            engine.backward(loss)
            engine.step()
            total += loss.item()
        _finish_step(engine.device)
        times.append(time.perf_counter() - start)
        losses.append(total / spec.accumulation)
    return losses, times


def rank_device(spec: TrainSpec) -> torch.device:
    """Where this rank of a spec's run trains: cuda:LOCAL_RANK for spec.device "cuda", else the CPU."""
    if spec.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init_peer_group(spec: TrainSpec) -> None:
    """The default process group a stock peer needs: nccl on this rank's GPU, gloo on a CPU."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if spec.device == "cuda":
        device = rank_device(spec)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        dist.init_process_group("gloo")


def peer_autocast(spec: TrainSpec) -> torch.dtype | None:
    """The stock peers' mixed precision: fp32 parameters under torch.autocast(bf16) for a bf16 spec (PyTorch's
    recipe). fp16 would need a GradScaler, whose skipped steps no engine shares: refused."""
    if spec.precision == "fp16":
        raise ValueError("the stock peers train fp32 or bf16 (autocast); fp16 needs a GradScaler whose skipped "
                         "steps differ from the engine's loss scaler: benchmark fp32 or bf16")
    return torch.bfloat16 if spec.precision == "bf16" else None


def ddp_run(rank: int, world: int, spec: TrainSpec, zero1: bool = False) -> dict:
    """The same training under torch's DistributedDataParallel + AdamW (the stock peer of stage 0), or with
    zero1=True, torch's ZeroRedundancyOptimizer around AdamW (the stock peer of stage 1). A bf16 spec trains
    under autocast and, on GPUs, all-reduces bf16 gradients (torch's bf16_compress_hook, nccl only), as zkern
    reduces them."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    autocast = peer_autocast(spec)
    device = rank_device(spec)
    if world > 1 or zero1:  # ZeroRedundancyOptimizer needs a group even at world size 1
        init_peer_group(spec)
    model = spec.make_model().to(device)
    ddp = model
    if world > 1:
        ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                      find_unused_parameters=spec.extra_every > 0)
        if autocast is not None and device.type == "cuda":  # torch's hook needs nccl: gloo reduces fp32
            ddp.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
    params = [p for p in model.parameters() if p.requires_grad]
    if zero1:
        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=spec.lr,
                                      weight_decay=spec.weight_decay)
    else:
        opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay)

    def sync(last: bool):  # DDP all-reduces only on the accumulation step's last micro-batch
        return contextlib.nullcontext() if last or world == 1 else ddp.no_sync()

    losses, times = torch_training_loop(spec, rank, world, ddp, opt, params, sync, autocast)
    peak = peaks(device)  # the training's, before the state copy
    state = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()} if rank == 0 else None
    return {"losses": losses, "state": state, "step_times": times, **peak,
            "model_state_bytes": model_state_bytes(model, opt)}


def torch_training_loop(spec: TrainSpec, rank: int, world: int, model, opt, params, sync,
                        autocast: torch.dtype | None = None) -> tuple[list, list]:
    """The plain torch loop every stock peer runs: zero_grad, accumulate the micro-batches (each forward under
    torch.autocast(autocast) when given, each backward under sync(is_last_micro_batch)), clip, step. Returns
    (loss per step, seconds per step); resets the peak memory counts first."""
    batches = spec.batches(world)
    device = rank_device(spec)
    losses, times = [], []
    reset_peaks(device)
    for step in range(spec.steps):
        start = time.perf_counter()
        opt.zero_grad()
        total = 0.0
        for micro in range(spec.accumulation):
            idx, tgt = batches[step][micro][rank]
            with sync(micro == spec.accumulation - 1):
                with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                    loss = spec.loss(model, idx.to(device), tgt.to(device), step)
                (loss / spec.accumulation).backward()
            total += loss.item()
        if spec.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, spec.clip)
        opt.step()
        _finish_step(device)
        times.append(time.perf_counter() - start)
        losses.append(total / spec.accumulation)
    return losses, times


def _finish_step(device: torch.device) -> None:
    """A step's time ends when its GPU work does: CUDA runs asynchronously to the host."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def model_state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer states this rank holds (a DTensor counts its local shard)."""
    params = list(model.parameters())
    state = getattr(opt, "optim", opt).state  # ZeroRedundancyOptimizer: the local optimizer holds this rank's shard
    tensors = [*params, *(p.grad for p in params if p.grad is not None),
               *(t for st in state.values() for t in st.values() if torch.is_tensor(t) and t.numel() > 1)]
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return sum(t.numel() * t.element_size() for t in local)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (VmHWM). Not getrusage's ru_maxrss: Linux carries that across
    execve, so a freshly spawned rank starts with its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_rss() -> None:
    """Restart the peak-RSS count from the current resident size (Linux: /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def reset_peaks(device: torch.device) -> None:
    """Restart the peak RSS and, on a GPU, the CUDA allocator's peak from what is held now."""
    reset_peak_rss()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def peaks(device: torch.device) -> dict:
    """This rank's peaks since reset_peaks: process RSS, and on a GPU the CUDA allocator's max allocated."""
    return {"peak_rss": peak_rss_bytes(),
            "peak_cuda": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def mean_losses(results: list[dict]) -> list[float]:
    """The global loss per step: the mean of the ranks' losses (equal micro-batch sizes)."""
    return [sum(r["losses"][s] for r in results) / len(results) for s in range(len(results[0]["losses"]))]


# ----------------------------------------------------------------------------------------------------------------
# Comparison


def compare_params(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], *, lr: float, steps: int,
                   rtol: float = 1e-5, lr_units: float = 1e-3) -> list[str]:
    """Failures (empty when all match) of zkern's equivalence bar, tensor by tensor:

    a tensor matches when its relative error ||a - e|| / ||e|| is within rtol (float32 rounding), or, where Adam's
    division by sqrt(v) amplifies rounding (gradients near zero, as in zero-initialised biases), when its largest
    element error is within lr_units * lr * steps (Adam moves an element by about lr per step).
    """
    failures = []
    if set(actual) != set(expected):
        return [f"names differ: missing {sorted(set(expected) - set(actual))}, "
                f"unexpected {sorted(set(actual) - set(expected))}"]
    for name, e in expected.items():
        a = actual[name]
        if a.shape != e.shape:
            failures.append(f"{name}: shape {tuple(a.shape)} != {tuple(e.shape)}")
            continue
        if not e.is_floating_point():
            if not torch.equal(a, e):
                failures.append(f"{name}: integer tensor differs")
            continue
        a, e = a.double(), e.double()
        if not torch.isfinite(a).all():
            failures.append(f"{name}: non-finite values")
            continue
        diff = (a - e).norm().item()
        ref = e.norm().item()
        rel = diff / ref if ref > 0 else (0.0 if diff == 0 else math.inf)
        max_err = (a - e).abs().max().item() if a.numel() else 0.0
        if rel <= rtol or max_err <= lr_units * lr * steps:
            continue
        failures.append(f"{name}: relative error {rel:.3e} > {rtol:g} and largest element error {max_err:.3e} > "
                        f"{lr_units:g} x lr x steps = {lr_units * lr * steps:.3e}")
    return failures


def fp32_sum_rtol(n: int, lam: float = 8.0) -> float:
    """Relative tolerance of a float32 sum of n non-negative terms (a sum of squares) computed in an order the test
    does not fix (torch's vectorised cascade, whose order depends on the CPU's vector width; a Triton tree), against
    the exact sum.

    u = 2**-24. The deterministic worst case over all orders is gamma_{n-1} = (n-1)u / (1-(n-1)u): 6% at n = 2**20,
    a bound no real order comes near. Round-to-nearest errors behave as independent and zero-mean, and Higham & Mary
    (SIAM J. Sci. Comput. 41(5), 2019, "A new approach to probabilistic rounding error analysis", Thm 3.1) bound the
    error of a sum by lam * sqrt(n) * u * sum|x_i| + O(u^2) with probability at least 1 - 2n exp(-lam^2 (1-u)^2 / 2);
    lam = 8 leaves a failure probability below 3e-8 up to n = 2**20 and below 5e-7 up to 2**24. One more u covers
    rounding each term (the square) once. Measured here: 2.1e-5 at n = 2**20 + 3 against a bound of 4.9e-4; a block
    of 1024 elements left out of that sum (1e-3) would fail it, and at n = 1000 one element (1e-3) against 1.5e-5.
    """
    u = 2.0**-24
    return lam * math.sqrt(n) * u + u


def assert_f32_rounding(actual: torch.Tensor, expected: torch.Tensor, scale: float, what: str, ulps: int = 8) -> None:
    """Element-wise agreement to float32 rounding: each element within `ulps` units in the last place of the
    larger of |expected| and `scale`, the size of the terms that formed it (lr times the steps for an Adam
    parameter, whose updates are about lr each; the gradient's magnitude for exp_avg, whose lerp can cancel).
    Fused multiply-adds and a different order of operations move results by a few such units, nothing more."""
    a, e = actual.double(), expected.double()
    bound = ulps * torch.finfo(torch.float32).eps * (e.abs() + scale)
    excess = ((a - e).abs() - bound).max().item() if a.numel() else 0.0
    assert excess <= 0, f"{what}: an element is off by {excess:.3g} beyond {ulps} ulps"


def assert_params_close(actual: dict, expected: dict, *, lr: float, steps: int, **kwargs) -> None:
    failures = compare_params(actual, expected, lr=lr, steps=steps, **kwargs)
    if failures:
        raise AssertionError("parameters differ from the reference:\n  " + "\n  ".join(failures))


# ----------------------------------------------------------------------------------------------------------------
# Spawning ranks


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank: int, world: int, port: int, fn, args, queue, threads: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(threads)
    try:
        result = fn(rank, world, *args)
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn(fn, world: int, *args, timeout: float = 300.0, threads: int = 1, subprocess: bool = False,
          allow_dead: bool = False) -> list:
    """Run fn(rank, world, *args) on `world` processes (torchrun's environment variables on a free 127.0.0.1
    port); returns the results by rank. World size 1 runs in this process unless subprocess=True. A rank that
    raises fails the whole call with that rank's traceback; a rank whose process dies without a result (a hard
    abort) fails it too, unless allow_dead, which puts {"died": exitcode} in its place. No rank is left running."""
    if world == 1 and not subprocess:
        return [fn(0, 1, *args)]
    import queue as queue_module

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, fn, args, queue, threads), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, ok, payload = queue.get(timeout=0.5)
            except queue_module.Empty:
                for r, p in enumerate(procs):
                    if r not in results and p.exitcode is not None and queue.empty():
                        if not allow_dead:
                            raise RuntimeError(f"rank {r} of {world} died (exit code {p.exitcode}) without a "
                                               f"result") from None
                        results[r] = {"died": p.exitcode}
                if time.monotonic() > deadline:
                    raise TimeoutError(f"spawn: ranks {sorted(set(range(world)) - set(results))} gave no result "
                                       f"within {timeout:g}s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} of {world} failed:\n{payload}")
            results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return [results[r] for r in range(world)]
