"""The systems `python bench/gpu_probe.py variants` measures, each training one TrainSpec's model, data and seed,
stepped in three phases (forward, backward, step) so that one loop times them all and reads the allocator between
the phases.

    python bench/gpu_probe.py variants zkern0 zkern3 ddp-fused --model tiny --device cpu

zkern0..zkern3       zkern's engine at that stage, bf16 weights and gradients, fp32 master and Adam state
zkern2-offload       stage 2 with offload_optimizer cpu (the host Adam; gradients down, parameters up)
zkern2-offload-bf16  the same with bf16 master and moments (bf16_master_weights_and_grads, bf16_optimizer_states,
                     stochastically rounded): 6 host bytes a parameter instead of 12
zkern2-offload-dpu   the same with the delayed update (offload_optimizer.delayed_update: the host Adam behind the
                     next step's forward and backward)
zkern2-offload-bf16-dpu  both: bf16 state and the delayed update (10 host bytes a parameter with its two staging
                     copies, where fp32 state's 16 outgrew a 128 GB host at 7B)
zkern2-offload-bf16-spec  bf16 state and the speculative step (offload_optimizer.speculative_step: each chunk's Adam
                     in backward, kept where the step comes out unclipped; 14 host bytes a parameter with its saves
                     and a staging buffer per chunk)
zkern2-offload-r25, -r50, -r75  partial offload (offload_optimizer.ratio 0.25, 0.5, 0.75): that share of the
                     optimizer shard on the host, the rest stepped on the device
zkern3-keep          stage 3 keeping a bf16 working shard beside the fp32 master to gather from
                     (zero_optimization.stage3_keep_working_shard; zkern3 casts each gather's chunk from the master)
zkern3-offload       stage 3 with offload_optimizer and offload_param cpu
zkern3-offload-bf16-spec  the same with bf16 state and the speculative step: DeepSpeed's SuperOffload configuration
                     (stage 3, both offloads, super_offload); the guessed parameters staged on the host
zkern3-offload-inline  the same with every unit's host chunk copied up on the compute stream, in line with the
                     compute (the path before stage3/uploads.py's side stream): the overlap's A/B
                     (every zkern offload variant builds its model on the device in bf16, as a user whose host cannot
                     hold a spare fp32 copy of the model does; the engine takes it from there)
ddp, ddp-fused       fp32 parameters under torch.autocast(bf16), torch.optim.AdamW with its defaults (foreach) or
                     fused=True; wrapped in DistributedDataParallel at world > 1 (one rank: the plain model)
zero1                DDP + torch's ZeroRedundancyOptimizer(AdamW) (stage 1's stock peer), AdamW as `ddp`
fsdp2, fsdp2-fused   FSDP2 fully_shard on each block and the root, MixedPrecisionPolicy(bf16), the same two AdamWs
fsdp2-zero2          FSDP2 with reshard_after_forward=False (ZeRO-2's traffic and memory), AdamW as `ddp`
fsdp2-offload        FSDP2 as `fsdp2` with CPUOffloadPolicy (parameters, gradients and torch's AdamW on the host), as
                     its users offload
deepspeed0..3        deepspeed.initialize at that stage with the same config (bf16, its own Adam), where installed
deepspeed2-offload   DeepSpeed ZeRO-Offload: stage 2 with offload_optimizer cpu (its DeepSpeedCPUAdam), where installed
torch-mixed          zkern's arithmetic written in torch: bf16 weights and gradients, an fp32 master copy stepped
                     by AdamW(fused=True) and copied back (like compared with like, without zkern)
torch-mixed-offload  zkern's offload arithmetic written in torch, as the reference for a model whose states outgrow
                     the device: the bf16 model built on the device (as zkern's offload variants take it), the fp32
                     master and AdamW on the host, stepped a slice of parameters at a time (the host then holds one
                     slice's fp32 gradients, not the model's); slow, and timed only to be complete
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from zkern.testing import TrainSpec, init_peer_group, rank_device

HOST_ADAM = {"device": "cpu", "pin_memory": True}
# name -> (stage, zero_optimization entries, bf16 entries)
OFFLOAD = {"zkern2-offload": (2, {"offload_optimizer": HOST_ADAM}, {}),
           "zkern2-offload-bf16": (2, {"offload_optimizer": HOST_ADAM},
                                   {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}),
           "zkern2-offload-dpu": (2, {"offload_optimizer": {**HOST_ADAM, "delayed_update": True}}, {}),
           "zkern2-offload-bf16-dpu": (2, {"offload_optimizer": {**HOST_ADAM, "delayed_update": True}},
                                       {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}),
           "zkern2-offload-bf16-spec": (2, {"offload_optimizer": {**HOST_ADAM, "speculative_step": True}},
                                        {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}),
           "zkern3-offload": (3, {"offload_optimizer": HOST_ADAM, "offload_param": HOST_ADAM}, {}),
           "zkern3-offload-bf16-spec": (3, {"offload_optimizer": {**HOST_ADAM, "speculative_step": True},
                                            "offload_param": HOST_ADAM},
                                        {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}),
           "zkern3-offload-inline": (3, {"offload_optimizer": HOST_ADAM, "offload_param": HOST_ADAM}, {}),
           **{f"zkern2-offload-r{int(r * 100)}": (2, {"offload_optimizer": {**HOST_ADAM, "ratio": r}}, {})
              for r in (0.25, 0.5, 0.75)}}
# name -> (stage, zero_optimization entries): zkern on the device with a key set
KEYED = {"zkern3-keep": (3, {"stage3_keep_working_shard": True})}
NAMES = ("zkern0", "zkern1", "zkern2", "zkern3", *KEYED, *OFFLOAD, "ddp", "ddp-fused", "zero1", "fsdp2", "fsdp2-fused",
         "fsdp2-zero2", "fsdp2-offload", "torch-mixed", "torch-mixed-offload", "deepspeed0", "deepspeed1", "deepspeed2",
         "deepspeed3", "deepspeed2-offload")


def deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def make_model(spec: TrainSpec) -> torch.nn.Module:
    """spec's model, initialised on the rank's device: the same weights for every system of a probe, without the
    host's serial random-number generator (about 10 s for the 0.87B preset on one core, per system)."""
    with torch.device(rank_device(spec)):
        return spec.make_model()


