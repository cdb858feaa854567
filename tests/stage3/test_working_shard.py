"""Stage 3 keeps no 16-bit working shard beside its fp32 master: each gather casts this rank's chunk from the master
into the gather's own slot (as FSDP2 does), so between steps a rank holds 12 bytes a parameter over N (master and
Adam's two moments), not 14 (tests/core/test_memory_measured.py walks the live tensors for it).
zero_optimization.stage3_keep_working_shard keeps the shard; both train to the bit.

    python -m pytest tests/stage3/test_working_shard.py -q
"""

import pytest
import torch

import zkern
from zkern.testing import TinyGPT, spawn

VOCAB, SEQ = 97, 16


def _config(precision: str, keep: bool, zero: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 0.5,
            precision: {"enabled": True}, "device": "cpu", "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.1}},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 4096,
                                  "stage3_keep_working_shard": keep, **zero}}


def _model() -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, dim=32, n_layer=2, n_head=2, seq=SEQ)
    # frozen parameters share units with trained ones (a LoRA-like mix): their values stay in the working dtype
    model.blocks[0].ln1.weight.requires_grad_(False)
    with torch.no_grad():
        model.blocks[0].ln1.weight.uniform_(0.5, 1.5)  # values a 16-bit dtype rounds
    return model


def _train(rank, world, precision, keep, zero, steps, save=None, load=None):
    engine = zkern.Engine(_model(), _config(precision, keep, zero))
    if load is not None:
        engine.load_checkpoint(load)
    losses = []
    for step in range(steps):
        if step == 1:  # a modifier rank's write: into the master (and the working shard where one is kept)
            ln = engine.module.blocks[1].ln2.weight
            with zkern.GatheredParameters([ln], modifier_rank=0):
                if rank == 0:
                    ln.data.fill_(0.75)
        for micro in range(2):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank + (100 if load else 0))
            idx = torch.randint(0, VOCAB, (2, SEQ), generator=g)
            loss = engine(idx, idx)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    if save is not None:
        engine.save_checkpoint(save)
    out = {"losses": losses, "fp32": engine.full_state_dict(rank0_only=True),
           "working": engine.full_working_state_dict(rank0_only=True),
           "ds_tensor": {n: (p.ds_tensor.device.type, p.ds_tensor.dtype, p.ds_tensor.numel())
                         for n, p in engine.module.named_parameters()},
           "params_bytes": engine.memory_report()["cpu"]["params"]}
    engine.destroy()
    return out


def _same(a: dict, b: dict) -> None:
    assert a["losses"] == b["losses"]
    for key in ("fp32", "working"):
        assert a[key].keys() == b[key].keys()
        for name, value in a[key].items():
            assert value.dtype == b[key][name].dtype and torch.equal(value, b[key][name]), (key, name)


@pytest.mark.dist
@pytest.mark.parametrize("precision,world,zero", [
    ("bf16", 2, {}),
    ("fp16", 2, {"zero_quantized_weights": True}),  # qwZ quantizes the cast values, as it did the working shard's
    ("bf16", 4, {"zero_hpz_partition_size": 2}),  # hpZ's secondary copies come from the gathered buffers
], ids=["bf16", "fp16-qwz", "bf16-hpz"])
def test_gathers_cast_from_the_master_train_as_the_working_shard_did(precision, world, zero):
    cast = spawn(_train, world, precision, False, zero, 3)
    kept = spawn(_train, world, precision, True, zero, 3)
    for c, k in zip(cast, kept):
        assert c["losses"] == k["losses"]
        assert c["params_bytes"] == 0 < k["params_bytes"]  # no working shard unless asked for
        for name, (device, dtype, numel) in c["ds_tensor"].items():  # DeepSpeed's partition: its length, no bytes
            assert (device, dtype) == ("meta", torch.float16 if precision == "fp16" else torch.bfloat16)
            assert numel == k["ds_tensor"][name][2] and k["ds_tensor"][name][0] == "cpu", name
    _same(cast[0], kept[0])
    frozen = cast[0]["fp32"]["blocks.0.ln1.weight"]  # a frozen weight holds its working-dtype value everywhere
    assert torch.equal(frozen, frozen.to(torch.bfloat16 if precision == "bf16" else torch.float16).float())


@pytest.mark.dist
@pytest.mark.parametrize("saver_keeps", [False, True], ids=["saved-cast", "saved-kept"])
def test_a_checkpoint_moves_between_the_two_without_a_difference(tmp_path, saver_keeps):
    path = str(tmp_path / "ckpt")
    spawn(_train, 2, "bf16", saver_keeps, {}, 2, path)
    same = spawn(_train, 2, "bf16", saver_keeps, {}, 2, None, path)
    other = spawn(_train, 2, "bf16", not saver_keeps, {}, 2, None, path)
    _same(same[0], other[0])
