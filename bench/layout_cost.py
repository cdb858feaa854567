"""What placing every parameter at a 256-byte boundary costs on the benchmark's presets: the padding elements the
flat layouts add (core/partition.py), for stages 0-2's buckets and stage 3's fetch units (one per module; one per
block with stage3_fetch_units), at worlds 1 and 8, beside the layout packed end to end with only the chunks aligned.

    python bench/layout_cost.py
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.engine_suite import MODELS  # noqa: E402
from zkern.core.partition import plan_layout, plan_unit_layout  # noqa: E402
from zkern.stage3.units import plan_units  # noqa: E402
from zkern.testing import TinyGPT  # noqa: E402

PRESETS = ("small", "25m", "1b", "7b", "13b")


def padding(name: str, world: int) -> dict[str, int]:
    """Padding elements of each layout of preset `name` at `world` ranks."""
    preset = MODELS[name]
    with torch.device("meta"):
        model = TinyGPT(**preset["model"])
    numels = [p.numel() for p in model.parameters()]
    total = sum(numels)
    per_module, _ = plan_units(model, (), 100_000)
    per_block, _ = plan_units(model, ("Block",), 100_000)
    layouts = {"stages 0-2": plan_layout(numels, world, preset["bucket"]),
               "stage 3, a unit per module": plan_unit_layout([[p.numel() for p in u.params] for u in per_module],
                                                             world),
               "stage 3, a unit per block": plan_unit_layout([[p.numel() for p in u.params] for u in per_block],
                                                            world)}
    return {"parameters": total, **{k: v.total - total for k, v in layouts.items()}}


def main() -> None:
    print(f"{'preset':8} {'world':>5} {'parameters':>14}  padding elements (share): stages 0-2 | stage 3 per module | "
          f"per block")
    for name in PRESETS:
        for world in (1, 8):
            row = padding(name, world)
            n = row.pop("parameters")
            cells = " | ".join(f"{v:,} ({v / n:.1e})" for v in row.values())
            print(f"{name:8} {world:>5} {n:>14,}  {cells}")


if __name__ == "__main__":
    main()
