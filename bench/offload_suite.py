"""The offload suite: where the time of an offloaded step goes, in four modes in the same run: gradients copied to
the host during backward (zkern's default), the same with a buffer per chunk (offload_optimizer.staging_chunks 0:
the default stages through a ring of four chunk buffers where a rank has more chunks), at step()
(offload_optimizer.copy_grads_during_backward false, through the ring too), with the delayed update
(offload_optimizer.delayed_update: the host Adam runs behind the next step's forward and backward), and with the
speculative step (offload_optimizer.speculative_step: each chunk's host Adam runs in backward as the chunk lands,
kept where the step comes out unclipped; the record says in how many of the timed steps the guess stood), once with
the gradient clipping every mode has (1.0, where a fresh model's guesses are undone: the Adam runs twice) and once
without clipping (where they stand), and with a partial offload (offload_optimizer.ratio 0.5: half the shard
stepped on the device, in place; the row says the share the split gave and the device part's host time in step()).

    python bench/run.py --suite offload --stage 2,3           # the small GPT, world 2, CPU
    python bench/run.py --suite offload --stage 3 --model 25m --steps 10 --json out.json

Each timed step (after the warm-up) is split by the host clock into forward + backward (which holds the copies made
during backward), the offloaded step (zkern/offload/host.py's accounting: the time it waited for gradients, and the
rest: the host Adam and the uploads), and reports how many gradient bytes were on the host before step() began. On a
CPU the copies are synchronous, so they are not hidden, only moved into backward: the record shows the accounting,
not an overlap; on a GPU the copies run on a side stream while backward computes, and the step's wait for gradients
is what was not hidden. For the delayed update, the host Adam's own time (timed in its thread) and how long the next
step() waited for it give the share of the host Adam hidden behind compute; on a CPU the Adam's threads and the
forward's share the same cores, so the share hidden there says little about a GPU host. Each mode's host staging is
read from the allocations behind its staging buffers (the ring's four chunks, one working-dtype copy of the shard
without it, two with the delayed update), beside the host total memory_report() counts.
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time

import torch

import zkern
from bench.engine_suite import MODELS, _git_sha
from zkern.core.buffers import allocated_bytes
from zkern.env_report import cpu_model
from zkern.testing import TinyGPT, spawn

# gradients down during backward (staged through the ring where it applies, the default), the same with a buffer per
# chunk (staging_chunks 0), at step(), the delayed update
MODES = ("backward", "whole", "step", "delayed", "speculative", "speculative-unclipped", "partial")
MODE_NAMES = {"backward": "during backward", "whole": "during backward, whole-shard staging", "step": "at step()",
              "delayed": "delayed update", "speculative": "speculative step",
              "speculative-unclipped": "speculative step, no clipping",
              "partial": f"partial offload, ratio {0.5:g}"}
PARTIAL_RATIO = 0.5  # the partial mode's offload_optimizer.ratio: that share on the host, the rest on the device


def _config(stage: int, mode: str, preset: dict, precision: str) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": preset["bucket"],
            "offload_optimizer": {"device": "cpu", "copy_grads_during_backward": mode != "step",
                                  "delayed_update": mode == "delayed", "staging_chunks": 0 if mode == "whole" else 4,
                                  "speculative_step": mode.startswith("speculative"),
                                  "ratio": PARTIAL_RATIO if mode == "partial" else 1.0}}
    if stage == 3:
        zero["stage3_fetch_units"] = ["Block"]
    cfg = {"train_micro_batch_size_per_gpu": preset["micro_batch"], "steps_per_print": 0,
           "gradient_clipping": 0.0 if mode == "speculative-unclipped" else 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": zero}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _worker(rank: int, world: int, runs: list[dict], model: str, steps: int, warmup: int, precision: str) -> list:
    preset = MODELS[model]
    out = []
    for run in runs:
        torch.manual_seed(0)
        engine = zkern.Engine(TinyGPT(**preset["model"]), _config(run["stage"], run["mode"], preset, precision))
        g = torch.Generator().manual_seed(rank)
        seq, vocab = preset["model"]["seq"], preset["model"]["vocab"]
        rows = []
        for step in range(steps):
            ids = torch.randint(0, vocab, (preset["micro_batch"], seq + 1), generator=g).to(engine.device)
            t0 = _now(engine)
            engine.backward(engine(ids[:, :-1], ids[:, 1:]))
            t1 = _now(engine)  # the compute stream done: copies on the side stream may still be on their way
            engine.step()
            t2 = _now(engine)
            if step >= warmup:
                rows.append({"forward_backward_s": t1 - t0, "step_call_s": t2 - t1, **engine.host_step.last_step})
        out.append({**run, "rows": rows, "params": sum(engine.runtime.full_shape(p).numel()
                                                        for p in engine.module.parameters()),
                    "host_staging_bytes": allocated_bytes(engine.host_step.staging_tensors()),
                    "staging_ring": len(engine.host_step.ring or ()),
                    "host_bytes": engine.memory_report()["host"].get("total", 0),
                    "device_share": engine.host_step.device_numel / max(
                        1, engine.host_step.device_numel + engine.host_step.host_numel)})
        engine.destroy()
    return out


def _now(engine) -> float:
    """The host clock once the device's compute stream has caught up (on a GPU calls only enqueue work)."""
    if engine.device.type == "cuda":
        torch.cuda.current_stream().synchronize()
    return time.perf_counter()


