"""The house rules of ARCHITECTURE.md, checked on the source: arrows only point down, no import cycles, no room
too big to see whole, kernels reached only through zkern.ops.

    python -m pytest tests/house/test_layout.py -q
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "zkern"

# Lowest first. A module may import its own package's modules and anything on a lower layer, nothing above.
LAYERS: list[tuple[str, ...]] = [
    ("zkern.errors", "zkern.safe_io", "zkern.reference"),
    ("zkern.cpu", "zkern.triton", "zkern.cuda"),
    ("zkern.ops",),
    ("zkern.config",),
    ("zkern.monitor", "zkern.activation_checkpointing", "zkern.checkpointing"),
    ("zkern.core",),
    ("zkern.comm",),
    ("zkern.optim",),
    ("zkern.offload",),
    ("zkern.stage12", "zkern.stage3"),
    ("zkern.checkpoint",),
    ("zkern.engine",),
    ("zkern.hf",),
    ("zkern",),  # the public face: names imported on first use, no static import of anything below
    ("zkern.testing",),
    ("zkern.env_report",),
    ("zkern.verify",),
]
# Rooms that must reach kernels through zkern.ops (the backend choice is made there, once).
THROUGH_OPS = ("zkern.core", "zkern.comm", "zkern.optim", "zkern.offload", "zkern.stage12", "zkern.stage3",
               "zkern.engine", "zkern.checkpoint")
KERNELS = ("zkern.cpu", "zkern.triton", "zkern.cuda")
MAX_FILE_LINES = 500
MAX_CLASS_LINES = 300


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _type_checking_only(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _defined_in(package: str) -> set[str]:
    """Names a package's __init__ binds (assignments, defs, classes, imports)."""
    path = MODULES.get(package)
    if path is None or path.name != "__init__.py":
        return set()
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _submodule(package: str, name: str) -> bool:
    """`from package import name` imports a submodule (a .py file, or a compiled extension such as
    zkern.cpu._adam_ext, built or not) rather than a name the package's __init__ binds."""
    if f"{package}.{name}" in MODULES:
        return True
    path = MODULES.get(package)  # a module file binds names; only a package (an __init__) has submodules
    return path is not None and path.name == "__init__.py" and name not in _defined_in(package)


def imports_of(name: str, annotations: bool = False) -> set[str]:
    """zkern modules `name` imports, at module level or inside functions (a lazy import is still an arrow); imports
    under `if TYPE_CHECKING:` are annotations only and count only with annotations=True."""
    tree = ast.parse(MODULES[name].read_text())
    skip = set() if annotations else {id(n) for node in ast.walk(tree) if _type_checking_only(node)
                                      for n in ast.walk(node)}
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" if _submodule(base, a.name) else base for a in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def layer_of(name: str) -> int:
    best = None
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if name == prefix or name.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (i, len(prefix))
    assert best is not None, f"{name} is on no layer of tests/house/test_layout.py: add it where it belongs"
    return best[0]


def room_of(name: str) -> str:
    """The package a module lives in (zkern itself for top-level files)."""
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def test_every_module_is_on_a_layer():
    for name in MODULES:
        layer_of(name)


@pytest.mark.parametrize("annotations", [False, True], ids=["code", "with type-only imports"])
def test_arrows_only_point_down(annotations):
    """Across layers, no import points up, not even one under `if TYPE_CHECKING:` (an annotation naming a class of a
    higher layer is a dependency all the same)."""
    graph = GRAPH if not annotations else {name: imports_of(name, annotations=True) for name in MODULES}
    upward = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
              for a, targets in graph.items() for b in sorted(targets)
              if layer_of(b) > layer_of(a) and not b.startswith(room_of(a) + ".")]
    assert not upward, "imports that point up:\n" + "\n".join(upward)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of the module graph: each of two or more modules is a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


@pytest.mark.parametrize("annotations", [False, True], ids=["code", "with type-only imports"])
def test_no_import_cycles(annotations):
    """No circle of imports, counting those under `if TYPE_CHECKING:`: a helper that annotates its caller's class
    depends on it as surely as one that imports it to run."""
    graph = GRAPH if not annotations else {name: imports_of(name, annotations=True) for name in MODULES}
    cycles = _circles(graph)
    assert not cycles, f"import cycles: {cycles}"


