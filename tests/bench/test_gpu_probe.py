"""bench/gpu_probe.py on the CPU: what a lent GPU's one run will execute, checked here first so that none of its
minutes goes to a harness bug. The same code paths run on a GPU, with CUDA events and the allocator's figures."""

import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench import gpu_probe, probe_systems, probe_world2  # noqa: E402


def test_bw_on_a_cpu_measures_the_host_and_says_why_nothing_else(tmp_path):
    out = tmp_path / "bw.json"
    assert gpu_probe.main(["bw", "--bytes", str(1 << 24), "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["host_copy_gbs"] > 0 and rec["machine"]["git_sha"]
    assert "no CUDA device" in rec["device"]


@pytest.mark.dist
def test_the_offload_headline_variants_train_the_same_model_under_activation_checkpointing(tmp_path):
    """The GPU lease's headline and parity steps (docs/gpu.md) on the CPU: zkern's offload recipes and FSDP2's CPU
    offload, every block recomputed in backward, each step's gradient norm recorded."""
    names = ["zkern2-offload", "zkern2-offload-bf16", "zkern2-offload-dpu", "zkern2-offload-bf16-dpu",
             "zkern2-offload-bf16-spec", "zkern3-offload-bf16-spec", "fsdp2-offload", "torch-mixed-offload"]
    rec = gpu_probe.run_variants(names, "tiny", "cpu", str(tmp_path / "h.json"), steps=2, warmup=1, micro_batch=None,
                                 snapshot=False, matmul_tflops=None, threads=1, timeout=120,
                                 checkpoint="non_reentrant", lr=3e-4, grad_norms=True)
    assert rec["model_kwargs"]["checkpoint"] == "non_reentrant" and rec["lr"] == 3e-4 and rec["grad_norms"]
    by = {v["system"]: v for v in rec["variants"]}
    assert set(by) == set(names) and not [v for v in by.values() if "error" in v], by
    for name in names:
        assert all(math.isfinite(x) for x in by[name]["losses"]), by[name]["losses"]
        assert len(by[name]["grad_norms"]) == len(by[name]["losses"]) == 1 + 2 + 1
        assert by[name]["host"]["peak_rss"] > 0
        if name.startswith("zkern"):  # the host step ran, and its gradients came down; the books' host bytes
            assert by[name]["offload_phases_s"]["grad_bytes_down"] > 0
            assert by[name]["host"]["zkern_counted"] > 0
    # the zkern variants and the torch reference of their arithmetic start from the same bf16 model built on the
    # device: the same first loss, bit for bit
    assert len({by[n]["losses"][0] for n in names if n != "fsdp2-offload"}) == 1
    # the reference does zkern's offload arithmetic in torch (fp32 master and moments on the host): the two Adams
    # part by fp32 roundings of the master, which move a bf16 weight only where they cross a rounding boundary, so
    # every loss within 2e-5 of zkern's (one chunk of parameters never uploaded moves them by 1.6e-4) and every
    # gradient norm within 1e-3
    ours, ref = by["zkern2-offload"], by["torch-mixed-offload"]
    assert all(abs(a - b) < 2e-5 * b for a, b in zip(ours["losses"], ref["losses"])), (ours, ref)
    assert all(abs(a - b) < 1e-3 * b for a, b in zip(ours["grad_norms"], ref["grad_norms"])), (ours, ref)
    # bf16 state and the delayed update each change the arithmetic (so the variant's config took), and train the
    # same model: their later losses are others than the fp32-state variant's, and close to them
    plain = by["zkern2-offload"]["losses"]
    for name in ("zkern2-offload-bf16", "zkern2-offload-dpu", "zkern2-offload-bf16-dpu"):
        later = by[name]["losses"][1:]
        assert later != plain[1:], name
        assert all(abs(a - b) < 0.01 * b for a, b in zip(later, plain[1:])), (name, later, plain)
    # the speculative step is the plain step's arithmetic whatever became of its guesses: at stage 2 the bf16
    # variant's losses bit for bit; at stage 3 with the parameters on the host (SuperOffload's shape), the same model
    assert by["zkern2-offload-bf16-spec"]["losses"] == by["zkern2-offload-bf16"]["losses"]
    for name in ("zkern2-offload-bf16-spec", "zkern3-offload-bf16-spec"):
        assert by[name]["offload_phases_s"]["speculation"] in ("kept", "clipped"), by[name]["offload_phases_s"]
        assert all(abs(a - b) < 0.01 * b for a, b in zip(by[name]["losses"], plain)), (name, by[name], plain)
    # FSDP2 trains the same model from the same weights: the first step's gradient norm (the engine's own figure,
    # torch's from .grad) and every loss within bf16's reach of zkern's, the delayed update's losses aside (its
    # model trails one update)
    fsdp = by["fsdp2-offload"]
    for name in ("zkern2-offload", "zkern2-offload-bf16"):
        ours = by[name]
        assert abs(ours["grad_norms"][0] - fsdp["grad_norms"][0]) < 0.02 * fsdp["grad_norms"][0], (name, ours, fsdp)
        assert all(abs(a - b) < 0.01 * b for a, b in zip(ours["losses"], fsdp["losses"])), (name, ours, fsdp)
        assert all(abs(a - b) < 0.1 * b for a, b in zip(ours["grad_norms"], fsdp["grad_norms"])), (name, ours, fsdp)


@pytest.mark.dist
def test_variants_record_every_system_and_survive_a_failing_one(tmp_path):
    out = tmp_path / "v.json"
    names = ["zkern0", "zkern3", "zkern2-offload", "ddp-fused", "fsdp2", "torch-mixed"]
    rec = gpu_probe.run_variants(names, "tiny", "cpu", str(out), steps=2, warmup=1, micro_batch=None,
                                 snapshot=False, matmul_tflops=None, threads=1, timeout=120)
    on_disk = json.loads(out.read_text())
    assert [v["system"] for v in on_disk["variants"]] == names
    for v in rec["variants"]:
        assert "error" not in v, v
        assert len(v["step_s"]["all"]) == 2 and v["step_s"]["median"] > 0
        assert len(v["losses"]) == 1 + 2 + 1  # warm-up, timed, instrumented
        for phase in ("build", "after_forward", "backward_peak", "after_step", "timed_peak"):
            assert v["memory"][phase]["rss"] > 0
    by = {v["system"]: v for v in rec["variants"]}
    # the same model, data and seed: every system starts from the same loss; zkern's bf16 arithmetic written in
    # torch (torch-mixed) starts bit for bit where zkern stage 0 does
    first = {name: v["losses"][0] for name, v in by.items()}
    assert first["torch-mixed"] == first["zkern0"], first
    assert max(first.values()) - min(first.values()) < 0.02 * first["zkern0"], first
    assert set(by["zkern2-offload"]["offload_phases_s"]) >= {"wait_down", "host_adam", "upload_issue",
                                                             "upload_tail", "grad_bytes_down"}
    assert by["zkern2-offload"]["offload_phases_s"]["grad_bytes_down"] > 0
    assert "zkern3" in gpu_probe.table(rec)
    # a variant that fails (here: cut off by its time limit) is recorded and the next one still runs
    rec = gpu_probe.run_variants(["zkern0", "ddp"], "tiny", "cpu", str(out), steps=1, warmup=1, micro_batch=None,
                                 snapshot=False, matmul_tflops=None, threads=1, timeout=0.01)
    assert all("error" in v for v in rec["variants"]) and len(json.loads(out.read_text())["variants"]) == 2
    with pytest.raises(SystemExit, match="unknown variant 'zkern9'"):
        gpu_probe.run_variants(["zkern9"], "tiny", "cpu", None, steps=1, warmup=1, micro_batch=None, snapshot=False,
                               matmul_tflops=None, threads=1, timeout=10)


def test_the_peak_is_attributed_to_the_first_zkern_frame_of_what_was_live_then():
    zk = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
          {"filename": "/repo/zkern/stage3/gatherer.py", "line": 120, "name": "gather"},
          {"filename": "/repo/bench/gpu_probe.py", "line": 9, "name": "measure"}]
    act = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "linear"},
           {"filename": "/repo/zkern/testing/models.py", "line": 41, "name": "forward"},  # innermost: the model's line
           {"filename": "/repo/zkern/engine/engine.py", "line": 127, "name": "forward"},
           {"filename": "/repo/bench/gpu_probe.py", "line": 9, "name": "measure"}]
    trace = [{"action": "alloc", "addr": 1, "size": 100, "frames": zk},
             {"action": "alloc", "addr": 2, "size": 50, "frames": act},
             {"action": "free_requested", "addr": 1, "size": 100},
             {"action": "free_completed", "addr": 1, "size": 100},  # the peak (1000 + 150) is already behind
             {"action": "alloc", "addr": 3, "size": 60, "frames": act},
             {"action": "free_completed", "addr": 2, "size": 50},
             {"action": "free_completed", "addr": 77, "size": 900},  # allocated before the trace: leaves the count
             {"action": "alloc", "addr": 4, "size": 500, "frames": act}]  # 1000 - 900 + 60 + 500 = 660: no new peak
    got = gpu_probe.attribute_peak(trace, base=1000)
    assert got["peak_allocated"] == 1150 and got["before_the_step"] == 1000
    assert got["sites"] == [{"site": "zkern/stage3/gatherer.py:120 gather", "bytes": 100},
                            {"site": "zkern/testing/models.py:41 forward", "bytes": 50}]


