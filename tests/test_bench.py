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
    return {"suite": "engine", "stages": [{"stage": s, "ratios": {**base, **ratios}} for s in (0, 1, 2, 3)]}


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


def adam_record(**ratios):
    base = {"offload_over_stock": 3.2, "offload_of_roofline": 0.97, "fp32_over_torch_fused": 1.3,
            "thread_speedup": 1.8}
    return {"suite": "adam", "ratios": {**base, **ratios}}


def test_adam_gates_fail_a_slow_step_and_skip_an_absent_optional_peer():
    committed = gates.load(str(GATES))
    assert gates.check(adam_record(), committed) == []  # no deepspeed figure: that gate is optional
    assert "offload_over_stock = 2, below its bound 2.7" in gates.check(adam_record(offload_over_stock=2.0),
                                                                          committed)[0]
    assert "offload_of_roofline" in gates.check(adam_record(offload_of_roofline=0.6), committed)[0]
    assert "offload_over_deepspeed" in gates.check(adam_record(offload_over_deepspeed=1.1), committed)[0]
    rec = adam_record()
    del rec["ratios"]["fp32_over_torch_fused"]
    assert gates.check(rec, committed) == ["adam: fp32_over_torch_fused: not in the record"]


def test_adam_suite_measures_every_candidate_on_a_small_buffer():
    from bench import adam_suite

    rec = adam_suite.run(numel=200_003, reps=2, progress=lambda line: None)
    assert set(rec["figures"]) >= {"zkern offload", "stock offload", "zkern fp32", "torch fused fp32",
                                   "zkern offload 1t", "in-place bandwidth"}
    assert all(f["median_s"] > 0 for f in rec["figures"].values())
    assert set(rec["ratios"]) >= {"offload_over_stock", "offload_of_roofline", "fp32_over_torch_fused",
                                  "thread_speedup"}
    assert "| zkern offload |" in adam_suite.table(rec)


def test_kernels_suite_runs_end_to_end_under_the_interpreter(monkeypatch):
    """The harness only (tiny sizes, interpreted kernels): every op measured against its stock twin, the
    record marked as interpreted, and the committed kernel gates applied to it (they fail: interpreted
    kernels are slow, which is why the record says its timings mean nothing)."""
    from bench import kernels_suite

    monkeypatch.setenv("ZKERN_BACKEND", "triton")
    rec = kernels_suite.run(numel=4096, interpret=True, progress=lambda line: None)
    assert rec["interpreted"] and set(rec["ops"]) == {"flatten", "unscale", "quantize_int8", "adam_bf16_copy"}
    assert all(r["zkern"]["median_s"] > 0 and r["stock"]["median_s"] > 0 for r in rec["ops"].values())
    assert "timings mean nothing" in kernels_suite.table(rec)
    failures = gates.check(rec, gates.load(str(GATES)))
    assert any("kernels: flatten_speedup" in f for f in failures)
