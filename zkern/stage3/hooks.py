"""Stage 3's module hooks: which units a running module holds, when they are gathered for backward, how reads of
another module's parameters are found, and what happens when ranks would gather different units.

    python -m pytest tests/stage3/ -q

  forward   a module's pre-hook opens a frame and acquires the units it needs (gathering those at rest); its
            post-hook, registered with always_call=True so that it runs even when the module raises (torch's
            non-reentrant checkpoint stops a recomputation by raising inside a module), closes the frame and
            releases exactly what the frame acquired. Outputs get a tensor hook that acquires again in backward.
  backward  an output's hook acquires the module's units and holds them until this rank's gradients for them are
            in (reduce.py completes them). A module that runs during backward is a recomputation
            (activation checkpointing): its units are held the same way, so the backward that follows uses that
            gather instead of a third one.
  external  the first pass watches torch calls for parameters at rest: a module that reads a parameter of
            another unit (a tied head) is given that unit to gather from then on.
  diverging in a verifying pass (agreement.py) every gather is preceded by a tag exchange. When ranks would
            gather different units (routed experts: rank 0 runs experts[0], rank 1 experts[1]), the smallest
            module containing all of them becomes one merged group that its nearest running ancestor gathers on
            every rank, from this gather on (stage3_merge_divergent_modules, default true); otherwise, or where
            no merge can help, a CommError names the ranks and the units before any data moves.

At the end of each forward and backward pass the lifecycle invariants are checked (lifecycle.check_pass_end).
"""

from __future__ import annotations

import logging
import sys

import torch
from torch.utils._pytree import tree_map

from zkern.comm.divergence import TagKind, path_under
from zkern.core.owners import weak_tensor_hook
from zkern.errors import InvariantError
from zkern.stage3.agreement import Agreement
from zkern.stage3.escapes import alias_parameters, mark_escaped
from zkern.stage3.external import WatchAtRest
from zkern.stage3.gatherer import Gatherer
from zkern.stage3.lifecycle import DataState, GradState, Unit, check_pass_end
from zkern.stage3.modules import Frame, ModuleMap, Pass

log = logging.getLogger("zkern")


