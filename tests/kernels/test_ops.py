"""zkern.ops.OPS is the one op table: every op it names has its reference twin, its public wrapper, and a definition
in each backend the table says has it; every op a wrapper dispatches is in the table; and the dispatch answers from
the table alone.

    python -m pytest tests/kernels/test_ops.py -q
"""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
import torch

from zkern import ops, reference

ROOT = pathlib.Path(ops.__file__).parent


def _defined(path: pathlib.Path) -> set[str]:
    """The top-level functions a source file defines (read, not imported: Triton need not be installed)."""
    return {n.name for n in ast.parse(path.read_text()).body if isinstance(n, ast.FunctionDef)}


HOMES = {"triton": lambda file: ROOT / "triton" / f"{file}.py", "cuda": lambda file: ROOT / "cuda" / "__init__.py",
         "cpu": lambda file: ROOT / "cpu" / "_ext.py"}
SOURCES = {"cuda": lambda file: ROOT / "cuda" / "csrc" / f"{file}.cu", "cpu": lambda file: ROOT / "cpu" / "csrc" /
           f"{file}.h", "triton": lambda file: ROOT / "triton" / f"{file}.py"}


@pytest.mark.parametrize("op", sorted(ops.OPS))
def test_every_op_has_its_twin_its_wrapper_and_its_homes(op):
    assert callable(getattr(reference, op, None)), f"zkern.reference has no {op}"
    assert callable(getattr(ops, op, None)), f"zkern.ops has no wrapper {op}"
    for backend, file in ops.OPS[op].items():
        assert backend in ops.BACKENDS and backend != "reference", f"{op}: unknown backend {backend!r}"
        assert SOURCES[backend](file).is_file(), f"{op}: {SOURCES[backend](file)} does not exist"
        assert op in _defined(HOMES[backend](file)), f"{op}: {HOMES[backend](file)} does not define it"


def test_every_op_a_wrapper_dispatches_is_in_the_table():
    dispatched = set()
    for node in ast.walk(ast.parse(inspect.getsource(ops))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_impl":
            name = node.args[1]
            assert isinstance(name, ast.Constant), ast.unparse(node)
            dispatched.add(name.value)
    assert dispatched == set(ops.OPS), f"dispatched {sorted(dispatched)}, table {sorted(ops.OPS)}"


def test_the_dispatch_answers_from_the_table(monkeypatch):
    """A forced backend runs the ops the table gives it and the reference for the rest."""
    monkeypatch.setitem(ops.AVAILABLE, "triton", object())  # present, whatever this machine has
    monkeypatch.setenv("ZKERN_BACKEND", "triton")
    t = torch.zeros(4)
    for op in ops.OPS:
        assert ops.backend_for(t, op) == ("triton" if "triton" in ops.OPS[op] else "reference"), op
    assert ops.ops_of("cuda") == tuple(op for op in ops.OPS if "cuda" in ops.OPS[op])
    assert ops.ops_of("reference") == tuple(ops.OPS)


def test_no_backend_defines_an_op_the_table_does_not_send_to_it():
    """A kernel file that defines one of the ops the table does not list for it would never be reached."""
    files = {"triton": {f.stem for f in (ROOT / "triton").glob("*.py") if not f.stem.startswith("_")},
             "cuda": {"__init__"}}
    for backend, stems in files.items():
        for stem in stems:
            path = ROOT / backend / f"{stem}.py"
            for op in _defined(path) & set(ops.OPS):
                assert backend in ops.OPS[op] and (backend == "cuda" or ops.OPS[op][backend] == stem), \
                    f"{path} defines {op}, which zkern.ops.OPS does not send there"


def test_the_static_gate_fails_on_a_table_row_it_did_not_compile():
    from bench.gpu_static_suite import op_table_gaps

    traced = {f"zkern.triton.{homes['triton']}" for homes in ops.OPS.values() if "triton" in homes}
    assert op_table_gaps(traced) == []
    gaps = op_table_gaps(traced - {"zkern.triton.quant"})
    assert sorted(g.split(":")[0] for g in gaps) == ["dequant_sum", "dequant_sum_requant", "dequantize", "quantize"]