class ZkernSystem:
    def __init__(self, spec: TrainSpec, world: int, on_device: bool = False):
        """on_device: hand the engine the model built on the device in the spec's 16-bit dtype (the offload
        variants: a model too big for the host's spare memory in fp32); else from the host in fp32, as most users
        hand it (the engine builds its buffers on the device itself)."""
        model = make_model(spec)
        if on_device and spec.precision == "bf16":
            model = model.to(torch.bfloat16)
        elif not on_device:
            model = model.cpu()
        self.engine = spec.build_engine(model, world)
        self.spec = spec

    def forward(self, idx, tgt, step, rank):
        return self.spec.loss(self.engine, idx, tgt, step, rank)

    def backward(self, loss):
        self.engine.backward(loss)

    def step(self):
        self.engine.step()

    def grad_norm(self) -> float:
        """The gradient norm the engine's last step computed (its own all-reduced figure)."""
        return float(self.engine.get_global_grad_norm())

    def close(self):
        self.engine.destroy()


class DeepSpeedSystem(ZkernSystem):
    """DeepSpeed's engine at the spec's stage: its forward, backward and step are zkern's calls too."""

    def __init__(self, spec: TrainSpec, world: int, offload: bool = False):
        import deepspeed

        from bench.peers import deepspeed_config

        model = make_model(spec).cpu()
        config = deepspeed_config(spec, world)
        if offload:
            config["zero_optimization"]["offload_optimizer"] = dict(HOST_ADAM)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        self.spec = spec

    def close(self):
        pass


class TorchSystem:
    """A stock torch loop: zero_grad(set_to_none=True) (torch's default, so no gradient lives through forward),
    forward under autocast when the parameters are fp32, backward, AdamW."""

    record_norms = False  # measure() turns it on with --grad-norms: a pass over the gradients before each step

    def __init__(self, spec: TrainSpec, model, params, opt, autocast: bool):
        self.spec, self.model, self.params, self.opt, self.autocast = spec, model, params, opt, autocast
        self.device = rank_device(spec)

    def forward(self, idx, tgt, step, rank):
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            return self.spec.loss(self.model, idx, tgt, step, rank)

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.last_norm = _norm_of_grads(self.params) if self.record_norms else None
        self.opt.step()

    def grad_norm(self) -> float:
        """The norm of the gradients the last step applied, from the parameters' .grad (FSDP2's shards summed over
        the ranks), read before the optimizer ran."""
        return self.last_norm

    def close(self):
        pass


def _norm_of_grads(params) -> float:
    """The global 2-norm of params' gradients: local tensors summed, FSDP2's DTensor shards over their mesh."""
    import torch.distributed as dist

    total, sharded = torch.zeros((), dtype=torch.float64, device=params[0].device), False
    for p in params:
        g = p.grad
        if g is None:
            continue
        if hasattr(g, "to_local"):
            g, sharded = g.to_local(), True
        total = total.to(g.device) + g.double().pow(2).sum()
    if sharded and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return float(total.sqrt())


