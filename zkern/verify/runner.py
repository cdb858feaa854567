"""A draw on zkern's engine, on every rank: build, train, write, overflow, save, load, as the draw says; what it
returns is what check.py compares with the single-process reference (single.py).

    python -m pytest tests/verify/test_verify.py -q
"""

from __future__ import annotations

import os

import torch

from zkern.testing.models import TinyGPT, TinyMoE, make_batches
from zkern.verify import recipes
from zkern.verify.draws import Draw
from zkern.verify.loops import AcceleratorLoop, EngineLoop
from zkern.verify.observe import quantized_units, working_digest

VOCAB, SEQ, DIM = 67, 16, 32
FROZEN = ("qkv", "proj")  # the layers a draw freezes (at the start, or from the load on)
QWZ_GROUP = 64  # zeropp_weight_group_size: qwZ quantizes each rank's chunk in groups of this many elements


def make_model(draw: Draw, checkpoint: str = "") -> torch.nn.Module:
    """The draw's model, initialised from its seed (the same on every rank and in the reference)."""
    torch.manual_seed(draw.seed)
    if draw.arch == "moe":
        return TinyMoE(vocab=VOCAB, dim=DIM, n_layer=2, n_head=2, seq=SEQ, n_experts=4, checkpoint=checkpoint,
                       sentinel=True)
    return TinyGPT(vocab=VOCAB, dim=DIM, n_layer=2, n_head=2, seq=SEQ, checkpoint=checkpoint, views=draw.views,
                   sentinel=True)


def freeze(model: torch.nn.Module) -> None:
    for block in model.blocks:
        for name in FROZEN:
            getattr(block, name).requires_grad_(False)


def written_name(draw: Draw) -> str:
    """The parameter the GatheredParameters write sets (never a frozen one)."""
    return "blocks.1.ln2.weight"


def written_value(shape: torch.Size) -> torch.Tensor:
    """Values exact in fp32, bf16 and fp16 (k / 64 for small k), so every precision writes the same numbers."""
    n = int(torch.Size(shape).numel())
    return ((torch.arange(n) % 7 - 3).float() / 64 + 1.0).view(shape)


def set_value(shape: torch.Size) -> torch.Tensor:
    """set_at's values: written_value's halved (still exact in every precision), so the two writes differ."""
    return written_value(shape) / 2


