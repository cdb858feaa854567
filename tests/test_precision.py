import pytest

from zkern import Config
from zkern.engine.precision import LossScaleAtMinimum, LossScaler


def scaler(**fp16):
    return LossScaler.from_config(Config.load({"train_batch_size": 1, "fp16": {"enabled": True, **fp16}}))


def test_dynamic_scale_hysteresis_and_window():
    s = scaler(initial_scale_power=4, hysteresis=2, loss_scale_window=3)
    assert s.scale == 16.0
    s.update(True)  # first overflow spends hysteresis
    assert s.scale == 16.0
    s.update(True)  # second halves
    assert s.scale == 8.0
    s.update(False)
    s.update(False)
    assert s.scale == 8.0
    s.update(False)  # third clean step since the overflow: doubles
    assert s.scale == 16.0
    s.update(True)  # hysteresis was refilled by the doubling
    assert s.scale == 16.0


def test_min_scale_raises_with_advice():
    s = scaler(initial_scale_power=1, hysteresis=1, min_loss_scale=1)
    s.update(True)
    assert s.scale == 1.0
    with pytest.raises(LossScaleAtMinimum, match="Current loss scale already at minimum.*bf16"):
        s.update(True)


def test_static_scale_and_no_fp16():
    s = scaler(loss_scale=128)
    s.update(True)
    assert s.scale == 128 and not s.dynamic
    assert LossScaler.from_config(Config.load({"train_batch_size": 1})).scale == 1.0
