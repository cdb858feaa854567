"""Stage 3 fetch units: which parameters are gathered together, and which modules need which units.

    python -c "from zkern.stage3.units import plan_units; from zkern.testing import TinyGPT; \
               print([(u.name, len(u.params)) for u in plan_units(TinyGPT(), (), 100)[0]])"

A fetch unit is gathered with one all-gather and reduced with one reduce-scatter. By default each module that
owns parameters directly is a unit of its own parameters; `fetch_classes` (config stage3_fetch_units) makes
each outermost instance of those module classes one unit covering its whole subtree, and `fetch_names` /
`fetch_suffixes` (leaf_module.names / name_suffixes) do the same for the modules at those paths, and so does a module
flagged with set_z3_leaf_modules (DeepSpeed's flag, leaf_modules.py). A parameter shared by
several modules (tied weights) belongs to the first owner in named_modules() order, and every module that
holds it needs that unit. Units smaller than the persistence threshold are merged into one persistent unit
that stays gathered. plan_units and plan_reduce_groups are pure (they read the module tree and sizes); the
runtime records built on them are lifecycle.Unit and reduce.ReduceGroup.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from zkern.stage3.leaf_modules import z3_leaf_module
from zkern.stage3.sharded_init import full_shape


@dataclass
class UnitPlan:
    name: str  # module path of the unit root ("" for the root module, "<persistent>" for the merged unit)
    params: list[torch.nn.Parameter]
    names: list[str]
    persistent: bool = False
    numel: int = field(init=False)

    def __post_init__(self) -> None:
        self.numel = sum(full_shape(p).numel() for p in self.params)  # init_sharded parameters are empty at rest


def register_external_parameter(module: torch.nn.Module, param: torch.nn.Parameter) -> None:
    """Declare that `module`'s forward reads `param`, which another module owns (DeepSpeed's function of the
    same name). Stage 3 then gathers param's unit whenever module runs. zkern detects such reads by itself in
    its first step; declare the ones that first happen later (a branch taken in some steps only). Call it
    before creating the zkern.Engine."""
    if not isinstance(param, torch.nn.Parameter):
        raise TypeError(f"register_external_parameter takes a torch.nn.Parameter, got {type(param).__name__}")
    external = module.__dict__.setdefault("_zkern_external_params", [])
    if all(p is not param for p in external):
        external.append(param)


def declare_known_readers(model: torch.nn.Module) -> None:
    """Declare the reads of torch's own modules whose forward uses a child's parameters without running the child:
    nn.MultiheadAttention passes out_proj's weight and bias to F.multi_head_attention_forward, so out_proj's forward
    never runs (nn.TransformerEncoderLayer and nn.Transformer hold one)."""
    for m in model.modules():
        if isinstance(m, torch.nn.MultiheadAttention):
            for p in m.out_proj.parameters(recurse=False):
                register_external_parameter(m, p)


def _is_fetch_class(m: torch.nn.Module, fetch_classes: tuple[str, ...]) -> bool:
    """m is an instance of a class named in fetch_classes, or of a subclass of one (DeepSpeed's leaf modules match
    with isinstance)."""
    return any(c.__name__ in fetch_classes for c in type(m).__mro__)


def _named_roots(modules: dict[str, torch.nn.Module], names: tuple[str, ...], suffixes: tuple[str, ...]) -> set[str]:
    """The modules DeepSpeed's leaf_module.names (exact named_modules() paths) and name_suffixes (path endings) pick;
    one that picks nothing is an error naming the model's module paths."""
    missing = [n for n in names if n not in modules]
    missing += [s for s in suffixes if not any(m.endswith(s) for m in modules if m)]
    if missing:
        shown = sorted(m for m in modules if m)
        raise ValueError(f"zero_optimization.leaf_module names {missing}, which match no module of the model; its "
                         f"module paths (named_modules()) are {shown[:40]}{' ...' if len(shown) > 40 else ''}")
    return {m for m in modules if m in names or (m and any(m.endswith(s) for s in suffixes))}


