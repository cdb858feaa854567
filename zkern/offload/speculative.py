"""The speculative half of the offloaded step (HostStep's, offload/host.py; offload_optimizer.speculative_step, or
DeepSpeed's super_offload): in the boundary's backward, each gradient chunk's host Adam runs as soon as the chunk is
on the host, in a background thread, on the guess that the step will apply it unclipped (no overflow, no clipping
coefficient below 1, every piece with a gradient, the hyper-parameters as they were when backward began). The Adam
stores each element's master and moments as it read them (ShardAdam.keep_saves: one pass, no extra read). step()
checks the guess against the step's decision: where it holds, the chunks stepped in backward only go up (their
uploads wait for the decision) and the rest step as usual; where it does not, every speculated chunk gets its saved
values back, its gradient comes down again (its staging holds the new parameters by then), and the step runs as if
nothing had been guessed. Either way the arithmetic is the non-speculative step's, bit for bit.

    python -m pytest tests/offload/test_speculative.py -q

A skipped step, a backward that is not the last before the step, dropped gradients, and anything that reads or
writes the host state between backward and step() (a checkpoint save or load, offload_states, the store) withdraw
the guess first (withdraw()). A withdrawal tells the background Adam to leave the chunks still queued alone.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref

import torch

from zkern.optim.shard_adam import ShardAdam

_HYPER = ("lr", "betas", "eps", "weight_decay", "adamw")


def _hyper(optimizer: ShardAdam) -> list[dict]:
    """The hyper-parameters the Adam reads, per group, as plain numbers (a scheduler may hold lr as a tensor)."""
    return [{k: float(g[k]) if isinstance(g[k], torch.Tensor) else g[k] for k in _HYPER}
            for g in optimizer.param_groups]


class SpeculativeStep:
    """HostStep's speculative Adam. HostStep's __init__ calls _init_speculation; _up, _events, _sent and
    host_groups are HostStep's."""

    def _init_speculation(self, enabled: bool) -> None:
        self.speculative = enabled
        self._guess: dict | None = None  # what the chunks in flight were stepped with (None: no guess this pass)
        self._speculated: list[tuple[int, int]] = []  # chunks the background Adam has stepped, in order
        self._spec_queue: queue.SimpleQueue | None = None
        self._spec_thread: threading.Thread | None = None
        self._spec_error: BaseException | None = None
        self._spec_cancel = False  # the guess is being withdrawn: the chunks still queued are left alone
        self._spec_adam_s = 0.0  # the background Adam's host time this step
        self._withdrawn = ""  # why this step's guess was withdrawn before step(), if it was

    def speculate(self, optimizer: ShardAdam, grad_scale: float) -> None:
        """A boundary backward begins: its chunks step in the background as they land, with grad_scale (the unscale
        factor, the clipping coefficient guessed 1) and the hyper-parameters as they are now."""
        self.withdraw()  # a second boundary backward changes gradients the first one's guesses stepped with
        if not self.speculative:
            return
        if type(optimizer) is not ShardAdam:
            raise RuntimeError(f"zkern: the speculative offloaded step runs zkern's Adam chunk by chunk, and the "
                               f"optimizer is {type(optimizer).__name__}; set "
                               f"zero_optimization.offload_optimizer.speculative_step to false")
        self._guess = {"optimizer": optimizer, "grad_scale": grad_scale,
                       "options": _hyper(optimizer),
                       "steps": [list(s) for s in optimizer.steps]}
        self._speculated, self._spec_error, self._spec_adam_s, self._withdrawn = [], None, 0.0, ""
        self._spec_cancel = False
        self._spec_queue = queue.SimpleQueue()
        # The thread holds its owner weakly, and the owner's collection wakes it to end: an engine dropped between a
        # boundary backward and its step() (a failed backward in an out-of-memory retry loop, a loop that stopped)
        # must not leave the thread waiting forever on its queue, holding the host state.
        thread = threading.Thread(target=_speculate_loop, args=(weakref.ref(self), self._spec_queue),
                                  name="zkern-speculative-adam", daemon=True)
        self._spec_wake = weakref.finalize(self, self._spec_queue.put, None)
        thread.start()
        self._spec_thread = thread

    def _speculated_landing(self, key: tuple[int, int]) -> None:
        """Chunk `key` was just sent down in a boundary backward: its Adam is queued behind the chunks before it."""
        if self._spec_queue is not None:
            self._spec_queue.put(key)

    def _speculate_one(self, key: tuple[int, int]) -> None:
        """The background Adam of chunk `key` on the guess (the loop's body, on its thread; the guess stays until the
        thread has been joined)."""
        guess = self._guess
        if self._spec_error is not None or self._spec_cancel or guess is None:
            return  # drain: a failed chunk ends the speculation (reported at the verdict), a withdrawal too
        began = time.perf_counter()
        try:
            guess["optimizer"].step(grad_scale=guess["grad_scale"], before_chunk=self._await_chunk, order=[key],
                                    options=guess["options"], save=True, advance=False,
                                    threads=self.background_threads)
            self._speculated.append(key)
        except BaseException as e:  # the chunk's call checks its arguments before it writes anything
            self._spec_error = e
        self._spec_adam_s += time.perf_counter() - began

    def _await_chunk(self, gi: int, ci: int) -> None:
        """Until chunk (gi, ci)'s gradient is on the host (its copy's event; the step's own wait is timed apart)."""
        event = self._events.pop((gi, ci), None)
        if event is not None:
            event.synchronize()

    def _stop_speculating(self, finish: bool = False) -> None:
        """No more chunks: wait for the background Adam to finish those queued (finish), or only the one it is
        stepping."""
        thread, self._spec_thread = self._spec_thread, None
        if thread is not None:
            self._spec_cancel = not finish
            self._spec_wake.detach()
            self._spec_queue.put(None)
            thread.join()
        self._spec_queue = None

    def withdraw(self, why: str = "withdrawn") -> bool:
        """Undo every speculated chunk's Adam (saved master and moments back; its gradient comes down again at the
        step); why: what the step's accounting says of it. True when there were any."""
        self._stop_speculating()
        guess, self._guess = self._guess, None
        if guess is None:
            return False
        self._withdrawn = why
        for key in self._speculated:
            guess["optimizer"].restore(*key)
            if self._sent is not None:
                self._sent.discard(key)
        undone, self._speculated = bool(self._speculated), []
        return undone

    def _send_kept(self, kept: list[tuple[int, int]], order: list[tuple[int, int]]) -> dict:
        """The kept chunks, stepped in backward, send their parameters up now that the guess stands; returns the
        step's arguments for the rest (the order of the chunks still to step; nothing without kept chunks)."""
        for key in kept:
            self._up(*key)
        done = set(kept)
        return {"order": [k for k in order if k not in done]} if kept else {}

    def verdict(self, grad_scale: float, active: list[list[bool]], optimizer) -> tuple[list, str]:
        """At step(), the decision known: (the chunks whose speculative Adam stands, in the order they stepped; what
        became of the guess: "kept", why it was withdrawn, "none" without a guess, "off" without speculation)."""
        guess = self._guess
        if guess is None:
            self._stop_speculating()
            return [], self._withdrawn or ("none" if self.speculative else "off")
        why = ""  # what the decision alone says, before the chunks still queued are stepped for nothing
        if grad_scale != guess["grad_scale"]:
            why = "clipped"
        elif optimizer is not guess["optimizer"] or _hyper(optimizer) != guess["options"]:
            why = "hyper-parameters changed"
        elif [list(s) for s in optimizer.steps] != guess["steps"]:
            why = "step counts changed"
        self._stop_speculating(finish=not why)
        error, self._spec_error = self._spec_error, None
        if error is not None:
            why = f"failed ({type(error).__name__}: {error})"
        elif not why and not all(active[gi][i] for gi, ci in self._speculated
                                 for i, _, _ in self.host_groups[gi].chunks[ci].pieces):
            why = "a piece got no gradient"
        if why:
            self.withdraw(why)
            if error is not None:
                raise RuntimeError(f"zkern: the speculative host Adam failed ({type(error).__name__}: {error}); "
                                   f"its chunks were restored") from error
            return [], why
        kept, self._speculated, self._guess = self._speculated, [], None
        return kept, "kept"


def _speculate_loop(owner: weakref.ref, keys: queue.SimpleQueue) -> None:
    """The speculative Adam's thread: each chunk key as it is queued, until None. It holds its SpeculativeStep (and
    through it the guess, the optimizer and the host state) only while stepping a chunk, so a dropped engine is
    collected, and its collection queues the None that ends this."""
    while (key := keys.get()) is not None:
        step = owner()
        if step is None:
            return
        step._speculate_one(key)
        del step  # not held while waiting for the next key
