"""The attributes DeepSpeed's ZeRO-3 puts on every partitioned parameter, which the frameworks built on it read:
`ds_id`, `ds_shape`, `ds_numel`, `ds_tensor` (this rank's partition of it) and `ds_status` (AVAILABLE,
NOT_AVAILABLE or INFLIGHT: whether the parameter is whole on this rank now). OpenRLHF gathers only the parameters
not available, LLaMA-Factory counts parameters with `ds_numel` (0 of them without it), axolotl and others test
`hasattr(p, "ds_id")`.

    python -m pytest tests/engine/test_engine_frameworks.py -q -k ds_attributes

`ds_status` compares equal to DeepSpeed's own `ZeroParamStatus` where a script imported deepspeed before building
the engine (it is then DeepSpeed's enum), else to zkern's `ZeroParamStatus` below, with the same names and values.
The static attributes are set once, by layout.attach_ds_attributes; mark() moves ds_status as units come and go.
"""

from __future__ import annotations

import enum
import sys


class ZeroParamStatus(enum.Enum):
    AVAILABLE = 1  # whole on this rank
    NOT_AVAILABLE = 2  # at rest: only this rank's partition exists
    INFLIGHT = 3  # an all-gather of it is on its way


def status_enum():
    """DeepSpeed's ZeroParamStatus when deepspeed is already imported (frameworks compare with it), else zkern's."""
    if "deepspeed" in sys.modules:
        try:
            from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus as theirs

            return theirs
        except ImportError:
            pass
    return ZeroParamStatus


def mark(params, status: str) -> None:
    """Set ds_status of params to the member named status ("AVAILABLE", ...)."""
    value = getattr(status_enum(), status)
    for p in params:
        p.ds_status = value
