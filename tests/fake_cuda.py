"""torch.cuda's streams and events faked on a machine without a GPU, for tests that pin the order of zkern's CUDA
calls (what waits for what, what is recorded where) while the tensors stay on the host. Every call is logged, in
order, as a line of text: "side waits for compute", "on side" (a `with torch.cuda.stream(side)` entered), "event 2
recorded on side", "event 2 synchronized", "compute waits for event 2". A fake copy has no queue: it runs at once.

    cuda = FakeCuda(monkeypatch)      # torch.cuda.Stream(...) is then cuda.side; the current stream cuda.compute
    ...
    assert cuda.calls == [...]
"""

from __future__ import annotations

import contextlib
import threading

import torch


class FakeStream:
    def __init__(self, name: str, cuda: FakeCuda):
        self.name, self.device, self._cuda = name, torch.device("cuda", 0), cuda

    def wait_stream(self, other: FakeStream) -> None:
        self._cuda.log(f"{self.name} waits for {other.name}")

    def wait_event(self, event: FakeEvent) -> None:
        self._cuda.log(f"{self.name} waits for event {event.n}")


class FakeEvent:
    def __init__(self, cuda: FakeCuda):
        self._cuda = cuda
        self.n = cuda.next_event()

    def record(self, stream: FakeStream | None = None) -> None:
        self._cuda.log(f"event {self.n} recorded on {(stream or self._cuda.current).name}")

    def synchronize(self) -> None:
        self._cuda.log(f"event {self.n} synchronized")


class FakeCuda:
    """Installs the fakes with monkeypatch: a compute stream (current), and one side stream that every
    torch.cuda.Stream(...) returns. The log is shared by threads (a background Adam synchronizes events too); the
    stack of current streams is the training thread's."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        self._lock = threading.Lock()
        self._events = 0
        self.compute, self.side = FakeStream("compute", self), FakeStream("side", self)
        self._current = [self.compute]
        monkeypatch.setattr(torch.cuda, "Stream", lambda *args, **kwargs: self.side)
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", self._on)
        monkeypatch.setattr(torch.cuda, "Event", lambda *args, **kwargs: FakeEvent(self))

    @property
    def current(self) -> FakeStream:
        return self._current[-1]

    def log(self, entry: str) -> None:
        with self._lock:
            self.calls.append(entry)

    def next_event(self) -> int:
        with self._lock:
            self._events += 1
            return self._events

    @contextlib.contextmanager
    def _on(self, stream: FakeStream):
        self.log(f"on {stream.name}")
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()