def test_ranks_sharing_one_gpu_get_local_rank_0_and_a_host_id_each():
    envs = [probe_world2.one_gpu_env(r) for r in range(2)]
    assert {e["LOCAL_RANK"] for e in envs} == {"0"}
    assert envs[0]["NCCL_HOSTID"] != envs[1]["NCCL_HOSTID"]
    assert all(e["NCCL_SOCKET_IFNAME"] == "lo" for e in envs)


@pytest.mark.dist
def test_world2_checks_pass_over_gloo_and_are_recorded_as_they_finish(tmp_path):
    out = tmp_path / "w2.json"
    rec = probe_world2.run("cpu", str(out), None, timeout=300)
    assert [c["check"] for c in json.loads(out.read_text())["checks"]] == list(probe_world2.CHECKS)
    assert all(c["status"] == "pass" for c in rec["checks"]), probe_world2.table(rec)
    with pytest.raises(SystemExit, match="unknown check"):
        probe_world2.run("cpu", None, ["smoke", "nope"], timeout=10)


def test_every_variant_name_builds_or_is_refused_by_name():
    assert set(probe_systems.NAMES) >= {"zkern0", "zkern1", "zkern2", "zkern3", "zkern2-offload", "zkern3-offload",
                                         "ddp", "ddp-fused", "fsdp2", "fsdp2-fused", "torch-mixed"}
    with pytest.raises(SystemExit, match="unknown system"):
        probe_systems.build("nope", None, 1)


