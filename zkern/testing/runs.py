"""A training run described once (TrainSpec) and run three ways: zkern's engine on every rank, a plain
single-process torch reference on the global batch, and the stock-PyTorch peers (DDP, ZeroRedundancyOptimizer).

    python -m pytest tests/engine/test_engine.py -q
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn as nn

from zkern.testing.memory import peak_rss_bytes, reset_peak_rss
from zkern.testing.models import DeepMLP, TinyGPT, TinyMoE, global_batch, hf_gpt2, make_batches


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
    extra_ranks: tuple[int, ...] = ()  # these ranks use the extra branch in every step, the others never
    reverse_at: tuple[int, ...] = ()  # steps whose forward runs the blocks in reverse order
    reduce_bucket_size: int = 500_000_000
    overlap_comm: bool = True
    zero: dict = field(default_factory=dict)  # more zero_optimization keys
    fp16: dict = field(default_factory=dict)  # more fp16 keys
    device: str = "cpu"  # "cuda" for the gpu-marked tests
    arch: str = "tiny"  # "tiny" (TinyGPT), "moe" (TinyMoE), "hf_gpt2" (Hugging Face GPT-2) or "deep" (DeepMLP); `model`
    # holds its kwargs
    param_groups: bool = False  # a client AdamW with HF Trainer's groups: decay on matrices, none on biases/norms
    config_groups: bool = False  # the same two groups as model_parameters of the config's optimizer
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
            case "deep":
                return DeepMLP(**self.model)
            case other:
                raise ValueError(f"unknown arch {other!r}")

    def two_groups(self, model: nn.Module) -> list[dict]:
        """HF Trainer's two AdamW groups: decay on matrices and embeddings, none on biases and norms."""
        decay = [p for p in model.parameters() if p.dim() >= 2 and p.requires_grad]
        rest = [p for p in model.parameters() if p.dim() < 2 and p.requires_grad]
        return [{"params": decay, "weight_decay": self.weight_decay}, {"params": rest, "weight_decay": 0.0}]

    def client_optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        """param_groups: a torch AdamW over two_groups; else None (the config's optimizer)."""
        if not self.param_groups:
            return None
        return torch.optim.AdamW(self.two_groups(model), lr=self.lr)

    def model_parameters(self, model: nn.Module) -> list[dict] | None:
        """config_groups: two_groups, for the config's optimizer (Engine's model_parameters); else None."""
        return self.two_groups(model) if self.config_groups else None

    def build_engine(self, model: nn.Module, world: int):
        import zkern

        return zkern.Engine(model, self.config(world), optimizer=self.client_optimizer(model),
                            model_parameters=self.model_parameters(model))

    def loss(self, model, idx: torch.Tensor, tgt: torch.Tensor, step: int, rank: int = 0) -> torch.Tensor:
        """The model's loss on one batch, as each arch computes it (HF GPT-2 shifts its labels itself)."""
        match self.arch:
            case "hf_gpt2":
                return model(input_ids=idx, labels=idx).loss
            case "moe":
                return model(idx, tgt)
            case _:
                return model(idx, tgt, **self.forward_kwargs(step, rank))

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

    def forward_kwargs(self, step: int, rank: int = 0) -> dict:
        extra = self.uses_extra(step) or rank in self.extra_ranks
        return {"use_extra": extra, "reverse_blocks": step in self.reverse_at}


