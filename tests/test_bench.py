"""The benchmark's CI gates: a ratio past its bound fails, and the gate file is checked."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gates  # noqa: E402
from bench.engine_suite import required_bytes_per_step  # noqa: E402

GATES = Path(__file__).resolve().parents[1] / "bench" / "gates.toml"


def record(**ratios):
    base = {"step_time_zkern_over_peer": 1.0, "model_state_zkern_over_peer": 1.0, "model_state_over_formula": 1.0,
            "comm_over_required": 1.0, "loss_gap_vs_ddp": 0.0}
    return {"stages": [{"stage": s, "ratios": {**base, **ratios}} for s in (0, 1, 2, 3)]}


def test_the_committed_gates_pass_a_good_record_and_fail_regressions():
    committed = gates.load(str(GATES))
    assert gates.check(record(), committed) == []
    slow = gates.check(record(step_time_zkern_over_peer=2.0), committed)
    assert len(slow) == 4 and all("step_time_zkern_over_peer = 2, above its bound" in f for f in slow)
    fat = gates.check(record(model_state_over_formula=1.10), committed)
    assert fat and "model_state_over_formula = 1.1, above its bound 1.02" in fat[0]
    chatty = gates.check(record(comm_over_required=0.5), committed)
    assert chatty and "below its bound 0.95" in chatty[0]
    assert "loss_gap_vs_ddp" in gates.check(record(loss_gap_vs_ddp=1e-3), committed)[0]


def test_a_missing_figure_fails_and_a_bad_gate_file_is_an_error(tmp_path):
    committed = gates.load(str(GATES))
    rec = record()
    del rec["stages"][2]["ratios"]["comm_over_required"]
    assert any("stage 2: comm_over_required: not in the record" in f for f in gates.check(rec, committed))
    bad = tmp_path / "gates.toml"
    bad.write_text('[[gate]]\nfigure = "x"\nmaxx = 1\n')
    with pytest.raises(ValueError, match="needs 'figure' and 'max' and/or 'min'"):
        gates.load(str(bad))


def test_required_bytes_are_the_zero_paper_volumes():
    # world 4, 1000 fp32 elements: a ring pass sends 3/4 of 4000 bytes = 3000
    assert required_bytes_per_step(0, 1000, 4, 4, 1) == 6000  # all-reduce: two passes
    assert required_bytes_per_step(1, 1000, 4, 4, 1) == 6000  # reduce-scatter + all-gather
    assert required_bytes_per_step(2, 1000, 4, 4, 3) == 12000  # a reduce-scatter per micro-step + all-gather
    assert required_bytes_per_step(3, 1000, 4, 4, 2) == 18000  # per micro-step: two all-gathers, one reduce-scatter