@pytest.mark.dist
def test_the_uploads_step_compares_the_side_stream_with_copies_in_line(tmp_path):
    """The lease's `uploads` step: stage 3 with offload_param, its prefetched units' host chunks up ahead of use
    (zkern3-offload) and in line (zkern3-offload-inline, the runtime built without stage3/uploads.py): the same
    arithmetic, so the same losses bit for bit, and only the first variant's uploads go ahead."""
    import dataclasses

    from bench import engine_suite
    from zkern.stage3.runtime import Stage3Runtime

    base = engine_suite.make_spec(0, "tiny", 3, "bf16", "cpu")
    spec = dataclasses.replace(base, model={**base.model, "checkpoint": "non_reentrant"})
    ahead, inline = (probe_systems.build(n, spec, 1) for n in ("zkern3-offload", "zkern3-offload-inline"))
    try:
        assert ahead.engine.runtime.gatherer.uploads is not None
        assert inline.engine.runtime.gatherer.uploads is None
        assert Stage3Runtime.__dict__["_uploads"].__func__.__name__ == "_uploads"  # the patch was undone
    finally:
        ahead.close()
        inline.close()
    rec = gpu_probe.run_variants(["zkern3-offload", "zkern3-offload-inline"], "tiny", "cpu", str(tmp_path / "u.json"),
                                 steps=2, warmup=1, micro_batch=None, snapshot=False, matmul_tflops=None, threads=1,
                                 timeout=120, checkpoint="non_reentrant", lr=3e-4, grad_norms=True)
    by = {v["system"]: v for v in rec["variants"]}
    assert not [v for v in by.values() if "error" in v], by
    assert by["zkern3-offload"]["losses"] == by["zkern3-offload-inline"]["losses"]
    assert by["zkern3-offload"]["grad_norms"] == by["zkern3-offload-inline"]["grad_norms"]