class Stage3Hooks:
    def __init__(self, root: torch.nn.Module, units: list[Unit], needs: dict[torch.nn.Module, list[int]],
                 gatherer: Gatherer, *, unit_of: dict[int, Unit], merge_divergent: bool):
        self.root, self.units, self.gatherer, self.comm = root, units, gatherer, gatherer.comm
        self.modules = ModuleMap(root, unit_of, needs)  # names, numbers, and which units each module gathers
        self.state = Pass()  # the pass in progress: phase, verification, open frames
        self.agreement = Agreement(gatherer, units, self.modules, self.state, merge_divergent=merge_divergent,
                                   hold=self._hold, hook_mid_call=self._hook_mid_call, abort=self.abort_pass)
        self._divergent_held: list[Unit] = []  # divergent units backward holds now (released at shared events)
        self.suspended = False  # every unit is pinned whole (gathered_for_generation): forwards need no hooks
        self._watch: WatchAtRest | None = None
        self._handles = []
        self._hooked: set[int] = set()
        self._hooked_mid_call: set[int] = set()  # hooked by a merge while running: no frame for that call
        for module in [root, *needs]:
            self.hook_module(module)

    # -- registration -----------------------------------------------------------------------------------------
    def hook_module(self, module: torch.nn.Module) -> None:
        if id(module) in self._hooked:
            return
        self._hooked.add(id(module))
        self._handles.append(module.register_forward_pre_hook(self._pre_forward))
        self._handles.append(module.register_forward_hook(self._post_forward, always_call=True))

    def _hook_mid_call(self, module: torch.nn.Module) -> None:
        """A merge made `module` a container while it runs: hook it (torch calls the new post-hook for the running
        call, whose pre-hook never ran)."""
        if id(module) not in self._hooked:
            self._hooked_mid_call.add(id(module))
            self.hook_module(module)

    # -- acquiring and releasing ------------------------------------------------------------------------------
    def _acquire(self, u: Unit, *, frame: Frame | None, requester: torch.nn.Module | None) -> None:
        """Make u whole for `frame` (forward) or hold it for backward; verifying passes first agree with every rank
        on the gather."""
        if u.persistent:
            return
        if self.comm.world > 1 and (not u.live or u.prefetched):
            if not self.state.verify and not self.state.departed and not self.gatherer.catch_up(u, self.state.phase):
                self._depart(u)
            if (self.state.verify or self.state.departed) and not u.live:
                self.agreement.agree((TagKind.GATHER, u.index, self.modules.number(requester)), requester=frame)
        event = self.gatherer.use(u, self.state.phase)
        if frame is not None:
            u.ref()
            frame.acquired.append(u)
        if self.state.phase == "backward":
            self._hold(u, requester if event else None)
            if event and requester is not None:
                self._release_divergent(requester, keep=u)
            if frame is None and not u.held:
                self.release(u)  # it only joined the ranks' all-gather: nothing here reads it

    def _hold(self, u: Unit, holder: torch.nn.Module | None) -> None:
        """Backward keeps u whole while it may be needed. A divergent unit: until an event outside `holder` (see
        _release_divergent), decided alike on every rank. Any other: until its gradients are in here, or for a
        frozen unit a module of which ran (its weights serve the input gradients), until backward ends; a unit
        whose gradients are complete already and no module of which ran here only passes through. One a module of
        which ran here but whose gradients are already in (a module reused inside and outside a reentrant activation
        checkpoint: the checkpoint's own backward delivered them) is read again by the backward still to come: it
        stays whole until backward ends, and a second gradient for it is added while its reduction has not been
        launched (GradReducer.on_grad names the fix once it has)."""
        if u.divergent:
            if not u.held and holder is not None:
                u.held, u.holder = True, holder
                self._divergent_held.append(u)
        elif u.grads is GradState.PENDING or (u.touched and (u.trainable == 0 or u.arrived)):
            u.held = True

    def _release_divergent(self, requester: torch.nn.Module, keep: Unit) -> None:
        """An event by `requester`: backward has moved on from every module that is not an ancestor of it, so the
        divergent units those modules hold are released (on every rank at this same event; a rank still waiting
        for their gradients keeps its copy as a lingering one)."""
        if not self._divergent_held:
            return
        where, kept = self.modules.path(requester), []
        for v in self._divergent_held:
            if not v.held:  # released elsewhere (end of backward)
                continue
            if v is keep or v.refs or path_under(where, self.modules.path(v.holder)):
                kept.append(v)
                continue
            v.held, v.holder = False, None
            self.release(v)
        self._divergent_held = kept

    def release(self, u: Unit) -> None:
        self.gatherer.release(u)

    def _close(self, frame: Frame) -> None:
        for u in frame.acquired:
            u.unref()
        for u in frame.acquired:
            self.release(u)
        frame.acquired.clear()

    # -- forward hooks ----------------------------------------------------------------------------------------
    def _pre_forward(self, module: torch.nn.Module, args) -> None:
        if self.suspended:
            return
        if module is self.root and self.state.phase == "forward" and not self.state.frames:
            self._begin_forward()
        frame = Frame(module)
        self.state.frames.append(frame)
        self.state.in_hook = True
        try:
            if self.state.phase == "forward":
                for ui in self.modules.needs.get(module, ()):
                    self.units[ui].touched = True
            for ui in self.modules.wanted(module):
                self._acquire(self.units[ui], frame=frame, requester=module)
        finally:
            self.state.in_hook = False

    def _post_forward(self, module: torch.nn.Module, args, output):
        # always_call: also runs when the module raised (then torch passes output=None and re-raises after us).
        if self.suspended:
            return output
        raised = output is None and sys.exc_info()[1] is not None
        self.state.in_hook = True
        try:
            if not raised and self.state.frames and self.state.frames[-1].module is module:
                output = self._keep_escaping_views(module, output, self.state.frames[-1])
            self._pop_frame(module, raised)
            if not raised and torch.is_grad_enabled() and self.modules.wanted(module):
                output = tree_map(lambda t: self._hook_output(t, module), output)
            if module is self.root and self.state.phase == "forward" and not self.state.frames:
                if raised:
                    self.abort_pass()
                else:
                    self._end_forward()
        finally:
            self.state.in_hook = False
        return output

    def _keep_escaping_views(self, module: torch.nn.Module, output, frame: Frame):
        """Views of the frame's units that leave the call keep their storage past the release (escapes.py)."""
        if not frame.acquired:
            return output
        output = alias_parameters(output, frame.acquired)
        for t in mark_escaped(output, module, frame.acquired):
            if torch.is_grad_enabled() and t.requires_grad and t.grad_fn is not None:
                self._hook_output(t, module)  # a kept view: its gradient reaches the parameter past the outputs
        return output

    def _pop_frame(self, module: torch.nn.Module, raised: bool) -> None:
        frames = self.state.frames
        index = next((i for i in range(len(frames) - 1, -1, -1) if frames[i].module is module), None)
        if index is None:
            # The pass was already aborted (a divergence raised inside a pre-hook), or a merge hooked this module
            # while it ran (torch then calls the new post-hook for the running call, whose pre-hook never ran).
            if raised or id(module) in self._hooked_mid_call:
                return
            raise InvariantError(f"zkern stage 3: the forward hook of '{self.modules.path(module)}' ran without its "
                                 f"pre-hook: hooks were added or removed while the module was running")
        skipped = self.state.frames[index + 1:]
        if skipped and not raised:
            names = ", ".join(f"'{self.modules.path(f.module)}' (holding {[u.name for u in f.acquired]})"
                              for f in skipped)
            raise InvariantError(f"zkern stage 3: '{self.modules.path(module)}' finished while modules it called had "
                                 f"not: {names}. Their forward hooks never ran: a BaseException (not an Exception) "
                                 f"raised inside them was caught by their caller, so torch skipped the hooks")
        for frame in reversed(self.state.frames[index:]):
            self._close(frame)
        del self.state.frames[index:]

    def _hook_output(self, t, module: torch.nn.Module):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(weak_tensor_hook(self._pre_backward, module))  # kept views outlive engines
        return t

    def _depart(self, u: Unit) -> None:
        """A pass that follows its record needs u, which the rest of the record does not hold (a module this rank
        never ran in the recorded pass): issue the rest of the record, as the other ranks will, then agree on every
        further all-gather with them; those that finished their pass serve it (_serve)."""
        self.gatherer.drain(self.state.phase)
        self.state.departed = True
        self.modules.changed = True  # the next passes record afresh, verifying
        if self.modules.once(f"depart:{self.state.phase}"):  # said by the rank it happens on, once
            log.warning("zkern stage 3: rank %d's %s pass needs unit '%s' where its recorded order has none left; its "
                        "further all-gathers are agreed with the other ranks one by one, and the next passes record "
                        "the order afresh (said once)", self.comm.rank, self.state.phase, u.name)

    def _begin_forward(self) -> None:
        self.state.departed = False
        self.state.verify = self.gatherer.begin_pass("forward")
        self.state.recording = self.gatherer.order.recording_only("forward")
        if self.state.recording:
            self._watch = WatchAtRest(self.modules, self.state, self.comm.rank, hook_module=self.hook_module,
                                      acquire=lambda u, frame, module: self._acquire(u, frame=frame,
                                                                                     requester=module))
            self._watch.__enter__()

    def _end_forward(self) -> None:
        self._stop_watching()
        self.agreement.agree_end(TagKind.END_FORWARD)
        self._end_pass("forward")
        check_pass_end(self.units, "forward")

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
            self._watch = None

    def _end_pass(self, phase: str) -> None:
        self.gatherer.end_pass(phase)
        self._hooked_mid_call.clear()
        if self.modules.changed:  # a module adopted or merged units: the next passes gather in another order
            self.gatherer.order.forget()
            self.modules.changed = False

    def abort_pass(self) -> None:
        """The model raised inside a pass: drop what the pass held, so the next call starts clean (idempotent)."""
        self._stop_watching()
        for frame in reversed(self.state.frames):
            self._close(frame)
        self.state.frames.clear()
        self.state.in_hook = False
        for u in self.units:
            if u.data is not DataState.REST and u.refs == 0:
                if self.state.phase == "forward":
                    u.held = False
                self.release(u)
        self.gatherer.drop_prefetched()
        self.gatherer.order.abandon(self.state.phase)

    # -- backward ---------------------------------------------------------------------------------------------
    def _pre_backward(self, module: torch.nn.Module, grad):
        self.state.in_hook = True
        try:
            for ui in self.modules.wanted(module):
                self._acquire(self.units[ui], frame=None, requester=module)
        finally:
            self.state.in_hook = False
        return grad

    def begin_backward(self) -> None:
        """After the reducer opened the pass: decide verification, and gather what every rank needs first."""
        self.state.phase = "backward"
        self.state.verify = self.gatherer.begin_pass("backward")
        self.state.in_hook = True
        try:
            for ui in self.modules.backward_set:  # held by the root: until backward ends
                self._acquire(self.units[ui], frame=None, requester=self.root)
        finally:
            self.state.in_hook = False

    def agree_end_backward(self) -> None:
        """loss.backward() returned: issue what the record still holds and agree with every rank that backward
        ended, serving the all-gathers a rank that left its record still needs. This comes before the wait for the
        reductions, which another rank may complete only after such a gather."""
        self.state.in_hook = True
        try:
            self.agreement.agree_end(TagKind.END_BACKWARD)
        finally:
            self.state.in_hook = False

    def end_backward(self) -> None:
        """Every gradient is in and reduced: release what backward held."""
        self.release_backward()
        self._end_pass("backward")
        self.state.phase = "forward"

    def release_backward(self) -> None:
        """Backward is over (or failed): nothing it held or left lingering stays gathered."""
        for u in self.units:
            if u.held or u.lingering:
                u.held, u.holder, u.lingering = False, None, False
                self.release(u)
        self._divergent_held = []

    def on_complete(self, u: Unit) -> None:
        """u's gradients are all in on this rank: backward no longer needs it here (a divergent unit keeps its
        hold, which only a shared event ends; a lingering copy of one goes)."""
        if u.lingering:
            u.lingering = False
            self.release(u)
        elif u.held and not u.divergent:
            u.held = False
            self.release(u)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
