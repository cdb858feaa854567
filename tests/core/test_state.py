"""The engine's state registry (zkern/core/state.py): every tensor the engine holds belongs to a registered
component; every component survives save -> load into a fresh engine; a load into a live engine, at any moment and
with any flags, leaves it exactly as a fresh engine loaded from the same checkpoint; reset returns every component
to a fresh engine's value. World 2, over the features that add state: accumulation, a scheduler, fp16 overflows,
bf16, offload to the host and to NVMe, qgZ with LoCo, hpZ, qwZ, int8-resting frozen units, a client optimizer.

    python -m pytest tests/core/test_state.py -q
"""

from __future__ import annotations

import collections
import dataclasses
import os
from dataclasses import replace

import torch
from checkpoint_runs import SCHEDULER, build, global_batches, spec_for, train

from zkern.core.state import KINDS, differences, equal
from zkern.testing.ranks import spawn

FP16 = {"initial_scale_power": 30, "hysteresis": 1, "loss_scale_window": 2}  # overflows in the first steps
RESTORED = ("weights", "optimizer", "lr_scheduler", "training")


def variants(world: int, root: str) -> dict:
    base = {"extra_config": {**SCHEDULER, "ranks_per_node": 1}, "accumulation": 2}
    loco = {"zero_quantized_gradients": True, "zeropp_loco_param": {"err_beta": 0.8, "reset_T": 1024},
            "reduce_bucket_size": 3000}
    return {
        "stage0": spec_for(world, stage=0, **base),
        "stage1_bf16_offload": spec_for(world, stage=1, precision="bf16", zero={"offload_optimizer": {"device": "cpu"}},
                                        **base),
        "stage2_fp16_loco": spec_for(world, stage=2, precision="fp16", fp16=FP16, zero=loco, **base),
        "stage3_bf16_zeropp_frozen": spec_for(
            world, stage=3, precision="bf16", model={"frozen": ("fc",)},
            zero={"zero_hpz_partition_size": 2, "zero_quantized_weights": True, **loco,
                  "zero_quantized_nontrainable_weights": True, "zeropp_weight_group_size": 64}, **base),
        "stage3_nvme": spec_for(world, stage=3, zero={
            "offload_optimizer": {"device": "nvme", "nvme_path": os.path.join(root, "nvme"), "buffer_count": 3},
            "offload_param": {"device": "nvme", "nvme_path": os.path.join(root, "nvme"), "max_in_cpu": 2000}},
            **base),
        "stage1_client_groups": spec_for(world, stage=1, param_groups=True, accumulation=2),
    }


def micro_step(engine, spec, step: int, micro: int, rank: int, world: int) -> None:
    """One micro-step of `step` without the accumulation's others (leaves gradients accumulated)."""
    idx, tgt = global_batches(spec, step + 1)[step]
    per = 4 // (world * spec.accumulation)
    lo = (micro * world + rank) * per
    engine.backward(engine(idx[lo:lo + per], tgt[lo:lo + per]))
    engine.step()


def storage_key(t: torch.Tensor) -> tuple:
    return (str(t.device), t.untyped_storage().data_ptr())