def global_batches(draw: Draw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[step] -> (idx, tgt) of the draw's global batch of that step; after them one more, the batch a draw drops."""
    batches = make_batches(draw.seed + 1, draw.steps, 1, 1, draw.global_size, SEQ, VOCAB)
    dropped = make_batches(draw.seed + 2, 1, 1, 1, draw.global_size, SEQ, VOCAB)
    return [b[0][0] for b in batches + dropped]


def groups(model: torch.nn.Module) -> list[dict]:
    """HF Trainer's groups: weight decay on matrices and embeddings, none on biases and norms."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": 0.01},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]


def config(draw: Draw, world: int, stage: int, root: str, device: str) -> dict:
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 100, "reduce_bucket_size": draw.bucket,
                  "stage3_prefetch_bucket_size": draw.bucket, "overlap_comm": draw.overlap,
                  "reduce_scatter": draw.reduce_scatter}
    if stage == 3 and draw.block_units:
        zero["stage3_fetch_units"] = ["MoEBlock" if draw.arch == "moe" else "Block"]
    if stage == 3 and draw.max_live:
        zero["stage3_max_live_parameters"] = draw.max_live
    if stage == 3 and draw.keep_working:
        zero["stage3_keep_working_shard"] = True
    if draw.muon_in_memory:
        zero["save_muon_momentum_buffer_in_memory"] = True
    nvme = os.path.join(root, "nvme")
    if draw.offload_optimizer != "none" and stage > 0:
        zero["offload_optimizer"] = {"device": draw.offload_optimizer, "nvme_path": nvme, "buffer_count": 3,
                                     "delayed_update": draw.delayed_update, "staging_chunks": draw.staging_chunks,
                                     "ratio": draw.offload_ratio,
                                     "speculative_step": draw.speculative}
    if draw.offload_param != "none" and stage == 3:
        zero["offload_param"] = {"device": draw.offload_param, "nvme_path": nvme, "max_in_cpu": 1000}
    if stage == 3:
        zero.update(zero_quantized_weights=draw.qwz, zero_hpz_partition_size=2 if draw.hpz else 1,
                    zeropp_weight_group_size=QWZ_GROUP)
    if stage >= 2 and draw.qgz:
        zero["zero_quantized_gradients"] = True
        if draw.loco:
            zero["zeropp_loco_param"] = {"err_beta": 0.8, "reset_T": 1024}
    cfg = {"train_micro_batch_size_per_gpu": draw.global_size // (world * draw.accumulation),
           "gradient_accumulation_steps": draw.accumulation, "gradient_clipping": draw.clip,
           "zero_optimization": zero, "steps_per_print": 0, "comm_timeout_s": 120, "device": device,
           "ranks_per_node": 2 if world >= 2 and world % 2 == 0 else world}
    sections = {"optimizer": recipes.optimizer_section(draw), "scheduler": recipes.scheduler_section(draw)}
    cfg.update({key: section for key, section in sections.items() if section is not None})
    if draw.predivide:
        cfg["gradient_predivide_factor"] = draw.predivide
    if draw.fp32_comm:
        cfg["communication_data_type"] = "fp32"
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if draw.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        if draw.bf16_state:
            cfg["bf16"].update(bf16_optimizer_states=True,
                               bf16_master_weights_and_grads=draw.bf16_state.startswith("master"))
            cfg["bf16_stochastic_rounding"] = draw.bf16_state.endswith("_sr")
    elif draw.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "hysteresis": 1, "loss_scale_window": 3}
    if draw.autocast:
        cfg["torch_autocast"] = {"enabled": True, "dtype": draw.autocast}
    return cfg


def build(draw: Draw, world: int, stage: int, root: str, frozen: bool, device: str = "cpu"):
    """The draw's training loop (loops.py) around an engine built for this phase."""
    import zkern

    model = make_model(draw, draw.checkpoint)
    if frozen:
        freeze(model)
    cfg = config(draw, world, stage, root, device)
    params = groups(model) if draw.groups else None
    client = None
    if draw.optimizer == "client":  # the user's own AdamW, built on the groups (or the trainable parameters)
        client = recipes.client_optimizer(draw, params or [p for p in model.parameters() if p.requires_grad])
        params = None
    if draw.frontend == "accelerator":
        return AcceleratorLoop(model, cfg, params, client)
    scheduler = recipes.client_scheduler if draw.scheduler == "client" else None
    return EngineLoop(zkern.Engine(model, cfg, optimizer=client, lr_scheduler=scheduler, model_parameters=params))


def micro_batches(batch, world: int, rank: int, accumulation: int):
    idx, tgt = batch
    per = idx.shape[0] // (world * accumulation)
    for micro in range(accumulation):
        lo = (micro * world + rank) * per
        yield idx[lo:lo + per], tgt[lo:lo + per]


def train_step(loop, draw: Draw, step: int, batch, world: int, rank: int, out: dict, dropped=None) -> None:
    engine = loop.engine
    if step == draw.eval_at:  # an evaluation (or a generation) between steps: no gradient, no state moves
        engine.eval()
        with engine.gathered_for_generation() if draw.eval_generation else torch.no_grad():
            idx, tgt = next(micro_batches(batch, world, rank, 1))
            loop.forward(idx, tgt)
        engine.train()
    if step == draw.dropped_at and dropped is not None:  # a bad batch: its backward, then zero_grad drops it
        idx, tgt = next(micro_batches(dropped, world, rank, draw.accumulation))
        engine.backward(loop.forward(idx, tgt) * 3.0)
        engine.zero_grad()
    if step == draw.spare_forward_at:  # a forward whose graph is dropped unused (a logging pass, say)
        idx, tgt = next(micro_batches(batch, world, rank, draw.accumulation))
        loop.forward(idx, tgt)
    micros = 1 if step == draw.short_at else draw.accumulation
    if micros < draw.accumulation:  # a short accumulation (an epoch's last): the first micro-step is the boundary
        engine.set_gradient_accumulation_boundary(True)
    total = 0.0
    for micro, (idx, tgt) in zip(range(micros), micro_batches(batch, world, rank, draw.accumulation)):
        poison = None
        if step == draw.overflow_at and micro == draw.overflow_micro and rank == draw.overflow_rank:
            poison = float("nan" if draw.overflow_nan else "inf")  # a spike on one rank: every rank skips
        last = micro == micros - 1
        total += loop.train_micro_step(idx, tgt, poison, before_step=(lambda: set_weight(engine, draw))
                                       if last and step == draw.set_at else None)
    if micros < draw.accumulation:
        engine.set_gradient_accumulation_boundary(None)
    out["losses"][step] = total / micros
    out["grad_norms"][step] = engine.last_grad_norm
    out.setdefault("hashes", {})[step] = working_digest(engine)


def write(engine, draw: Draw, rank: int) -> None:
    import zkern

    param = dict(engine.module.named_parameters())[written_name(draw)]
    with zkern.GatheredParameters(param, modifier_rank=0):
        if rank == 0:
            with torch.no_grad():
                param.copy_(written_value(param.shape).to(param.dtype))


def set_weight(engine, draw: Draw) -> None:
    """safe_set_full_fp32_param of the written parameter to set_value, between a backward and its step() (every
    rank, the same value: it is a collective)."""
    import zkern

    param = dict(engine.module.named_parameters())[written_name(draw)]
    zkern.safe_set_full_fp32_param(param, set_value(zkern.safe_get_full_fp32_param(param).shape))


def stray_micro_step(loop, draw: Draw, batch, world: int, rank: int) -> None:
    """A micro-step whose gradients a load must discard (a live engine loaded mid-accumulation)."""
    idx, tgt = next(micro_batches(batch, world, rank, draw.accumulation))
    loop.stray_micro_step(idx, tgt, draw.accumulation)


def load_flags(draw: Draw) -> dict:
    """load_checkpoint's flags for the draw's load."""
    return {"": {}, "no_optimizer": {"load_optimizer_states": False},
            "no_scheduler": {"load_lr_scheduler_states": False},
            "module_only": {"load_module_only": True}}[draw.load_flags]


def run_phases(rank: int, world: int, draw: Draw, root: str, phases: list[int], device: str = "cpu") -> dict:
    """Run the draw's phases listed (indices into draw.phases) on this rank; returns losses and gradient norms per
    step, counters, and (rank 0) the final fp32 weights. With ZKERN_MUTANT set, that planted bug is in the engine
    meanwhile (planted.py; mutants.py is the fuzzer's own test)."""
    from zkern.verify.planted import planted

    with planted():
        return _run_phases(rank, world, draw, root, phases, device)


def _run_phases(rank: int, world: int, draw: Draw, root: str, phases: list[int], device: str) -> dict:
    out = {"losses": {}, "grad_norms": {}, "hashes": {}}
    batches = global_batches(draw)
    ckpt = os.path.join(root, "ckpt")
    if draw.frontend == "trainer":  # one phase: the Trainer runs the whole loop
        from zkern.verify import trainer_loop

        model = make_model(draw, draw.checkpoint)
        if draw.frozen == "start":
            freeze(model)
        cfg = config(draw, world, draw.stage, root, device)
        return _finished(trainer_loop.train(draw, model, cfg, batches, world, rank, device, out), out)
    loop = None
    for index in phases:
        phase_world, stage, first, last = draw.phases[index]
        if phase_world != world:
            raise ValueError(f"phase {index} runs at world {phase_world}, not {world}")
        frozen = draw.frozen == "start" or (draw.frozen == "load" and index == 1)
        if loop is not None:
            held = _held(loop) if draw.frontend == "engine" else {}
            loop.destroy()
            loop = None
            out["outlived"] = _alive(held)
        loop = build(draw, world, stage, root, frozen, device)
        if index == 1:
            loop.load(ckpt, load_flags(draw))
        if draw.qwz:
            out.setdefault("qwz_units", {})[index] = quantized_units(loop.engine)
        for step in range(first, last):
            if step == draw.write_at:
                write(loop.engine, draw, rank)
            train_step(loop, draw, step, batches[step], world, rank, out, dropped=batches[draw.steps])
            if step == draw.reads_at:
                reads(loop.engine, draw, rank, os.path.join(root, "reads"))
            if step == draw.save_at:
                loop.save(ckpt, draw.async_save)
                if draw.load_into == "live":
                    stray_micro_step(loop, draw, batches[step], world, rank)
                    loop.wait()
                    loop.load(ckpt, load_flags(draw))
                else:
                    if draw.async_save:  # training goes on while the writer writes; the fresh engine resumes at the
                        scratch = {"losses": {}, "grad_norms": {}}  # save, so this step is thrown away
                        train_step(loop, draw, step + 1, batches[step + 1], world, rank, scratch)
                    loop.wait()
    return _finished(loop.engine, out)


def _held(loop) -> dict:
    """Weak references to what a phase's engine holds (its runtime, its optimizer)."""
    import weakref

    engine = loop.engine
    held = {"runtime": weakref.ref(engine.runtime)}
    if engine.optimizer is not None:
        held["optimizer"] = weakref.ref(engine.optimizer)
    return held


def _alive(held: dict) -> list[str]:
    """What of a destroyed and dropped engine is still alive once Python has collected it (nothing may be)."""
    import gc

    gc.collect()
    return sorted(name for name, ref in held.items() if ref() is not None)


def reads(engine, draw: Draw, rank: int, path: str) -> None:
    """Everything a run may do between steps that reads and must not change it (draw.reads_at)."""
    import zkern

    engine.save_checkpoint(path, tag="sync")
    engine.save_checkpoint(path, tag="async", async_save=True)
    engine.wait_checkpoint()
    engine.full_state_dict(rank0_only=True)
    engine.full_working_state_dict(rank0_only=True)
    for _ in engine.stream_full_weights(rank0_only=True):
        pass
    param = dict(engine.module.named_parameters())[written_name(draw)]
    with zkern.GatheredParameters(param, modifier_rank=0):  # entered to write; nothing written
        pass


def _finished(engine, out: dict) -> dict:
    """out with the engine's counters and (rank 0) its final fp32 weights and what its 16-bit export holds against
    them (the trained model, an update in flight included: every export must hold it); the engine destroyed."""
    out.update(skipped=engine.skipped_steps, global_steps=engine.global_steps, loss_scale=engine.loss_scale)
    exported = engine.full_working_state_dict(rank0_only=True)
    state = engine.full_state_dict(rank0_only=True)
    if state is not None:
        out["export_behind"] = sorted(k for k, v in exported.items() if k in state and v.is_floating_point()
                                      and not torch.equal(v, state[k].to(v.dtype)))
    out["state"] = None if state is None else {k: v.detach().cpu() for k, v in state.items()}
    engine.destroy()
    return out
