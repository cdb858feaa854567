"""ZeRO-Infinity in the engine: offload_optimizer.device "nvme" (stages 1-3) and offload_param.device "nvme" (stage
3) train exactly as host-memory offload does (the same arithmetic, the states and the parameter shard in files
instead of host memory), world 2; checkpoints cross between the two both ways; parameter chunks are read ahead of
their gathers; a directory zkern cannot write to is an error naming it before any step, and a file changed behind
zkern's back refuses the step whole (the parameter file: the gather that reads it)."""

import dataclasses
import os
import subprocess
import sys

import pytest
import torch
from checkpoint_runs import SCHEDULER, cross_resume, spec_for

import zkern
from zkern import ops
from zkern.checkpoint import load_optimizer_state_dict
from zkern.testing import TrainSpec, assert_params_close, engine_run, reference_run, spawn

pytestmark = pytest.mark.skipif(not ops.cpu_ext.available(), reason="needs the C++ extension (make setup)")

SMALL_TILES = {"sub_group_size": 1000}  # many tiles per region, tiles that cross chunk and piece boundaries


def host(spec: TrainSpec) -> TrainSpec:
    """The same run with every offload in host memory."""
    zero = {k: v for k, v in spec.zero.items() if k not in ("offload_optimizer", "offload_param", "sub_group_size")}
    zero["offload_optimizer"] = {"device": "cpu"}
    if "offload_param" in spec.zero:
        zero["offload_param"] = {"device": "cpu"}
    return dataclasses.replace(spec, zero=zero)


def on_nvme(spec: TrainSpec, path, optimizer: bool = True) -> TrainSpec:
    """The optimizer's states (optimizer=True; else in host memory) on NVMe, and stage 3's parameter shard too
    where the spec offloads it, with a host cache of 2000 elements and two reads ahead of 3000 elements at most:
    chunks leave the cache and are read again every pass."""
    zero = {**spec.zero, **SMALL_TILES,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(path), "buffer_count": 3} if optimizer
            else {"device": "cpu"}}
    if "offload_param" in spec.zero:
        zero["offload_param"] = {"device": "nvme", "nvme_path": str(path), "max_in_cpu": 2000, "buffer_count": 2,
                                 "buffer_size": 3000}
    return dataclasses.replace(spec, zero=zero)


CASES = {
    # sometimes-unused parameters, unused in the first step: pieces that skip steps (their tiles are not read);
    # two param groups (decay / no decay) through model_parameters: one region per group at stages 1-2
    "stage1-groups": TrainSpec(stage=1, steps=4, model=dict(extra_branch=True), extra_every=2, extra_phase=1,
                               config_groups=True, reduce_bucket_size=5000),
    "stage2-bf16-groups-accum-clip": TrainSpec(stage=2, steps=4, precision="bf16", accumulation=2, clip=0.05,
                                               config_groups=True, reduce_bucket_size=5000),
    # one region for the whole shard; a frozen layer's master lies between trainable chunks
    "stage3-bf16-groups-frozen": TrainSpec(stage=3, steps=4, precision="bf16", config_groups=True,
                                           model=dict(reuse_first_block=True, frozen=("fc",))),
    # the parameter shard on NVMe too (and with the optimizer in host memory, below); unused parameters
    "stage3-params": TrainSpec(stage=3, steps=4, zero={"offload_param": {}}, model=dict(extra_branch=True),
                               extra_every=2, extra_phase=1),
    "stage3-bf16-params-frozen": TrainSpec(stage=3, steps=4, precision="bf16", zero={"offload_param": {}},
                                           model=dict(frozen=("fc",))),
}
PARAMS_ONLY = "stage3-params-only"  # stage3-params with the optimizer in host memory


def engine_runs(rank, world, specs):
    return [engine_run(rank, world, s) for s in specs]


