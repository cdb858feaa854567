"""zkern over NCCL with several ranks on one GPU: `python bench/gpu_probe.py world2`.

NCCL refuses two ranks on one device ("Duplicate GPU detected": it compares host hashes and bus ids). Given a
distinct NCCL_HOSTID each, the ranks look like separate hosts and talk over loopback sockets
(NCCL_SOCKET_IFNAME=lo, NCCL_IB_DISABLE=1), every one on cuda:0 (LOCAL_RANK=0). That proves the NCCL path (groups,
the order of the two communicators' collectives, streams, results equal to one process), never a speed. If NCCL
refuses anyway, the checks run over gloo with CUDA tensors (zkern's backend_for patched in the ranks) and the
record says so. On a CPU the same checks run over gloo: that is how tests/bench/test_gpu_probe.py checks this file.

  smoke        all_reduce, all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single on real data, checked
  stages_fp32  stages 0-3 (fp32, accumulation 2, clipping) against single-process torch AdamW, parameter by
               parameter (zkern.testing.assert_params_close)
  bf16_curves  stages 1-3 in bf16: every step's loss within 4 bf16 ulps (4 * 2^-8, relative) of the fp32 run's
  moe          stage 3 with routed experts (ranks run different experts) against single-process AdamW
  zeropp       world 4 as 2 nodes of 2: hpZ alone exactly as single-process AdamW; qwZ+qgZ+hpZ (int8 gathers, int4
               reductions) with every loss within 2% of the fp32 reference over its few steps
  dead_rank    one rank leaves before its first backward: the other ends with zkern.CommError within
               comm_timeout_s, no hang
  checkpoint   saved at world 2 (stage 3), loaded at world 1 (stage 1): the same fp32 weights, bit for bit
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import time
import traceback

import torch

from zkern.testing import TrainSpec, assert_params_close, engine_run, mean_losses, reference_run, spawn

CHECKS = ("smoke", "stages_fp32", "bf16_curves", "moe", "zeropp", "dead_rank", "checkpoint")


def one_gpu_env(rank: int) -> dict:
    """A rank's environment for sharing GPU 0 with the others under NCCL."""
    return {"LOCAL_RANK": "0", "NCCL_HOSTID": f"zkern-probe-rank{rank}", "NCCL_SOCKET_IFNAME": "lo",
            "NCCL_IB_DISABLE": "1", "NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def _use_backend(backend: str) -> None:
    """In a rank: make zkern's groups use `backend` for CUDA tensors ("nccl" is zkern's own choice)."""
    if backend == "nccl":
        return
    import zkern.comm.collectives as collectives
    import zkern.engine.engine as engine_module

    def gloo_everywhere(device: torch.device) -> str:
        return "gloo"

    collectives.backend_for = gloo_everywhere
    engine_module.backend_for = gloo_everywhere


# -- what each rank runs --------------------------------------------------------------------------------------------
def _smoke(rank: int, world: int, device: str, backend: str) -> dict:
    import torch.distributed as dist

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    if device == "cuda":
        torch.cuda.set_device(dev)
        dist.init_process_group(backend, device_id=dev if backend == "nccl" else None)
    else:
        dist.init_process_group("gloo")
    n = 1 << 20
    g = torch.Generator().manual_seed(rank)
    mine = torch.randn(world * n, generator=g).to(dev)
    every = [torch.randn(world * n, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    total = sum(every)
    t = mine.clone()
    dist.all_reduce(t)
    errors = {"all_reduce": (t.cpu() - total).abs().max().item()}
    out = torch.empty(world * n, device=dev)
    dist.all_gather_into_tensor(out, mine[:n].contiguous())
    errors["all_gather_into_tensor"] = (out.cpu() - torch.cat([e[:n] for e in every])).abs().max().item()
    if backend != "gloo":
        part = torch.empty(n, device=dev)
        dist.reduce_scatter_tensor(part, mine)
        errors["reduce_scatter_tensor"] = (part.cpu() - total[rank * n:(rank + 1) * n]).abs().max().item()
    got = torch.empty(world * n, device=dev)
    dist.all_to_all_single(got, mine)
    want = torch.cat([e[rank * n:(rank + 1) * n] for e in every])
    errors["all_to_all_single"] = (got.cpu() - want).abs().max().item()
    if device == "cuda":
        torch.cuda.synchronize()
    dist.destroy_process_group()
    return errors


def _engine_runs(rank: int, world: int, specs: list[TrainSpec], backend: str) -> list[dict]:
    _use_backend(backend)
    out = []
    for s in specs:
        r = engine_run(rank, world, s)
        out.append({"losses": r["losses"], "state": r["state"], "skipped": r["skipped"]})
    return out


def _leaves(rank: int, world: int, spec: TrainSpec, backend: str) -> dict:
    _use_backend(backend)
    import zkern

    engine = spec.build_engine(spec.make_model(), world)
    idx, tgt = spec.batches(world)[0][0][rank]
    dev = engine.device
    loss = spec.loss(engine, idx.to(dev), tgt.to(dev), 0, rank)
    if rank == 1:
        os._exit(0)  # gone, without a word to the others
    import faulthandler

    # a rank still here well past the timeout prints where it waits (the record shows where a hang sits)
    faulthandler.dump_traceback_later(engine.comm.timeout_s + 25, exit=False)
    start = time.monotonic()
    try:
        engine.backward(loss)
        engine.step()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return {"error": None, "seconds": time.monotonic() - start}
    except zkern.CommError as e:
        return {"error": f"CommError: {e}"[:600], "seconds": time.monotonic() - start}
    finally:
        faulthandler.cancel_dump_traceback_later()


def _save(rank: int, world: int, spec: TrainSpec, path: str, backend: str) -> dict:
    from zkern.testing import engine_training_loop

    _use_backend(backend)
    engine = spec.build_engine(spec.make_model(), world)
    engine_training_loop(spec, rank, world, engine)
    engine.save_checkpoint(path, tag="w2")
    engine.wait_checkpoint()
    state = engine.full_state_dict(rank0_only=True)
    engine.destroy()
    return {"state": None if state is None else {k: v.cpu() for k, v in state.items()}}


def _load(rank: int, world: int, spec: TrainSpec, path: str) -> dict:
    engine = spec.build_engine(spec.make_model(), world)
    engine.load_checkpoint(path, tag="w2")
    state = engine.full_state_dict()
    engine.destroy()
    return {"state": {k: v.cpu() for k, v in state.items()}}


# -- the checks, on the calling side ---------------------------------------------------------------------------------
class Probe:
    def __init__(self, device: str, timeout: float):
        self.device, self.timeout = device, timeout
        self.backend = "nccl" if device == "cuda" else "gloo"
        self.note = None

    def spawn(self, fn, world: int, *args, allow_dead: bool = False):
        cuda = self.device == "cuda"
        return spawn(fn, world, *args, subprocess=cuda, timeout=self.timeout, allow_dead=allow_dead,
                     rank_env=one_gpu_env if cuda else None, threads=2 if cuda else 1)

    def spec(self, **kw) -> TrainSpec:
        return TrainSpec(device=self.device, **kw)

    def smoke(self) -> dict:
        try:
            errors = self.spawn(_smoke, 2, self.device, self.backend)
        except Exception as e:
            if self.device != "cuda":
                raise
            self.note = f"nccl refused two ranks on one GPU; the checks ran over gloo with CUDA tensors: {e}"[-1500:]
            self.backend = "gloo"
            errors = self.spawn(_smoke, 2, self.device, self.backend)
        worst = max(v for r in errors for v in r.values())
        assert worst <= 1e-5 * 2, f"collectives off by {worst}: {errors}"
        return {"max_abs_error": worst, "backend": self.backend, "per_rank": errors}

    def stages_fp32(self) -> dict:
        specs = [self.spec(stage=s, steps=4, accumulation=2, clip=0.05) for s in range(4)]
        per_rank = self.spawn(_engine_runs, 2, specs, self.backend)
        for i, s in enumerate(specs):
            ref, _ = reference_run(s, 2)
            assert_params_close(per_rank[0][i]["state"], ref, lr=s.lr, steps=s.steps)
        return {"stages": [0, 1, 2, 3]}

    def bf16_curves(self) -> dict:
        specs = [self.spec(stage=s, steps=4, precision="bf16", accumulation=2, lr=1e-2) for s in (1, 2, 3)]
        per_rank = self.spawn(_engine_runs, 2, specs, self.backend)
        gaps = {}
        for i, s in enumerate(specs):
            _, ref_losses = reference_run(dataclasses.replace(s, precision="fp32"), 2)
            got = mean_losses([r[i] for r in per_rank])
            gaps[s.stage] = max(abs(a - b) / b for a, b in zip(got, ref_losses))
            assert per_rank[0][i]["skipped"] == 0
        assert max(gaps.values()) <= 4 * 2**-8, gaps
        return {"max_relative_loss_gap": gaps}

    def moe(self) -> dict:
        spec = self.spec(stage=3, arch="moe", steps=4, forced_routes={0: [0, 1]}, reduce_bucket_size=3000)
        per_rank = self.spawn(_engine_runs, 2, [spec], self.backend)
        ref, _ = reference_run(spec, 2)
        assert_params_close(per_rank[0][0]["state"], ref, lr=spec.lr, steps=spec.steps)
        return {}

    def zeropp(self) -> dict:
        node = {"ranks_per_node": 2}
        exact = self.spec(stage=3, steps=4, zero={"zero_hpz_partition_size": 2}, extra_config=node)
        quant = self.spec(stage=3, steps=4, precision="bf16", lr=1e-2, extra_config=node,
                          zero={"zero_quantized_weights": True, "zero_quantized_gradients": True,
                                "zero_hpz_partition_size": 2})
        per_rank = self.spawn(_engine_runs, 4, [exact, quant], self.backend)
        ref, _ = reference_run(exact, 4)
        assert_params_close(per_rank[0][0]["state"], ref, lr=exact.lr, steps=exact.steps)
        _, ref_losses = reference_run(dataclasses.replace(quant, precision="fp32"), 4)
        got = mean_losses([r[1] for r in per_rank])
        gap = max(abs(a - b) / b for a, b in zip(got, ref_losses))
        assert gap <= 0.02, (got, ref_losses)
        return {"quantized_max_relative_loss_gap": gap}

    def dead_rank(self) -> dict:
        """Passes when the surviving rank raises zkern.CommError within the timeout. A rank that the backend's own
        watchdog kills instead (NCCL aborts a process whose collective timed out) ends without a hang but without
        the error zkern promises: a failure, with the time it took."""
        timeout = 20
        spec = self.spec(stage=2, steps=1, extra_config={"comm_timeout_s": timeout})
        start = time.monotonic()
        results = self.spawn(_leaves, 2, spec, self.backend, allow_dead=True)
        elapsed = time.monotonic() - start
        r0 = {**results[0], "spawn_seconds": elapsed}
        assert "died" in results[1], results[1]
        assert "died" not in r0, f"rank 0 was killed (exit code {r0['died']}) {elapsed:.0f} s in, not a CommError"
        assert r0.get("error"), f"rank 0 finished a step without its peer: {r0}"
        assert r0["seconds"] <= timeout + 30, r0
        return r0

    def checkpoint(self) -> dict:
        spec = self.spec(stage=3, steps=3)
        with tempfile.TemporaryDirectory() as path:
            saved = self.spawn(_save, 2, spec, path, self.backend)[0]["state"]
            loaded = spawn(_load, 1, dataclasses.replace(spec, stage=1), path, subprocess=self.device == "cuda",
                           timeout=self.timeout)[0]["state"]
        diff = [k for k in saved if not torch.equal(saved[k], loaded[k])]
        assert not diff and set(saved) == set(loaded), f"differ after the world-2 -> world-1 load: {diff[:5]}"
        return {"tensors": len(saved)}


def run(device: str, json_path: str | None, checks: list[str] | None, timeout: float) -> dict:
    from bench.probe_record import machine, write_json

    unknown = set(checks or ()) - set(CHECKS)
    if unknown:
        raise SystemExit(f"probe world2: unknown check(s) {sorted(unknown)}; known: {', '.join(CHECKS)}")
    probe = Probe(device, timeout)
    record = {"probe": "world2", "machine": machine(), "device": device, "checks": []}
    for name in checks or CHECKS:
        print(f"[probe world2] {name} ...", file=sys.stderr, flush=True)
        t = time.perf_counter()
        try:
            detail = getattr(probe, name)()
            status, error = "pass", None
        except AssertionError as e:
            status, detail, error = "fail", {}, (str(e) or traceback.format_exc())[-2000:]
        except Exception:
            status, detail, error = "error", {}, traceback.format_exc()[-3000:]
        entry = {"check": name, "status": status, "seconds": time.perf_counter() - t, "backend": probe.backend,
                 "detail": detail, "error": error}
        record["checks"].append(entry)
        record["note"] = probe.note
        write_json(json_path, record)
        print(f"[probe world2] {name}: {status} in {entry['seconds']:.1f} s", file=sys.stderr, flush=True)
    return record


def table(record: dict) -> str:
    rows = [f"world2 on {record['machine'].get('device') or 'cpu'} ({record['device']})"
            + (f"; {record['note']}" if record.get("note") else ""), "| check | status | s | backend | detail |",
            "|---|---|---|---|---|"]
    for c in record["checks"]:
        what = c["error"].strip().splitlines()[-1][:120] if c["error"] else str(c["detail"])[:120]
        rows.append(f"| {c['check']} | {c['status']} | {c['seconds']:.1f} | {c['backend']} | {what} |")
    return "\n".join(rows)
