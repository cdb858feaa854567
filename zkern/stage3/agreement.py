"""Stage 3's agreement across ranks: in a verifying pass every gather is preceded by a tag exchange; when ranks would
gather different units (routed experts), the smallest module containing them all becomes one merged group that its
nearest running ancestor gathers on every rank (stage3_merge_divergent_modules), or a CommError names the ranks and
the units before any data moves.

    python -m pytest tests/stage3/test_stage3_moe.py -q

Functions of the module hooks (h: a hooks.Stage3Hooks), which call agree() before a verified gather.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from zkern.comm.divergence import TagKind, common_prefix, describe_mismatch, exchange_tags, path_under
from zkern.errors import CommError
from zkern.stage3.lifecycle import DataState, Unit

if TYPE_CHECKING:
    from zkern.stage3.hooks import Frame, Stage3Hooks


def agree(h: Stage3Hooks, tag: tuple[int, int, int], *, requester: Frame | None) -> None:
    """Exchange tags until every rank is about to do the same thing; resolve a divergence in between (each
    rank derives the same resolution from the same tags) or raise a CommError naming it."""
    while True:
        tags = exchange_tags(h.comm, tag, h.gatherer.device)
        if all(t == tags[0] for t in tags):
            return
        resolve(h, tags, requester, tag)
        if tag[0] == TagKind.GATHER and h.units[tag[1]].live:
            return  # the resolution gathered it


def resolve(h: Stage3Hooks, tags: list[tuple[int, int, int]], requester: Frame | None,
            mine: tuple[int, int, int]) -> None:
    end = TagKind.END_FORWARD if h.phase == "forward" else TagKind.END_BACKWARD
    wanted = sorted({t[1] for t in tags if t[0] == TagKind.GATHER})
    what = describe_mismatch(tags, [u.name for u in h.units], [h._path(m) for m in h.modules])
    if not wanted or any(t[0] not in (TagKind.GATHER, end) for t in tags):
        raise diverged(h, what, "no merge can line these up")
    if not h.verify:  # a pass that followed its record, and a rank left it: serve, no merge
        serve(h, wanted, mine[1] if mine[0] == TagKind.GATHER else None)
        return
    if not h.merge_divergent:
        raise diverged(h, what, "zero_optimization.stage3_merge_divergent_modules is false")
    if h.phase == "backward":
        merge_for_backward(h, wanted, what)
    else:
        merge_into_container(h, wanted, requester, what)
    h.needs_changed = True
    h.gatherer.verify_all = False  # found and merged: passes that follow their record need not verify


def serve(h: Stage3Hooks, wanted: list[int], own: int | None) -> None:
    """Every rank takes part in the all-gathers of the units some rank asked for, in unit order: the asker keeps
    its own (its _acquire uses it next), the others let theirs go. The next passes record afresh."""
    h.needs_changed = True
    for ui in wanted:
        u = h.units[ui]
        if ui == own:
            gather_agreed(h, u)
        else:
            h.gatherer.join(u, "parameters another rank asked for")


def merge_into_container(h: Stage3Hooks, wanted: list[int], requester: Frame | None, what: str) -> None:
    """Forward: the units under the deepest module containing every wanted unit become one group, gathered
    from now on by `container` (the nearest module that runs on every rank) and, in this pass, by the deepest
    open frame containing them."""
    prefix = common_prefix([h.units[i].name for i in wanted])
    group = list(wanted)
    if siblings(h, wanted, prefix):  # children of a ModuleList/ModuleDict chosen per rank: take them all
        group = [u.index for u in h.units if not u.persistent and path_under(u.name, prefix)]
    container = container_of(h, prefix, proper=len(wanted) == 1)
    frames = [f for f in h.frames if f is not requester and path_under(prefix, h._path(f.module))]
    frame = frames[-1] if frames else None
    tag = (TagKind.ATTACH, h._module_number(container), h._module_number(frame.module if frame else None))
    tags = exchange_tags(h.comm, tag, h.gatherer.device)
    if frame is None or any(t != tags[0] for t in tags):
        raise diverged(h, what, "the ranks are not inside one common module that could gather the merged "
                                "units")
    h.merged[container] = sorted({*h.merged.get(container, []), *group})
    if id(container) not in h._hooked:
        h._hooked_mid_call.add(id(container))
        h.hook_module(container)
    for ui in group:
        h.units[ui].divergent = True
    for ui in group:
        gather_agreed(h, h.units[ui])
        h.units[ui].ref()
        frame.acquired.append(h.units[ui])
    where = h._path(container) or "<root>"
    h._say(f"merge:{where}",
           f"zkern stage 3: ranks gathered different units ({what}); module '{where}'"
           f" now gathers its {len(group)} unit(s) under '{prefix or '<root>'}' together on every rank "
           f"({sum(h.units[i].bucket.padded for i in group)} elements), starting with this gather. To "
           f"choose this yourself, list the module's class in zero_optimization.stage3_fetch_units")


def merge_for_backward(h: Stage3Hooks, wanted: list[int], what: str) -> None:
    """Backward: every rank gathers the wanted units now. Units a forward merge already covers are gathered
    by their container's backward hook from the next pass on; any others, when every later backward begins."""
    container = {i: m for m, group in h.merged.items() for i in group}
    later = [i for i in wanted if i not in container]
    h.backward_set = sorted({*h.backward_set, *later})
    for ui in wanted:
        u = h.units[ui]
        u.divergent = True
        gather_agreed(h, u)
        h._hold(u, container.get(ui, h.root))  # a holder every rank names alike
    if later:
        h._say(f"backward:{later}", f"zkern stage 3: ranks' backward passes gathered different units ({what});"
                                    f" every rank now gathers {[h.units[i].name for i in later]} when "
                                    f"backward begins")


