"""This rank's part of every stage-3 fetch unit, and where each parameter lies in it: what layout.py builds once and
what everything after it reads (whole tensors, GatheredParameters, reports, the shard map, the ds_* attributes).
The runtime owns one; the helpers are given it, never the runtime.

    python -m pytest tests/stage3/test_stage3.py -q
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from zkern.comm.collectives import Comm
from zkern.core.partition import Layout
from zkern.stage3.lifecycle import Unit

if TYPE_CHECKING:
    from zkern.comm.zeropp import Secondary
    from zkern.offload.store import ShardStore


@dataclass(eq=False)
class Shards:
    comm: Comm
    dtype: torch.dtype  # the working dtype
    params_on_host: bool  # offload_param: the working shard rests on the host (or in a file), gathers start there
    # -- the plan (layout.plan) -----------------------------------------------------------------------------------
    units: list[Unit] = field(default_factory=list)
    layout: Layout | None = None  # one bucket per unit, padded to whole 64-element chunks; rank r owns chunk r
    all_params: list[torch.nn.Parameter] = field(default_factory=list)  # unit by unit, trainable first in each
    all_names: list[str] = field(default_factory=list)
    params: list[torch.nn.Parameter] = field(default_factory=list)  # the trainable ones
    names: list[str] = field(default_factory=list)
    trainable_index: dict[int, int] = field(default_factory=dict)  # id(p) -> index in params
    frozen_ids: set[int] = field(default_factory=set)
    unit_of: dict[int, Unit] = field(default_factory=dict)  # id(p) -> its unit
    full_shapes: dict[int, torch.Size] = field(default_factory=dict)  # id(p) -> its whole shape
    offsets: dict[int, int] = field(default_factory=dict)  # id(p) -> its first element in its unit
    # -- the homes (layout.allocate) ------------------------------------------------------------------------------
    store: ShardStore | None = None  # where each shard's bytes live
    param_store: object | None = None  # offload_param "nvme": the parameter files (param_shard is their stand-in)
    # working dtype; None where the gathers cast each chunk from the master (mixed precision with the master on the
    # device, unless zero_optimization.stage3_keep_working_shard): no 16-bit copy of the shard beside the master
    param_shard: torch.Tensor | None = None
    master: torch.Tensor | None = None  # fp32 (mixed precision or offload), else None: the working shard steps
    grad_shard: torch.Tensor | None = None
    empty: torch.Tensor | None = None  # what a parameter's .data is at rest
    # -- the optimizer's pieces (layout.make_shard_groups) --------------------------------------------------------
    pieces_param: list[list[int]] = field(default_factory=list)  # per group: trainable index of each piece
    pieces_start: list[list[int]] = field(default_factory=list)  # per group: first element of its parameter
    secondary: Secondary | None = None  # hpZ's copies (a load or a modifier rank's write makes them stale)

    @property
    def source(self) -> torch.Tensor:
        """The shard the gathers read: the working shard, or the master they cast from."""
        return self.param_shard if self.param_shard is not None else self.master

