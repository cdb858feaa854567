"""offload_optimizer.cpuadam_cores_perc (DeepSpeed's, from SuperOffload): the host Adam that runs beside the
training thread (the speculative step's, the delayed update's) takes that share of the CPU Adam's threads, leaving the
rest to the thread that drives the device; the step's own Adam, which nothing else waits beside, takes them all. The
share changes where the work runs, never what it computes.

    python -m pytest tests/offload/test_background_threads.py -q
"""

from __future__ import annotations

import threading

import pytest
import torch

import zkern
from zkern import ops
from zkern.config import Config, ConfigError
from zkern.cpu import _ext
from zkern.testing import TinyGPT

pytestmark = pytest.mark.skipif(not _ext.available(), reason="the CPU Adam kernel is not built here")


def _config(clip: float = 0.0, **offload) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "device": "cpu", "gradient_clipping": clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": 2, "reduce_bucket_size": 3000,
                                  "offload_optimizer": {"device": "cpu", **offload}}}


def _train(cfg: dict, steps: int = 2) -> tuple[zkern.Engine, list[torch.Tensor]]:
    torch.manual_seed(0)
    engine = zkern.Engine(TinyGPT(), cfg)
    for seed in range(steps):
        ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(seed))
        engine.backward(engine(ids, ids))
        engine.step()
    engine.host_step.settle()  # the delayed update's last Adam has finished
    return engine, [p.detach().clone() for g in engine.optimizer.param_groups for p in g["params"]]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Each CPU Adam kernel call's (calling thread's name, threads asked for) with ten threads to share."""
    monkeypatch.setenv("ZKERN_CPU_THREADS", "10")
    calls, real = [], _ext.adam_step_

    def spy(*args, **kwargs):
        calls.append((threading.current_thread().name, kwargs.get("threads")))
        return real(*args, **kwargs)

    monkeypatch.setattr(ops._CpuBackend, "adam_step_", staticmethod(spy))  # what zkern.ops dispatches host Adams to
    return calls


@pytest.mark.parametrize("offload, clip, background, foreground", [
    # kept guesses: every chunk's Adam ran in backward, beside the training thread
    ({"speculative_step": True, "cpuadam_cores_perc": 0.5}, 0.0, "zkern-speculative-adam", False),
    # clipped: the guesses are undone and the step's own Adam redoes every chunk with all threads
    ({"super_offload": True, "cpuadam_cores_perc": 0.5}, 1e-3, "zkern-speculative-adam", True),
    ({"delayed_update": True, "cpuadam_cores_perc": 0.5}, 0.0, "zkern-delayed-adam", False),
])
def test_the_background_adam_takes_its_share_of_threads_and_the_step_all(kernel_calls, offload, clip, background,
                                                                         foreground):
    engine, _ = _train(_config(clip, **offload))
    fate = engine.host_step.last_step["speculation"]
    assert fate == ("clipped" if clip else "kept" if "delayed_update" not in offload else "off")
    assert engine.host_step.last_step["background_adam_threads"] == 5
    behind = {threads for name, threads in kernel_calls if name == background}
    ahead = {threads for name, threads in kernel_calls if name != background}
    # half of the ten (a refuted guess may be decided before the background Adam reached any chunk)
    assert behind == {5} or (foreground and not behind), kernel_calls
    assert ahead == ({None} if foreground else set()), kernel_calls  # None: the kernel's default, all ten
    engine.destroy()


def test_the_share_defaults_to_deepspeeds_and_the_plain_step_has_no_background_adam(kernel_calls):
    engine, _ = _train(_config(speculative_step=True))
    assert engine.host_step.background_threads == 8  # DeepSpeed's default share, 0.8, of ten
    engine.destroy()
    kernel_calls.clear()
    engine, _ = _train(_config())
    assert engine.host_step.background_threads is None
    assert kernel_calls and {threads for _, threads in kernel_calls} == {None}
    engine.destroy()


@pytest.mark.parametrize("offload", [{"speculative_step": True}, {"delayed_update": True}])
def test_the_share_changes_where_the_adam_runs_not_what_it_computes(monkeypatch, offload):
    monkeypatch.setenv("ZKERN_CPU_THREADS", "4")  # 4 threads against 1: the kernel splits the chunks differently
    one, whole = [_train(_config(**offload, cpuadam_cores_perc=share), steps=3)[1] for share in (0.25, 1.0)]
    assert all(torch.equal(a, b) for a, b in zip(one, whole))


def test_the_share_rounds_down_and_keeps_one_thread(monkeypatch):
    monkeypatch.setenv("ZKERN_CPU_THREADS", "100")
    assert _ext.threads_share(0.29) == 29 and _ext.threads_share(1.0) == 100
    monkeypatch.setenv("ZKERN_CPU_THREADS", "2")
    assert _ext.threads_share(0.1) == 1
    for bad in (0.0, 1.5, -0.2):
        with pytest.raises(ValueError, match=r"\(0, 1\]"):
            _ext.threads_share(bad)


@pytest.mark.parametrize("share, words", [(0, r"in \(0, 1\]"), (1.5, "cpuadam_cores_perc"), ("most", "number")])
def test_a_share_outside_zero_to_one_is_refused(share, words):
    cfg = _config(super_offload=True, cpuadam_cores_perc=share)
    with pytest.raises(ConfigError, match=words):
        Config.load(cfg)


def test_a_share_with_no_background_adam_is_said_not_ignored():
    notes = Config.load(_config(cpuadam_cores_perc=0.9)).notes
    assert any(path.endswith("cpuadam_cores_perc") and "none is on" in why for path, why in notes.warned), notes
    quiet = Config.load(_config(super_offload=True, cpuadam_cores_perc=0.9)).notes
    assert not any(path.endswith("cpuadam_cores_perc") for path, _ in quiet.warned)


def test_the_start_up_block_says_which_host_adam_runs_beside_the_training_thread_and_on_how_many_threads():
    from zkern.config.report import startup_block

    guessing = startup_block(Config.load(_config(clip=1.0, super_offload=True, cpuadam_cores_perc=0.75)))
    assert "host Adam: the speculative step, in backward on 0.75 of the CPU Adam's threads" in guessing
    assert "gradient norm is at most gradient_clipping 1," in guessing  # where its guesses can stand
    delayed = startup_block(Config.load(_config(delayed_update=True)))
    assert "host Adam: the delayed update, one step behind the model, on 0.8 of" in delayed
    assert "host Adam" not in startup_block(Config.load(_config()))