def _median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def run(stages: list[int], world: int | None, model: str, steps: int | None = None, precision: str = "fp32",
        progress=None) -> dict:
    progress = progress or (lambda line: print(f"[bench] {line}", flush=True))
    if any(s not in (1, 2, 3) for s in stages):
        raise SystemExit(f"bench: the offload suite offloads the optimizer at stages 1-3, got {stages}")
    world = world or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    preset = MODELS[model]
    steps = steps or preset["steps"]
    warmup = preset["warmup"]
    if steps <= warmup:
        raise SystemExit(f"bench: the offload suite times the steps after {warmup} warm-up steps: give --steps above "
                         f"{warmup}")
    runs = [{"stage": s, "mode": mode} for s in stages for mode in MODES]
    progress(f"offload: {model}, stages {stages}, world {world}, {steps} steps ({warmup} warm-up)")
    results = spawn(_worker, world, runs, model, steps, warmup, precision, timeout=3600)
    rows = []
    for i, run in enumerate(runs):
        ranks = [r[i]["rows"] for r in results]
        labels = ("speculation", "background_adam_threads")  # what the step was, not how long it took
        per = [{k: max(rk[j][k] for rk in ranks) for k in ranks[0][j] if k not in labels}
               for j in range(len(ranks[0]))]  # the slowest rank's figures
        total = [r["forward_backward_s"] + r["step_call_s"] for r in per]
        bytes_total = per[0]["grad_bytes_in_backward"] + per[0]["grad_bytes_at_step"]
        delayed, speculative = run["mode"] == "delayed", run["mode"].startswith("speculative")
        # a row's delayed Adam is the previous step's, joined (and waited for) in this step's step(); the
        # speculative Adam is this step's own, run in its backward, and step() waits for its last chunks
        adam = _median(per, "adam_s") if delayed else _median(per, "speculative_adam_s") if speculative else None
        waited = _median(per, "landing_wait_s") if delayed else \
            _median(per, "speculation_wait_s") if speculative else None
        kept = sum(r["speculation"] == "kept" for r in ranks[0]) if speculative else None
        rows.append({"stage": run["stage"], "mode": run["mode"], "grads_during_backward": run["mode"] != "step",
                     "step_s": statistics.median(total),
                     "forward_backward_s": _median(per, "forward_backward_s"),
                     "offloaded_step_s": _median(per, "step_s"), "grad_wait_s": _median(per, "grad_wait_s"),
                     "backward_copy_s": _median(per, "backward_copy_s"),
                     "grad_bytes": bytes_total,
                     "share_on_host_before_step": per[0]["grad_bytes_in_backward"] / bytes_total if bytes_total else 0,
                     "steps_timed": len(per), "host_adam_s": adam, "host_adam_wait_s": waited,
                     "host_adam_threads": ranks[0][0].get("background_adam_threads"),
                     "host_staging_bytes": results[0][i]["host_staging_bytes"],
                     "staging_ring": results[0][i]["staging_ring"],
                     "host_bytes": results[0][i]["host_bytes"],
                     "host_adam_hidden": None if not adam else max(0.0, 1 - waited / adam),
                     "speculation_kept_steps": kept,
                     # partial offload: the device part's share of the shard and its chunks' host time in step()
                     "device_share": results[0][i]["device_share"],
                     "device_step_s": _median(per, "device_step_s") if "device_step_s" in per[0] else 0.0})
        progress(f"stage {run['stage']}, {MODE_NAMES[run['mode']]}: step {rows[-1]['step_s'] * 1e3:.1f} ms")
    ratios = {}
    for s in stages:
        mode = {r["mode"]: r for r in rows if r["stage"] == s}
        ratios[f"stage{s}_step_during_backward_over_at_step"] = mode["backward"]["step_s"] / mode["step"]["step_s"]
        ratios[f"stage{s}_step_delayed_over_during_backward"] = mode["delayed"]["step_s"] / mode["backward"]["step_s"]
        ratios[f"stage{s}_step_ring_over_whole_shard"] = mode["backward"]["step_s"] / mode["whole"]["step_s"]
        ratios[f"stage{s}_step_partial_over_during_backward"] = mode["partial"]["step_s"] / mode["backward"]["step_s"]
        for name in ("speculative", "speculative-unclipped"):
            ratios[f"stage{s}_step_{name.replace('-', '_')}_over_during_backward"] = \
                mode[name]["step_s"] / mode["backward"]["step_s"]
    return {"suite": "offload", "model": model, "params": results[0][0]["params"], "world": world, "steps": steps,
            "warmup": warmup, "precision": precision,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({cpu_model()})",
            "versions": {"zkern": zkern.__version__, "torch": torch.__version__, "python": platform.python_version()},
            "git_sha": _git_sha(), "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "rows": rows, "ratios": ratios}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def _device_part(row: dict) -> str:
    share = row.get("device_share") or 0.0
    return "-" if not share else f"{share * 100:.0f}%, {row.get('device_step_s', 0.0) * 1e3:.1f} ms"


def table(record: dict) -> str:
    out = [f"offload suite: {record['model']} GPT ({record['params']:,} parameters), world {record['world']}, "
           f"{record['precision']}, optimizer on the host, medians of {record['steps'] - record['warmup']} steps "
           f"(slowest rank), {record['device']}", "",
           "| stage | mode | step | fwd+bwd | of it copying grads | offloaded step | of it waiting for grads "
           "| grad bytes on host before step() | host Adam (delayed, speculative) | of it hidden | guesses kept "
           "| host staging (rank 0) | on the device (partial offload): share, its step |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        adam = "-" if r.get("host_adam_s") is None else f"{r['host_adam_s'] * 1e3:.1f} ms"
        if r.get("host_adam_threads") is not None:
            adam += f" ({r['host_adam_threads']} threads)"
        hidden = "-" if r.get("host_adam_hidden") is None else f"{r['host_adam_hidden'] * 100:.0f}%"
        kept = "-" if r.get("speculation_kept_steps") is None else \
            f"{r['speculation_kept_steps']} of {r['steps_timed']}"
        out.append(f"| {r['stage']} | {MODE_NAMES[r.get('mode', 'backward' if r['grads_during_backward'] else 'step')]}"
                   f" | {r['step_s'] * 1e3:.1f} ms | {r['forward_backward_s'] * 1e3:.1f} ms | "
                   f"{r['backward_copy_s'] * 1e3:.1f} ms | {r['offloaded_step_s'] * 1e3:.1f} ms | "
                   f"{r['grad_wait_s'] * 1e3:.1f} ms | {r['share_on_host_before_step'] * 100:.0f}% of "
                   f"{r['grad_bytes'] / 2**20:.1f} MiB | {adam} | {hidden} | {kept} | "
                   f"{_mib(r.get('host_staging_bytes'))} | {_device_part(r)} |")
    out.append("ratios: " + ", ".join(f"{k} {v:.3f}" for k, v in record["ratios"].items()))
    return "\n".join(out)