BENCH = {module_name(p): p for p in sorted((ROOT.parent / "bench").glob("*.py"))}


def bench_imports(name: str) -> set[str]:
    """bench modules `name` imports, at module level or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(BENCH[name].read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "bench":
            found |= {f"bench.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench."):
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {t for t in found if t in BENCH and t != name}


def test_the_benchmark_has_no_import_cycles():
    """The benchmark's modules point one way too (the GPU probe's parts once imported each other in a circle)."""
    graph = {name: bench_imports(name) for name in BENCH}
    assert graph["bench.probe_world2"], "the bench graph was not read (probe_world2 imports probe_record)"
    cycles = _circles(graph)
    assert not cycles, f"import cycles in bench/: {cycles}"


def test_only_the_store_asks_where_a_shard_lives():
    """`is_meta` (a stand-in for bytes in a file) is asked by offload/store.py and the file stores behind it only."""
    allowed = {"zkern.offload.store", "zkern.offload.nvme", "zkern.offload.nvme_params"}
    askers = [name for name, path in MODULES.items() if name not in allowed
              and any(".is_meta" in line.split("#")[0] for line in path.read_text().splitlines())]
    assert not askers, f"ask zkern.offload.store.ShardStore instead: {askers}"


def test_kernels_only_through_ops():
    direct = [f"{a} imports {b}" for a, targets in GRAPH.items() for b in targets
              if a.startswith(THROUGH_OPS) and b.startswith(KERNELS)]
    assert not direct, "reach kernels through zkern.ops:\n" + "\n".join(direct)


def test_rooms_are_small():
    too_long = []
    for path in MODULES.values():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            too_long.append(f"{path.relative_to(ROOT.parent)}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{path.relative_to(ROOT.parent)}: class {node.name} "
                                f"{node.end_lineno - node.lineno + 1} lines")
    assert not too_long, f"split these (files <= {MAX_FILE_LINES}, classes <= {MAX_CLASS_LINES} lines):\n" + \
        "\n".join(too_long)


@pytest.mark.parametrize("bad", [{"zkern.a": {"zkern.b"}, "zkern.b": {"zkern.a"}}])
def test_the_cycle_check_can_fail(bad, monkeypatch):
    """A two-module cycle planted in the graph is found (the check is not vacuous)."""
    monkeypatch.setattr(sys.modules[__name__], "GRAPH", bad)
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycles(annotations=False)


def test_zkern_testing_names_are_its_documented_api():
    """zkern.testing is a public module: every name in __all__ resolves and its docstring names it."""
    import zkern.testing as testing

    doc = testing.__doc__
    missing = [n for n in testing.__all__ if not hasattr(testing, n)]
    undocumented = [n for n in testing.__all__ if n not in doc]
    assert not missing and not undocumented, (missing, undocumented)


def test_the_public_errors_live_in_errors_py():
    """One place for what zkern raises on purpose: every exception class zkern exports is defined in zkern/errors.py
    (the modules that raise them import it from there)."""
    import zkern

    errors = [n for n in zkern.__all__ if isinstance(getattr(zkern, n), type)
              and issubclass(getattr(zkern, n), BaseException)]
    assert {"ConfigError", "CommError", "CheckpointError", "LossScaleAtMinimum", "InvariantError"} <= set(errors)
    homes = {n: getattr(zkern, n).__module__ for n in errors}
    elsewhere = [f"{n} in {home}" for n, home in homes.items() if home != "zkern.errors"]
    assert not elsewhere, elsewhere


TEST_ROOMS = {"checkpoint", "config", "comm", "core", "engine", "stage3", "offload", "optim", "kernels", "hf", "verify",
              "bench", "house"}


def test_every_test_file_lives_in_a_room():
    """tests/<room>/test_*.py (ARCHITECTURE.md, "Tests"): no test file at the top of tests/, no room of another
    name."""
    tests = ROOT.parent / "tests"
    top = sorted(p.name for p in tests.glob("test_*.py"))
    assert not top, f"test files outside a room: {top}; move each into tests/<room>/"
    rooms = {p.parent.name for p in tests.glob("*/test_*.py")}
    assert rooms <= TEST_ROOMS, f"test rooms not named in ARCHITECTURE.md: {sorted(rooms - TEST_ROOMS)}"

