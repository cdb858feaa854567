"""CI regression gates: ratios measured in one benchmark run, checked against bench/gates.toml.

    python bench/run.py --stage 0,1,2,3 --model small --steps 6 --gate bench/gates.toml

A gate names a ratio of a stage's record (engine_suite.run_stage's "ratios") and its bound; a failing gate
prints the figure, its value and its bound, and run.py exits non-zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import tomllib


@dataclass(frozen=True)
class Gate:
    figure: str  # a key of a stage's "ratios"
    stages: tuple[int, ...]
    max: float | None = None
    min: float | None = None
    why: str = ""


def load(path: str) -> list[Gate]:
    with open(path, "rb") as f:
        data = tomllib.load(f)
    gates = []
    for i, g in enumerate(data.get("gate", [])):
        unknown = set(g) - {"figure", "stages", "max", "min", "why"}
        if unknown or "figure" not in g or ("max" not in g and "min" not in g):
            raise ValueError(f"{path}: gate {i} needs 'figure' and 'max' and/or 'min' (unknown keys: "
                             f"{sorted(unknown)})")
        gates.append(Gate(figure=g["figure"], stages=tuple(g.get("stages", (0, 1, 2, 3))), max=g.get("max"),
                          min=g.get("min"), why=g.get("why", "")))
    return gates


def check(record: dict, gates: list[Gate]) -> list[str]:
    """Failures, one line each (empty: every gate holds). A gate whose figure the record lacks fails."""
    failures = []
    for stage in record["stages"]:
        for gate in gates:
            if stage["stage"] not in gate.stages:
                continue
            value = stage["ratios"].get(gate.figure)
            where = f"stage {stage['stage']}: {gate.figure}"
            if value is None:
                failures.append(f"{where}: not in the record")
            elif gate.max is not None and value > gate.max:
                failures.append(f"{where} = {value:.4g}, above its bound {gate.max:g} ({gate.why})")
            elif gate.min is not None and value < gate.min:
                failures.append(f"{where} = {value:.4g}, below its bound {gate.min:g} ({gate.why})")
    return failures
