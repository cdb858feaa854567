"""CI regression gates: ratios measured in one benchmark run, checked against bench/gates.toml.

    python bench/run.py --stage 0,1,2,3 --model small --steps 6 --gate bench/gates.toml

A gate names a suite (default "engine"), a ratio of that suite's record and its bound: the engine suite's
ratios are per stage (engine_suite.run_stage's "ratios"), the adam suite's are the record's own "ratios". A
failing gate prints the figure, its value and its bound, and run.py exits non-zero. Gates of a suite that did
not run, and gates measured for another device (`device = "cpu"`: thresholds set on CI's CPU) or another CPU
path (`isa = "avx512"`: the adam suite's record names the path it timed) are not checked; run.py says which.
"""

from __future__ import annotations

from dataclasses import dataclass

import tomllib


@dataclass(frozen=True)
class Gate:
    figure: str  # a key of the suite's "ratios" (per stage for the engine suite)
    stages: tuple[int, ...]
    suite: str = "engine"
    optional: bool = False  # a figure only some runs have (an optional peer's): absent is not a failure
    device: str | None = None  # "cpu" or "cuda": checked only on records from that device (None: any)
    isa: str | None = None  # "avx512", "avx2" or "scalar": checked only on records of that CPU Adam path (None: any)
    max: float | None = None
    min: float | None = None
    why: str = ""


def load(path: str) -> list[Gate]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    gates = []
    for i, g in enumerate(data.get("gate", [])):
        unknown = set(g) - {"figure", "stages", "max", "min", "why", "suite", "optional", "device", "isa"}
        if unknown or "figure" not in g or ("max" not in g and "min" not in g):
            raise ValueError(f"{path}: gate {i} needs 'figure' and 'max' and/or 'min' (unknown keys: "
                             f"{sorted(unknown)})")
        gates.append(Gate(figure=g["figure"], stages=tuple(g.get("stages", (0, 1, 2, 3))), max=g.get("max"),
                          min=g.get("min"), why=g.get("why", ""), suite=g.get("suite", "engine"),
                          optional=bool(g.get("optional", False)), device=g.get("device"), isa=g.get("isa")))
    return gates


def _bound_failure(where: str, value: float | None, gate: Gate) -> str | None:
    if value is None:
        return None if gate.optional else f"{where}: not in the record"
    if gate.max is not None and value > gate.max:
        return f"{where} = {value:.4g}, above its bound {gate.max:g} ({gate.why})"
    if gate.min is not None and value < gate.min:
        return f"{where} = {value:.4g}, below its bound {gate.min:g} ({gate.why})"
    return None


def applies(gate: Gate, record: dict) -> bool:
    """Whether the gate judges this record: same suite, and the device and CPU path it was measured for (if it names
    them)."""
    return gate.suite == record.get("suite", "engine") and gate.device in (None, record.get("device")) \
        and gate.isa in (None, record.get("isa"))


def check(record: dict, gates: list[Gate]) -> list[str]:
    """Failures of the gates that apply to record, one line each (empty: all hold). A missing figure fails."""
    suite = record.get("suite", "engine")
    failures = []
    for gate in gates:
        if not applies(gate, record):
            continue
        if suite == "engine":
            for stage in record["stages"]:
                if stage["stage"] in gate.stages:
                    failures.append(_bound_failure(f"stage {stage['stage']}: {gate.figure}",
                                                   stage["ratios"].get(gate.figure), gate))
        else:
            failures.append(_bound_failure(f"{suite}: {gate.figure}", record["ratios"].get(gate.figure), gate))
    return [f for f in failures if f is not None]
