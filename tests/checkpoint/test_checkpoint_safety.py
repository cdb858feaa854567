"""Checkpoints that cannot hurt: a damaged file is an error naming it before any state changes, nothing in a
checkpoint is ever executed, a save killed at any moment leaves `latest` loadable at the step its tag names, and
consolidation's memory stays bounded.

    python -m pytest tests/checkpoint/test_checkpoint_safety.py -q
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from checkpoint_runs import V2, build, spec_for, train, v2_spec

from zkern.checkpoint import CheckpointError, consolidate, inspect, load_fp32_state_dict
from zkern.checkpoint.manifest import manifest_bytes

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)  # the shared helpers (checkpoint_runs.py)


def engine_state(engine) -> dict:
    return {"weights": engine.full_state_dict(), "exp_avg": [t.clone() for t in engine.optimizer.exp_avg],
            "exp_avg_sq": [t.clone() for t in engine.optimizer.exp_avg_sq],
            "steps": [list(s) for s in engine.optimizer.steps], "global_steps": engine.global_steps,
            "working": _working(engine)}


def _working(engine) -> dict:
    """The working-dtype weights by parameter name (derived from the masters on load, as a step derives them)."""
    values = engine.runtime.full_working()
    return {name: values[id(p)].clone() for name, p in zip(engine.runtime.names, engine.runtime.params)}


def assert_state_equal(a: dict, b: dict) -> None:
    assert a["global_steps"] == b["global_steps"] and a["steps"] == b["steps"]
    for key in ("exp_avg", "exp_avg_sq"):
        assert all(torch.equal(x, y) for x, y in zip(a[key], b[key])), key
    for key in ("weights", "working"):
        assert a[key].keys() == b[key].keys() and all(torch.equal(a[key][k], b[key][k]) for k in a[key]), key


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An engine trained 3 steps past a checkpoint saved at step 2 (so a load would change it)."""
    root = tmp_path_factory.mktemp("corrupt")
    spec = spec_for(1, stage=2)
    engine = build(spec, 1)
    train(engine, spec, 0, 2, 0, 1)
    engine.save_checkpoint(root / "base")
    train(engine, spec, 2, 5, 0, 1)
    return engine, root


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _flip_weight(path) -> None:
    """A byte inside a master weight's values (every reader of weights must notice)."""
    from zkern.checkpoint.tensorfile import read_header

    info = next(t for key, t in read_header(str(path))[0].items() if key.startswith("master:"))
    _flip(path, (info.begin + info.end) // 2)


def _manifest_edit(path, edit) -> None:
    outer = json.loads(path.read_bytes())
    edit(outer["manifest"])
    path.write_bytes(manifest_bytes(outer["manifest"]))  # a well-formed manifest that lies


def _shape_lie(body):
    body["params"]["tok.weight"]["shape"] = [67, 33]


def _huge_lie(body):
    body["params"]["tok.weight"]["shape"] = [10**12, 10**4]  # a 40 PB tensor: must not be allocated


CORRUPTIONS = {
    "flipped data byte": ("rank00000.safetensors", _flip_weight, "sha256"),
    "flipped header byte": ("rank00000.safetensors", lambda p: _flip(p, 12), "rank00000.safetensors"),
    "truncated file": ("rank00000.safetensors", lambda p: os.truncate(p, p.stat().st_size // 2), "truncated"),
    "deleted file": ("rank00000.safetensors", os.unlink, "missing"),
    "manifest with a wrong shape": ("manifest.json", lambda p: _manifest_edit(p, _shape_lie), "shape"),
    "manifest with a huge shape": ("manifest.json", lambda p: _manifest_edit(p, _huge_lie), "tok.weight"),
    "manifest edited by hand": ("manifest.json", lambda p: p.write_text(p.read_text().replace('"stage": 2',
                                                                                            '"stage": 1')),
                                "sha256 does not match"),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_a_damaged_checkpoint_is_an_error_naming_the_file_and_changes_nothing(saved, case):
    engine, root = saved
    file, damage, message = CORRUPTIONS[case]
    copy = root / case.replace(" ", "_")
    shutil.copytree(root / "base", copy)
    damage(copy / "global_step2" / file)
    before = engine_state(engine)
    with pytest.raises(CheckpointError, match=message) as error:
        engine.load_checkpoint(copy)
    assert file in str(error.value) or "tok.weight" in str(error.value)
    assert_state_equal(engine_state(engine), before)
    with pytest.raises(CheckpointError):
        load_fp32_state_dict(copy)
    with pytest.raises(CheckpointError):
        consolidate(copy, root / f"{case}_out")


@pytest.mark.parametrize("case", ["flipped data byte", "flipped header byte", "truncated file"])
def test_inspect_finds_every_damaged_byte_of_a_rank_file(saved, case):
    """`inspect` re-hashes a rank file as its header's checksum plus every tensor's, which together cover each byte:
    a byte flipped in the data or in the header, or a cut, is reported against the file."""
    _, root = saved
    copy = root / f"inspect_{case.replace(' ', '_')}"
    shutil.copytree(root / "base", copy)
    assert "checksums: all hold" in "\n".join(inspect(copy))
    file, damage, _ = CORRUPTIONS[case]
    damage(copy / "global_step2" / file)
    report = "\n".join(inspect(copy))
    assert "checksums: FAILED" in report and file in report, report


def test_a_version_1_checkpoint_with_whole_file_checksums_still_loads_and_verifies(tmp_path):
    """Version 1 manifests hold each file's whole sha256 instead of its header's: they load as before, and
    `inspect` checks the whole-file checksum (a flipped byte is found). Made from the version-2 checkpoint in
    tests/data (versions 1 and 2 differ in the checksums only)."""
    from zkern.checkpoint.tensorfile import file_sha256

    copy = tmp_path / "v1"
    shutil.copytree(V2, copy)
    tag = copy / "global_step3"

    def as_version_1(body):
        assert body["version"] == 2
        body["version"] = 1
        for name, info in body["files"].items():
            del info["header_sha256"]
            info["sha256"] = file_sha256(str(tag / name))

    _manifest_edit(tag / "manifest.json", as_version_1)
    fresh = build(v2_spec(), 1)
    fresh.load_checkpoint(copy)
    reference = build(v2_spec(), 1)
    reference.load_checkpoint(V2)
    assert_state_equal(engine_state(fresh), engine_state(reference))
    assert "checksums: all hold" in "\n".join(inspect(copy))
    _flip_weight(tag / "rank00000.safetensors")
    assert "rank00000.safetensors sha256 differs" in "\n".join(inspect(copy))


class _Marker:
    """Unpickling this writes a file: if it ever exists, a checkpoint ran code."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_no_file_of_a_checkpoint_is_ever_unpickled(saved, tmp_path):
    engine, root = saved
    marker = tmp_path / "code_ran"
    payload = pickle.dumps(_Marker(str(marker)))
    buffer = tmp_path / "torch_save.pt"
    torch.save({"x": _Marker(str(marker))}, buffer)
    for name in ("latest", "global_step2/manifest.json", "global_step2/rank00000.safetensors"):
        for content in (payload, buffer.read_bytes()):
            copy = tmp_path / f"pickled_{name.replace('/', '_')}_{len(content)}"
            shutil.copytree(root / "base", copy)
            (copy / name).write_bytes(content)
            with pytest.raises(CheckpointError):
                engine.load_checkpoint(copy)
            with pytest.raises(CheckpointError):
                load_fp32_state_dict(copy)
            inspect(copy)
            assert not marker.exists(), f"loading a checkpoint whose {name} is a pickle ran its code"


KILL_SPEC = {"stage": 1, "model": {"vocab": 2048, "dim": 128, "seq": 16}}


def kill_child(directory: str) -> None:
    """Resume from `latest` if there is one, then train and save every step until killed."""
    spec = spec_for(1, **KILL_SPEC)
    engine = build(spec, 1)
    engine.load_checkpoint(directory)
    print("ready", engine.global_steps, flush=True)
    while True:
        train(engine, spec, engine.global_steps, engine.global_steps + 1, 0, 1)
        engine.save_checkpoint(directory)


def test_a_save_killed_at_any_moment_leaves_latest_loadable_at_its_step(tmp_path):
    directory = tmp_path / "ckpt"
    spec = spec_for(1, **KILL_SPEC)
    reference = build(spec, 1)
    expected = {0: engine_state(reference)}
    # Step 0 saved first, so a kill that lands before the first child's first save (a loaded machine starts the
    # child slowly) still leaves a checkpoint to resume, as every later kill does.
    reference.save_checkpoint(directory)
    rng = random.Random(1234)
    code = (f"import sys; sys.path[:0] = [{HERE!r}, {TESTS!r}]; from test_checkpoint_safety import kill_child; "
            f"kill_child({str(directory)!r})")
    mid_save, steps_seen = 0, []
    for attempt in range(20):
        left_over = _temporaries(directory)  # what earlier kills left (the child's next save sweeps them)
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 env={**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads())}, text=True)
        line = child.stdout.readline()
        assert line.startswith("ready"), f"the saving child did not start: {line!r}"
        if attempt % 2:  # between or inside saves, wherever a random moment falls
            time.sleep(rng.uniform(0.0, 0.6))
        else:  # provably inside a save: once its temporary directory exists, at a random point of the writing
            deadline = time.monotonic() + 60
            while not _temporaries(directory) - left_over:
                assert time.monotonic() < deadline, "the child never started a save"
                time.sleep(0.0005)
            time.sleep(rng.uniform(0.0, 0.002))
        child.send_signal(signal.SIGKILL)
        child.wait()
        mid_save += any(p.name.startswith(".tmp-") for p in directory.iterdir())
        engine = build(spec, 1)
        path, _ = engine.load_checkpoint(directory)
        assert path is not None and os.path.basename(path) == f"global_step{engine.global_steps}"
        while reference.global_steps < engine.global_steps:
            train(reference, spec, reference.global_steps, reference.global_steps + 1, 0, 1)
            expected[reference.global_steps] = engine_state(reference)
        assert_state_equal(engine_state(engine), expected[engine.global_steps])
        steps_seen.append(engine.global_steps)
    # The kills landed inside saves (a temporary directory was left behind) as well as between them.
    assert mid_save >= 5, f"only {mid_save} of 20 kills interrupted a save"
    assert steps_seen[-1] > steps_seen[0], steps_seen


def _temporaries(directory) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.startswith(".tmp-")} if directory.exists() else set()


def test_consolidating_a_1gb_checkpoint_stays_under_5_percent_of_its_size(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(3072, 3072, bias=False) for _ in range(10)])
    import zkern

    engine = zkern.Engine(model, {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
                                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "steps_per_print": 0})
    engine.backward(engine(torch.randn(2, 3072)).pow(2).mean())
    engine.step()
    path = engine.save_checkpoint(tmp_path / "ckpt")
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert size > 1 << 30
    expected = engine.full_state_dict()
    del engine, model
    # VmHWM, the peak resident set of this process's own memory (ru_maxrss would carry over the forking parent's
    # peak across exec).
    code = ("import sys; from zkern.checkpoint.__main__ import main; "
            f"rc = main(['consolidate', {str(tmp_path / 'ckpt')!r}, {str(tmp_path / 'out')!r}]); "
            "hwm = next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmHWM')); "
            "print(hwm * 1024, 'torch' in sys.modules); sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    peak, torch_imported = run.stdout.split()[-2:]
    print(f"consolidation of a {size / 2**30:.2f} GiB checkpoint: peak RSS {int(peak) / 2**20:.1f} MiB "
          f"({int(peak) / size:.1%}), torch imported: {torch_imported}")
    assert int(peak) < 0.05 * size
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "model.safetensors", "pt") as f:
        for name in expected:
            assert torch.equal(f.get_tensor(name), expected[name]), name


def test_a_zero_element_tensor_is_stored_and_the_next_one_follows(tmp_path):
    """A model may hold an empty buffer: it is a header entry with no bytes, and the tensors after it keep their
    order and bytes (safetensors' own reader agrees)."""
    from safetensors.torch import load_file

    from zkern.checkpoint.ranges import byte_view
    from zkern.checkpoint.tensorfile import StreamWriter

    tensors = {"empty": torch.zeros(0), "after": torch.arange(5, dtype=torch.float32)}
    path = str(tmp_path / "t.safetensors")
    writer = StreamWriter(path, [(k, "F32", tuple(t.shape)) for k, t in tensors.items()], {})
    for k, t in tensors.items():
        writer.begin(k)
        writer.write(byte_view(t))
    writer.close()
    back = load_file(path)
    assert back["empty"].numel() == 0 and torch.equal(back["after"], tensors["after"])