@pytest.mark.dist
def test_nvme_offload_trains_bit_for_bit_as_host_offload(tmp_path):
    cases = {**CASES, PARAMS_ONLY: CASES["stage3-params"]}
    names = list(cases)
    specs = [on_nvme(cases[n], tmp_path, optimizer=n != PARAMS_ONLY) for n in names] + \
        [host(cases[n]) for n in names]
    per_rank = spawn(engine_runs, 2, specs)
    k = len(names)
    for i, name in enumerate(names):
        nvme, plain = per_rank[0][i], per_rank[0][k + i]
        assert nvme["global_steps"] == plain["global_steps"] == 4, name
        assert nvme["losses"] == plain["losses"], name
        for key, value in plain["state"].items():
            assert torch.equal(nvme["state"][key], value), f"{name}: {key}"
        spec = cases[name]
        if spec.precision == "fp32":  # and, like host offload, single-process torch AdamW's training
            ref_state, _ = reference_run(spec, 2)
            assert_params_close(nvme["state"], ref_state, lr=spec.lr, steps=spec.steps)
        for r in range(2):
            mem, host_mem = per_rank[r][i]["memory"], per_rank[r][k + i]["memory"]
            if "offload_param" in spec.zero:  # the file holds the shard (4 KiB-padded); the cache 2000 elements
                width = 2 if spec.precision == "bf16" else 4
                shard = host_mem["host"]["params"]
                assert shard <= mem["nvme"]["params"] < shard + 4096 and mem["host"]["params"] <= 2000 * width, name
            if name == PARAMS_ONLY:
                continue
            # nothing of the master or the moments stays in host memory; the files hold them, padded per region
            # to whole 4 KiB blocks, and the tile buffers are buffer_count x 3 states x one tile
            assert mem["host"]["master"] == mem["host"]["optimizer"] == 0, name
            master = host_mem["host"]["master"]
            assert master <= mem["nvme"]["master"] < master + 4096 * 2, name
            assert mem["nvme"]["optimizer"] == 2 * mem["nvme"]["master"], name
            assert mem["host"]["nvme_buffers"] == 3 * 3 * 4 * 1024, name
            log = "\n".join(per_rank[r][i]["log"])
            assert "zkern NVMe: master and Adam moments in" in log or r > 0, name
    assert os.listdir(tmp_path) == []  # engine.destroy() removed each rank's own directory under nvme_path


@pytest.mark.dist
@pytest.mark.parametrize("stage, precision, zero, model", [
    (2, "fp32", {}, {}),
    # the parameter file too, with a frozen layer: its shard is saved from and loaded into the file
    (3, "bf16", {"offload_param": {}}, {"frozen": ("fc",)}),
])
def test_checkpoints_cross_between_host_and_nvme_offload_both_ways(tmp_path, stage, precision, zero, model):
    base = spec_for(2, stage=stage, precision=precision, config_groups=True, reduce_bucket_size=500, zero=zero,
                    model=model, extra_config=SCHEDULER)  # the warm-up's lr, read live by each tile, resumes too
    specs = {"cpu": host(base), "nvme": on_nvme(base, tmp_path / "nvme")}
    out = spawn(cross_resume, 2, specs, str(tmp_path / "ckpt"))[0]
    for key in ("cpu->cpu", "cpu->nvme", "nvme->cpu", "nvme->nvme"):
        assert out[f"{key} steps"] == 6, key
        for name, value in out["uninterrupted"].items():
            assert torch.equal(out[key][name], value), f"{key}: {name}"
    # what the NVMe engine wrote equals what the host engine wrote: the optimizer states read back from its files
    for suffix in ("", "-async"):
        a = load_optimizer_state_dict(str(tmp_path / "ckpt" / f"cpu{suffix}"))
        b = load_optimizer_state_dict(str(tmp_path / "ckpt" / f"nvme{suffix}"))
        assert sorted(a) == sorted(b)
        for name in a:
            assert a[name]["step"] == b[name]["step"] == 3
            for state in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(a[name][state], b[name][state]), (suffix, name, state)


# -- errors ------------------------------------------------------------------------------------------------------
def _config(path, **zero):
    return {"train_micro_batch_size_per_gpu": 2, "device": "cpu",
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2, **SMALL_TILES,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": str(path)}, **zero}}


def _model():
    torch.manual_seed(0)
    return zkern.testing.TinyGPT(vocab=67, dim=32, n_layer=1, n_head=2, seq=16)


def _step(engine, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 67, (2, 16), generator=g)
    engine.backward(engine(idx, idx))
    engine.step()


def test_a_directory_zkern_cannot_write_is_an_error_naming_it_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OSError, match=rf"cannot create the optimizer directory {blocker}/zkern-optimizer-rank0"):
        zkern.Engine(_model(), _config(blocker))
    locked = tmp_path / "read-only"
    locked.mkdir()
    if os.geteuid() == 0:  # root writes through permission bits; an immutable directory stops it too
        subprocess.run(["chattr", "+i", str(locked)], check=True)
    else:
        locked.chmod(0o555)
    try:
        with pytest.raises(OSError, match=rf"cannot create the optimizer directory {locked}/zkern-optimizer-rank0"):
            zkern.Engine(_model(), _config(locked))
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(locked)], check=True)
        else:
            locked.chmod(0o755)


FULL_DISK = """
import resource, signal, sys, torch, zkern, zkern.testing
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing us
resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 10, 16 << 10))  # files of 16 KiB at most: a full disk
torch.manual_seed(0)
model = zkern.testing.TinyGPT(vocab=67, dim=32, n_layer=1, n_head=2, seq=16)
config = {"train_micro_batch_size_per_gpu": 2, "device": "cpu", "optimizer": {"type": "AdamW"},
          "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": sys.argv[1]}}}
try:
    zkern.Engine(model, config)
except OSError as e:
    print("OSError", e)
"""


def test_a_full_disk_is_an_error_naming_the_file_when_the_engine_is_built(tmp_path):
    out = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert "OSError" in out.stdout and "cannot reserve" in out.stdout and str(tmp_path) in out.stdout, \
        out.stdout + out.stderr