def gather_agreed(h: Stage3Hooks, u: Unit) -> None:
    """Join the all-gather of u that every rank issues now: gather it, or, where it is whole already, gather
    into its own buffer."""
    if u.data is DataState.REST:
        h.gatherer.gather(u, async_op=False)
    else:
        u.lingering = False
        h.gatherer.regather(u, "parameters gathered to line ranks up")


def siblings(h: Stage3Hooks, wanted: list[int], prefix: str) -> bool:
    """Are the wanted units inside different children of one ModuleList or ModuleDict (experts[0],
    experts[1], ...)? Then the other children are the other choices a rank can make, and merging all of them
    now saves a divergence (and, outside verifying passes, a discarded step) per choice later."""
    container = h.by_path.get(prefix)
    return len(wanted) > 1 and isinstance(container, (torch.nn.ModuleList, torch.nn.ModuleDict))


def container_of(h: Stage3Hooks, prefix: str, proper: bool) -> torch.nn.Module:
    """The deepest module that has a forward and contains `prefix` (strictly, when `proper`)."""
    best = h.root
    for m in h.modules:
        path = h._path(m)
        if not path_under(prefix, path) or (proper and path == prefix):
            continue
        if type(m).forward is torch.nn.Module.forward:  # ModuleList, ModuleDict: never called
            continue
        if len(path) >= len(h._path(best)):
            best = m
    return best


def diverged(h: Stage3Hooks, what: str, why: str) -> CommError:
    h.abort_pass()
    return CommError(
        f"zkern rank {h.comm.rank} of {h.comm.world}: the ranks' stage-3 gathers diverged ({what}); "
        f"{why}. Nothing was gathered and no rank has stepped. Each rank must gather the same units in the same "
        f"order: make every rank run the same modules, or list the class of the module whose children are "
        f"chosen per rank (an MoE layer) in zero_optimization.stage3_fetch_units, so that it is gathered whole, "
        f"or leave stage3_merge_divergent_modules at true to let zkern do that when it sees the divergence")


def agree_end(h: Stage3Hooks, kind: TagKind) -> None:
    """At the end of every pass (several ranks): the rest of the record is issued, then the ranks agree that the
    pass ended. Passes that follow their record exchange this one tag per pass; a rank that departed from it
    is served here."""
    if h.comm.world == 1:
        return
    if not h.verify and not h.departed:
        h.gatherer.drain(h.phase)
    agree(h, (kind, -1, -1), requester=None)
