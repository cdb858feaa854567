"""Activation checkpointing (zkern.activation_checkpointing; zkern.checkpointing is DeepSpeed's name for the same
module): its API and config section."""

import logging

import pytest
import torch

import zkern
from zkern import ConfigError, checkpointing
from zkern.testing import TinyGPT, TrainSpec, assert_params_close, engine_run, reference_run, spawn

# The section as DeepSpeed's documentation and example configs write it.
SECTION = {"partition_activations": True, "cpu_checkpointing": True, "contiguous_memory_optimization": False,
           "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False}


@pytest.fixture(autouse=True)
def fresh_settings():
    checkpointing.reset()
    yield
    checkpointing.reset()


def test_deepspeeds_name_is_the_same_module_and_shares_its_settings():
    import zkern.activation_checkpointing as activation_checkpointing
    import zkern.checkpointing as deepspeed_name

    assert deepspeed_name is activation_checkpointing is zkern.checkpointing is zkern.activation_checkpointing
    assert not activation_checkpointing.is_configured()
    deepspeed_name.configure(None, checkpoint_in_cpu=True)
    assert activation_checkpointing.is_configured()


def test_the_section_parses_with_deepspeed_meanings_and_bad_keys_are_named():
    cfg = zkern.Config.load({"train_batch_size": 1, "activation_checkpointing": SECTION})
    assert cfg.activation_checkpointing.cpu_checkpointing and cfg.activation_checkpointing.number_checkpoints is None
    assert zkern.Config.load({"train_batch_size": 1}).activation_checkpointing is None
    with pytest.raises(ConfigError, match="'activation_checkpointing.cpu_checkpoint'.*cpu_checkpointing"):
        zkern.Config.load({"train_batch_size": 1, "activation_checkpointing": {"cpu_checkpoint": True}})
    with pytest.raises(ConfigError, match="number_checkpoints' must be a number"):
        zkern.Config.load({"train_batch_size": 1, "activation_checkpointing": {"number_checkpoints": "4"}})
    with pytest.raises(ConfigError, match="number_checkpoints' must be >= 1"):
        zkern.Config.load({"train_batch_size": 1, "activation_checkpointing": {"number_checkpoints": 0}})
    with pytest.raises(ValueError, match="no model parallelism"):
        checkpointing.configure(object())


@pytest.mark.parametrize("cpu", [False, True])
def test_checkpoint_gives_the_gradients_of_the_plain_call_and_counts_what_it_moves(cpu):
    checkpointing.configure(None, checkpoint_in_cpu=cpu, profile=True)
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Dropout(0.3), torch.nn.Linear(16, 8))
    x = torch.randn(5, 8, requires_grad=True)
    scale = torch.tensor(2.0)  # a tensor input that needs no gradient

    def fn(a, s):
        return block(a) * s

    torch.manual_seed(1)
    plain = fn(x, scale)
    plain.square().sum().backward()
    expected = [x.grad.clone(), *(p.grad.clone() for p in block.parameters())]
    x.grad = None
    block.zero_grad()
    torch.manual_seed(1)  # the same dropout mask: checkpoint restores the RNG state for the recomputation
    out = checkpointing.checkpoint(fn, x, scale)
    out.square().sum().backward()
    got = [x.grad, *(p.grad for p in block.parameters())]
    torch.testing.assert_close(out, plain, rtol=0, atol=0)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    stats = checkpointing.stats()
    assert stats["calls"] == 1 and stats["recomputations"] == 1
    assert stats["offloaded_bytes"] == ((5 * 8 + 1) * 4 if cpu else 0)
    assert stats["forward_seconds"] > 0 and stats["recompute_seconds"] > 0


def seed_config_worker(rank, world, spec):
    result = engine_run(rank, world, spec)
    result["checkpointing"] = checkpointing.stats()
    return result


@pytest.mark.dist
def test_a_config_with_the_section_trains_at_stage_3_and_moves_activations_to_the_host():
    spec = TrainSpec(stage=3, steps=3, accumulation=2, model=dict(checkpoint="zkern"), reduce_bucket_size=3000,
                     extra_config={"activation_checkpointing": SECTION})
    results = spawn(seed_config_worker, 2, spec)
    ref_state, _ = reference_run(spec, 2)
    assert_params_close(results[0]["state"], ref_state, lr=spec.lr, steps=spec.steps)
    said = [m for m in results[0]["log"] if "changes nothing" in m]
    assert len(said) == 1 and "partition_activations" in said[0]
    model = TinyGPT()
    block_input = spec.micro_batch * model.config.seq * model.config.hidden_size * 4  # fp32 bytes
    micro_steps = spec.steps * spec.accumulation
    for r in results:
        stats = r["checkpointing"]
        assert stats["calls"] == stats["recomputations"] == micro_steps * model.config.n_layer
        assert stats["offloaded_bytes"] == micro_steps * model.config.n_layer * block_input


def test_configure_reads_a_config_and_keywords_override_it(caplog):
    with caplog.at_level(logging.INFO, logger="zkern"):
        checkpointing.configure(None, deepspeed_config={"train_batch_size": 1, "activation_checkpointing": SECTION},
                                checkpoint_in_cpu=False, synchronize=True)
        settings = checkpointing._state.settings
        assert checkpointing.is_configured() and settings.synchronize_checkpoint_boundary is True
        assert settings.partition_activations is True and settings.cpu_checkpointing is False
        checkpointing.configure(None, partition_activations=True)  # as DeepSpeed's: each call starts from defaults
        settings = checkpointing._state.settings
        assert settings.partition_activations is True and settings.synchronize_checkpoint_boundary is False
    assert sum("changes nothing" in r.getMessage() for r in caplog.records) == 1  # said once


def test_cpu_checkpointing_keeps_the_gpu_generator_in_the_recomputation(monkeypatch):
    """With cpu_checkpointing the region's inputs reach torch's checkpoint as host copies; torch saves the generator
    state only of the devices its arguments are on, so an empty anchor on each original GPU goes with them (checked
    here with fake CUDA tensors: no GPU needed to see which devices torch is handed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        anchors = zkern.checkpointing.rng_anchors([torch.device("cuda", 1), None, torch.device("cpu"),
                                                   torch.device("cuda", 1), torch.device("cuda", 0)])
    assert [a.device for a in anchors] == [torch.device("cuda", 1), torch.device("cuda", 0)]
    assert all(a.numel() == 0 for a in anchors)
    assert zkern.checkpointing.rng_anchors([torch.device("cpu"), None]) == []
    handed = []
    real = torch.utils.checkpoint.checkpoint

    def spy(fn, *args, **kwargs):
        handed.append([a.device for a in args if isinstance(a, torch.Tensor)])
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", spy)
    zkern.checkpointing.configure(checkpoint_in_cpu=True)
    try:
        x = torch.randn(3, requires_grad=True)
        zkern.checkpointing.checkpoint(lambda t: t * 2, x).sum().backward()
    finally:
        zkern.checkpointing.reset()
    assert handed == [[torch.device("cpu")]] and torch.equal(x.grad, torch.full((3,), 2.0))
