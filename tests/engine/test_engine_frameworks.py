"""What the frameworks built on DeepSpeed call on its engine and parameters, on zkern: engines without an optimizer
(TRL's and OpenRLHF's reference and teacher models, Accelerate's eval models), the `ds_*` attributes of stage-3
parameters, the engine standing for its module, the config read as a dict.

    python -m pytest tests/engine/test_engine_frameworks.py -q
"""

import pytest
import torch

import zkern
from zkern.testing import TinyGPT, spawn


def _config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "device": "cpu",
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}, **extra}


def _reference_worker(rank, world, stage):
    """A reference engine (no optimizer) beside a training engine in one process: its logits equal the unsharded
    model's before and after the training engine steps; it refuses to train."""
    torch.manual_seed(0)
    plain = TinyGPT()
    ref_model, train_model = TinyGPT(), TinyGPT()
    ref_model.load_state_dict(plain.state_dict())
    train_model.load_state_dict(plain.state_dict())
    reference = zkern.Engine(ref_model, _config(stage))
    trainer = zkern.Engine(train_model, _config(stage, optimizer={"type": "AdamW", "params": {"lr": 1e-2}}))
    idx = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(rank))
    out = {}
    with torch.no_grad():
        out["before"] = (reference(idx) - plain(idx)).abs().max().item()
    trainer.backward(trainer(idx, idx))
    trainer.step()
    with torch.no_grad():
        out["after"] = (reference(idx) - plain(idx)).abs().max().item()
    out["trainer_moved"] = (trainer.full_state_dict()["blocks.0.fc.weight"]
                            - plain.state_dict()["blocks.0.fc.weight"]).abs().max().item()
    try:
        reference.backward(reference(idx, idx))
        out["backward"] = None
    except RuntimeError as e:
        out["backward"] = str(e)
    memory = reference.memory_report()["cpu"]
    out["optimizer"], out["master"] = memory["optimizer"], memory["master"]
    out["frozen"] = all(not p.requires_grad for p in ref_model.parameters())
    out["optimizer_attr"] = reference.optimizer
    try:
        reference.save_checkpoint("/nonexistent")
        out["save"] = None
    except zkern.CheckpointError as e:
        out["save"] = str(e)
    reference.destroy()
    trainer.destroy()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_engine_without_an_optimizer_runs_forward_beside_a_training_one(stage):
    for r in spawn(_reference_worker, 2, stage):
        assert r["before"] == 0.0 and r["after"] == 0.0, r  # fp32, the same arithmetic: equal
        assert r["trainer_moved"] > 0
        assert r["backward"] is not None and "built without an optimizer" in r["backward"]
        assert r["optimizer"] == 0 and r["master"] == 0 and r["frozen"] and r["optimizer_attr"] is None
        assert r["save"] is not None and "no optimizer" in r["save"]


def test_initialize_without_an_optimizer_returns_none_for_it():
    engine, optimizer, loader, scheduler = zkern.initialize(model=TinyGPT(), config=_config(0))
    assert optimizer is None and loader is None and scheduler is None
    with pytest.raises(zkern.ConfigError, match="an lr_scheduler was given but no optimizer"):
        zkern.Engine(TinyGPT(), _config(0), lr_scheduler=lambda opt: None)


def _ds_attributes_worker(rank, world, import_deepspeed):
    if import_deepspeed:  # as a framework does before building the engine
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    else:
        from zkern.stage3.ds_attributes import ZeroParamStatus
    model = TinyGPT()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    engine = zkern.Engine(model, _config(3, optimizer={"type": "AdamW"}))
    params = dict(engine.module.named_parameters())
    out = {"ids": sorted(p.ds_id for p in params.values()),
           "shapes": {n: tuple(p.ds_shape) for n, p in params.items()},
           "numels": {n: p.ds_numel for n, p in params.items()},
           "partition": {n: p.ds_tensor.numel() for n, p in params.items()},
           "at_rest": {n: p.ds_status == ZeroParamStatus.NOT_AVAILABLE for n, p in params.items()}}
    seen = {}
    hook = engine.module.blocks[0].fc.register_forward_pre_hook(  # after the engine's own pre-hook gathered it
        lambda m, args: seen.update(inside=m.weight.ds_status == ZeroParamStatus.AVAILABLE))
    engine(torch.randint(0, 67, (2, 16)))
    hook.remove()
    out["inside_forward"] = seen["inside"]
    with zkern.GatheredParameters([params["blocks.0.fc.weight"]]):
        out["gathered"] = params["blocks.0.fc.weight"].ds_status == ZeroParamStatus.AVAILABLE
    out["after"] = params["blocks.0.fc.weight"].ds_status == ZeroParamStatus.NOT_AVAILABLE
    out["expected_shapes"] = shapes
    engine.destroy()
    return out


@pytest.mark.dist
@pytest.mark.parametrize("import_deepspeed", [False, True])
def test_stage3_parameters_carry_deepspeeds_attributes(import_deepspeed):
    if import_deepspeed:
        pytest.importorskip("deepspeed")
    results = spawn(_ds_attributes_worker, 2, import_deepspeed)
    for r in results:
        assert r["ids"] == list(range(len(r["ids"])))
        assert r["shapes"] == r["expected_shapes"]
        assert all(r["numels"][n] == torch.Size(s).numel() for n, s in r["expected_shapes"].items())
        assert all(r["at_rest"].values()) and r["inside_forward"] and r["gathered"] and r["after"]
    # every element of every parameter is in exactly one rank's partition
    for name, shape in results[0]["expected_shapes"].items():
        assert sum(r["partition"][name] for r in results) == torch.Size(shape).numel(), name


