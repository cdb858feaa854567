from zkern.stage3.order import OrderRecord
from zkern.stage3.units import plan_reduce_groups


def test_order_record_follows_then_stops_at_a_departure():
    r = OrderRecord()
    assert r.recording_only("forward") and list(r.upcoming("forward")) == []
    for u in (0, 1, 2):
        assert r.see("forward", u) is None  # first pass: records only
    r.end("forward")
    assert list(r.upcoming("forward")) == [0, 1, 2]
    assert r.see("forward", 0) is None and list(r.upcoming("forward")) == [1, 2]
    assert r.see("forward", 2) == 1  # departure: names what the record expected
    assert list(r.upcoming("forward")) == [] and r.see("forward", 1) is None  # no longer followed
    r.end("forward")
    assert list(r.upcoming("forward")) == [0, 2, 1]  # re-recorded
    r.forget()
    assert r.recording_only("forward") and r.recording_only("backward")


def test_reduce_groups_are_consecutive_trainable_units_within_the_bucket():
    assert plan_reduce_groups([4, 4, 4, 10, 2], [True] * 5, 8) == [[0, 1], [2], [3], [4]]
    assert plan_reduce_groups([4, 4, 4], [True, False, True], 100) == [[0], [2]]
    assert plan_reduce_groups([4], [False], 100) == []
