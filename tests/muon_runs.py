"""Muon's test runs, shared by tests/optim/test_muon.py and tests/offload/test_nvme_muon.py: the config's Muon spec and
the one-process reference, torch.optim.Muon on the hidden matrices with torch.optim.AdamW on the rest."""

from __future__ import annotations

import torch
import torch.optim._muon as torch_muon

from zkern.testing import TrainSpec, global_batch

MUON_LR, ADAM_LR, STEPS = 2e-2, 1e-2, 4
PARAMS = {"lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": 0.9, "weight_decay": 0.01, "betas": [0.9, 0.99],
          "eps": 1e-8}


def muon_spec(stage: int, ns_method: str = "gram", **kwargs) -> TrainSpec:
    optimizer = {"type": "Muon", "params": {**PARAMS, "ns_method": ns_method}}
    return TrainSpec(stage=stage, steps=STEPS, reduce_bucket_size=3000, extra_config={"optimizer": optimizer},
                     **kwargs)


def hidden(name: str, p: torch.Tensor) -> bool:
    """DeepSpeed's use_muon rule, written out: matrices whose name names neither an embedding nor the LM head."""
    return p.ndim >= 2 and "embed" not in name and "lm_head" not in name


def _exact_newton_schulz(grad, coefficients, steps, eps):
    x = grad.double()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm().clamp(min=eps)
    a, b, c = coefficients
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if tall else x).float()


def reference(spec: TrainSpec, world: int, exact: bool, prepare=None) -> dict[str, torch.Tensor]:
    """One process, the whole global batch: torch.optim.Muon on the hidden matrices, torch.optim.AdamW on the rest,
    clip_grad_norm_ over both (exact: torch's Newton-Schulz in fp64 instead of bf16)."""
    model = spec.make_model()
    if prepare is not None:
        prepare(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    tagged = [(getattr(p, "use_muon", hidden(n, p)), p) for n, p in named]
    muon = torch.optim.Muon([p for m, p in tagged if m], lr=MUON_LR, weight_decay=PARAMS["weight_decay"],
                            momentum=PARAMS["momentum"], nesterov=True)
    adamw = torch.optim.AdamW([p for m, p in tagged if not m], lr=ADAM_LR, betas=tuple(PARAMS["betas"]),
                              eps=PARAMS["eps"], weight_decay=PARAMS["weight_decay"])
    saved = torch_muon._zeropower_via_newtonschulz
    if exact:
        torch_muon._zeropower_via_newtonschulz = _exact_newton_schulz
    try:
        batches = spec.batches(world)
        for step in range(spec.steps):
            muon.zero_grad()
            adamw.zero_grad()
            idx, tgt = global_batch(batches, step)
            spec.loss(model, idx, tgt, step).backward()
            if spec.clip > 0:
                torch.nn.utils.clip_grad_norm_([p for _, p in named], spec.clip)
            muon.step()
            adamw.step()
    finally:
        torch_muon._zeropower_via_newtonschulz = saved
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
