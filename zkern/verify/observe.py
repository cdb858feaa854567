"""What a run reports of its engine besides losses and weights: a digest of the working parameters each rank
computes with, and where qwZ's int8 gathers put their quantization groups. runner.py and trainer_loop.py both
report them; check.py and single.py read them.

    python -m pytest tests/verify/test_verify.py -q
"""

from __future__ import annotations

import hashlib

import torch


def working_digest(engine) -> str:
    """A digest of the working parameters this rank holds whole (stages 0-2: all of them; stage 3: the persistent
    units): every rank computes with them, so every rank's must be the same after each step."""
    h = hashlib.sha256()
    for name, p in engine.module.named_parameters():
        if p.numel():
            h.update(name.encode())
            h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def quantized_units(engine) -> list:
    """qwZ's gathers, as the reference must redo them: per unit gathered through int8, its padded size and its
    parameters' (name, offset, numel) in its flat buffer. Every rank quantizes its own chunk (padded / world
    elements) in groups of zeropp_weight_group_size from the chunk's start, so where the groups fall is a fact of
    the layout, which the reference cannot know otherwise; the values in them are the reference's own. The
    persistent unit (parameters under stage3_param_persistence_threshold) is gathered exactly, as are units a
    GatheredParameters context pins."""
    rt = engine.runtime
    gatherer = getattr(rt, "gatherer", None)
    if gatherer is None or not gatherer.quantize_weights:
        return []
    names = {id(p): n for n, p in engine.module.named_parameters()}
    return [[u.bucket.padded, [[names[id(p)], gatherer.layout[id(p)][1], gatherer.layout[id(p)][0].numel()]
                                for p in u.plan.params]]
            for u in rt.units if not u.persistent]
