"""Nothing torch would not do: the aten operations zkern dispatches in a training step's forward, backward and
optimizer step, counted by a dispatch mode, against plain torch doing the same arithmetic on the same model (bf16
weights where zkern trains in bf16), at stages 0-3. The forward runs exactly torch's operations (at stage 3 plus
one copy per unit gathered: at world 1 the all-gather is that copy); every operation zkern adds in backward and in
the step is named here with why it is there and how many there are; no host synchronisation in forward or backward,
and one in the step (the control exchange's read). Views, allocations and profiler marks move no data and are not
counted. A planted extra copy or `.item()` fails it.

    python -m pytest tests/engine/test_ops_and_syncs.py -q
"""

from __future__ import annotations

import collections
import contextlib
import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import zkern
from zkern.testing import TinyGPT

# Operations that move no data: views and metadata, allocations (an allocation is not an operation on data; what
# zkern allocates is measured by the memory suite), profiler marks.
QUIET = {"view", "slice", "_unsafe_view", "as_strided", "t", "transpose", "expand", "detach", "alias", "lift_fresh",
         "unsqueeze", "squeeze", "reshape", "select", "split", "permute", "split_with_sizes", "unbind", "narrow",
         "empty", "empty_like", "empty_strided", "set_", "_record_function_enter_new", "_record_function_exit"}
SYNCS = {"_local_scalar_dense", "is_nonzero", "equal", "item"}  # a host read of a device value


class Counted(TorchDispatchMode):
    """Every operation dispatched while it is on: (name, the zkern call site that issued it)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in QUIET:
            sites = [f"{f.filename.rsplit('/zkern/', 1)[-1]}:{f.name}" for f in traceback.extract_stack()
                     if "/zkern/" in f.filename and "/testing/" not in f.filename]
            self.ops[(name, sites[-1] if sites else "model")] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def counting_syncs(box: list):
    """Tensor.tolist reads the host copy without dispatching anything: counted here."""
    original = torch.Tensor.tolist

    def tolist(self):
        box.append("tolist")
        return original(self)
    torch.Tensor.tolist = tolist
    try:
        yield
    finally:
        torch.Tensor.tolist = original


def by_name(ops: collections.Counter) -> collections.Counter:
    out = collections.Counter()
    for (name, _), n in ops.items():
        out[name] += n
    return out


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyGPT(vocab=67, dim=32, n_layer=2, n_head=2, seq=16)


def phases(stage: int, precision: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "device": "cpu", "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = zkern.Engine(model(), cfg)
    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # past the first steps' recording and verifying passes
        engine.backward(engine(ids, ids))
        engine.step()
    out = {}
    gathers = sum(engine.runtime.gather_counts().values()) if stage == 3 else 0
    for phase in ("forward", "backward", "step"):
        mode, syncs = Counted(), []
        with counting_syncs(syncs), mode:
            match phase:
                case "forward":
                    loss = engine(ids, ids)
                case "backward":
                    engine.backward(loss)
                case "step":
                    engine.step()
        out[phase] = (mode.ops, syncs + [n for (n, _), k in mode.ops.items() for _ in range(k) if n in SYNCS])
        if stage == 3 and phase != "step":
            now = sum(engine.runtime.gather_counts().values())
            out[f"{phase} gathers"], gathers = now - gathers, now
    out["params"] = sum(1 for p in engine.module.parameters() if p.requires_grad)
    if stage == 2:
        layout = engine.runtime.groups[0].layout
        out["buckets"] = len(layout.buckets)
        out["gaps"] = sum(1 for i in range(1, len(layout.offsets))
                          if layout.bucket_of(i).first != i
                          and layout.offsets[i] > layout.offsets[i - 1] + layout.numels[i - 1])
        out["gaps"] += sum(1 for b in layout.buckets if b.padded > layout.offsets[b.last - 1] - b.offset
                           + layout.numels[b.last - 1])
    if stage == 3:
        out["groups"] = len(engine.runtime.reducer.groups)
    engine.destroy()
    return out


def torch_phases(precision: str) -> dict:
    m = model()
    if precision == "bf16":
        m = m.to(torch.bfloat16)
    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(0))
    mode = Counted()
    with mode:
        loss = m(ids, ids)
    forward = by_name(mode.ops)
    mode = Counted()
    with mode:
        loss.backward()
    return {"forward": forward, "backward": by_name(mode.ops)}


def extra_backward(stage: int, got: dict) -> dict[str, tuple[int, str]]:
    """Per operation: how many more than torch's backward zkern runs, and why."""
    p = got["params"]
    match stage:
        case 0 | 1:
            return {"add_": (p, "each gradient accumulates into its view of the flat gradient buffer (DDP's "
                                "gradient_as_bucket_view does the same); torch's first backward takes it as it is"),
                    "zero_": (1, "the flat gradient buffer comes back zeroed at a step's first backward (between "
                                 "steps its memory is free, as zero_grad(set_to_none=True) frees torch's)")}
        case 2:
            return {"copy_": (p + got["buckets"], "each gradient into its bucket (contiguous_gradients), and each "
                                                  "bucket's reduced chunk into the gradient shard"),
                    "zero_": (1 + got["gaps"], "the gradient shard comes back zeroed at a step's first backward; the "
                                               "padding between and after the parameters in each bucket is zeroed")}
        case 3:
            groups = got["groups"]
            return {"copy_": (got["backward gathers"] + p + groups,
                              "each unit gathered for backward (at world 1 the all-gather is a copy), each gradient "
                              "into its reduction buffer's sections, each reduced section into the gradient shard"),
                    "zero_": (1 + groups, "the gradient shard comes back zeroed at a step's first backward; each "
                                          "reduction buffer starts zeroed (its padding, and parameters without a "
                                          "gradient, reduce as zero)")}
    raise ValueError(stage)


