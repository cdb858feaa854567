"""Plain JSON data: what a checkpoint's manifest holds besides tensor entries (hyper-parameters, saved forms of the
state components, the config), and the test that a saved value can stand where a live one is.

    python -m pytest tests/checkpoint/test_checkpoint_hostile.py -q
"""

from __future__ import annotations

from zkern.checkpoint.manifest import check_plain


def plain(value, where: str):
    """Hyper-parameters and scheduler states as JSON: tuples become lists (they are restored by the object's own
    load), anything not plain data is an error."""
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, list):
        return [plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    check_plain(value, where)
    return value


def jsonable(value):
    """The config as plain data (enums and other objects by their str)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, str)) or (isinstance(value, float) and value == value
                                                                 and abs(value) != float("inf")):
        return value
    return str(value)


def same_kind(saved, live) -> bool:
    """Plain JSON `saved` can stand where the live value is (numbers for numbers, lists for lists and tuples, ...)."""
    if live is None or saved is None:
        return True
    if isinstance(live, bool) or isinstance(saved, bool):
        return isinstance(live, bool) and isinstance(saved, bool)
    if isinstance(live, (int, float)):
        return isinstance(saved, (int, float))
    if isinstance(live, (list, tuple)):
        return isinstance(saved, list) and len(saved) == len(live) and all(map(same_kind, saved, live))
    if isinstance(live, dict):
        return isinstance(saved, dict) and all(same_kind(saved[k], live[k]) for k in saved.keys() & live.keys())
    return isinstance(saved, type(live))
