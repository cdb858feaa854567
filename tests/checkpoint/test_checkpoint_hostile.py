"""A hostile or damaged directory: every rank raises zkern.CheckpointError, promptly, within bounded memory, and the
engine is unchanged. Special files under a checkpoint's names (a symlink to /dev/zero, a FIFO), JSON nested past
any limit, manifests whose fields are missing or of the wrong type (re-signed, so only validation can catch them),
optimizer param groups that try to set keys the optimizer does not have, and a Hugging Face index that points
outside its directory.

    python -m pytest tests/checkpoint/test_checkpoint_hostile.py -q
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch
from checkpoint_runs import build, spec_for, train

from zkern.checkpoint import CheckpointError
from zkern.checkpoint.manifest import manifest_bytes
from zkern.testing.ranks import spawn


def _edit(manifest_path: str, edit) -> None:
    with open(manifest_path) as f:
        outer = json.load(f)
    edit(outer["manifest"])
    with open(manifest_path, "wb") as f:
        f.write(manifest_bytes(outer["manifest"]))  # correctly signed: the lie is in the content


def _set(path: list, value):
    def edit(body):
        node = body
        for key in path[:-1]:
            node = node[key]
        if value is _DELETE:
            del node[path[-1]]
        else:
            node[path[-1]] = value
    return edit


_DELETE = object()

# name -> (how the tag directory is damaged, the words the error must contain)
DAMAGE = {
    "manifest is /dev/zero": (lambda d: _replace_with_symlink(d, "manifest.json", "/dev/zero"), "not a regular file"),
    "manifest is a FIFO": (lambda d: _replace_with_fifo(d, "manifest.json"), "not a regular file"),
    "manifest nested 100000 deep": (lambda d: _write(d, "manifest.json", "[" * 100000 + "]" * 100000),
                                    "nests deeper"),
    "global_steps missing": (lambda d: _edit(os.path.join(d, "manifest.json"),
                                             _set(["state", "counters", "global_steps"], _DELETE)), "global_steps"),
    "loss_scaler of the wrong type": (lambda d: _edit(os.path.join(d, "manifest.json"),
                                                      _set(["state", "loss_scaler"], "big")), "loss_scaler"),
    "a scale as text": (lambda d: _edit(os.path.join(d, "manifest.json"),
                                        _set(["state", "loss_scaler", "state", "scale"], "1e9")), "scale"),
    "a generator state that does not decode": (lambda d: _edit(os.path.join(d, "manifest.json"),
                                                               _set(["rank_state", "rank1", "generators", "cpu"],
                                                                    "not base64!")), "generator"),
    "rank_state of the wrong type": (lambda d: _edit(os.path.join(d, "manifest.json"), _set(["rank_state"], [1])),
                                     "rank_state"),
    "aliases to numbers": (lambda d: _edit(os.path.join(d, "manifest.json"), _set(["aliases"], {"a": 3})),
                           "aliases"),
    "param group lr as text": (lambda d: _edit(os.path.join(d, "manifest.json"),
                                               _set(["optimizer", "param_groups", 0, "lr"], "0.1; import os")),
                               "param_groups"),
    "scheduler state that does not fit": (lambda d: _edit(os.path.join(d, "manifest.json"),
                                                          _set(["state", "lr_scheduler", "state"], {"evil": [1]})),
                                          "does not fit"),
    "a rank file that is a FIFO": (lambda d: _replace_with_fifo(d, "rank00000.safetensors"), "rank00000.safetensors"),
    # a KeyError once the weights had been applied, before the manifest's structure checks knew the key
    "client_state missing": (lambda d: _edit(os.path.join(d, "manifest.json"), _set(["client_state"], _DELETE)),
                             "client_state"),
}


def _write(directory: str, name: str, text: str) -> None:
    with open(os.path.join(directory, name), "w") as f:
        f.write(text)


def _replace_with_symlink(directory: str, name: str, target: str) -> None:
    os.unlink(os.path.join(directory, name))
    os.symlink(target, os.path.join(directory, name))


def _replace_with_fifo(directory: str, name: str) -> None:
    os.unlink(os.path.join(directory, name))
    os.mkfifo(os.path.join(directory, name))


SCHEDULED = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4}}}


def hostile_worker(rank: int, world: int, root: str, cases: list[str]) -> dict:
    spec = spec_for(world, stage=2, extra_config=SCHEDULED)
    engine = build(spec, world)
    train(engine, spec, 0, 2, rank, world)
    base = os.path.join(root, "base")
    engine.save_checkpoint(base)
    train(engine, spec, 2, 3, rank, world)
    before = engine.full_state_dict()
    out = {}
    for case in cases:
        directory = os.path.join(root, case.replace(" ", "_"))
        if rank == 0:
            shutil.copytree(base, directory, symlinks=True)
            DAMAGE[case][0](os.path.join(directory, "global_step2"))
        torch.distributed.barrier()
        start = time.monotonic()
        try:
            engine.load_checkpoint(directory)
            out[case] = ("loaded", None)
        except CheckpointError as e:
            out[case] = ("CheckpointError", str(e))
        except Exception as e:  # any other kind is a failure of the test
            out[case] = (type(e).__name__, str(e))
        out[case] += (time.monotonic() - start,)
        after = engine.full_state_dict()
        assert all(torch.equal(after[k], v) for k, v in before.items()), f"{case}: the engine changed"
    return out


@pytest.mark.dist
def test_a_hostile_directory_is_a_checkpoint_error_on_every_rank_promptly(tmp_path):
    results = spawn(hostile_worker, 2, str(tmp_path), sorted(DAMAGE), timeout=300)
    for rank, out in enumerate(results):
        for case, (kind, message, seconds) in out.items():
            assert kind == "CheckpointError", f"rank {rank}, {case}: {kind}: {message}"
            assert DAMAGE[case][1] in message, f"rank {rank}, {case}: {message}"
            assert seconds < 30, f"rank {rank}, {case}: took {seconds:.0f} s"


def test_latest_as_a_fifo_or_a_device_is_refused_without_blocking(tmp_path):
    spec = spec_for(1, stage=1)
    engine = build(spec, 1)
    train(engine, spec, 0, 1, 0, 1)
    engine.save_checkpoint(tmp_path)
    for make in (lambda p: os.mkfifo(p), lambda p: os.symlink("/dev/zero", p)):
        os.unlink(tmp_path / "latest")
        make(tmp_path / "latest")
        start = time.monotonic()
        with pytest.raises(CheckpointError, match="not a regular file"):
            engine.load_checkpoint(tmp_path)
        assert time.monotonic() - start < 10


def test_saved_param_group_keys_are_not_planted_in_the_optimizer(tmp_path):
    """A checkpoint's param groups may set the hyper-parameters the live optimizer has, never 'params' or new keys."""
    spec = spec_for(1, stage=1)
    engine = build(spec, 1)
    train(engine, spec, 0, 1, 0, 1)
    path = engine.save_checkpoint(tmp_path)
    _edit(os.path.join(path, "manifest.json"), lambda body: body["optimizer"]["param_groups"][0].update(
        {"params": [1, 2], "planted": "x", "lr": 0.25}))
    fresh = build(spec, 1)
    pieces = list(fresh.optimizer.param_groups[0]["params"])
    fresh.load_checkpoint(tmp_path)
    group = fresh.optimizer.param_groups[0]
    assert group["lr"] == 0.25 and "planted" not in group and group["params"] == pieces