def unclaimed_tensors(engine) -> list[str]:
    """Paths of tensors reachable from the engine's objects whose storage no registered component owns."""
    claimed = {storage_key(t) for c in engine.state for t in c.tensors()
               if t is not None and not t.is_meta and t.numel()}
    # breadth first: a tensor is reported by its shortest path (engine.runtime.x, not through a holder of the runtime)
    seen, found, stack = set(), [], collections.deque([("engine", engine)])
    while stack:
        path, obj = stack.popleft()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if not obj.is_meta and obj.numel() and storage_key(obj) not in claimed:
                found.append(f"{path} {tuple(obj.shape)} {obj.dtype}")
            continue
        if isinstance(obj, dict):
            stack += [(f"{path}[{k!r}]", v) for k, v in obj.items()]
            stack += [(f"{path}.key", k) for k in obj if isinstance(k, torch.Tensor)]
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            stack += [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)) or \
                type(obj).__module__.startswith("zkern") or dataclasses.is_dataclass(obj):
            if hasattr(obj, "__dict__"):
                stack += [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    return sorted(found)


def registry_worker(rank: int, world: int, specs: dict, root: str) -> dict:
    out = {}
    for name, spec in specs.items():
        ckpt = os.path.join(root, name)
        saver = build(spec, world)
        train(saver, spec, 0, 3, rank, world)
        micro_step(saver, spec, 3, 0, rank, world)  # gradients accumulated: the walk sees them too
        unclaimed = unclaimed_tensors(saver)
        saver.state.reset("transient")  # the partial accumulation goes, its count too (zero_grad keeps the count)
        saved = saver.state.snapshot(*RESTORED)
        saver.save_checkpoint(ckpt)
        fresh = build(spec, world)
        pristine = fresh.state.snapshot()
        fresh.load_checkpoint(ckpt)
        loaded = fresh.state.snapshot()
        result = {"unclaimed": unclaimed, "kinds": sorted({c.kind for c in saver.state}),
                  "restored": differences(saved, fresh.state.snapshot(*RESTORED))}
        # A live engine at the end of one step and one micro-step, loaded with each set of flags, against a fresh
        # engine loaded with the same flags.
        for flags in ({}, {"load_optimizer_states": False}, {"load_lr_scheduler_states": False},
                      {"load_module_only": True}):
            live = build(spec, world)
            train(live, spec, 0, 1, rank, world)
            micro_step(live, spec, 1, 0, rank, world)
            live.load_checkpoint(ckpt, **flags)
            other = build(spec, world)
            other.load_checkpoint(ckpt, **flags)
            live_state, other_state = live.state.snapshot(), other.state.snapshot()
            live_state.pop("generators"), other_state.pop("generators")  # module-only loads leave them be
            result[f"live {flags}"] = differences(live_state, other_state)
            live.destroy(), other.destroy()
        # reset: back to the fresh engine's value for every kind a load may reset
        fresh.state.reset("transient", "optimizer", "lr_scheduler", "training")
        after = fresh.state.snapshot("transient", "optimizer", "lr_scheduler", "training")
        before = {k: v for k, v in pristine.items() if k in after and k != "generators"}
        after.pop("generators", None)
        result["reset"] = differences(before, after)
        result["loaded_equals_fresh"] = equal(loaded, pristine)  # the load did change something
        for e in (saver, fresh):
            e.destroy()
        out[name] = result
    return out


def test_every_tensor_is_claimed_and_every_component_resumes_and_resets(tmp_path):
    world = 2
    specs = variants(world, str(tmp_path))
    results = spawn(registry_worker, world, specs, str(tmp_path), timeout=900)
    for rank, per_spec in enumerate(results):
        for name, r in per_spec.items():
            where = f"rank {rank}, {name}"
            assert r["unclaimed"] == [], f"{where}: tensors no state component owns: {r['unclaimed'][:10]}"
            assert set(r["kinds"]) <= set(KINDS)
            assert r["restored"] == [], f"{where}: not restored by save -> load: {r['restored']}"
            for key, diff in r.items():
                if key.startswith("live"):
                    assert diff == [], f"{where}: {key}: a live engine differs from a fresh one after the load: {diff}"
            assert r["reset"] == [], f"{where}: reset does not return to a fresh engine's value: {r['reset']}"
            assert not r["loaded_equals_fresh"], f"{where}: the load changed nothing (the test would prove nothing)"


def test_a_component_left_out_of_the_registry_is_found(tmp_path):
    """The walk's own check: a buffer no component claims is reported by its path."""
    spec = spec_for(1, stage=2)
    engine = build(spec, 1)
    assert unclaimed_tensors(engine) == []
    engine.runtime.stray = torch.ones(3)
    assert unclaimed_tensors(engine) == ["engine.runtime.stray (3,) torch.float32"]


def test_snapshots_see_a_changed_moment():
    """equal/differences tell a changed element apart (the comparisons above can fail)."""
    spec = replace(spec_for(1, stage=1), steps=1)
    engine = build(spec, 1)
    train(engine, spec, 0, 1, 0, 1)
    before = engine.state.snapshot()
    moment = engine.optimizer.exp_avg[0]
    moment[5] = torch.nextafter(moment[5], torch.tensor(float("inf")))  # one ulp
    assert differences(before, engine.state.snapshot()) == ["optimizer.pieces"]


class _Tally:
    """A piece of training state a user or a later feature adds: a count with a saved form."""

    def __init__(self):
        self.count = 0

    def component(self):
        from zkern.core.state import Component

        def check(saved):
            if not isinstance(saved, dict) or not isinstance(saved.get("count"), int):
                raise ValueError(f"not a tally: {saved!r}")

        return Component("tally", "training", reset=lambda: setattr(self, "count", 0),
                         snapshot=lambda: self.count, save=lambda: {"count": self.count}, check=check,
                         restore=lambda saved: setattr(self, "count", saved["count"]))


def test_registering_a_component_is_all_it_takes_to_save_check_restore_and_reset_it(tmp_path, caplog):
    """The checkpoint knows no component by name: one registered is saved, checked before anything changes,
    restored, reset by a load that does not restore its kind, and a checkpoint without it resets it (with a word)."""
    import json

    from zkern.checkpoint import CheckpointError
    from zkern.checkpoint.manifest import manifest_bytes

    spec = spec_for(1, stage=2)
    saver, tally = build(spec, 1), _Tally()
    saver.state.add(tally.component())
    train(saver, spec, 0, 1, 0, 1)
    tally.count = 7
    saver.save_checkpoint(tmp_path / "with")
    plain = build(spec, 1)
    train(plain, spec, 0, 1, 0, 1)
    plain.save_checkpoint(tmp_path / "without")

    loader, fresh = build(spec, 1), _Tally()
    loader.state.add(fresh.component())
    fresh.count = 3
    loader.load_checkpoint(tmp_path / "with")
    assert fresh.count == 7
    fresh.count = 3
    loader.load_checkpoint(tmp_path / "with", load_module_only=True)  # the training kind is not restored: reset
    assert fresh.count == 0
    fresh.count = 3
    with caplog.at_level("WARNING", logger="zkern"):
        loader.load_checkpoint(tmp_path / "without")
    assert fresh.count == 0 and "holds no tally state" in caplog.text
    with caplog.at_level("WARNING", logger="zkern"):
        build(spec, 1).load_checkpoint(tmp_path / "with")  # an engine without the component says what it left
    assert "holds tally state, which this engine has no place for" in caplog.text

    manifest = tmp_path / "with" / "global_step1" / "manifest.json"
    outer = json.loads(manifest.read_bytes())
    outer["manifest"]["state"]["tally"] = {"count": "seven"}
    manifest.write_bytes(manifest_bytes(outer["manifest"]))
    fresh.count, steps = 5, loader.global_steps
    try:
        loader.load_checkpoint(tmp_path / "with")
    except CheckpointError as e:
        assert "'tally' cannot be restored: not a tally" in str(e)
    else:
        raise AssertionError("a saved form its component refuses was loaded")
    assert fresh.count == 5 and loader.global_steps == steps  # nothing changed