def test_a_state_file_changed_behind_zkern_refuses_the_step_before_any_change(tmp_path):
    engine = zkern.Engine(_model(), _config(tmp_path))
    _step(engine, 0)
    before = engine.full_state_dict()
    (victim,) = [os.path.join(root, f) for root, _, files in os.walk(tmp_path) for f in files
                 if f == "exp_avg_sq-0.bin"]
    os.truncate(victim, 4096)
    with pytest.raises(OSError, match=rf"{victim} changed under zkern"):
        _step(engine, 1)
    after = engine.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and engine.global_steps == 1


def test_gathered_parameters_writes_reach_the_master_on_disk(tmp_path):
    """Stage 3: a GatheredParameters(modifier_rank=0) write goes into the master and the parameter shard in the
    files (the master only where it changed), and training goes on from it exactly as with host offload."""
    results = []
    nvme = {"device": "nvme", "nvme_path": str(tmp_path)}
    for offload in ({"device": "cpu"}, nvme):
        cfg = _config(tmp_path, stage=3, offload_optimizer=offload, offload_param=offload,
                      stage3_param_persistence_threshold=10)
        cfg["bf16"] = {"enabled": True}
        model = _model()
        engine = zkern.Engine(model, cfg)
        _step(engine, 0)
        with zkern.GatheredParameters([model.head.weight], modifier_rank=0), torch.no_grad():
            model.head.weight[:3].fill_(0.25)
        after_write = engine.full_state_dict()
        _step(engine, 1)
        results.append((after_write, engine.full_state_dict()))
        engine.destroy()
    (host_write, host_end), (nvme_write, nvme_end) = results
    assert torch.equal(nvme_write["head.weight"][:3], torch.full_like(nvme_write["head.weight"][:3], 0.25))
    for key in host_end:
        assert torch.equal(nvme_write[key], host_write[key]) and torch.equal(nvme_end[key], host_end[key]), key


def test_parameter_chunks_are_read_ahead_of_their_gathers(tmp_path):
    """With no host cache (max_in_cpu 0) every gather needs its chunk from disk: after the first pass records the
    order, the gatherer's prefetch starts those reads ahead, and the gathers find them under way."""
    cfg = _config(tmp_path, stage=3, offload_optimizer={"device": "cpu"}, stage3_param_persistence_threshold=10,
                  stage3_prefetch_bucket_size=3000,
                  offload_param={"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0})
    engine = zkern.Engine(_model(), cfg)
    store = engine.runtime.param_store
    for seed in range(3):
        _step(engine, seed)
    assert store.ahead_hits > store.reads / 3 and store.cached == 0, (store.ahead_hits, store.reads)
    (params,) = [os.path.join(root, f) for root, _, files in os.walk(tmp_path) for f in files if f == "params.bin"]
    os.truncate(params, 4096)  # a parameter file shortened behind zkern's back: the next gather names it
    with pytest.raises(OSError, match=rf"{params} reached the end of the file"):
        _step(engine, 4)
    engine.destroy()
    assert os.listdir(tmp_path) == []


def test_nvme_config_needs_zkerns_adam_and_a_path_and_reads_the_aio_section():
    with pytest.raises(zkern.ConfigError, match="nvme_path' is required"):
        zkern.Config.load({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme"}}})
    with pytest.raises(zkern.ConfigError, match="buffer_count' must be >= 3"):
        zkern.Config.load({"zero_optimization": {"stage": 1, "offload_optimizer": {
            "device": "nvme", "nvme_path": "/tmp", "buffer_count": 2}}})
    with pytest.raises(zkern.ConfigError, match="offload_param.nvme_path' is required"):
        zkern.Config.load({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                                 "offload_param": {"device": "nvme"}}})
    aio = zkern.Config.load({"aio": {"intra_op_parallelism": 3, "block_size": 65536, "single_submit": True}}).aio
    assert (aio.thread_count, aio.block_size, aio.queue_depth, aio.single_submit) == (3, 65536, 8, True)
    with pytest.raises(zkern.ConfigError, match="'aio.block_size' must be a multiple of 4096"):
        zkern.Config.load({"aio": {"block_size": 1000}})  # failed with EINVAL inside a step before
    with pytest.raises(zkern.ConfigError, match="same setting under DeepSpeed's old and new names"):
        zkern.Config.load({"aio": {"thread_count": 2, "intra_op_parallelism": 4}})
    with pytest.raises(zkern.ConfigError, match="'aio.use_gds' = true asks for GPUDirect Storage"):
        zkern.Config.load({"aio": {"use_gds": True}})
    model = _model()
    cfg = _config("/tmp")
    del cfg["optimizer"]
    with pytest.raises(zkern.ConfigError, match="steps zkern's own Adam/AdamW"):
        zkern.Engine(model, cfg, optimizer=torch.optim.AdamW(model.parameters()))
