"""Planted bugs: the fuzzer's own test. Each mutant breaks one thing zkern must get right, the way a real bug would
(an optimizer that never updates, a reduction that forgets a rank, a checkpoint that drops the moments); `make
mutants` plants each in turn in the engine's ranks and runs draws until one fails. A mutant no draw fails is a hole
in the net.

    make mutants                                                # every mutant, its killing draws; a record
    python -m zkern.verify.mutants --only adam.no_update        # one

The mutants and their planting are in planted.py; this file is the driver: the draws that reach each mutant's code,
which of them kills which (KILLERS, replayed by tests/verify/test_verify.py), and the hunt.
"""

from __future__ import annotations

import os

from zkern.verify.planted import ENV, MUTANTS, planted  # noqa: F401  (planted: this module's public name before)

# Draws chosen to reach every mutant's code: exact fp32 runs of each stage (clipping, accumulation), fp16 with a
# planted overflow, save and load, qgZ with LoCo, qwZ, hpZ, ZeRO-Offload and NVMe, a load that leaves the optimizer
# behind, torch's SGD and zkern's Lamb over the shard pieces. `make mutants` tries them first,
# then random draws; KILLERS records which of them kills which mutant (the CI test replays exactly those).
TARGETED = [
    '{"accumulation": 2, "clip": 0.05, "seed": 11, "stage": 2, "world": 2}',
    '{"clip": 0.05, "seed": 12, "stage": 1, "world": 2}',
    '{"seed": 13, "stage": 3, "world": 2}',
    '{"overflow_at": 1, "precision": "fp16", "seed": 14, "stage": 2, "steps": 4, "world": 2}',
    '{"save_at": 1, "seed": 15, "stage": 2, "world": 2}',
    '{"loco": true, "qgz": true, "seed": 16, "stage": 2, "world": 4}',
    '{"qwz": true, "seed": 17, "stage": 3, "world": 2}',
    '{"hpz": true, "seed": 18, "stage": 3, "world": 4}',
    '{"offload_optimizer": "cpu", "seed": 19, "stage": 2, "world": 2}',
    '{"offload_optimizer": "nvme", "seed": 20, "stage": 2, "world": 2}',
    '{"load_flags": "no_optimizer", "save_at": 1, "seed": 21, "stage": 2, "world": 2}',
    '{"accumulation": 2, "clip": 0.05, "optimizer": "SGD", "seed": 22, "stage": 1, "world": 2}',
    '{"optimizer": "Lamb", "seed": 23, "stage": 2, "world": 2}',
    '{"accumulation": 2, "frontend": "accelerator", "load_flags": "no_optimizer", "save_at": 1, "seed": 24, '
    '"stage": 2, "world": 2}',
    '{"accumulation": 2, "frontend": "trainer", "groups": true, "seed": 25, "stage": 2, "world": 2}',
    '{"delayed_update": true, "offload_optimizer": "cpu", "save_at": 1, "seed": 26, "stage": 2, "world": 2}',
    '{"offload_optimizer": "cpu", "seed": 27, "set_at": 1, "stage": 2, "world": 2}',
    '{"bucket": 1000, "offload_optimizer": "cpu", "seed": 28, "stage": 2, "staging_chunks": 1, "world": 2}',
    '{"offload_optimizer": "cpu", "offload_param": "cpu", "seed": 29, "stage": 3, "world": 1}',
    '{"clip": 0.05, "offload_optimizer": "cpu", "seed": 30, "speculative": true, "stage": 2, "world": 2}',
    '{"offload_optimizer": "cpu", "offload_param": "cpu", "overflow_at": 1, "precision": "fp16", "seed": 31, '
    '"speculative": true, "stage": 3, "world": 2}',
    '{"seed": 32, "stage": 3, "views": true, "world": 2}',
    '{"delayed_update": true, "offload_optimizer": "cpu", "reads_at": 1, "seed": 33, "stage": 2, "world": 2}',
    '{"optimizer": "Muon", "seed": 34, "stage": 3, "world": 2}',
    '{"delayed_update": true, "offload_optimizer": "cpu", "seed": 457105, "stage": 1, "write_at": 1}',
    '{"offload_optimizer": "cpu", "offload_ratio": 0.5, "save_at": 1, "seed": 35, "stage": 3, "world": 2}',
    '{"precision": "bf16", "seed": 36, "stage": 3, "world": 2}',
    '{"offload_optimizer": "nvme", "optimizer": "Muon", "seed": 37, "stage": 2, "world": 2}',
]


