"""The docs point at things that exist: every relative link (and its #anchor), every repository path and every
`zkern.` name that README.md, ARCHITECTURE.md, docs/ and bench/results/README.md mention."""

from __future__ import annotations

import glob
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "ARCHITECTURE.md", ROOT / "bench/results/README.md",
                *ROOT.glob("docs/*.md")])
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\n]+)`")
# A repository path inside a code span: a top-level folder of the checkout, then anything path-like.
PATH = re.compile(r"(?<![\w./-])((?:zkern|tests|bench|examples|docs|\.ci)/[\w./{},*-]*)")
RECORD = re.compile(r"(?<![\w./-])((?:cpu|h100|h200)-\d{4}-\d\d-\d\d-[\w./{},*-]*)")
NAME = re.compile(r"(?<![\w.])zkern(?:\.[A-Za-z_]\w*)+")
# A file inside the package named from its room, as ARCHITECTURE.md does: `engine/engine.py`, `stage3/`.
ROOM_FILE = re.compile(r"^([a-z0-9_]+/(?:[\w/]+\.(?:py|cpp|cu|h|toml))?)$")
ROOTS = ("zkern/", "tests/", "bench/", "examples/", "docs/", ".ci/")
# Where tools write their output (bench/gpu_lease.sh's folder, a fuzz report): named by .gitignore, never committed.
GENERATED = [line.strip() for line in (ROOT / ".gitignore").read_text().splitlines() if "/" in line.strip()]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code marks and punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")}


def _expand(pattern: str) -> list[str]:
    """`a-{1,2}.json` -> a-1.json, a-2.json (the docs' shorthand for a family of files)."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if not m:
        return [pattern]
    return [x for alt in m.group(1).split(",") for x in _expand(pattern[:m.start()] + alt + pattern[m.end():])]


def _exists(pattern: str, base: Path) -> bool:
    pattern = pattern.split("::")[0].rstrip(".,:;")
    if base == ROOT and pattern in GENERATED:
        return True
    return all(glob.glob(str(base / p)) or glob.glob(str(base / p) + "*") for p in _expand(pattern))


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_reach_a_file_and_a_heading(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.is_file() and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n  " + "\n  ".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_paths_named_in_code_exist(page):
    missing = []
    for span in CODE.findall(page.read_text()):
        for path in PATH.findall(span):
            if not _exists(path, ROOT):
                missing.append(path)
        room = ROOM_FILE.match(span.strip())
        if room and not span.startswith(ROOTS) and not _exists(room.group(1), ROOT / "zkern"):
            missing.append(f"zkern/{room.group(1)}")
        for record in RECORD.findall(span):
            if not _exists(record, ROOT / "bench/results"):
                missing.append(record)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_zkern_names_resolve(page):
    names = {n for span in CODE.findall(page.read_text()) for n in NAME.findall(span)}
    unresolved = sorted(n for n in names if not _resolves(n))
    assert not unresolved, f"{page.relative_to(ROOT)} names what zkern does not have: {unresolved}"


def test_the_front_door_is_short():
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines: move detail into docs/ and leave the front door"
