"""The differential fuzzer: random draws of the crossings users combine, each run on zkern's engine (1, 2, 3 or 4
CPU ranks over gloo) and compared with the single-process reference; a failing draw is printed as the command that
repeats it.

    python -m zkern.verify.fuzz --draws 2000 --seed 0          # make fuzz
    python -m zkern.verify.fuzz --draw '{"stage": 3, "save_at": 1}'
    python -m zkern.verify.fuzz --draws 60 --where speculative=true --where world=2   # only draws with those values

Draws run in batches: each world size's ranks are started once per batch and run its draws one after another (a
rank costs seconds to start on two cores, a draw a fraction of one). A batch that fails as a whole (a rank died, a
hang past the timeout) is run again draw by draw, so the draw to blame is the one reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import random
import shutil
import sys
import tempfile
import time
import traceback

from zkern.testing.ranks import spawn
from zkern.verify.check import compare, compare_runs
from zkern.verify.draws import WORLDS, Draw, random_draw
from zkern.verify.harness import (
    Outcome,
    compare_loco,
    loco_twin,
    twin_without_checkpoint,
    twin_without_reads,
    verify_draw,
)
from zkern.verify.runner import run_phases
from zkern.verify.single import reference, units_of


def _run_jobs(rank: int, world: int, jobs: list[tuple[Draw, str, list[int]]]) -> list:
    """On every rank of one world size: each job's phases in turn; an exception is that job's result (as text), so
    the batch goes on. An exception on one rank only would leave the others in a collective: they fail within the
    engine's comm_timeout_s, and the batch is then run draw by draw."""
    out = []
    for draw, root, phases in jobs:
        try:
            out.append(run_phases(rank, world, draw, root, phases))
        except Exception as e:
            out.append(f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=4)}")
    return out


def _batch(draws: list[Draw], root: str, timeout: float) -> list[Outcome]:
    """Run draws in as few spawns as their world sizes allow; raises if a spawn fails as a whole."""
    start = time.perf_counter()
    runs: dict[tuple[int, str], list[list[dict]]] = {}  # (draw index, "run"/"twin") -> per phase, per rank
    rounds: list[dict[int, list]] = [{}, {}]  # round -> world -> [(key, phase index, job)]
    for i, draw in enumerate(draws):
        variants = [("run", draw)]
        twin = twin_without_checkpoint(draw)
        if twin is not None:
            variants.append(("twin", twin))
        if loco_twin(draw) is not None:
            variants.append(("noloco", loco_twin(draw)))
        if twin_without_reads(draw) is not None:
            variants.append(("noreads", twin_without_reads(draw)))
        for name, d in variants:
            where = os.path.join(root, f"{i}-{name}")
            worlds = [w for w, _, _, _ in d.phases]
            if len(set(worlds)) == 1:
                rounds[0].setdefault(worlds[0], []).append(((i, name), None, (d, where, list(range(len(worlds))))))
            else:
                for k, w in enumerate(worlds):
                    rounds[k].setdefault(w, []).append(((i, name), k, (d, where, [k])))
    for stage in rounds:
        for world, entries in sorted(stage.items()):
            per_rank = spawn(_run_jobs, world, [job for _, _, job in entries], timeout=timeout * len(entries))
            for j, (key, _, _) in enumerate(entries):
                results = [per_rank[r][j] for r in range(world)]
                slot = runs.setdefault(key, [])
                slot.append(results)
    outcomes = []
    for i, draw in enumerate(draws):
        outcome = Outcome(draw)
        for key in ((i, "run"), (i, "twin"), (i, "noloco"), (i, "noreads")):
            for phase in runs.get(key, []):
                errors = [r for r in phase if isinstance(r, str)]
                if errors:
                    outcome.failures.append(f"{key[1]}: {errors[0]}")
        if outcome.ok:
            outcome.failures += compare(draw, runs[(i, "run")], reference(draw, units_of(runs[(i, "run")])))
            if (i, "twin") in runs:
                outcome.failures += compare_runs(runs[(i, "run")], runs[(i, "twin")],
                                                 "with vs without the save and load")
            if (i, "noloco") in runs:
                outcome.failures += compare_loco(runs[(i, "run")], runs[(i, "noloco")])
            if (i, "noreads") in runs:
                outcome.failures += compare_runs(runs[(i, "run")], runs[(i, "noreads")],
                                                 "with vs without the reads between steps")
        outcomes.append(outcome)
    seconds = (time.perf_counter() - start) / max(1, len(draws))
    for o in outcomes:
        o.seconds = seconds
    return outcomes


# How many random draws a focused run may look through per draw it keeps, before saying the values seldom meet.
TRIES_PER_DRAW = 2000


def _a(noun: str) -> str:
    return f"{'an' if noun[0] in 'aeiou' else 'a'} {noun}"


