"""Muon's parameter groups: which parameters Muon trains (DeepSpeed's `use_muon` flag), and each optimizer group split
into its Muon half and its AdamW half before the runtime lays the shards out (so a shard group is one or the other).

    python -m pytest tests/optim/test_muon.py -q

A parameter's own `use_muon` attribute decides where it is set; where it is absent zkern sets it as
deepspeed.initialize does: True for a tensor of two or more dimensions whose name holds neither "embed" nor
"lm_head" (the hidden matrices), False otherwise. Each group keeps its own overrides in both halves (lr and
weight_decay; betas and eps only reach the AdamW half), the Muon half under the config's muon_lr unless the group
sets lr.
"""

from __future__ import annotations

import torch

from zkern.config import Config

_NOT_HIDDEN = ("embed", "lm_head")


def wanted(cfg: Config) -> bool:
    """The config's optimizer is Muon."""
    return cfg.optimizer is not None and cfg.optimizer.type == "muon"


def tag(model: torch.nn.Module) -> None:
    """Set `use_muon` on every parameter that lacks it (DeepSpeed's rule); ValueError for a tag Muon cannot honour."""
    for name, p in model.named_parameters():
        ndim = len(getattr(p, "ds_shape", p.shape))  # a stage-3 parameter at rest is empty: its full shape
        if not hasattr(p, "use_muon"):
            p.use_muon = ndim >= 2 and not any(k in name.lower() for k in _NOT_HIDDEN)
        elif p.use_muon and ndim < 2:
            raise ValueError(f"parameter '{name}' has use_muon = True and shape {tuple(p.shape)}; Muon orthogonalizes "
                             f"matrices (2 or more dimensions): set its use_muon to False to train it with AdamW")


def split(model: torch.nn.Module, groups: list[list[torch.nn.Parameter]], requested: list[dict] | None
          ) -> tuple[list[list[torch.nn.Parameter]], list[dict]]:
    """Each group as its Muon half then its AdamW half (an empty half left out), with the requested group's options
    and "use_muon" in each half's dict."""
    tag(model)
    out_groups, out_requested = [], []
    for gi, params in enumerate(groups):
        options = {k: v for k, v in (requested[gi] if requested else {}).items() if k != "params"}
        for muon in (True, False):
            half = [p for p in params if bool(p.use_muon) is muon]
            if half:
                out_groups.append(half)
                out_requested.append({**options, "params": half, "use_muon": muon})
    return out_groups, out_requested


def optimizer_groups(cfg: Config, pieces: list[list[torch.Tensor]], requested: list[dict]) -> list[dict]:
    """ShardMuon's param groups over the shard pieces: the config's Muon or AdamW options, under each group's own."""
    o = cfg.optimizer.params
    out = []
    for group_pieces, req in zip(pieces, requested):
        if req["use_muon"]:
            g = {"lr": o["muon_lr"], "momentum": o["momentum"], "weight_decay": o["weight_decay"],
                 "nesterov": o["nesterov"], "ns_method": o["ns_method"], "ns_steps": o["ns_steps"]}
            g.update({k: req[k] for k in ("lr", "weight_decay") if k in req})
        else:
            g = {"lr": o["adam_lr"], "betas": tuple(o["betas"]), "eps": o["eps"], "weight_decay": o["weight_decay"]}
            g.update({k: tuple(req[k]) if k == "betas" else req[k]
                      for k in ("lr", "betas", "eps", "weight_decay") if k in req})
        out.append({"params": group_pieces, "use_muon": req["use_muon"], **g})
    return out
