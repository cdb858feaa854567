"""Stage 3's gather-order record: what the last pass gathered, where this pass is in it, and whether this pass
still follows it (prefetch is only safe while it does).

    python -m pytest tests/stage3/test_order.py -q

Pure bookkeeping over unit indices, one record per phase ("forward", "backward"); no torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator


class OrderRecord:
    def __init__(self):
        self._trace: dict[str, list[int] | None] = {"forward": None, "backward": None}
        self._valid = {"forward": False, "backward": False}
        self._cursor = {"forward": 0, "backward": 0}
        self._recording: dict[str, list[int]] = {"forward": [], "backward": []}

    def recording_only(self, phase: str) -> bool:
        """No usable record for this phase: the pass only records (and prefetches nothing)."""
        return self._trace[phase] is None or not self._valid[phase]

    def see(self, phase: str, unit: int) -> int | None:
        """unit was needed now. Returns None while the pass follows the record (or only records); on the first
        departure from it, the unit the record expected (-1 past its end), and the pass stops following it."""
        self._recording[phase].append(unit)
        if self.recording_only(phase):
            return None
        trace, cursor = self._trace[phase], self._cursor[phase]
        if cursor < len(trace) and trace[cursor] == unit:
            self._cursor[phase] = cursor + 1
            return None
        self._valid[phase] = False
        return trace[cursor] if cursor < len(trace) else -1

    def follows(self, phase: str) -> bool:
        """This pass has a record and has not left it."""
        return not self.recording_only(phase)

    def find(self, phase: str, unit: int) -> int | None:
        """How many record entries lie before the next occurrence of unit from the cursor on (0: it is next), or
        None when the rest of the record does not hold it (or the pass follows no record)."""
        if self.recording_only(phase):
            return None
        trace, cursor = self._trace[phase], self._cursor[phase]
        for k in range(cursor, len(trace)):
            if trace[k] == unit:
                return k - cursor
        return None

    def skip(self, phase: str, count: int) -> list[int]:
        """Pass over the next `count` record entries without needing them (other ranks do: the caller joins their
        all-gathers); returns them. They enter this pass's recording, as the gathers they are."""
        trace, cursor = self._trace[phase], self._cursor[phase]
        passed = trace[cursor:cursor + count]
        self._cursor[phase] = cursor + len(passed)
        self._recording[phase].extend(passed)
        return passed

    def remaining(self, phase: str) -> int:
        """Record entries not reached yet (0 when the pass follows no record)."""
        if self.recording_only(phase):
            return 0
        return len(self._trace[phase]) - self._cursor[phase]

    def upcoming(self, phase: str) -> Iterator[int]:
        """The units the record says come next, lazily (nothing when the pass does not follow a record): the
        caller stops at its prefetch budget, so a call costs what it prefetches, not the rest of the pass."""
        if self.recording_only(phase):
            return iter(())
        return itertools.islice(self._trace[phase], self._cursor[phase], None)

    def end(self, phase: str) -> None:
        """The pass is over: what it gathered becomes the record the next pass follows."""
        self._trace[phase] = self._recording[phase]
        self._valid[phase] = True
        self._cursor[phase] = 0
        self._recording[phase] = []

    def begin(self, phase: str) -> None:
        self._recording[phase] = []
        self._cursor[phase] = 0

    def abandon(self, phase: str) -> None:
        """The pass failed: neither it nor the current record is trusted."""
        self._valid[phase] = False
        self._recording[phase] = []

    def forget(self) -> None:
        """The modules' needs changed: the next passes record afresh."""
        self._trace = {"forward": None, "backward": None}