def parse_where(terms: list[str]) -> dict:
    """--where's KEY=VALUE terms as {Draw field: value}; VALUE is JSON (true, 2, 0.05, "cpu") or else a plain word."""
    fields = {f.name: f for f in dataclasses.fields(Draw)}
    where = {}
    for term in terms:
        key, eq, text = term.partition("=")
        key = key.strip()
        if not eq or not key:
            raise ValueError(f"--where {term!r}: give KEY=VALUE, a field of a draw and its value (speculative=true)")
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            raise ValueError(f"--where {term!r}: a draw has no field {key!r}"
                             + (f"; did you mean {near[0]!r}?" if near else f" (fields: {', '.join(fields)})"))
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        default = fields[key].default
        if type(value) is not type(default) and not (type(default) is float and type(value) is int):
            raise ValueError(f"--where {term!r}: {key} takes {_a(type(default).__name__)} (a draw's default: "
                             f"{json.dumps(default)}), got {json.dumps(value)}")
        where[key] = value
    return where


def draws_for(count: int, seed: int, worlds: tuple[int, ...] = WORLDS, nvme: bool = True,
              where: dict | None = None) -> list[Draw]:
    """The first count random draws from seed whose fields hold where's values (all of them without where)."""
    rng = random.Random(seed)
    draws, tries = [], 0
    while len(draws) < count:
        draw = random_draw(rng, worlds, nvme=nvme)
        tries += 1
        if all(getattr(draw, k) == v for k, v in (where or {}).items()):
            draws.append(draw)
        elif tries >= TRIES_PER_DRAW * count:
            raise ValueError(f"--where {where}: {len(draws)} of {tries} random draws hold those values, fewer than "
                             f"the {count} asked for; the draws seldom or never combine them (or --worlds/--no-nvme "
                             f"rule them out)")
    return draws


def fuzz(count: int, seed: int, worlds: tuple[int, ...] = WORLDS, batch: int = 12, timeout: float = 120.0,
         nvme: bool = True, report=print, where: dict | None = None) -> list[Outcome]:
    """count random draws from seed (only those holding where's field values, when given); returns every outcome
    (report(line) is called per failure and per batch)."""
    return run_draws(draws_for(count, seed, worlds, nvme, where), batch, timeout, report)


def run_draws(draws: list[Draw], batch: int = 12, timeout: float = 120.0, report=print) -> list[Outcome]:
    """Each draw on the engine and the reference, in batches; every outcome (report as for fuzz)."""
    count = len(draws)
    outcomes: list[Outcome] = []
    for first in range(0, count, batch):
        chunk = draws[first:first + batch]
        root = tempfile.mkdtemp(prefix="zkern-fuzz-")
        try:
            try:
                done = _batch(chunk, root, timeout)
            except Exception:  # the batch as a whole failed: find the draw by running each alone
                done = [verify_draw(d, timeout=timeout) for d in chunk]
        finally:
            shutil.rmtree(root, ignore_errors=True)
        outcomes += done
        for o in done:
            if not o.ok:
                report(f"FAIL {o.draw.repro()}\n  " + "\n  ".join(o.failures[:8]))
        failed = sum(not o.ok for o in outcomes)
        report(f"[fuzz] {len(outcomes)}/{count} draws, {failed} failed, "
               f"{sum(o.seconds for o in outcomes) / len(outcomes):.2f} s per draw")
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zkern.verify.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--draws", type=int, default=200, help="how many random draws (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="the first draw's seed (draws are a function of it)")
    parser.add_argument("--worlds", default="1,2,3,4", help="world sizes to draw from (default 1,2,3,4)")
    parser.add_argument("--draw", default=None, help="run this one draw (JSON, as a failure prints it)")
    parser.add_argument("--no-nvme", action="store_true", help="draw no NVMe offload (a slow or small disk)")
    parser.add_argument("--json", default=None, help="write every outcome to this file")
    parser.add_argument("--where", action="append", default=[], metavar="KEY=VALUE",
                        help="keep only draws whose field KEY has VALUE (JSON), e.g. speculative=true; repeatable")
    args = parser.parse_args(argv)
    if args.draw is not None:
        outcome = verify_draw(Draw.from_json(args.draw))
        print("PASS" if outcome.ok else "FAIL\n  " + "\n  ".join(outcome.failures))
        return 0 if outcome.ok else 1
    worlds = tuple(int(w) for w in args.worlds.split(","))
    try:  # a bad --where, or too few draws holding it, is said before anything runs
        where = parse_where(args.where)
        draws = draws_for(args.draws, args.seed, worlds, not args.no_nvme, where)
    except ValueError as e:
        parser.error(str(e))
    start = time.perf_counter()
    outcomes = run_draws(draws)
    failed = [o for o in outcomes if not o.ok]
    focus = "".join(f", {k}={json.dumps(v)}" for k, v in where.items())
    print(f"[fuzz] {len(outcomes)} draws (seed {args.seed}, worlds {args.worlds}{focus}) in "
          f"{time.perf_counter() - start:.0f} s: {len(failed)} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"draw": json.loads(o.draw.to_json()), "failures": o.failures, "seconds": o.seconds}
                       for o in outcomes], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
