"""What zkern makes of a config file: the engine's start-up block (rank 0) and `python -m zkern.config check`.

    python -m zkern.config check ds_config.json [--world 8] [--hidden-size 4096]

Prints the resolved settings that matter (batch sizes, stage, precision, offload, ZeRO++, optimizer, scheduler,
monitors) and, key by key, what was accepted but changes nothing in zkern, what was warned about (keys that are not
DeepSpeed's), what was read under another spelling, and what "auto" became. Exit code 0 when the config is usable, 1
with the ConfigError's message when it is not.
"""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

from zkern.config.model import Config
from zkern.errors import ConfigError


def summary(cfg: Config) -> list[str]:
    """The settings a reader checks first, one line each."""
    zero = cfg.zero_optimization
    lines = [f"batch: train_batch_size {cfg.train_batch_size} = micro {cfg.train_micro_batch_size_per_gpu} x "
             f"accumulation {cfg.gradient_accumulation_steps} x world {cfg.world_size}",
             f"ZeRO stage {zero.stage}, {cfg.precision}, gradient_clipping {cfg.gradient_clipping:g}"]
    offload = [f"optimizer -> {zero.offload_optimizer_device}" for _ in [0] if zero.offload_optimizer_device != "none"]
    if zero.offload_optimizer_device == "cpu" and zero.offload_optimizer_ratio < 1.0:
        offload[0] += f" (ratio {zero.offload_optimizer_ratio:g}: that share on the host, the rest on the device)"
    offload += [f"parameters -> {zero.offload_param_device}" for _ in [0] if zero.offload_param_device != "none"]
    if offload:
        lines.append("offload: " + ", ".join(offload))
    muon = cfg.optimizer is not None and cfg.optimizer.type == "muon"
    if muon and zero.offload_optimizer_device == "nvme":
        lines.append("Muon on NVMe: master and AdamW moments in files; Muon's momentum " + (
            "in host memory (save_muon_momentum_buffer_in_memory)" if zero.save_muon_momentum_buffer_in_memory else
            "in the exp_avg files"))
    elif zero.save_muon_momentum_buffer_in_memory:
        lines.append("save_muon_momentum_buffer_in_memory: changes nothing here (it keeps Muon's momentum off NVMe; "
                     "this run has no Muon on offload_optimizer \"nvme\")")
    share = f"{zero.offload_optimizer_cpuadam_cores_perc:g} of the CPU Adam's threads (cpuadam_cores_perc)"
    if zero.offload_optimizer_delayed_update:
        lines.append(f"host Adam: the delayed update, one step behind the model, on {share}")
    elif zero.offload_optimizer_speculative_step or zero.offload_optimizer_super_offload:
        kept = (f"kept at steps without overflow whose gradient norm is at most gradient_clipping "
                f"{cfg.gradient_clipping:g}, else redone" if cfg.gradient_clipping > 0 else
                "kept at steps without overflow, else redone")
        lines.append(f"host Adam: the speculative step, in backward on {share}; {kept}")
    zeropp = [name for name, on in (("qwZ", zero.zero_quantized_weights), ("hpZ", zero.zero_hpz_partition_size > 1),
                                    ("qgZ", zero.zero_quantized_gradients), ("LoCo", zero.loco_err_beta is not None))
              if on]
    if zeropp:
        lines.append("ZeRO++: " + ", ".join(zeropp))
    bf16_state = [name for name, on in (("master", cfg.bf16.bf16_master_weights_and_grads),
                                        ("moments", cfg.bf16.bf16_optimizer_states)) if on and cfg.bf16.enabled]
    if bf16_state:
        rounding = "stochastic rounding" if cfg.bf16_stochastic_rounding else "rounded to nearest even"
        lines.append(f"optimizer state in bf16: {' and '.join(bf16_state)}, {rounding}")
    if cfg.optimizer is not None:
        lines.append(f"optimizer: {cfg.optimizer.type} {cfg.optimizer.params}")
    if cfg.scheduler is not None:
        lines.append(f"scheduler: {cfg.scheduler.type} {cfg.scheduler.params}")
    monitors = [name for name in ("tensorboard", "csv_monitor", "wandb", "comet") if getattr(cfg.monitor, name)]
    extras = monitors + [name for name, on in (("wall_clock_breakdown", cfg.wall_clock_breakdown),
                                               ("memory_breakdown", cfg.memory_breakdown),
                                               ("flops_profiler", cfg.flops_profiler.enabled),
                                               ("comms_logger", cfg.comms_logger.enabled)) if on]
    if extras:
        lines.append("reporting: " + ", ".join(extras))
    return lines


def startup_block(cfg: Config) -> str:
    """The engine's start-up block: the summary, then every note."""
    notes = cfg.notes.lines()
    body = summary(cfg) + (notes or ["every key is implemented and set explicitly"])
    return "zkern config:\n  " + "\n  ".join(body)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zkern.config", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="parse a config and say what zkern makes of it")
    check.add_argument("path", help="a DeepSpeed-style JSON config")
    check.add_argument("--world", type=int, default=1, help="the world size to resolve it for (default 1)")
    check.add_argument("--hidden-size", type=int, default=None,
                       help="the model's hidden size, for \"auto\" bucket sizes (as the HF integration derives them)")
    args = parser.parse_args(argv)
    try:
        cfg = Config.load(args.path)
        model = None if args.hidden_size is None else SimpleNamespace(config=SimpleNamespace(
            hidden_size=args.hidden_size))
        try:
            cfg = cfg.resolve(args.world, model)
        except ConfigError as e:
            if "auto" not in str(e):
                raise
            print(f"note: not resolved for world {args.world}: {e}")
    except ConfigError as e:
        print(f"{args.path}: error: {e}", file=sys.stderr)
        return 1
    print(f"{args.path}: usable by zkern")
    print(startup_block(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
