"""zkern's benchmark: the same model, data and seed under zkern and under stock PyTorch, side by side.

    python bench/run.py --stage 3                 # world 2 on CPU, the "small" GPT, a table on stdout
    python bench/run.py --stage 1 --model tiny --steps 6 --json out.json

"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import engine_suite  # noqa: E402

HIGHEST_STAGE = 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="zkern against stock PyTorch on the same model and data")
    parser.add_argument("--stage", type=int, default=3, help="ZeRO stage (0-3; default 3)")
    parser.add_argument("--world", type=int, default=2, help="ranks (default 2, CPU over gloo)")
    parser.add_argument("--model", default="small", choices=sorted(engine_suite.MODELS), help="model preset")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    parser.add_argument("--json", default=None, help="also write the record as JSON to this path")
    args = parser.parse_args(argv)
    if not 0 <= args.stage <= HIGHEST_STAGE:
        parser.error("--stage must be 0, 1, 2 or 3")
    if args.world < 1:
        parser.error("--world must be >= 1")
    record = engine_suite.run(stage=args.stage, world=args.world, model=args.model, steps=args.steps)
    print(engine_suite.table(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
