"""The delayed update's half of the offloaded step (HostStep's, offload/host.py): step i's host Adam in a background
thread while the loop goes on to step i+1's forward and backward, and its parameters sent up at step i+1's step().
The module docstring of offload/host.py says what it computes and what waits for it.

    python -m pytest tests/offload/test_delayed_update.py -q
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from zkern.optim.shard_adam import ShardAdam


class DelayedUpdate:
    """HostStep's background Adam and its landing. HostStep's __init__ sets the flight's attributes (_flight,
    _flight_error, _flight_done, _flight_over, _flight_news, _to_land, on_landed); _up, host_groups and stream are
    HostStep's."""

    def _launch(self, optimizer: ShardAdam, grad_scale: float, active: list[list[bool]],
                order: list[tuple[int, int]]) -> None:
        """Start the Adam of this step in the background, chunk by chunk in `order`, with the hyper-parameters as
        they are now (the LR schedule moves them when step() returns)."""
        options = [dict(g) for g in optimizer.param_groups]
        self._flight_done, self._flight_over = set(), False

        def finished(gi: int, ci: int) -> None:
            with self._flight_news:
                self._flight_done.add((gi, ci))
                self._flight_news.notify_all()

        def run() -> None:
            began = time.perf_counter()
            try:
                optimizer.step(grad_scale=grad_scale, active=active, before_chunk=self._wait_down,
                               after_chunk=finished, options=options, order=order, threads=self.background_threads)
            except BaseException as e:  # raised on the training thread by settle()
                self._flight_error = e
            finally:
                self._adam_s = time.perf_counter() - began
                with self._flight_news:
                    self._flight_over = True
                    self._flight_news.notify_all()

        self._to_land = active
        self._flight = threading.Thread(target=run, name="zkern-delayed-adam", daemon=True)
        self._flight.start()

    _adam_s = 0.0  # the last delayed Adam's host time
    landing_wait_s = 0.0  # how long the last landing waited for its Adam

    def _wait_chunk(self, key: tuple[int, int]) -> None:
        """Until the background Adam, if one runs, is done with chunk `key` (a failure is raised by settle())."""
        if self._flight is None:
            return
        with self._flight_news:
            self._flight_news.wait_for(lambda: self._flight_over or key in self._flight_done)

    def settle(self) -> None:
        """Wait for the delayed update's host Adam, if one runs: then nothing writes the host state behind the
        caller's back. Its error, if it failed, is raised here (the host state is then half-updated: load a
        checkpoint)."""
        flight, self._flight = self._flight, None
        if flight is None:
            return
        flight.join()
        error, self._flight_error = self._flight_error, None
        if error is not None:
            self._to_land = None
            raise RuntimeError(f"zkern: the delayed host Adam step failed ({type(error).__name__}: {error}); the "
                               f"optimizer state is partly updated, so resume from a checkpoint") from error

    def land(self, refresh: bool = True) -> bool:
        """The delayed update reaches the working parameters: wait for its Adam, then send every piece it stepped
        (the next forward computes with them). refresh=False leaves the runtime's whole copies to the caller (the
        engine's step, whose after_step refreshes them anyway). True when an update was sent."""
        if self._to_land is None:
            self.settle()
            return False
        began = time.perf_counter()
        self.settle()
        self.landing_wait_s = time.perf_counter() - began
        if self._to_land is None:  # nothing to send
            return False
        self._active, self._to_land = self._to_land, None
        for gi, g in enumerate(self.host_groups):
            for ci in range(len(g.chunks)):
                self._up(gi, ci)
        if self.stream is not None:
            torch.cuda.current_stream().wait_stream(self.stream)
        if refresh and self.on_landed is not None:
            self.on_landed()
        return True

    def pending(self) -> bool:
        """An update is stepped (or stepping) on the host and not yet sent to the working parameters."""
        return self._to_land is not None

    @contextlib.contextmanager
    def landed_view(self):
        """Inside: the working parameters hold the update in flight, as its landing will send them (what an export
        reads: the trained model); after: the values they had, bit for bit, and the update still pending, so the run
        goes on exactly as one that never looked. Collective where landing is (the runtime's refresh); every rank
        enters it together. Without an update pending, a wait for the background Adam."""
        self.settle()
        if self._to_land is None:
            yield
            return
        kept, self._active = self._active, self._to_land
        before: list[tuple[torch.Tensor, torch.Tensor]] = []  # this rank's stepped ranges, as the forward has them
        try:
            for gi, g in enumerate(self.host_groups):
                for ci, chunk in enumerate(g.chunks):
                    dev = self.device_groups[gi].chunks[ci].out
                    if chunk.out is None or chunk.out is dev:
                        continue
                    before += [(dev[lo:hi], dev[lo:hi].to("cpu", copy=True)) for lo, hi in self._stepped(gi, ci)]
                    self._up(gi, ci)
            if self.stream is not None:
                torch.cuda.current_stream().wait_stream(self.stream)
            if self.on_landed is not None:
                self.on_landed()
            yield
        finally:
            for dst, values in before:
                dst.copy_(values)
            self._active = kept
            if self.on_landed is not None:
                self.on_landed()

    def resume_pending(self) -> None:
        """A checkpoint saved with an update pending was loaded: the working parameters hold the weights its forward
        computed with, the masters and the host staging the update; every piece lands at the next step."""
        self.settle()
        self._to_land = [[True] * len(g.pieces) for g in self.host_groups]