class MixedTorchSystem(TorchSystem):
    """bf16 weights and gradients, an fp32 master: after backward the gradients are upcast onto the master, fused
    AdamW steps it, and the bf16 weights take its rounding (zkern's arithmetic; DeepSpeed's bf16 optimizer)."""

    def __init__(self, spec: TrainSpec, model, world: int):
        model = model.to(torch.bfloat16)
        params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float() for p in params]
        for m in self.master:
            m.requires_grad_(True)
        opt = torch.optim.AdamW(self.master, lr=spec.lr, weight_decay=spec.weight_decay, fused=True)
        super().__init__(spec, model, params, opt, autocast=False)
        self.world = world

    def forward(self, idx, tgt, step, rank):
        for p in self.params:
            p.grad = None
        return self.spec.loss(self.model, idx, tgt, step, rank)

    def step(self):
        import torch.distributed as dist

        grads = [p.grad for p in self.params]
        if self.world > 1:  # one bf16 all-reduce per gradient (a plain loop; DDP's buckets are the ddp rows)
            for g in grads:
                dist.all_reduce(g)
                g.div_(self.world)
        for m, g in zip(self.master, grads):
            m.grad = g.float()
        self.last_norm = _norm_of_grads(self.master) if self.record_norms else None
        self.opt.step()
        for m in self.master:
            m.grad = None
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.master)


class MixedOffloadTorchSystem(TorchSystem):
    """torch-mixed with the master and the optimizer on the host (world 1): after backward each slice of parameters
    has its bf16 gradients copied down and upcast, its AdamW(fused=True, on the host's CPU) step, and its new values
    rounded to bf16 on the way back up."""

    SLICES = 16  # host fp32 gradients held at once: 1/SLICES of the model

    def __init__(self, spec: TrainSpec, model, world: int):
        if world != 1:
            raise SystemExit("probe: torch-mixed-offload is a one-rank reference")
        model = model.to(torch.bfloat16)
        params = [p for p in model.parameters() if p.requires_grad]
        per = -(-len(params) // self.SLICES)
        self.slices = []
        for lo in range(0, len(params), per):
            device_side = params[lo:lo + per]
            master = [p.detach().to("cpu", torch.float32).requires_grad_(True) for p in device_side]
            opt = torch.optim.AdamW(master, lr=spec.lr, weight_decay=spec.weight_decay, fused=True)
            self.slices.append((device_side, master, opt))
        super().__init__(spec, model, params, self.slices[0][2], autocast=False)

    def forward(self, idx, tgt, step, rank):
        for p in self.params:
            p.grad = None
        return self.spec.loss(self.model, idx, tgt, step, rank)

    def step(self):
        total = 0.0
        for device_side, master, opt in self.slices:
            for m, p in zip(master, device_side):
                m.grad = p.grad.to("cpu").float()
            if self.record_norms:
                total += sum(float(m.grad.double().pow(2).sum()) for m in master)
            opt.step()
            with torch.no_grad():
                for m, p in zip(master, device_side):
                    m.grad = None
                    p.copy_(m)
        self.last_norm = total ** 0.5 if self.record_norms else None


@contextlib.contextmanager
def _uploads_inline():
    """Inside: a stage-3 runtime built gets no side stream for its uploads (each prefetched unit's host chunk is
    then copied up on the compute stream, as before stage3/uploads.py)."""
    from zkern.stage3.runtime import Stage3Runtime

    original = Stage3Runtime.__dict__["_uploads"]
    Stage3Runtime._uploads = staticmethod(lambda *args: None)
    try:
        yield
    finally:
        Stage3Runtime._uploads = original


def build(name: str, spec: TrainSpec, world: int):
    """The system called name, built on this rank for spec (bf16 or fp32 as the spec says)."""
    if name not in NAMES:
        raise SystemExit(f"probe: unknown system {name!r}; known: {', '.join(NAMES)}")
    device = rank_device(spec)
    if name.startswith("zkern"):
        if name in OFFLOAD:
            stage, zero, bf16_state = OFFLOAD[name]
            spec = dataclasses.replace(spec, stage=stage, zero={**spec.zero, **zero})
            if bf16_state:
                spec = dataclasses.replace(spec, extra_config={
                    **spec.extra_config, "bf16": {"enabled": True, **bf16_state}, "bf16_stochastic_rounding": True})
        elif name in KEYED:
            stage, zero = KEYED[name]
            spec = dataclasses.replace(spec, stage=stage, zero={**spec.zero, **zero})
        else:
            spec = dataclasses.replace(spec, stage=int(name[-1]))
        if spec.stage == 3:
            spec = dataclasses.replace(spec, zero={"stage3_fetch_units": ["Block"], **spec.zero})
        with _uploads_inline() if name.endswith("-inline") else contextlib.nullcontext():
            return ZkernSystem(spec, world, on_device=name in OFFLOAD)
    if name.startswith("deepspeed"):
        return DeepSpeedSystem(dataclasses.replace(spec, stage=int(name[len("deepspeed")])), world,
                               offload=name.endswith("-offload"))
    if world > 1 or name.startswith(("fsdp2", "zero1")):
        init_peer_group(spec)
    bf16 = spec.precision == "bf16"
    fused = True if name.endswith("-fused") else None
    if device.type == "cuda" and name in ("zero1", "fsdp2-zero2"):
        fused = True  # as the bench's peers run on a GPU (peers._fused)
    match name:
        case "zero1":
            from torch.distributed.optim import ZeroRedundancyOptimizer
            from torch.nn.parallel import DistributedDataParallel

            model = make_model(spec)
            params = [p for p in model.parameters() if p.requires_grad]
            wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None) \
                if world > 1 else model
            opt = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=spec.lr,
                                          weight_decay=spec.weight_decay, fused=fused)
            return TorchSystem(spec, wrapped, params, opt, autocast=bf16)
        case "ddp" | "ddp-fused":
            model = make_model(spec)
            params = [p for p in model.parameters() if p.requires_grad]
            wrapped = model
            if world > 1:
                from torch.nn.parallel import DistributedDataParallel

                wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
            opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay,
                                    fused=True if name == "ddp-fused" else None)
            return TorchSystem(spec, wrapped, params, opt, autocast=bf16)
        case "fsdp2" | "fsdp2-fused" | "fsdp2-zero2" | "fsdp2-offload":
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

            model = make_model(spec)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16) if bf16 else \
                MixedPrecisionPolicy()
            reshard = name != "fsdp2-zero2"
            # CPUOffloadPolicy: the sharded fp32 parameters and their gradients live on the host, and the optimizer
            # (torch's AdamW, as FSDP2's users step it) runs there; a CPU-only machine is the host already (and
            # FSDP2 refuses the policy without an accelerator)
            host = name == "fsdp2-offload" and device.type != "cpu"
            offload = CPUOffloadPolicy() if host else OffloadPolicy()
            for block in model.blocks:
                fully_shard(block, mp_policy=policy, reshard_after_forward=reshard, offload_policy=offload)
            fully_shard(model, mp_policy=policy, reshard_after_forward=reshard, offload_policy=offload)
            params = [p for p in model.parameters() if p.requires_grad]
            opt = torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, fused=fused)
            return TorchSystem(spec, model, params, opt, autocast=False)
        case "torch-mixed":
            if not bf16:
                raise SystemExit("probe: torch-mixed is the bf16 recipe; run it with a bf16 spec")
            return MixedTorchSystem(spec, make_model(spec), world)
        case "torch-mixed-offload":
            if not bf16:
                raise SystemExit("probe: torch-mixed-offload is the bf16 recipe; run it with a bf16 spec")
            return MixedOffloadTorchSystem(spec, make_model(spec), world)