def reference_run(spec: TrainSpec, world: int, prepare=None) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain single-process torch: the same model, the whole global batch per step, torch.optim.AdamW (with the
    spec's param groups), torch.nn.utils.clip_grad_norm_. Returns (final state_dict in fp32, loss per step).
    A model with activation checkpointing is trained without it here: checkpointing must not change the math.
    prepare(model), if given, runs on the freshly built model before training (the test's own changes)."""
    device = torch.device("cuda" if spec.device == "cuda" else "cpu")
    model = replace(spec, model={**spec.model, "checkpoint": ""}).make_model()
    if prepare is not None:
        prepare(model)
    model = model.to(device)
    batches = spec.batches(world)
    params = [p for p in model.parameters() if p.requires_grad]
    # DeepSpeed's (and so zkern's) "Adam" decouples weight decay like AdamW unless adam_w_mode is false.
    groups = spec.two_groups(model) if spec.param_groups or spec.config_groups else params
    delayed = bool(spec.zero.get("offload_optimizer", {}).get("delayed_update"))
    if delayed:  # AdamW steps the masters; the model trails them by one update
        masters = {id(p): torch.nn.Parameter(p.detach().clone()) for p in params}
        groups = ([{**g, "params": [masters[id(p)] for p in g["params"]]} for g in groups]
                  if isinstance(groups[0], dict) else [masters[id(p)] for p in groups])
    opt = torch.optim.AdamW(groups, lr=spec.lr, weight_decay=spec.weight_decay)
    losses = []
    for step in range(spec.steps):
        opt.zero_grad()
        if spec.extra_ranks:  # ranks compute differently: the mean of every rank's micro-batch losses
            pairs = [(r, pair) for micro in batches[step] for r, pair in enumerate(micro)]
            loss = sum(spec.loss(model, idx.to(device), tgt.to(device), step, r) for r, (idx, tgt) in pairs)
            loss = loss / len(pairs)
        else:
            idx, tgt = global_batch(batches, step)
            loss = spec.loss(model, idx.to(device), tgt.to(device), step)
        loss.backward()
        if spec.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, spec.clip)
        if delayed:
            with torch.no_grad():
                for p in params:  # the last update lands; this step's goes to the masters only
                    masters[id(p)].grad, p.grad = p.grad, None
                    p.copy_(masters[id(p)])
        opt.step()
        losses.append(loss.item())
    if delayed:
        with torch.no_grad():
            for p in params:
                p.copy_(masters[id(p)])
    return {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}, losses


def engine_run(rank: int, world: int, spec: TrainSpec) -> dict:
    """Train spec with zkern.Engine on this rank; returns losses (this rank's mean per step), the final
    full_state_dict (rank 0), memory_report, comm_stats after construction and at the end, counters."""
    import logging


    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("zkern")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    model = spec.make_model()
    engine = spec.build_engine(model, world)
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
    memory = engine.memory_report()
    engine.destroy()
    logger.removeHandler(handler)
    logger.setLevel(level)
    return {"losses": losses, "state": state, "memory": memory, **peak,
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
            loss = spec.loss(engine, idx.to(engine.device), tgt.to(engine.device), step, rank)
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


def ddp_run(rank: int, world: int, spec: TrainSpec, zero1: bool = False, fused: bool | None = None) -> dict:
    """The same training under torch's DistributedDataParallel + AdamW (the stock peer of stage 0), or with
    zero1=True, torch's ZeroRedundancyOptimizer around AdamW (the stock peer of stage 1). A bf16 spec trains
    under autocast and, on GPUs, all-reduces bf16 gradients (torch's bf16_compress_hook, nccl only), as zkern
    reduces them. fused: AdamW's own argument (None: torch's default, the foreach implementation; True: the fused
    kernel, what a GPU user who cares about speed sets)."""
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
                                      find_unused_parameters=spec.extra_every > 0 or bool(spec.extra_ranks))
        if autocast is not None and device.type == "cuda":  # torch's hook needs nccl: gloo reduces fp32
            ddp.register_comm_hook(dist.group.WORLD, default_hooks.bf16_compress_hook)
    params = [p for p in model.parameters() if p.requires_grad]
    if zero1:
        opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=spec.lr,
                                      weight_decay=spec.weight_decay, fused=fused)
    else:
        opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, fused=fused)

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
                    loss = spec.loss(model, idx.to(device), tgt.to(device), step, rank)
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
