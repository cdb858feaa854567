"""Stage 3's agreement across ranks: in a verifying pass every gather is preceded by a tag exchange; when ranks would
gather different units (routed experts), the smallest module containing them all becomes one merged group that its
nearest running ancestor gathers on every rank (stage3_merge_divergent_modules), or a CommError names the ranks and
the units before any data moves.

    python -m pytest tests/stage3/test_stage3_moe.py -q

The module hooks (hooks.py) call agree() before a verified gather. Agreement sees the parts it acts on (the
gatherer, the units, the module map, the pass in progress) and calls back into the hooks for three things only:
hold a unit for backward, hook a module that a merge makes a container while it runs, abort the pass.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from zkern.comm.collectives import Comm
from zkern.comm.divergence import TagKind, common_prefix, describe_mismatch, exchange_tags, path_under
from zkern.errors import CommError
from zkern.stage3.gatherer import Gatherer
from zkern.stage3.lifecycle import DataState, Unit
from zkern.stage3.modules import Frame, ModuleMap, Pass


class Agreement:
    def __init__(self, gatherer: Gatherer, units: list[Unit], modules: ModuleMap, state: Pass, *,
                 merge_divergent: bool, hold: Callable[[Unit, torch.nn.Module], None],
                 hook_mid_call: Callable[[torch.nn.Module], None], abort: Callable[[], None]):
        self.gatherer, self.units, self.modules, self.state = gatherer, units, modules, state
        self.comm: Comm = gatherer.comm
        self.merge_divergent = merge_divergent
        self.hold, self.hook_mid_call, self.abort = hold, hook_mid_call, abort

    def agree(self, tag: tuple[int, int, int], *, requester: Frame | None) -> None:
        """Exchange tags until every rank is about to do the same thing; resolve a divergence in between (each
        rank derives the same resolution from the same tags) or raise a CommError naming it."""
        while True:
            tags = exchange_tags(self.comm, tag, self.gatherer.device)
            if all(t == tags[0] for t in tags):
                return
            self.resolve(tags, requester, tag)
            if tag[0] == TagKind.GATHER and self.units[tag[1]].live:
                return  # the resolution gathered it

    def resolve(self, tags: list[tuple[int, int, int]], requester: Frame | None,
                mine: tuple[int, int, int]) -> None:
        end = TagKind.END_FORWARD if self.state.phase == "forward" else TagKind.END_BACKWARD
        wanted = sorted({t[1] for t in tags if t[0] == TagKind.GATHER})
        what = describe_mismatch(tags, [u.name for u in self.units],
                                 [self.modules.path(m) for m in self.modules.modules])
        if not wanted or any(t[0] not in (TagKind.GATHER, end) for t in tags):
            raise self.diverged(what, "no merge can line these up")
        if not self.state.verify:  # a pass that followed its record, and a rank left it: serve, no merge
            self.serve(wanted, mine[1] if mine[0] == TagKind.GATHER else None)
            return
        if not self.merge_divergent:
            raise self.diverged(what, "zero_optimization.stage3_merge_divergent_modules is false")
        if self.state.phase == "backward":
            self.merge_for_backward(wanted, what)
        else:
            self.merge_into_container(wanted, requester, what)
        self.modules.changed = True
        self.gatherer.verify_all = False  # found and merged: passes that follow their record need not verify

    def serve(self, wanted: list[int], own: int | None) -> None:
        """Every rank takes part in the all-gathers of the units some rank asked for, in unit order: the asker keeps
        its own (its _acquire uses it next), the others let theirs go. The next passes record afresh."""
        self.modules.changed = True
        for ui in wanted:
            u = self.units[ui]
            if ui == own:
                self.gather_agreed(u)
            else:
                self.gatherer.join(u, "parameters another rank asked for")

    def merge_into_container(self, wanted: list[int], requester: Frame | None, what: str) -> None:
        """Forward: the units under the deepest module containing every wanted unit become one group, gathered
        from now on by `container` (the nearest module that runs on every rank) and, in this pass, by the deepest
        open frame containing them."""
        prefix = common_prefix([self.units[i].name for i in wanted])
        group = list(wanted)
        if self.siblings(wanted, prefix):  # children of a ModuleList/ModuleDict chosen per rank: take them all
            group = [u.index for u in self.units if not u.persistent and path_under(u.name, prefix)]
        container = self.container_of(prefix, proper=len(wanted) == 1)
        frames = [f for f in self.state.frames
                  if f is not requester and path_under(prefix, self.modules.path(f.module))]
        frame = frames[-1] if frames else None
        tag = (TagKind.ATTACH, self.modules.number(container), self.modules.number(frame.module if frame else None))
        tags = exchange_tags(self.comm, tag, self.gatherer.device)
        if frame is None or any(t != tags[0] for t in tags):
            raise self.diverged(what, "the ranks are not inside one common module that could gather the merged "
                                      "units")
        self.modules.merged[container] = sorted({*self.modules.merged.get(container, []), *group})
        self.hook_mid_call(container)
        for ui in group:
            self.units[ui].divergent = True
        for ui in group:
            self.gather_agreed(self.units[ui])
            self.units[ui].ref()
            frame.acquired.append(self.units[ui])
        where = self.modules.path(container) or "<root>"
        self.modules.say(f"merge:{where}",
                         f"zkern stage 3: ranks gathered different units ({what}); module '{where}' now gathers its "
                         f"{len(group)} unit(s) under '{prefix or '<root>'}' together on every rank "
                         f"({sum(self.units[i].bucket.padded for i in group)} elements), starting with this gather. "
                         f"To choose this yourself, list the module's class in zero_optimization.stage3_fetch_units",
                         self.comm.rank)

    def merge_for_backward(self, wanted: list[int], what: str) -> None:
        """Backward: every rank gathers the wanted units now. Units a forward merge already covers are gathered
        by their container's backward hook from the next pass on; any others, when every later backward begins."""
        container = {i: m for m, group in self.modules.merged.items() for i in group}
        later = [i for i in wanted if i not in container]
        self.modules.backward_set = sorted({*self.modules.backward_set, *later})
        for ui in wanted:
            u = self.units[ui]
            u.divergent = True
            self.gather_agreed(u)
            self.hold(u, container.get(ui, self.modules.root))  # a holder every rank names alike
        if later:
            self.modules.say(f"backward:{later}",
                             f"zkern stage 3: ranks' backward passes gathered different units ({what}); every rank "
                             f"now gathers {[self.units[i].name for i in later]} when backward begins", self.comm.rank)

    def gather_agreed(self, u: Unit) -> None:
        """Join the all-gather of u that every rank issues now: gather it, or, where it is whole already, gather
        into its own buffer."""
        if u.data is DataState.REST:
            self.gatherer.gather(u, async_op=False)
        else:
            u.lingering = False
            self.gatherer.regather(u, "parameters gathered to line ranks up")

    def siblings(self, wanted: list[int], prefix: str) -> bool:
        """Are the wanted units inside different children of one ModuleList or ModuleDict (experts[0],
        experts[1], ...)? Then the other children are the other choices a rank can make, and merging all of them
        now saves a divergence (and, outside verifying passes, a discarded step) per choice later."""
        container = self.modules.by_path.get(prefix)
        return len(wanted) > 1 and isinstance(container, (torch.nn.ModuleList, torch.nn.ModuleDict))

    def container_of(self, prefix: str, proper: bool) -> torch.nn.Module:
        """The deepest module that has a forward and contains `prefix` (strictly, when `proper`)."""
        best = self.modules.root
        for m in self.modules.modules:
            path = self.modules.path(m)
            if not path_under(prefix, path) or (proper and path == prefix):
                continue
            if type(m).forward is torch.nn.Module.forward:  # ModuleList, ModuleDict: never called
                continue
            if len(path) >= len(self.modules.path(best)):
                best = m
        return best

    def diverged(self, what: str, why: str) -> CommError:
        self.abort()
        return CommError(
            f"zkern rank {self.comm.rank} of {self.comm.world}: the ranks' stage-3 gathers diverged ({what}); "
            f"{why}. Nothing was gathered and no rank has stepped. Each rank must gather the same units in the same "
            f"order: make every rank run the same modules, or list the class of the module whose children are "
            f"chosen per rank (an MoE layer) in zero_optimization.stage3_fetch_units, so that it is gathered whole, "
            f"or leave stage3_merge_divergent_modules at true to let zkern do that when it sees the divergence")

    def agree_end(self, kind: TagKind) -> None:
        """At the end of every pass (several ranks): the rest of the record is issued, then the ranks agree that the
        pass ended. Passes that follow their record exchange this one tag per pass; a rank that departed from it
        is served here."""
        if self.comm.world == 1:
            return
        if not self.state.verify and not self.state.departed:
            self.gatherer.drain(self.state.phase)
        self.agree((kind, -1, -1), requester=None)
