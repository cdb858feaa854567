"""Reading files a user (or an attacker) put in a directory: regular files only, never more than a cap, never
blocking on a FIFO or a device, JSON of bounded size and depth, names confined to the directory. Every failure is a
CheckpointError that names the file.

    python -m pytest tests/checkpoint/test_checkpoint_safety.py -q
"""

from __future__ import annotations

import json
import os
import stat

from zkern.errors import CheckpointError

MAX_JSON_DEPTH = 64  # zkern's manifests nest about 6 deep; HF indices 2


def read_capped(path: str, cap: int, what: str) -> bytes:
    """The bytes of a regular file of at most `cap` bytes. A FIFO, a device or a socket under that name (a symlink to
    /dev/zero, a pipe named like the file) is refused without reading, and opening never waits for a writer."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise CheckpointError(f"{path}: cannot open the {what} ({e.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"{path}: the {what} is not a regular file (a FIFO, device or socket under its "
                                  f"name); refusing to read it")
        if info.st_size > cap:
            raise CheckpointError(f"{path}: {info.st_size} bytes, more than any {what} zkern reads ({cap})")
        chunks, total = [], 0
        while True:
            chunk = os.read(fd, min(1 << 20, cap + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > cap:
                raise CheckpointError(f"{path}: grew past {cap} bytes while being read; refusing it")
        return b"".join(chunks)
    finally:
        os.close(fd)


def _depth(value, limit: int) -> int:
    """Nesting depth of parsed JSON, stopping once it passes limit (iterative: no recursion to exhaust)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((v, depth + 1) for v in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_json(raw: bytes, path: str, what: str, max_depth: int = MAX_JSON_DEPTH):
    """JSON from bytes, or a CheckpointError naming the file (invalid text, too deep, not UTF-8)."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise CheckpointError(f"{path}: the {what} nests deeper than any zkern reads; the file is damaged or hostile") \
            from None
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: the {what} is not valid JSON ({type(e).__name__}: {e})") from None
    if _depth(value, max_depth) > max_depth:
        raise CheckpointError(f"{path}: the {what} nests deeper than {max_depth} levels; the file is damaged or "
                              f"hostile")
    return value


def confined(directory: str, name: object, what: str) -> str:
    """directory/name for a plain file name listed in a file of that directory: no separators, no '..', not
    absolute (a listing cannot make a reader open a file elsewhere)."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\x00" in name or os.path.isabs(name):
        raise CheckpointError(f"{directory}: the {what} names {name!r}, which is not a file name in that directory; "
                              f"refusing to read outside it")
    return os.path.join(directory, name)