def test_the_engine_stands_for_its_module_and_reads_as_deepspeeds():
    class WithMethod(TinyGPT):
        config_class = "TinyConfig"

        def describe(self) -> str:
            return "a model method"

    engine = zkern.Engine(WithMethod(), _config(2, optimizer={"type": "AdamW"}))
    assert engine.describe() == "a model method" and engine.config_class == "TinyConfig"
    assert engine.zero_optimization_stage() == 2
    assert engine.config["zero_optimization"]["stage"] == 2 and "bf16" in engine.config
    assert engine.config.get("train_micro_batch_size_per_gpu") == 2
    with pytest.raises(AttributeError):
        _ = engine.no_such_attribute



def _stream_worker(rank, world, stage, precision, zero, bucket_bytes):
    from zkern.testing import allocation_peak

    torch.manual_seed(0)
    model = TinyGPT(vocab=67, dim=64, n_layer=4, n_head=4, seq=16)
    cfg = _config(stage, optimizer={"type": "AdamW", "params": {"lr": 1e-2}},
                  zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0, **zero})
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    engine = zkern.Engine(model, cfg)
    idx = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(idx, idx))
    engine.step()
    whole = engine.full_working_state_dict()
    buckets = []

    def consume():
        for bucket in engine.stream_full_weights(bucket_bytes=bucket_bytes):
            buckets.append(bucket)  # fresh copies already: the caller keeps them
            del bucket

    _, measured = allocation_peak(consume)
    units = [u.bucket.padded for u in engine.runtime.units] if stage == 3 else [0]
    width = 2 if precision == "bf16" else 4
    streamed = [(n, t) for b in buckets for n, t in b]
    sizes = [(sum(t.numel() * t.element_size() for t in {id(t): t for _, t in b}.values()), len(b)) for b in buckets]
    first_names = [n for n, p in model.named_parameters()]  # one name per tensor, in the model's order
    callback = []
    engine.stream_full_weights(bucket_bytes=bucket_bytes, rank0_only=True,
                               on=lambda b: callback.append([n for n, _ in b]))
    engine.destroy()
    return {"whole": whole, "streamed": streamed, "sizes": sizes, "peak": measured.peak["cpu"],
            "kept": sum(t.numel() * t.element_size() for _, t in streamed), "unit_bytes": max(units) * width,
            "callback": callback, "params": [n for n, _ in model.named_parameters(remove_duplicate=False)],
            "first_names": first_names}


@pytest.mark.dist
@pytest.mark.parametrize("stage, precision, zero", [
    (0, "fp32", {}), (1, "bf16", {}), (2, "bf16", {}), (3, "fp32", {}), (3, "bf16", {}),
    (3, "bf16", {"zero_quantized_weights": True}), (3, "bf16", {"stage3_fetch_units": ["Block"]})])
def test_weights_stream_out_in_buckets_equal_to_the_whole_weights(stage, precision, zero):
    bucket_bytes = 40_000
    for rank, r in enumerate(spawn(_stream_worker, 2, stage, precision, zero, bucket_bytes)):
        streamed = dict(r["streamed"])
        names = [n for n, _ in r["streamed"]]
        # every name once (a tied tensor under both of its names, one after the other), the tensors in the model's
        # order
        assert sorted(names) == sorted(r["params"]) and len(set(names)) == len(names)
        assert [n for n in names if n in r["first_names"]] == r["first_names"]
        for name, value in streamed.items():  # the working weights, exactly (qwZ: the exact gather, not int8)
            assert torch.equal(value, r["whole"][name]), (rank, name)
        # no bucket past the size asked, but a parameter larger than it, which comes alone
        assert all(size <= bucket_bytes or count <= 2 for size, count in r["sizes"]), r["sizes"]
        # memory: the caller kept every bucket (kept); beyond it the stream held at most a bucket and a unit
        assert r["peak"] <= r["kept"] + bucket_bytes + r["unit_bytes"] + 4096, (r["peak"], r["kept"])
        # rank0_only: the others take part in the gathers and get empty buckets
        assert (sum(map(len, r["callback"])) == len(r["params"])) == (rank == 0)


def test_engine_config_reads_as_deepspeeds_dict():
    # OpenRLHF's offload_deepspeed_states reads the offload device this way; HF fills "auto" before DeepSpeed sees
    # the dict, and DeepSpeed's engine shows the batch trio it derived
    cfg = {"train_batch_size": 4, "gradient_accumulation_steps": "auto", "steps_per_print": 0, "device": "cpu",
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                 "stage3_param_persistence_threshold": "auto"}}
    engine = zkern.Engine(TinyGPT(vocab=67, dim=32, n_layer=1, n_head=2, seq=16), cfg)
    assert engine.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert engine.config["zero_optimization"]["offload_optimizer"]["pin_memory"] is False  # the user's own keys
    assert engine.config["zero_optimization"]["stage3_param_persistence_threshold"] == 320  # 10 x hidden
    assert (engine.config["train_micro_batch_size_per_gpu"], engine.config["gradient_accumulation_steps"]) == (4, 1)
    assert "offload_param" not in engine.config["zero_optimization"]  # nothing the user did not ask for
    engine.config["zero_optimization"]["stage"] = 1  # a copy: the engine is not written to
    assert engine.config["zero_optimization"]["stage"] == 3 and engine.zero_optimization_stage() == 3
    engine.destroy()