def plan_units(model: torch.nn.Module, fetch_classes: tuple[str, ...], persistence_threshold: int,
               fetch_names: tuple[str, ...] = (), fetch_suffixes: tuple[str, ...] = ()
               ) -> tuple[list[UnitPlan], dict[torch.nn.Module, list[int]]]:
    """(units, needs): the fetch units in first-owner order (the persistent unit, if any, last), and for every
    module that must gather something before it runs, the indices of the non-persistent units it needs.
    fetch_names / fetch_suffixes pick unit roots by module path, as fetch_classes does by class."""
    modules = dict(model.named_modules())
    present = {c.__name__ for m in modules.values() for c in type(m).__mro__}  # a base class names its subclasses
    missing = [c for c in fetch_classes if c not in present]
    if missing:
        raise ValueError(f"zero_optimization.stage3_fetch_units names module classes {missing} that the model does "
                         f"not contain; its classes are {sorted(present)}")
    named = _named_roots(modules, fetch_names, fetch_suffixes)
    owner: dict[int, str] = {}  # id(param) -> name of its first owning module
    pname: dict[int, str] = {}
    for mname, m in modules.items():
        for pn, p in m.named_parameters(recurse=False):
            if id(p) not in owner:
                owner[id(p)] = mname
                pname[id(p)] = f"{mname}.{pn}" if mname else pn
    # Unit roots: outermost instances of the fetch classes; every other owner module is a root of its own.
    roots: list[str] = []
    for mname, m in modules.items():
        picked = _is_fetch_class(m, fetch_classes) or mname in named or z3_leaf_module(m)
        if picked and not any(_inside(mname, r) for r in roots):
            roots.append(mname)
    root_of: dict[int, str] = {}
    for pid, mname in owner.items():
        coarse = [r for r in roots if _inside(mname, r)]
        root_of[pid] = coarse[0] if coarse else mname
    by_root: dict[str, list[torch.nn.Parameter]] = {}
    for p in model.parameters():  # registration order, tied parameters once
        by_root.setdefault(root_of[id(p)], []).append(p)
    units, small = [], []
    for rname, params in by_root.items():
        plan = UnitPlan(rname, params, [pname[id(p)] for p in params])
        (small if plan.numel < persistence_threshold else units).append(plan)
    if small:
        units.append(UnitPlan("<persistent>", [p for u in small for p in u.params],
                              [n for u in small for n in u.names], persistent=True))
    unit_of = {id(p): i for i, u in enumerate(units) for p in u.params}
    needs: dict[torch.nn.Module, list[int]] = {}
    for mname, m in modules.items():
        own = [*m.parameters(recurse=False), *m.__dict__.get("_zkern_external_params", ())]
        missing = [p for p in own if id(p) not in unit_of]
        if missing:
            raise ValueError(f"register_external_parameter: module '{mname}' names a parameter of shape "
                             f"{tuple(missing[0].shape)} that is not in the model")
        wanted = [unit_of[id(p)] for p in own]
        if mname in roots:
            wanted += [unit_of[id(p)] for p in m.parameters()]
        wanted = sorted({u for u in wanted if not units[u].persistent})
        if wanted:
            needs[m] = wanted
    return units, needs


def _inside(name: str, root: str) -> bool:
    """Is module `name` the module `root` or inside it?"""
    return root == "" or name == root or name.startswith(root + ".")


def plan_reduce_groups(padded: list[int], trainable: list[bool], bucket_numel: int) -> list[list[int]]:
    """Unit indices reduced together: consecutive trainable units up to bucket_numel elements a group (a larger
    unit alone). A unit with nothing to train ends a group: its chunk would break the group's contiguous shard
    range."""
    groups: list[list[int]] = []
    current: list[int] = []
    for i, (size, train) in enumerate(zip(padded, trainable)):
        if not train:
            if current:
                groups.append(current)
            current = []
            continue
        if current and sum(padded[j] for j in current) + size > bucket_numel:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups
