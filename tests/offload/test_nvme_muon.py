"""Muon with offload_optimizer.device "nvme": the master and AdamW's moments in files, Muon's momentum in the exp_avg
file (or in host memory with zero_optimization.save_muon_momentum_buffer_in_memory). It is the host-offload Muon's
arithmetic on values read from and written back to the files, so it must train as Muon with the optimizer in host
memory does, bit for bit, and hold the one-process torch.optim.Muon + AdamW bar through that. Checkpoints move between
NVMe, host and device Muon both ways.

    python -m pytest tests/offload/test_nvme_muon.py -q
"""

import dataclasses
import os

import pytest
import torch
from checkpoint_runs import assert_same_state, cross_resume, spec_for, train
from muon_runs import MUON_LR, muon_spec, reference

import zkern
from zkern import ops
from zkern.checkpoint import load_optimizer_state_dict
from zkern.errors import ConfigError
from zkern.testing import TrainSpec, assert_params_close, engine_run, spawn

pytestmark = pytest.mark.skipif(not ops.cpu_ext.available(), reason="needs the C++ extension (make setup)")

IN_MEMORY = {"save_muon_momentum_buffer_in_memory": True}


def on_nvme(spec: TrainSpec, path) -> TrainSpec:
    """The optimizer's states in files under path, tiles of 1000 elements, and stage 3's parameter shard there too
    where the spec offloads it."""
    zero = {**spec.zero, "sub_group_size": 1000,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(path), "buffer_count": 3}}
    if "offload_param" in spec.zero:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(path), "max_in_cpu": 2000}
    return dataclasses.replace(spec, zero=zero)

CASES = {
    # world 2, accumulation and clipping; stage 3 cuts matrices over both ranks (assembled each step)
    "stage1-fp32": dict(stage=1, accumulation=2, clip=0.5),
    "stage2-bf16": dict(stage=2, precision="bf16", accumulation=2, clip=0.5),
    "stage3-fp32-momentum-in-memory": dict(stage=3, clip=0.5, zero=IN_MEMORY),
    # the parameter shard in a file too, a frozen matrix (no Muon piece there)
    "stage3-bf16-params": dict(stage=3, precision="bf16", zero={"offload_param": {}}, model=dict(frozen=("fc",))),
}


def spec_of(name: str) -> TrainSpec:
    kwargs = dict(CASES[name])
    zero = kwargs.pop("zero", {})
    return dataclasses.replace(muon_spec(kwargs.pop("stage"), **kwargs), zero=zero)


def host_offload(spec: TrainSpec) -> TrainSpec:
    zero = {k: v for k, v in spec.zero.items() if k not in IN_MEMORY}
    zero["offload_optimizer"] = {"device": "cpu"}
    if "offload_param" in zero:
        zero["offload_param"] = {"device": "cpu"}
    return dataclasses.replace(spec, zero=zero)


def runs(rank, world, specs):
    return [engine_run(rank, world, s) for s in specs]


@pytest.mark.dist
def test_muon_on_nvme_trains_bit_for_bit_as_host_offload(tmp_path):
    names = list(CASES)
    nvme = [on_nvme(spec_of(n), tmp_path) for n in names]
    host = [host_offload(spec_of(n)) for n in names]
    per_rank = spawn(runs, 2, nvme + host, timeout=900)
    k = len(names)
    for i, name in enumerate(names):
        got, plain = per_rank[0][i], per_rank[0][k + i]
        assert got["global_steps"] == plain["global_steps"] == spec_of(name).steps, name
        assert got["losses"] == plain["losses"], name
        for key, value in plain["state"].items():
            assert torch.equal(got["state"][key], value), f"{name}: {key}"
        if spec_of(name).precision == "fp32":  # and so torch.optim.Muon + AdamW's training, to the Muon bar
            assert_params_close(got["state"], reference(spec_of(name), 2, exact=True), lr=MUON_LR,
                                steps=spec_of(name).steps)
        in_memory = "momentum-in-memory" in name
        for r in range(2):
            mem, host_mem = per_rank[r][i]["memory"], per_rank[r][k + i]["memory"]
            assert mem["host"]["master"] == 0, name
            master = host_mem["host"]["master"]
            assert master <= mem["nvme"]["master"] < master + 4096 * 2, name
            # host offload keeps the momentum (Muon pieces) and both moments (AdamW pieces) in memory; on NVMe only
            # the momentum, and only when asked
            held = mem["host"]["optimizer"]
            if in_memory:
                assert 0 < held < host_mem["host"]["optimizer"], name
            else:
                assert held == 0, name
            log = "\n".join(per_rank[r][i]["log"])
            assert r > 0 or ("Muon on NVMe" in log and ("Muon's momentum in host memory" in log) == in_memory), name
    assert os.listdir(tmp_path) == []