# The step's operations by call site, how many on this model (one gradient segment of one piece), and why (the CPU
# Adam itself runs in zkern's C++ extension and dispatches nothing):
STEP_SITES = {
    "engine/stepping.py:optimizer_step": (7, "the step's control vector: the overflow flag and squared norm (two "
                                             "zeros, two additions over the gradient segments), cast and concatenated "
                                             "with the gather signature and the parameters that got gradients, for "
                                             "one all-reduce"),
    "reference.py:unscale_and_check_": (17, "ops.unscale_and_check_: one pass over the gradient shard for the squared "
                                            "norm (fp32 partials) and the overflow flag (each piece's extremes, "
                                            "their finiteness); a bf16 shard's piece is read as fp32 (one cast more)"),
    "reference.py:_squares": (2, "the squared norm's partial sum: a product and a sum"),
}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zkern_runs_torchs_operations_and_names_every_other(stage, precision):
    got, ref = phases(stage, precision), torch_phases(precision)
    forward = by_name(got["forward"][0])
    if stage == 3:  # one copy per unit gathered (world 1: the all-gather is a copy of the rank's whole chunk)
        assert forward["copy_"] - ref["forward"]["copy_"] == got["forward gathers"] > 0
        forward["copy_"] -= got["forward gathers"]
    assert +forward == +ref["forward"], f"forward: zkern-only {dict(forward - ref['forward'])}, torch-only " \
                                        f"{dict(ref['forward'] - forward)}"
    backward = by_name(got["backward"][0])
    for op, (count, why) in extra_backward(stage, got).items():
        assert backward[op] - ref["backward"][op] == count, (op, backward[op], ref["backward"][op], count, why)
        backward[op] = ref["backward"][op]
    assert +backward == +ref["backward"], f"backward: unnamed zkern-only {dict(backward - ref['backward'])}, " \
                                          f"torch-only {dict(ref['backward'] - backward)}"
    unnamed = {site for _, site in got["step"][0] if site not in STEP_SITES}
    assert not unnamed, f"the step ran operations from {sorted(unnamed)}, which this test does not name"
    per_site = collections.Counter()
    for (_, site), n in got["step"][0].items():
        per_site[site] += n
    for site, (count, why) in STEP_SITES.items():
        count += precision == "bf16" and site == "reference.py:unscale_and_check_"
        assert per_site[site] == count, f"the step's operations at {site} ({why}): {per_site[site]}, not {count}"
    assert got["forward"][1] == [] and got["backward"][1] == [], (got["forward"][1], got["backward"][1])
    assert got["step"][1] == ["tolist"], f"the step synchronised the host {got['step'][1]}: one read expected"


def test_a_planted_copy_or_host_read_fails_it(monkeypatch):
    from zkern.engine import stepping

    real = stepping.ops.unscale_and_check_

    def planted(segment, inv):
        found, sq = real(segment.clone(), inv)  # an extra copy of the gradient shard
        sq.item()  # and a host read
        return found, sq
    monkeypatch.setattr(stepping.ops, "unscale_and_check_", planted)
    with pytest.raises(AssertionError, match="step"):
        test_zkern_runs_torchs_operations_and_names_every_other(1, "fp32")
