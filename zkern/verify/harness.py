"""Run one draw end to end: its engine phases on their ranks (zkern.testing.spawn: gloo on 127.0.0.1), the
single-process reference, the comparisons; and, for a draw that saves and loads within one layout, the same draw
without the save and load, which must agree bit for bit.

    python -m zkern.verify.fuzz --draws 20
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass, field

import torch

from zkern.testing.ranks import spawn
from zkern.verify.check import compare, compare_runs
from zkern.verify.draws import Draw
from zkern.verify.reference_math import hyper_at
from zkern.verify.runner import run_phases
from zkern.verify.single import reference, units_of


@dataclass
class Outcome:
    draw: Draw
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


def _engine_runs(draw: Draw, root: str, timeout: float) -> list[list[dict]]:
    """Per phase, per rank: the runner's results. Phases at one world size share one set of ranks."""
    phases = draw.phases
    worlds = [w for w, _, _, _ in phases]
    if len(set(worlds)) == 1:
        per_rank = spawn(run_phases, worlds[0], draw, root, list(range(len(phases))), timeout=timeout)
        return [per_rank]
    return [spawn(run_phases, w, draw, root, [i], timeout=timeout) for i, w in enumerate(worlds)]


def twin_without_checkpoint(draw: Draw) -> Draw | None:
    """The same draw without its save and load, when the load keeps the layout (so the two runs must be equal bit for
    bit); None otherwise (also where the load leaves the optimizer or the scheduler behind). A delayed update in
    flight at the save is saved pending and resumed by the load, so those draws are twinned too."""
    if draw.save_at < 0 or draw.frozen == "load" or draw.load_flags:
        return None
    if draw.load_into == "fresh" and len({(w, s) for w, s, _, _ in draw.phases}) > 1:
        return None
    return dataclasses.replace(draw, save_at=-1, async_save=False, load_into="fresh", world_after=0, stage_after=-1)


def twin_without_reads(draw: Draw) -> Draw | None:
    """The same draw without its reads between steps (saves, exports, a GatheredParameters that writes nothing): a
    read never changes a run, so the two must agree bit for bit."""
    return dataclasses.replace(draw, reads_at=-1) if draw.reads_at >= 0 else None


def loco_twin(draw: Draw) -> Draw | None:
    """A LoCo draw's twin without LoCo: qgZ's int4 noise keeps both within the bar, so the bar alone cannot tell a
    LoCo that does nothing; the two runs must differ (compare_loco). None where LoCo cannot change the result."""
    return dataclasses.replace(draw, loco=False) if draw.loco and loco_can_act(draw) else None


def loco_can_act(draw: Draw) -> bool:
    """Whether an error LoCo keeps can reach an update: its errors feed the next reduction of the same engine (a
    later micro-step of the step, or the next step), and restart at zero after a skipped step, a batch dropped by
    zero_grad (its reductions consumed them) and a load into another layout. At world 1 nothing is reduced; a step
    whose learning rate is 0 moves nothing (a warm-up from 0, as the Trainer's, runs its first two applied steps at
    0, as DeepSpeed's WarmupLR does). Counted within one engine lifetime only (a load between two steps is taken to
    restart them: fewer draws checked, never a draw held to a change that cannot happen)."""
    moves, applied = {}, 0  # step -> whether its update can move the weights; optimizer steps applied before it
    for step in range(draw.steps):
        moves[step] = hyper_at(draw, applied - 1)[0] > 0
        applied += step != draw.overflow_at
    for world, _, first, last in draw.phases:
        if world < 2:
            continue
        for step in range(first, last):
            if step == draw.overflow_at:
                continue
            if draw.accumulation >= 2 and step != draw.short_at and moves[step]:  # micro 1's errors reach micro 2's
                return True
            if step + 1 < last and step + 1 not in (draw.overflow_at, draw.dropped_at) and moves[step + 1]:
                return True
    return False


def compare_loco(run: list[list[dict]], without: list[list[dict]]) -> list[str]:
    a, b = run[-1][0]["state"], without[-1][0]["state"]
    if all(torch.equal(a[k], b[k]) for k in a):
        return ["LoCo changed nothing: the weights equal those of the same draw without it, bit for bit"]
    return []


def verify_draw(draw: Draw, root: str | None = None, timeout: float = 300.0) -> Outcome:
    """The draw's failures (empty when it passes); an exception inside a run is a failure with its traceback."""
    start = time.perf_counter()
    outcome = Outcome(draw)
    scratch = root or tempfile.mkdtemp(prefix="zkern-verify-")
    try:
        runs = _engine_runs(draw, os.path.join(scratch, "run"), timeout)
        outcome.failures += compare(draw, runs, reference(draw, units_of(runs)))
        twin = twin_without_checkpoint(draw)
        if twin is not None:
            twin_runs = _engine_runs(twin, os.path.join(scratch, "twin"), timeout)
            outcome.failures += compare_runs(runs, twin_runs, "with vs without the save and load")
        unread = twin_without_reads(draw)
        if unread is not None:
            outcome.failures += compare_runs(runs, _engine_runs(unread, os.path.join(scratch, "noreads"), timeout),
                                             "with vs without the reads between steps")
        plain = loco_twin(draw)
        if plain is not None:
            outcome.failures += compare_loco(runs, _engine_runs(plain, os.path.join(scratch, "noloco"), timeout))
    except Exception as e:  # a crash, a hang past the timeout, an error a rank raised: all are findings
        outcome.failures.append(f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=3)}")
    finally:
        if root is None:
            shutil.rmtree(scratch, ignore_errors=True)
    outcome.seconds = time.perf_counter() - start
    return outcome