@pytest.mark.dist
def test_muon_checkpoints_cross_between_device_host_and_nvme(tmp_path):
    base = spec_for(2, stage=3, extra_config=muon_spec(3).extra_config)
    specs = {"device": base,
             "host": dataclasses.replace(base, zero={"offload_optimizer": {"device": "cpu"}}),
             "nvme": on_nvme(base, tmp_path / "files"),
             "nvme-in-memory": on_nvme(dataclasses.replace(base, zero=IN_MEMORY), tmp_path / "files")}
    out = spawn(cross_resume, 2, specs, str(tmp_path / "ckpt"), "device", False, timeout=900)[0]
    saved = {name: load_optimizer_state_dict(tmp_path / "ckpt" / name) for name in specs}
    for name in specs:  # the same state, whichever home it was saved from
        assert set(saved[name]["blocks.0.fc.weight"]) == {"momentum_buffer"}, name
        assert_same_state(saved[name], saved["device"], f"{name}: the saved optimizer state")
    for key, state in out.items():
        if key != "uninterrupted" and not key.endswith(" steps"):
            assert_params_close(state, out["uninterrupted"], lr=MUON_LR, steps=3)


def test_muon_momentum_lives_in_the_exp_avg_file(tmp_path):
    """After two steps the momentum of each Muon piece is in its exp_avg file (none of it in host memory), equal to
    what host offload keeps in memory; each AdamW piece's moments are in their two files; the second moment's file
    stays zero under the Muon pieces."""
    spec = dataclasses.replace(muon_spec(1), steps=2)
    engines = {}
    try:
        for name, s in (("host", host_offload(spec)), ("nvme", on_nvme(spec, tmp_path))):
            engines[name] = s.build_engine(s.make_model(), 1)
            train(engines[name], s, 0, 2, 0, 1)
        h, n = engines["host"].optimizer, engines["nvme"].optimizer
        assert type(n).__name__ == "NvmeMuon" and n.state_bytes() == 0
        muon = 0
        for hg, ng in zip(h.param_groups, n.param_groups):
            for hp, piece in zip(hg["params"], ng["params"]):
                assert piece.is_meta
                if hg["use_muon"]:
                    muon += 1
                    assert torch.equal(n.shard.read("momentum_buffer", piece), h.state[hp]["momentum_buffer"])
                    assert not n.shard.read("exp_avg_sq", piece).any()
                    assert "momentum_buffer" not in n.state.get(piece, {})
                else:
                    for state in ("exp_avg", "exp_avg_sq"):
                        assert torch.equal(n.shard.read(state, piece), h.state[hp][state])
        assert muon > 0
        # torch's state_dict reads the files; loading one writes them (here: host offload's, the same values)
        ours, theirs = n.state_dict(), h.state_dict()
        assert_same_state(ours["state"], theirs["state"], "NvmeMuon.state_dict")
        n.reset_state()  # as never stepped: zero momentum in the files, no AdamW state
        reset = n.state_dict()["state"]
        assert all(set(s) == {"momentum_buffer"} and not s["momentum_buffer"].any() for s in reset.values())
        n.load_state_dict(theirs)
        assert_same_state(n.state_dict()["state"], theirs["state"], "NvmeMuon.load_state_dict")
    finally:
        for engine in engines.values():
            engine.destroy()


def test_save_muon_momentum_buffer_in_memory_is_said_where_it_changes_nothing(caplog):
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon", "params": {"lr": 0.02}},
              "zero_optimization": {"stage": 1, **IN_MEMORY}}
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    with caplog.at_level("INFO", logger="zkern"):
        engine, *_ = zkern.initialize(model=model, config=config)
    try:
        assert "save_muon_momentum_buffer_in_memory: changes nothing here" in caplog.text
    finally:
        engine.destroy()
    with pytest.raises(ConfigError, match="save_muon_momentum_buffer_in_memory"):
        zkern.initialize(model=model, config={**config, "zero_optimization": {
            "stage": 1, "save_muon_momentum_buffer_in_memory": "yes"}})