@contextlib.contextmanager
def offload_phases(system, out: dict):
    """Inside: the host step's phases are timed (seconds, host clock) into out: `wait_down` (blocked on a gradient
    chunk still coming down), `upload_issue` (queueing the parameter chunks back up), `host_adam` (the rest of the
    optimizer's host time: the CPU Adam itself), `upload_tail` (after step() returns, until the uploads land); plus
    the bytes each way. Nothing is timed for a system without a host step."""
    import time

    host = getattr(getattr(system, "engine", None), "host_step", None)
    if host is None:
        yield
        return
    spent = {"wait_down": 0.0, "upload_issue": 0.0}
    wait_down, up = host._wait_down, host._up

    def timed(fn, key):
        def inner(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        return inner

    host._wait_down, host._up = timed(wait_down, "wait_down"), timed(up, "upload_issue")
    try:
        yield spent
    finally:
        host._wait_down, host._up = wait_down, up
        out.update(spent)
        if host.speculative:  # what became of the backward's guess, and its Adam's time and threads
            out.update({k: host.last_step.get(k) for k in ("speculation", "speculated_chunks", "speculative_adam_s",
                                                           "speculation_wait_s", "background_adam_threads")})
        out["grad_bytes_down"] = sum(c.grad.numel() * c.grad.element_size() for g in host.host_groups
                                     for c in g.chunks)
        out["param_bytes_up"] = sum(c.out.numel() * c.out.element_size() for g, d in
                                    zip(host.host_groups, host.device_groups) for c, dc in zip(g.chunks, d.chunks)
                                    if c.out is not None and c.out is not dc.out)
