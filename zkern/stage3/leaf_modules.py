"""DeepSpeed's ZeRO-3 leaf-module flags (deepspeed.utils.set_z3_leaf_modules): a module flagged as a leaf is one fetch
unit with its whole subtree, gathered before it runs, so a mixture-of-experts block whose experts are chosen per rank
gathers the same parameters on every rank. LLaMA-Factory and others flag their MoE blocks this way.

    zkern.set_z3_leaf_modules(model, [MixtralSparseMoeBlock])   # before zkern.Engine(model, config)

The flag is DeepSpeed's own attribute (`module._z3_leaf`), so modules flagged by DeepSpeed's function are leaves on
zkern too; the config's zero_optimization.leaf_module and stage3_fetch_units pick units the same way.

    python -m pytest tests/hf/test_framework_flows.py -q
"""

from __future__ import annotations

import torch

FLAG = "_z3_leaf"  # DeepSpeed's attribute name


def _matches(module: torch.nn.Module, wanted: type | str) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    cls = type(module)
    return wanted in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _flag(model: torch.nn.Module, classes, flag: bool, raise_if_not_found: bool) -> list[torch.nn.Module]:
    if isinstance(classes, (type, str)) or not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf module classes are a list of module types or class names, got {classes!r}")
    found = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    if not found and raise_if_not_found:
        present = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(f"no module of the classes {list(classes)} in the model; its classes are {present}")
    for m in found:
        setattr(m, FLAG, flag)
    return found


def set_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True
                        ) -> list[torch.nn.Module]:
    """Flag every module that is an instance of one of leaf_module_classes (types, or class names, plain or
    module-qualified) as a stage-3 leaf; returns the flagged modules."""
    return _flag(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: torch.nn.Module, leaf_module_classes, raise_if_not_found: bool = True
                          ) -> list[torch.nn.Module]:
    """Clear the flag set_z3_leaf_modules set."""
    return _flag(model, leaf_module_classes, False, raise_if_not_found)


def z3_leaf_module(module: torch.nn.Module) -> bool:
    """Whether module is flagged as a leaf."""
    return getattr(module, FLAG, False) is True


def get_z3_leaf_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The flagged modules of model, in modules() order."""
    return [m for m in model.modules() if z3_leaf_module(m)]
