"""What stage 3's module hooks know and share with the code that acts for them (agreement.py, external.py): the
model's modules by name and number and which units each gathers (ModuleMap), and the pass in progress (Pass: its
phase, whether it verifies, its open frames). hooks.py owns one of each; the others are given them, never the hooks.

    python -m pytest tests/stage3/ -q
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from zkern.stage3.lifecycle import Unit

log = logging.getLogger("zkern")


@dataclass(eq=False)
class Frame:
    """One running module call and the units it holds."""

    module: torch.nn.Module
    acquired: list[Unit] = field(default_factory=list)


@dataclass
class Pass:
    """The forward or backward pass in progress."""

    phase: str = "forward"
    verify: bool = False  # this pass exchanges a tag before each gather (decided when the pass begins)
    departed: bool = False  # this pass left its record here: every further gather is agreed first
    recording: bool = True  # this forward pass follows no record (it watches for external reads)
    in_hook: bool = False  # the runtime's own work is running (gathering sets p.data): not the model reading
    frames: list[Frame] = field(default_factory=list)


class ModuleMap:
    """The model's modules by name and number, and the units each module gathers: planned and declared (needs),
    detected (external.py adds to needs), and merged where ranks diverged (agreement.py)."""

    def __init__(self, root: torch.nn.Module, unit_of: dict[int, Unit], needs: dict[torch.nn.Module, list[int]]):
        """unit_of: id(parameter) -> its unit (the runtime's Shards.unit_of)."""
        self.root = root
        self.needs = needs  # module -> units it reads (planned, declared and detected)
        self.merged: dict[torch.nn.Module, list[int]] = {}  # container -> units of children chosen per rank
        self.backward_set: list[int] = []  # units every rank gathers when backward begins (divergent backward needs)
        self.changed = False  # a module adopted or merged units: the next passes gather in another order
        self.by_path = dict(root.named_modules())
        self.modules = list(self.by_path.values())
        self.paths = {id(m): name for name, m in self.by_path.items()}
        self.module_index = {id(m): i for i, m in enumerate(self.modules)}
        self.unit_of = unit_of
        self._said: set[str] = set()

    def wanted(self, module: torch.nn.Module) -> list[int]:
        own = self.needs.get(module, [])
        merged = self.merged.get(module)
        return own if not merged else own + [i for i in merged if i not in own]

    def path(self, module: torch.nn.Module) -> str:
        return self.paths.get(id(module), f"<{type(module).__name__} outside the model>")

    def number(self, module: torch.nn.Module | None) -> int:
        return -1 if module is None else self.module_index.get(id(module), -1)

    def param_name(self, p: torch.nn.Parameter) -> str:
        u = self.unit_of[id(p)]
        return next(n for q, n in zip(u.plan.params, u.plan.names) if q is p)

    def once(self, key: str) -> bool:
        """True the first time key is asked (what is said once is said by the first to ask)."""
        first = key not in self._said
        self._said.add(key)
        return first

    def say(self, key: str, message: str, rank: int) -> None:
        """A warning, once, from rank 0."""
        if self.once(key) and rank == 0:
            log.warning(message)