def test_a_hf_index_pointing_outside_its_directory_is_refused(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    import zkern

    model_dir, other = tmp_path / "model", tmp_path / "other"
    config = GPT2Config(vocab_size=67, n_positions=16, n_embd=32, n_layer=1, n_head=2)
    GPT2LMHeadModel(config).save_pretrained(other)
    config.save_pretrained(model_dir)
    names = list(json.loads((other / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (other / "model.safetensors").read_bytes()[:8], "little")]))
    index = {"metadata": {}, "weight_map": {n: "../other/model.safetensors" for n in names if n != "__metadata__"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = {"train_batch_size": 1, "device": "cpu", "optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 3}}
    with pytest.raises(CheckpointError, match="refusing to read outside"):
        zkern.hf.from_pretrained(GPT2LMHeadModel, model_dir, cfg)
    (model_dir / "model.safetensors.index.json").write_text("[" * 50000 + "]" * 50000)
    with pytest.raises(CheckpointError, match="nests deeper"):
        zkern.hf.from_pretrained(GPT2LMHeadModel, model_dir, cfg)


def test_a_missing_tag_never_loads_another_tags_moved_aside_copy(tmp_path):
    """A save of tag "a-b" killed between its two renames leaves ".old-a-b-<nonce>": loadable as "a-b", never as "a"
    (it was found by prefix, so load_checkpoint(tag="a") loaded another run's weights without a word)."""
    spec = spec_for(1, stage=1)
    engine = build(spec, 1)
    train(engine, spec, 0, 1, 0, 1)
    engine.save_checkpoint(str(tmp_path), tag="a-b")
    os.rename(tmp_path / "a-b", tmp_path / ".old-a-b-x7q2")
    fresh = build(spec, 1)
    before = fresh.full_state_dict()
    assert fresh.load_checkpoint(str(tmp_path), tag="a") == (None, None)
    assert all(torch.equal(v, fresh.full_state_dict()[k]) for k, v in before.items())
    path, _ = fresh.load_checkpoint(str(tmp_path), tag="a-b")
    assert path.endswith(".old-a-b-x7q2")
