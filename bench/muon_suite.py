"""--suite muon: what Muon costs against zkern's Adam at each stage, in step time and in traffic.

    python bench/run.py --suite muon                      # stages 0-3, worlds 1 and 2, one run
    python bench/run.py --suite muon --stage 3 --world 4

Per stage and world, the same model and data trained by zkern with the config's AdamW and with its Muon (the hidden
matrices; AdamW for the rest), each in its own ranks: the median step time after warm-up (the slowest rank's), and
the bytes a rank sends per step, Muon's traffic for the matrices that span ranks counted apart (comm_stats' "muon":
the pieces to their owners and the results back). Newton-Schulz is arithmetic Adam does not do (five iterations of
three matrix products per matrix); at stage 0 every rank repeats it for every matrix, at stages 1-3 each rank does it
for the matrices it holds whole and those it owns.
"""

from __future__ import annotations

import datetime
import statistics
import time

import torch

from bench import engine_suite
from zkern.env_report import cpu_model
from zkern.testing import TrainSpec, spawn

MODEL = dict(vocab=4096, dim=256, n_layer=4, n_head=4, seq=64)  # 3.4M parameters, every block matrix 256 x 256 or wider
WORLDS = (1, 2)
WARMUP, TIMED = 2, 5
OPTIMIZERS = {"adamw": {"type": "AdamW", "params": {"lr": 1e-3}},
              "muon": {"type": "Muon", "params": {"lr": 1e-3, "ns_method": "gram"}},
              "muon-standard": {"type": "Muon", "params": {"lr": 1e-3, "ns_method": "standard"}}}


def spec_for(stage: int, optimizer: str) -> TrainSpec:
    return TrainSpec(stage=stage, model=MODEL, micro_batch=2, steps=WARMUP + TIMED, reduce_bucket_size=1 << 22,
                     extra_config={"optimizer": OPTIMIZERS[optimizer]})


def _time(rank: int, world: int, spec: TrainSpec) -> dict:
    engine = spec.build_engine(spec.make_model(), world)
    batches = spec.batches(world)
    times, before = [], None
    for s in range(spec.steps):
        if s == WARMUP:
            before = engine.comm_stats()
        idx, tgt = batches[s][0][rank]
        start = time.perf_counter()
        engine.backward(engine(idx, tgt))
        engine.step()
        if s >= WARMUP:
            times.append(time.perf_counter() - start)
    after = engine.comm_stats()
    kinds = [k for k in after if isinstance(after[k], int)]
    sent = {k: (after[k] - before[k]) / TIMED for k in kinds}
    spanning = engine.optimizer.spanning_numel() if hasattr(engine.optimizer, "spanning_numel") else 0
    engine.destroy()
    return {"times": times, "sent": sent, "spanning": spanning}


def measure(stage: int, world: int, optimizer: str) -> dict:
    per_rank = spawn(_time, world, spec_for(stage, optimizer), timeout=900, subprocess=True)
    step = statistics.median(max(ts) for ts in zip(*(r["times"] for r in per_rank)))
    sent = max(sum(r["sent"].values()) for r in per_rank)
    muon = max(r["sent"].get("muon", 0) for r in per_rank)
    return {"step_s": step, "sent_per_step": sent, "muon_sent_per_step": muon, "spanning": per_rank[0]["spanning"]}


def run(stages: list[int], worlds: tuple[int, ...] = WORLDS, progress=print) -> dict:
    rows, ratios = [], {}
    for world in worlds:
        for stage in stages:
            got = {name: measure(stage, world, name) for name in OPTIMIZERS}
            flat = {f"{n}_{k}": v for n, m in got.items() for k, v in m.items()}
            rows.append({"stage": stage, "world": world, **flat})
            for name in ("muon", "muon-standard"):
                ratios[f"stage{stage}_world{world}_{name}_over_adamw"] = got[name]["step_s"] / got["adamw"]["step_s"]
            progress(f"[muon] stage {stage} world {world}: AdamW {got['adamw']['step_s'] * 1e3:.0f} ms, Muon (gram) "
                     f"{got['muon']['step_s'] * 1e3:.0f} ms, Muon (standard) {got['muon-standard']['step_s'] * 1e3:.0f}"
                     f" ms; Muon's assembly {got['muon']['muon_sent_per_step'] / 1e6:.2f} MB a step of "
                     f"{got['muon']['sent_per_step'] / 1e6:.2f} MB sent")
    return {"suite": "muon", "device": "cpu", "model": MODEL, "params": TrainSpec(model=MODEL).num_params(),
            "warmup": WARMUP, "timed": TIMED, "rows": rows, "ratios": ratios, "cpu": cpu_model(),
            "threads": torch.get_num_threads(), "torch": torch.__version__, "git_sha": engine_suite._git_sha(),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def table(record: dict) -> str:
    out = [f"muon suite: TinyGPT {record['model']} ({record['params']:,} parameters), fp32, median step time of the "
           f"slowest rank; MB sent per step by a rank (Muon's assembly apart)", "",
           f"{'stage':>5} {'world':>5} {'AdamW ms':>9} {'Muon ms':>8} {'x':>5} {'std ms':>7} {'x':>5} "
           f"{'sent MB':>8} {'Muon MB':>8} {'spanning':>9}"]
    for r in record["rows"]:
        a = r["adamw_step_s"]
        out.append(f"{r['stage']:>5} {r['world']:>5} {a * 1e3:>9.0f} {r['muon_step_s'] * 1e3:>8.0f} "
                   f"{r['muon_step_s'] / a:>5.2f} {r['muon-standard_step_s'] * 1e3:>7.0f} "
                   f"{r['muon-standard_step_s'] / a:>5.2f} {r['muon_sent_per_step'] / 1e6:>8.2f} "
                   f"{r['muon_muon_sent_per_step'] / 1e6:>8.2f} {r['muon_spanning']:>9,}")
    return "\n".join(out)
