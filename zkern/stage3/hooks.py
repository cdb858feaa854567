"""Stage 3's module hooks: which units a running module holds, when they are gathered for backward, how reads of
another module's parameters are found, and what happens when ranks would gather different units.

    python -m pytest tests/test_stage3.py tests/test_stage3_checkpointing.py tests/test_stage3_moe.py -q

  forward   a module's pre-hook opens a frame and acquires the units it needs (gathering those at rest); its
            post-hook, registered with always_call=True so that it runs even when the module raises (torch's
            non-reentrant checkpoint stops a recomputation by raising inside a module), closes the frame and
            releases exactly what the frame acquired. Outputs get a tensor hook that acquires again in backward.
  backward  an output's hook acquires the module's units and holds them until this rank's gradients for them are
            in (stage3_reduce.py completes them). A module that runs during backward is a recomputation
            (activation checkpointing): its units are held the same way, so the backward that follows uses that
            gather instead of a third one.
  external  the first pass watches torch calls for parameters at rest: a module that reads a parameter of
            another unit (a tied head) is given that unit to gather from then on.
  diverging in a verifying pass (divergence.py) every gather is preceded by a tag exchange. When ranks would
            gather different units (routed experts: rank 0 runs experts[0], rank 1 experts[1]), the smallest
            module containing all of them becomes one merged group that its nearest running ancestor gathers on
            every rank, from this gather on (stage3_merge_divergent_modules, default true); otherwise, or where
            no merge can help, a CommError names the ranks and the units before any data moves.

At the end of each forward and backward pass the lifecycle invariants are checked (lifecycle.check_pass_end).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from zkern.comm.collectives import CommError
from zkern.comm.divergence import (
    TagKind,
    common_prefix,
    describe_mismatch,
    exchange_tags,
    path_under,
)
from zkern.stage3.gatherer import Gatherer
from zkern.stage3.lifecycle import DataState, GradState, InvariantError, Unit, check_pass_end

log = logging.getLogger("zkern")

# Attribute reads an at-rest parameter answers correctly (its empty stand-in has the right dtype and device).
_METADATA = frozenset({"dtype", "device", "requires_grad", "is_leaf", "layout", "is_cuda", "grad_fn"})


@dataclass(eq=False)
class Frame:
    """One running module call and the units it holds."""

    module: torch.nn.Module
    acquired: list[Unit] = field(default_factory=list)


class _WatchAtRest(TorchFunctionMode):
    """Recording passes only: a torch call that reads a parameter at rest gathers its unit for the running
    module (and remembers that the module needs it)."""

    def __init__(self, hooks: Stage3Hooks):
        super().__init__()
        self.hooks = hooks

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.hooks.in_hook:  # the runtime's own work (gathering sets p.data) is not the model reading
            return func(*args, **kwargs)
        if getattr(getattr(func, "__self__", None), "__name__", None) in _METADATA:
            return func(*args, **kwargs)
        for leaf in tree_flatten((args, kwargs))[0]:
            if isinstance(leaf, torch.nn.Parameter):
                self.hooks.adopt_if_at_rest(leaf)
        return func(*args, **kwargs)


class Stage3Hooks:
    def __init__(self, root: torch.nn.Module, units: list[Unit], needs: dict[torch.nn.Module, list[int]],
                 gatherer: Gatherer, *, merge_divergent: bool):
        self.root, self.units, self.gatherer, self.comm = root, units, gatherer, gatherer.comm
        self.needs = needs  # module -> units it reads (planned, declared and detected)
        self.merged: dict[torch.nn.Module, list[int]] = {}  # container -> units of children chosen per rank
        self.backward_set: list[int] = []  # units every rank gathers when backward begins (divergent backward needs)
        self._divergent_held: list[Unit] = []  # divergent units backward holds now (released at shared events)
        self.merge_divergent = merge_divergent
        self.by_path = dict(root.named_modules())
        self.modules = list(self.by_path.values())
        self.paths = {id(m): name for name, m in self.by_path.items()}
        self.module_index = {id(m): i for i, m in enumerate(self.modules)}
        self.unit_of = {id(p): u for u in units for p in u.plan.params}
        self.frames: list[Frame] = []
        self.phase = "forward"
        self.verify = False  # this pass exchanges a tag before each gather (decided when the pass begins)
        self.departed = False  # this pass left its record here: every further gather is agreed first
        self.recording = True  # this forward pass follows no record (it watches for external reads)
        self.in_hook = False
        self.suspended = False  # every unit is pinned whole (gathered_for_generation): forwards need no hooks
        self.needs_changed = False
        self._watch: _WatchAtRest | None = None
        self._said: set[str] = set()
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

    def _wanted(self, module: torch.nn.Module) -> list[int]:
        own = self.needs.get(module, [])
        merged = self.merged.get(module)
        return own if not merged else own + [i for i in merged if i not in own]

    # -- acquiring and releasing ------------------------------------------------------------------------------
    def _acquire(self, u: Unit, *, frame: Frame | None, requester: torch.nn.Module | None) -> None:
        """Make u whole for `frame` (forward) or hold it for backward; verifying passes first agree with every rank
        on the gather."""
        if u.persistent:
            return
        if self.comm.world > 1 and (not u.live or u.prefetched):
            if not self.verify and not self.departed and not self.gatherer.catch_up(u, self.phase):
                self._depart(u)
            if (self.verify or self.departed) and not u.live:
                self._agree((TagKind.GATHER, u.index, self._module_number(requester)), requester=frame)
        event = self.gatherer.use(u, self.phase)
        if frame is not None:
            u.ref()
            frame.acquired.append(u)
        if self.phase == "backward":
            self._hold(u, requester if event else None)
            if event and requester is not None:
                self._release_divergent(requester, keep=u)
            if frame is None and not u.held:
                self.release(u)  # it only joined the ranks' all-gather: nothing here reads it

    def _hold(self, u: Unit, holder: torch.nn.Module | None) -> None:
        """Backward keeps u whole while it may be needed. A divergent unit: until an event outside `holder` (see
        _release_divergent), decided alike on every rank. Any other: until its gradients are in here, or for a
        frozen unit a module of which ran (its weights serve the input gradients), until backward ends; a unit
        whose gradients are complete already (no module of it ran here) only passes through."""
        if u.divergent:
            if not u.held and holder is not None:
                u.held, u.holder = True, holder
                self._divergent_held.append(u)
        elif u.grads is GradState.PENDING or (u.trainable == 0 and u.touched):
            u.held = True

    def _release_divergent(self, requester: torch.nn.Module, keep: Unit) -> None:
        """An event by `requester`: backward has moved on from every module that is not an ancestor of it, so the
        divergent units those modules hold are released (on every rank at this same event; a rank still waiting
        for their gradients keeps its copy as a lingering one)."""
        if not self._divergent_held:
            return
        where, kept = self._path(requester), []
        for v in self._divergent_held:
            if not v.held:  # released elsewhere (end of backward)
                continue
            if v is keep or v.refs or path_under(where, self._path(v.holder)):
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
        if module is self.root and self.phase == "forward" and not self.frames:
            self._begin_forward()
        frame = Frame(module)
        self.frames.append(frame)
        self.in_hook = True
        try:
            if self.phase == "forward":
                for ui in self.needs.get(module, ()):
                    self.units[ui].touched = True
            for ui in self._wanted(module):
                self._acquire(self.units[ui], frame=frame, requester=module)
        finally:
            self.in_hook = False

    def _post_forward(self, module: torch.nn.Module, args, output):
        # always_call: also runs when the module raised (then torch passes output=None and re-raises after us).
        if self.suspended:
            return output
        raised = output is None and sys.exc_info()[1] is not None
        self.in_hook = True
        try:
            self._pop_frame(module, raised)
            if not raised and torch.is_grad_enabled() and self._wanted(module):
                output = tree_map(lambda t: self._hook_output(t, module), output)
            if module is self.root and self.phase == "forward" and not self.frames:
                if raised:
                    self.abort_pass()
                else:
                    self._end_forward()
        finally:
            self.in_hook = False
        return output

    def _pop_frame(self, module: torch.nn.Module, raised: bool) -> None:
        index = next((i for i in range(len(self.frames) - 1, -1, -1) if self.frames[i].module is module), None)
        if index is None:
            # The pass was already aborted (a divergence raised inside a pre-hook), or a merge hooked this module
            # while it ran (torch then calls the new post-hook for the running call, whose pre-hook never ran).
            if raised or id(module) in self._hooked_mid_call:
                return
            raise InvariantError(f"zkern stage 3: the forward hook of '{self._path(module)}' ran without its "
                                 f"pre-hook: hooks were added or removed while the module was running")
        skipped = self.frames[index + 1:]
        if skipped and not raised:
            names = ", ".join(f"'{self._path(f.module)}' (holding {[u.name for u in f.acquired]})" for f in skipped)
            raise InvariantError(f"zkern stage 3: '{self._path(module)}' finished while modules it called had not: "
                                 f"{names}. Their forward hooks never ran: a BaseException (not an Exception) "
                                 f"raised inside them was caught by their caller, so torch skipped the hooks")
        for frame in reversed(self.frames[index:]):
            self._close(frame)
        del self.frames[index:]

    def _hook_output(self, t, module: torch.nn.Module):
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(lambda grad: self._pre_backward(module, grad))
        return t

    def _depart(self, u: Unit) -> None:
        """A pass that follows its record needs u, which the rest of the record does not hold (a module this rank
        never ran in the recorded pass): issue the rest of the record, as the other ranks will, then agree on every
        further all-gather with them; those that finished their pass serve it (_serve)."""
        self.gatherer.drain(self.phase)
        self.departed = True
        self.needs_changed = True  # the next passes record afresh, verifying
        if f"depart:{self.phase}" not in self._said:  # said by the rank it happens on, once
            self._said.add(f"depart:{self.phase}")
            log.warning("zkern stage 3: rank %d's %s pass needs unit '%s' where its recorded order has none left; its "
                        "further all-gathers are agreed with the other ranks one by one, and the next passes record "
                        "the order afresh (said once)", self.comm.rank, self.phase, u.name)

    def _begin_forward(self) -> None:
        self.departed = False
        self.verify = self.gatherer.begin_pass("forward")
        self.recording = self.gatherer.order.recording_only("forward")
        if self.recording:
            self._watch = _WatchAtRest(self)
            self._watch.__enter__()

    def _end_forward(self) -> None:
        self._stop_watching()
        self._agree_end(TagKind.END_FORWARD)
        self._end_pass("forward")
        check_pass_end(self.units, "forward")

    def _stop_watching(self) -> None:
        if self._watch is not None:
            self._watch.__exit__(None, None, None)
            self._watch = None

    def _end_pass(self, phase: str) -> None:
        self.gatherer.end_pass(phase)
        self._hooked_mid_call.clear()
        if self.needs_changed:  # a module adopted or merged units: the next passes gather in another order
            self.gatherer.order.forget()
            self.needs_changed = False

    def abort_pass(self) -> None:
        """The model raised inside a pass: drop what the pass held, so the next call starts clean (idempotent)."""
        self._stop_watching()
        for frame in reversed(self.frames):
            self._close(frame)
        self.frames.clear()
        self.in_hook = False
        for u in self.units:
            if u.data is not DataState.REST and u.refs == 0:
                if self.phase == "forward":
                    u.held = False
                self.release(u)
        self.gatherer.drop_prefetched()
        self.gatherer.order.abandon(self.phase)

    # -- external reads ---------------------------------------------------------------------------------------
    def adopt_if_at_rest(self, p: torch.nn.Parameter) -> None:
        u = self.unit_of.get(id(p))
        if u is None or u.persistent or (u.data is DataState.GATHERED and not u.prefetched):
            return
        frame = self.frames[-1] if self.frames else None
        module = frame.module if frame is not None else self.root
        wanted = self.needs.setdefault(module, [])
        if u.index not in wanted:
            wanted.append(u.index)
            self.hook_module(module)
            self.needs_changed = True
            if self.comm.rank == 0:
                log.info("zkern stage 3: %s reads '%s' of unit '%s' outside that unit's modules; it gathers that "
                         "unit from now on", type(module).__name__, self._param_name(p), u.name)
        u.touched = True
        self.in_hook = True
        try:
            self._acquire(u, frame=frame, requester=module)
        finally:
            self.in_hook = False

    # -- backward ---------------------------------------------------------------------------------------------
    def _pre_backward(self, module: torch.nn.Module, grad):
        self.in_hook = True
        try:
            for ui in self._wanted(module):
                self._acquire(self.units[ui], frame=None, requester=module)
        finally:
            self.in_hook = False
        return grad

    def begin_backward(self) -> None:
        """After the reducer opened the pass: decide verification, and gather what every rank needs first."""
        self.phase = "backward"
        self.verify = self.gatherer.begin_pass("backward")
        self.in_hook = True
        try:
            for ui in self.backward_set:  # held by the root: until backward ends
                self._acquire(self.units[ui], frame=None, requester=self.root)
        finally:
            self.in_hook = False

    def agree_end_backward(self) -> None:
        """loss.backward() returned: issue what the record still holds and agree with every rank that backward
        ended, serving the all-gathers a rank that left its record still needs. This comes before the wait for the
        reductions, which another rank may complete only after such a gather."""
        self.in_hook = True
        try:
            self._agree_end(TagKind.END_BACKWARD)
        finally:
            self.in_hook = False

    def end_backward(self) -> None:
        """Every gradient is in and reduced: release what backward held."""
        self.release_backward()
        self._end_pass("backward")
        self.phase = "forward"

    def _agree_end(self, kind: TagKind) -> None:
        """At the end of every pass (several ranks): the rest of the record is issued, then the ranks agree that the
        pass ended. Passes that follow their record exchange this one tag per pass; a rank that departed from it
        is served here."""
        if self.comm.world == 1:
            return
        if not self.verify and not self.departed:
            self.gatherer.drain(self.phase)
        self._agree((kind, -1, -1), requester=None)

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

    # -- agreement across ranks -------------------------------------------------------------------------------
    def _agree(self, tag: tuple[int, int, int], *, requester: Frame | None) -> None:
        """Exchange tags until every rank is about to do the same thing; resolve a divergence in between (each
        rank derives the same resolution from the same tags) or raise a CommError naming it."""
        while True:
            tags = exchange_tags(self.comm, tag, self.gatherer.device)
            if all(t == tags[0] for t in tags):
                return
            self._resolve(tags, requester, tag)
            if tag[0] == TagKind.GATHER and self.units[tag[1]].live:
                return  # the resolution gathered it

    def _resolve(self, tags: list[tuple[int, int, int]], requester: Frame | None,
                 mine: tuple[int, int, int]) -> None:
        end = TagKind.END_FORWARD if self.phase == "forward" else TagKind.END_BACKWARD
        wanted = sorted({t[1] for t in tags if t[0] == TagKind.GATHER})
        what = describe_mismatch(tags, [u.name for u in self.units], [self._path(m) for m in self.modules])
        if not wanted or any(t[0] not in (TagKind.GATHER, end) for t in tags):
            raise self._diverged(what, "no merge can line these up")
        if not self.verify:  # a pass that followed its record, and a rank left it: serve, no merge
            self._serve(wanted, mine[1] if mine[0] == TagKind.GATHER else None)
            return
        if not self.merge_divergent:
            raise self._diverged(what, "zero_optimization.stage3_merge_divergent_modules is false")
        if self.phase == "backward":
            self._merge_for_backward(wanted, what)
        else:
            self._merge_into_container(wanted, requester, what)
        self.needs_changed = True
        self.gatherer.verify_all = False  # found and merged: passes that follow their record need not verify

    def _serve(self, wanted: list[int], own: int | None) -> None:
        """Every rank takes part in the all-gathers of the units some rank asked for, in unit order: the asker keeps
        its own (its _acquire uses it next), the others let theirs go. The next passes record afresh."""
        self.needs_changed = True
        for ui in wanted:
            u = self.units[ui]
            if ui == own:
                self._gather_agreed(u)
            else:
                self.gatherer.join(u, "parameters another rank asked for")

    def _merge_into_container(self, wanted: list[int], requester: Frame | None, what: str) -> None:
        """Forward: the units under the deepest module containing every wanted unit become one group, gathered
        from now on by `container` (the nearest module that runs on every rank) and, in this pass, by the deepest
        open frame containing them."""
        prefix = common_prefix([self.units[i].name for i in wanted])
        group = list(wanted)
        if self._siblings(wanted, prefix):  # children of a ModuleList/ModuleDict chosen per rank: take them all
            group = [u.index for u in self.units if not u.persistent and path_under(u.name, prefix)]
        container = self._container(prefix, proper=len(wanted) == 1)
        frames = [f for f in self.frames if f is not requester and path_under(prefix, self._path(f.module))]
        frame = frames[-1] if frames else None
        tag = (TagKind.ATTACH, self._module_number(container), self._module_number(frame.module if frame else None))
        tags = exchange_tags(self.comm, tag, self.gatherer.device)
        if frame is None or any(t != tags[0] for t in tags):
            raise self._diverged(what, "the ranks are not inside one common module that could gather the merged "
                                       "units")
        self.merged[container] = sorted({*self.merged.get(container, []), *group})
        if id(container) not in self._hooked:
            self._hooked_mid_call.add(id(container))
            self.hook_module(container)
        for ui in group:
            self.units[ui].divergent = True
        for ui in group:
            self._gather_agreed(self.units[ui])
            self.units[ui].ref()
            frame.acquired.append(self.units[ui])
        where = self._path(container) or "<root>"
        self._say(f"merge:{where}",
                  f"zkern stage 3: ranks gathered different units ({what}); module '{where}'"
                  f" now gathers its {len(group)} unit(s) under '{prefix or '<root>'}' together on every rank "
                  f"({sum(self.units[i].bucket.padded for i in group)} elements), starting with this gather. To "
                  f"choose this yourself, list the module's class in zero_optimization.stage3_fetch_units")

    def _merge_for_backward(self, wanted: list[int], what: str) -> None:
        """Backward: every rank gathers the wanted units now. Units a forward merge already covers are gathered
        by their container's backward hook from the next pass on; any others, when every later backward begins."""
        container = {i: m for m, group in self.merged.items() for i in group}
        later = [i for i in wanted if i not in container]
        self.backward_set = sorted({*self.backward_set, *later})
        for ui in wanted:
            u = self.units[ui]
            u.divergent = True
            self._gather_agreed(u)
            self._hold(u, container.get(ui, self.root))  # a holder every rank names alike
        if later:
            self._say(f"backward:{later}", f"zkern stage 3: ranks' backward passes gathered different units ({what});"
                                           f" every rank now gathers {[self.units[i].name for i in later]} when "
                                           f"backward begins")

    def _gather_agreed(self, u: Unit) -> None:
        """Join the all-gather of u that every rank issues now: gather it, or, where it is whole already, gather
        into its own buffer."""
        if u.data is DataState.REST:
            self.gatherer.gather(u, async_op=False)
        else:
            u.lingering = False
            self.gatherer.regather(u, "parameters gathered to line ranks up")

    def _siblings(self, wanted: list[int], prefix: str) -> bool:
        """Are the wanted units inside different children of one ModuleList or ModuleDict (experts[0],
        experts[1], ...)? Then the other children are the other choices a rank can make, and merging all of them
        now saves a divergence (and, outside verifying passes, a discarded step) per choice later."""
        container = self.by_path.get(prefix)
        return len(wanted) > 1 and isinstance(container, (torch.nn.ModuleList, torch.nn.ModuleDict))

    def _container(self, prefix: str, proper: bool) -> torch.nn.Module:
        """The deepest module that has a forward and contains `prefix` (strictly, when `proper`)."""
        best = self.root
        for m in self.modules:
            path = self._path(m)
            if not path_under(prefix, path) or (proper and path == prefix):
                continue
            if type(m).forward is torch.nn.Module.forward:  # ModuleList, ModuleDict: never called
                continue
            if len(path) >= len(self._path(best)):
                best = m
        return best

    def _diverged(self, what: str, why: str) -> CommError:
        self.abort_pass()
        return CommError(
            f"zkern rank {self.comm.rank} of {self.comm.world}: the ranks' stage-3 gathers diverged ({what}); "
            f"{why}. Nothing was gathered and no rank has stepped. Each rank must gather the same units in the same "
            f"order: make every rank run the same modules, or list the class of the module whose children are "
            f"chosen per rank (an MoE layer) in zero_optimization.stage3_fetch_units, so that it is gathered whole, "
            f"or leave stage3_merge_divergent_modules at true to let zkern do that when it sees the divergence")

    # -- names ------------------------------------------------------------------------------------------------
    def _path(self, module: torch.nn.Module) -> str:
        return self.paths.get(id(module), f"<{type(module).__name__} outside the model>")

    def _module_number(self, module: torch.nn.Module | None) -> int:
        return -1 if module is None else self.module_index.get(id(module), -1)

    def _param_name(self, p: torch.nn.Parameter) -> str:
        u = self.unit_of[id(p)]
        return next(n for q, n in zip(u.plan.params, u.plan.names) if q is p)

    def _say(self, key: str, message: str) -> None:
        if key not in self._said and self.comm.rank == 0:
            log.warning(message)
        self._said.add(key)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