# Which TARGETED draw (its index) kills each mutant: `make mutants` on 2026-11-26 (bench/results/
# cpu-2026-11-26-mutants.json), each the first draw it tried that failed. The CI test replays these.
KILLERS = {
    **{name: 0 for name in ("adam.no_update", "adam.lr_x1.5", "adam.uphill", "adam.step_stuck",
                            "adam.no_bias_correction", "adam.no_weight_decay", "adam.grad_scale_dropped",
                            "adam.betas_swapped", "step.clip_ignored", "step.control_not_reduced", "scheduler.frozen",
                            "reduce.bucket_skipped", "reduce.rank0_twice", "reduce.no_predivide",
                            "stage12.params_not_gathered")},
    "step.overflow_applied": 3, "scaler.frozen": 3,
    "stage3.shard_offset": 2, "stage3.unit_grads_dropped": 2, "stage3.stale_after_step": 2,
    "ckpt.moments_not_restored": 4, "ckpt.step_count_plus_one": 4, "ckpt.scheduler_not_restored": 4,
    "loco.no_feedback": 5, "qgz.hop_drops_ranks": 5, "qwz.scales_dropped": 5,  # LoCo dequantizes what it sends
    "hpz.always_fresh": 7, "offload.not_uploaded": 8, "nvme.last_tile_skipped": 9,
    "ckpt.load_flags_ignored": 10, "torch_optimizer.grad_scale_dropped": 11, "lamb.norms_local": 12,
    "accelerate.boundary_ignored": 13, "accelerate.load_flags_dropped": 13, "trainer.accumulation_divided_twice": 14,
    "offload.delay_lands_at_once": 15,  # added 2026-11-27, killed by its targeted draw (tests/verify replays it)
    "offload.staging_overwritten": 16,  # added 2026-11-27 with the draws' set_at (a weight set before step())
    "offload.ring_reused_early": 17,  # added 2026-11-27 with the staging ring (offload_optimizer.staging_chunks)
    "offload.upload_unwaited": 18,  # added 2026-11-27 with stage 3's uploads ahead of use (stage3/uploads.py)
    "offload.speculation_kept_when_clipped": 19,  # added 2026-11-27 with the speculative step (speculative.py)
    "offload.speculation_in_place": 20,  # added 2026-11-28 with the speculative step beside stage 3's offload_param
    # added 2026-11-28 with issue 59's classes: views of a parameter a module hands out, exports and reads under the
    # delayed update, a dropped engine (its first fresh load: the draw that saves and loads at stage 2)
    "stage3.views_freed": 21, "offload.save_lands_update": 22, "offload.export_one_behind": 22,
    "engine.hooks_hold_runtime": 4,
    "muon.spans_not_assembled": 23, "muon.aspect_scale_dropped": 23,  # added 2026-11-28 with Muon (optim/muon.py)
    # added 2026-11-28: the GatheredParameters write the fuzzer found comparing with the weights before the update
    "offload.write_compared_with_stale": 24,
    "offload.device_part_unstepped": 25,  # added 2026-11-28 with partial offload (offload/partial.py)
    "stage3.gather_source_cached": 26,  # added 2026-11-29 with stage 3's gathers cast from the master
    "nvme.muon_momentum_unwritten": 27,  # added 2026-11-29 with Muon on NVMe (offload/nvme_muon.py)
}


def hunt(name: str, draws: list, report=print) -> dict:
    """Plant mutant `name` in the engine's ranks and run draws (Draw objects) in batches until one fails."""
    import shutil
    import tempfile
    import time

    from zkern.verify import fuzz

    start = time.perf_counter()
    os.environ[ENV] = name
    tried = 0
    try:
        for first in range(0, len(draws), 4):
            chunk = draws[first:first + 4]
            root = tempfile.mkdtemp(prefix="zkern-mutant-")
            try:
                try:
                    outcomes = fuzz._batch(chunk, root, 60.0)
                except Exception as e:  # a batch that failed as a whole: its first draw is the one to blame
                    return {"mutant": name, "killed": True, "by": chunk[0].to_json(), "tried": tried + 1,
                            "why": f"{type(e).__name__}: {str(e)[:300]}", "seconds": time.perf_counter() - start}
            finally:
                shutil.rmtree(root, ignore_errors=True)
            for o in outcomes:
                tried += 1
                if not o.ok:
                    # a mutant whose own patch raised (its frames in planted.py) proves nothing about the net
                    patch = MUTANTS[name][1].__name__  # in a traceback, or in the message of a call it broke
                    broken = any("verify/planted.py" in f or f"{patch}." in f for f in o.failures)
                    return {"mutant": name, "killed": True, "by": o.draw.to_json(), "tried": tried,
                            "why": o.failures[0][:300], "seconds": time.perf_counter() - start,
                            "mutant_raised": broken}
    finally:
        os.environ.pop(ENV, None)
    return {"mutant": name, "killed": False, "by": None, "tried": tried, "why": None,
            "seconds": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import random

    from zkern.verify.draws import Draw, random_draw

    parser = argparse.ArgumentParser(prog="python -m zkern.verify.mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default=None, help="comma-separated mutant names (default: all)")
    parser.add_argument("--draws", type=int, default=40, help="random draws to try after the targeted ones")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the record here")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(MUTANTS)
    unknown = set(names) - set(MUTANTS)
    if unknown:
        parser.error(f"unknown mutants {sorted(unknown)}; the mutants are {', '.join(MUTANTS)}")
    rng = random.Random(args.seed)
    extra = [random_draw(rng) for _ in range(args.draws)]
    results = []
    for name in names:
        result = hunt(name, [Draw.from_json(t) for t in TARGETED] + extra)
        results.append(result)
        state = f"killed by draw {result['tried']}" if result["killed"] else "SURVIVED"
        print(f"[mutants] {name}: {state} ({result['seconds']:.0f} s) {result['why'] or ''}"[:240], flush=True)
    survivors = [r["mutant"] for r in results if not r["killed"]]
    print(f"[mutants] {len(results) - len(survivors)} of {len(results)} killed" +
          (f"; survived: {', '.join(survivors)}" if survivors else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seed": args.seed, "random_draws": args.draws, "results": results}, f, indent=1)
    return 1 if survivors else 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
