"""python -m zkern.checkpoint {consolidate,inspect} ...: see zkern/checkpoint/consolidate.py."""

from __future__ import annotations

import argparse
import sys

from zkern.checkpoint.consolidate import consolidate, inspect
from zkern.errors import CheckpointError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zkern.checkpoint", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write an HF-loadable model.safetensors from a checkpoint, in streaming")
    c.add_argument("ckpt_dir")
    c.add_argument("out_dir")
    c.add_argument("--tag", default=None, help="the tag to read (default: the one 'latest' names)")
    c.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    c.add_argument("--max-shard-size", default=None, help="e.g. 5GB: split into shards plus an index")
    i = sub.add_parser("inspect", help="tags, steps, world, stage, sizes, and whether every checksum holds")
    i.add_argument("ckpt_dir")
    i.add_argument("--no-verify", action="store_true", help="skip re-hashing the files")
    args = parser.parse_args(argv)
    try:
        if args.command == "consolidate":
            for path in consolidate(args.ckpt_dir, args.out_dir, tag=args.tag, dtype=args.dtype,
                                    max_shard_size=args.max_shard_size):
                print(path)
        else:
            print("\n".join(inspect(args.ckpt_dir, verify=not args.no_verify)))
    except (CheckpointError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
