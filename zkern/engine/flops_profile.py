"""DeepSpeed's flops_profiler: at profile_step, one forward counted by torch's flop counter and timed per module;
a table of parameters, FLOPs, latency and achieved FLOP/s per module (to output_file, else the log), rank 0.

    python -m pytest tests/engine/test_reporting.py -q -k flops

module_depth limits the depth listed (-1: all), top_modules how many modules per depth are listed by FLOPs (the
whole model always comes first), detailed lists every module of those depths. Parameter counts are the whole
parameters' (stage 3's are at rest: their full shapes are counted). Backward is reported as DeepSpeed estimates it:
2x the forward's FLOPs (plus recompute_fwd_factor x the forward's with activation checkpointing).
"""

from __future__ import annotations

import logging
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from zkern.engine.parts import EngineParts

log = logging.getLogger("zkern")


def _numel(parts: EngineParts, p: torch.nn.Parameter) -> int:
    return int(parts.runtime.full_shape(p).numel())


def profile_forward(parts: EngineParts, run, args, kwargs, cfg) -> tuple[object, dict]:
    model = parts.module
    root = type(model).__name__
    names = {id(m): (f"{root}.{n}" if n else root) for n, m in model.named_modules()}
    seconds: dict[str, float] = {}
    starts: dict[int, float] = {}
    sync = (lambda: torch.cuda.synchronize(parts.device)) if parts.device.type == "cuda" else (lambda: None)

    def before(module, _):
        sync()
        starts[id(module)] = time.perf_counter()

    def after(module, _, __):
        sync()
        name = names[id(module)]
        seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - starts.pop(id(module), time.perf_counter())

    handles = []
    for m in model.modules():
        handles.append(m.register_forward_pre_hook(before))
        handles.append(m.register_forward_hook(after, always_call=True))
    try:
        with FlopCounterMode(display=False) as counter:
            out = run(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    flops = {name: sum(ops.values()) for name, ops in counter.get_flop_counts().items()}
    rows = []
    for name_in_model, module in model.named_modules():
        name = f"{root}.{name_in_model}" if name_in_model else root
        depth = 0 if not name_in_model else name_in_model.count(".") + 1
        params = sum(_numel(parts, p) for p in {id(p): p for p in module.parameters()}.values())
        latency = seconds.get(name, 0.0)
        f = flops.get(name, 0)
        rows.append({"module": name, "depth": depth, "params": params, "flops": f, "latency_s": latency,
                     "flops_per_s": f / latency if latency > 0 else 0.0})
    result = {"rows": rows, "total_flops": counter.get_total_flops(), "forward_s": seconds.get(root, 0.0),
              "backward_flops_estimate": int((2 + cfg.recompute_fwd_factor) * counter.get_total_flops())}
    if parts.rank == 0:
        _report(result, cfg)
    return out, result


def _report(result: dict, cfg) -> None:
    rows = result["rows"]
    lines = [f"zkern flops profiler (one forward at step {cfg.profile_step}): {result['total_flops']:.4g} FLOPs "
             f"forward, {result['backward_flops_estimate']:.4g} estimated for backward, "
             f"{1000 * result['forward_s']:.2f} ms forward",
             f"{'module':<48} {'params':>12} {'FLOPs':>12} {'latency ms':>11} {'FLOP/s':>11}"]
    depths = sorted({r["depth"] for r in rows})
    if cfg.module_depth >= 0:
        depths = [d for d in depths if d <= cfg.module_depth]
    for depth in depths:
        at = sorted((r for r in rows if r["depth"] == depth), key=lambda r: -r["flops"])
        if not cfg.detailed:
            at = at[:cfg.top_modules]
        for r in at:
            lines.append(f"{r['module'][:48]:<48} {r['params']:>12} {r['flops']:>12.4g} "
                         f"{1000 * r['latency_s']:>11.3f} {r['flops_per_s']:>11.4g}")
    text = "\n".join(lines)
    if cfg.output_file:
        with open(cfg.output_file, "w") as f:
            f.write(text + "\n")
    else:
        log.info("%s", text)
