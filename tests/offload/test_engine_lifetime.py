"""Nothing outlives its engine: an engine dropped (or destroy()ed and dropped) at any point of a step leaves no
zkern thread running and no host state alive: after a backward that raised (an out-of-memory retry loop, as
Accelerate's find_executable_batch_size runs, rebuilds the engine), between a backward and its step(), with an
asynchronous save in flight; for the offloaded step, the delayed update, the speculative step and NVMe. Before, the
speculative step's thread waited forever on its queue, holding the host master and moments, and every engine's
gradient hooks kept its runtime alive from C++ where Python's collector cannot see.

    python -m pytest tests/offload/test_engine_lifetime.py -q
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

import zkern
from zkern.testing import TinyGPT

MODES = {"cpu": {"device": "cpu"}, "delayed": {"device": "cpu", "delayed_update": True},
         "speculative": {"device": "cpu", "speculative_step": True}, "nvme": {"device": "nvme"}}


def _zkern_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("zkern")]


def _drop_at(stage: int, mode: str, point: str, destroy: bool, tmp) -> dict:
    """Build an engine, take it to `point`, drop it; weak references to what it held."""
    offload = {**MODES[mode], **({"nvme_path": str(tmp)} if mode == "nvme" else {})}
    engine = zkern.Engine(TinyGPT(), {
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "device": "cpu", "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0,
                              "offload_optimizer": offload}})
    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # a delayed update is in flight after these
        engine.backward(engine(ids, ids))
        engine.step()
    loss = engine(ids, ids)
    match point:
        case "failed-backward":
            def fail(grad):
                raise RuntimeError("planted: out of memory")
            loss.register_hook(fail)
            with pytest.raises(RuntimeError, match="planted"):
                engine.backward(loss)
        case "before-step":
            engine.backward(loss)
        case "save-in-flight":
            engine.backward(loss)
            engine.step()
            engine.save_checkpoint(tmp / "ckpt", tag="t", async_save=True)
    held = {"runtime": weakref.ref(engine.runtime), "optimizer": weakref.ref(engine.optimizer),
            "host step": weakref.ref(engine.host_step),
            "host master": weakref.ref(engine.host_step.host_groups[0].chunks[0].param.untyped_storage())}
    if destroy:
        engine.destroy()
    del engine, loss
    return held


@pytest.mark.parametrize("destroy", [False, True], ids=["dropped", "destroyed"])
@pytest.mark.parametrize("point", ["failed-backward", "before-step", "save-in-flight"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_nothing_outlives_a_dropped_engine(mode, point, destroy, tmp_path):
    before = _zkern_threads()
    held = [_drop_at(2 if i % 2 == 0 else 3, mode, point, destroy, tmp_path / str(i)) for i in range(3)]
    deadline = time.monotonic() + 60  # an asynchronous save's writer finishes its file, then ends
    gc.collect()  # engines are cycles of Python objects: the collector frees them, and their threads then end
    while _zkern_threads() != before and time.monotonic() < deadline:
        time.sleep(0.05)
        gc.collect()
    gc.collect()  # what a thread that just ended held is collectable only now
    assert _zkern_threads() == before, f"threads left running: {_zkern_threads()}"
    alive = [f"engine {i}: {what}" for i, refs in enumerate(held) for what, ref in refs.items() if ref() is not None]
    assert not alive, f"still alive after the engines were dropped: {alive}"
    if mode == "nvme":
        leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and "ckpt" not in p.parts]
        assert not leftovers, f"NVMe files left behind: {leftovers[:5]}"
