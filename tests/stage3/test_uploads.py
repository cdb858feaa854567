"""Stage 3's offload_param uploads ahead of use (zkern/stage3/uploads.py): a prefetched unit's host chunk goes up
off the compute stream and is waited for where the unit is first used or let go.

On a CPU at world 1 the copies are deferred until that wait, so a gatherer that read a unit before waiting for it
would read its slot's previous contents (the last gather of that unit: the weights before the step) and train
differently. These runs must match the same model without offload_param bit for bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fake_cuda import FakeCuda

from zkern.stage3.uploads import Uploads
from zkern.testing import TrainSpec, engine_training_loop

PARAM = {"offload_param": {"device": "cpu", "pin_memory": True}, "stage3_fetch_units": ["Block"]}

CASES = {
    "param": TrainSpec(stage=3, zero=PARAM, steps=4),
    "param+optimizer-bf16": TrainSpec(stage=3, precision="bf16", steps=4,
                                      zero={**PARAM, "offload_optimizer": {"device": "cpu", "pin_memory": True}}),
    "param+delayed-accum": TrainSpec(stage=3, accumulation=2, clip=0.05, steps=4, zero={
        **PARAM, "offload_optimizer": {"device": "cpu", "pin_memory": True, "delayed_update": True}}),
}


def _without_offload(spec: TrainSpec) -> TrainSpec:
    zero = {k: v for k, v in spec.zero.items() if k not in ("offload_param", "offload_optimizer")}
    if "delayed_update" in str(spec.zero):  # the delay is an offload_optimizer option: keep the host optimizer
        zero["offload_optimizer"] = spec.zero["offload_optimizer"]
    return dataclasses.replace(spec, zero=zero)


def _train(spec: TrainSpec) -> dict:
    engine = spec.build_engine(spec.make_model(), 1)
    losses, _ = engine_training_loop(spec, 0, 1, engine)
    uploads = engine.runtime.gatherer.uploads
    out = {"losses": losses, "state": {k: v.clone() for k, v in engine.full_state_dict().items()},
           "launched": 0 if uploads is None else uploads.launched,
           "pending": None if uploads is None else dict(uploads.pending)}
    engine.destroy()
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_prefetched_uploads_train_as_the_parameters_on_the_device(name):
    spec = CASES[name]
    off, plain = _train(spec), _train(_without_offload(spec))
    # the uploads went ahead (every forward and backward after the first records its order and prefetches)
    assert off["launched"] >= spec.steps, off["launched"]
    assert off["pending"] == {}  # every upload was waited for by the end of each pass
    assert plain["launched"] == 0
    assert off["losses"] == plain["losses"]
    for k, v in plain["state"].items():
        assert torch.equal(off["state"][k], v), k


def test_no_prefetch_means_no_upload_ahead():
    spec = dataclasses.replace(CASES["param"], zero={**PARAM, "stage3_prefetch_bucket_size": 0})
    assert _train(spec)["launched"] == 0


def test_deferred_copy_lands_only_at_the_wait():
    uploads = Uploads(torch.device("cpu"), world=1)
    src, dst = torch.arange(4.0), torch.zeros(4)
    with uploads.ahead(7):
        uploads.copy(dst, src)
    assert dst.tolist() == [0.0] * 4  # queued, as a side stream's copy would be
    src[0] = 9.0  # the host writes before the wait: the copy reads it then (on a GPU, a race; never done by zkern)
    uploads.wait(7)
    assert dst.tolist() == [9.0, 1.0, 2.0, 3.0]
    uploads.wait(7)  # nothing pending: no-op


def test_copies_are_immediate_outside_ahead_and_at_world_2():
    src = torch.arange(4.0)
    outside, dst = Uploads(torch.device("cpu"), world=1), torch.zeros(4)
    outside.copy(dst, src)
    assert torch.equal(dst, src)
    two, dst2 = Uploads(torch.device("cpu"), world=2), torch.zeros(4)
    with two.ahead(0):
        two.copy(dst2, src)  # a CPU all-gather reads the slot as it launches
    assert torch.equal(dst2, src)


def test_nested_uploads_are_an_error():
    uploads = Uploads(torch.device("cpu"), world=1)
    with pytest.raises(RuntimeError, match="inside the upload of unit 1"):
        with uploads.ahead(1):
            with uploads.ahead(2):
                pass


def test_on_cuda_the_side_stream_waits_for_compute_and_compute_waits_for_the_copy(monkeypatch):
    """The CUDA path's order of calls, with torch.cuda's streams and events faked (this machine has no GPU): the
    side stream waits for the compute stream before the copy is queued on it, the event is recorded after it, and
    only the wait makes the compute stream wait for that event."""
    cuda = FakeCuda(monkeypatch)
    uploads = Uploads(torch.device("cuda", 0), world=1)
    assert not uploads.defer
    dst, src = torch.zeros(4), torch.arange(4.0)
    with uploads.ahead(5):
        uploads.copy(dst, src)
        cuda.log(f"copy on {cuda.current.name}")
    assert torch.equal(dst, src)  # a real stream would run it later; the fake has no queue
    cuda.log("compute goes on")
    uploads.wait(5)
    uploads.wait(5)  # waited once: nothing left
    assert cuda.calls == ["side waits for compute", "on side", "copy on side", "event 1 recorded on side",
                          "compute goes on", "compute waits for event 1"]
