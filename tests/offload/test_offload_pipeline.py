"""The offloaded step's gradients leave during backward (offload_optimizer.copy_grads_during_backward, the default):
each chunk is copied to the host as its reduction lands in the boundary's backward, and step() copies only what is
not there yet. Against the same engine copying everything at step() (the key off), bit for bit, at stages 1-3, with
accumulation, clipping, an fp16 overflow on one rank, a gradient and a weight written between backward and step
(the weight's write rewrites the working copies, and must leave the host's gradient copies alone), a zero_grad()
that drops a backward, and a checkpoint resumed by a fresh engine; and the step's accounting says where each chunk
went down.

    python -m pytest tests/offload/test_offload_pipeline.py -q
"""

from __future__ import annotations

import pytest
import torch

import zkern
from zkern.core.buffers import allocated_bytes
from zkern.testing import TinyGPT, spawn


def _config(stage: int, during_backward: bool, offload_param: bool, ring: int = 0) -> dict:
    zero = {"stage": stage, "reduce_bucket_size": 3000, "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu", "copy_grads_during_backward": during_backward,
                                  "staging_chunks": ring}}
    if offload_param:
        zero["offload_param"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "steps_per_print": 0,
            "device": "cpu", "gradient_clipping": 0.5, "fp16": {"enabled": True, "initial_scale_power": 8},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "zero_optimization": zero}


def _backward(engine, rank: int, seed: int, poison: bool = False) -> None:
    ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(100 * seed + rank))
    loss = engine(ids, ids)
    engine.backward(loss * float("inf") if poison else loss)


def _run(rank: int, stage: int, during_backward: bool, offload_param: bool, ckpt: str, ring: int = 0) -> dict:
    torch.manual_seed(0)
    cfg = _config(stage, during_backward, offload_param, ring)
    engine = zkern.Engine(TinyGPT(), cfg)
    accounts = []

    def micro(seed: int, poison: bool = False, before_step=None) -> None:
        _backward(engine, rank, seed, poison)
        if before_step is not None:
            before_step()
        engine.step()
        if engine.was_step_applied():
            accounts.append(dict(engine.host_step.last_step))

    def halve_a_gradient():  # written after it went to the host
        p = dict(engine.module.named_parameters())["blocks.0.fc.weight"]
        zkern.safe_set_full_grad(p, zkern.safe_get_full_grad(p) * 0.5)

    def set_a_weight():  # every working copy is rewritten from the masters, after the gradients went to the host
        p = dict(engine.module.named_parameters())["blocks.1.fc.weight"]
        zkern.safe_set_full_fp32_param(p, zkern.safe_get_full_fp32_param(p) * 0.5)

    micro(0), micro(1, before_step=set_a_weight)
    micro(2), micro(3, before_step=halve_a_gradient)
    micro(4, poison=rank == 1), micro(5)  # an overflow on one rank: the step is skipped
    skipped = engine.skipped_steps
    micro(6)
    _backward(engine, rank, 7)
    engine.zero_grad()  # the accumulation's gradients so far are dropped, its boundary backward's included
    micro(8)  # the count stays: this one ends the accumulation
    engine.save_checkpoint(ckpt, tag=f"s{stage}-{during_backward}-{ring}")
    engine.destroy()
    torch.manual_seed(1)
    engine = zkern.Engine(TinyGPT(), cfg)
    engine.load_checkpoint(ckpt, tag=f"s{stage}-{during_backward}-{ring}")
    micro(10), micro(11)
    chunks = sum(len(g.chunks) for g in engine.host_step.host_groups)
    ringed = engine.host_step.ring is not None
    state = engine.full_state_dict()
    engine.destroy()
    return {"state": state, "accounts": accounts, "chunks": chunks, "skipped": skipped, "ringed": ringed}


RING = 2  # staging buffers in the ring runs: fewer than the chunks, so buffers are reused within a step


def _worker(rank, world, stage, offload_param, ckpt):
    return {(during, ring): _run(rank, stage, during, offload_param, ckpt, ring)
            for during in (True, False) for ring in (0, RING)}


@pytest.mark.dist
@pytest.mark.parametrize("stage, offload_param", [(1, False), (2, False), (3, False), (3, True)])
def test_gradients_copied_during_backward_train_bit_for_bit_as_copied_at_the_step(stage, offload_param, tmp_path):
    results = spawn(_worker, 2, stage, offload_param, str(tmp_path))
    for rank, r in enumerate(results):
        early, late = r[(True, 0)], r[(False, 0)]
        for mode, run in r.items():  # the staging ring too, its buffers reused within each step
            assert run["skipped"] == 1
            for name, value in late["state"].items():
                assert torch.equal(run["state"][name], value), (rank, mode, name)
        n = early["chunks"]
        assert n > RING
        # the ring stages stage 3's parameters on the host itself with offload_param (they rest there): no ring
        assert [r[(d, RING)]["ringed"] for d in (True, False)] == [not offload_param] * 2
        if not offload_param:  # during backward the first RING chunks to land came down; the rest at the step
            went = [(a["grad_chunks_in_backward"], a["grad_chunks_at_step"]) for a in r[(True, RING)]["accounts"]]
            assert went == [(RING, n - RING), (0, n), (RING, n - RING), (RING, n - RING)], went
        # the applied steps: every chunk went down in backward, except after the gradient write (all again at the
        # step)
        went = [(a["grad_chunks_in_backward"], a["grad_chunks_at_step"]) for a in early["accounts"]]
        assert went == [(n, 0), (0, n), (n, 0), (n, 0)], went
        assert [(a["grad_chunks_in_backward"], a["grad_chunks_at_step"]) for a in late["accounts"]] == [(0, n)] * 4
        total = {a["grad_bytes_in_backward"] + a["grad_bytes_at_step"] for a in early["accounts"] + late["accounts"]}
        assert len(total) == 1 and total.pop() > 0  # every step moves the whole gradient shard, once
        assert all(a["grad_bytes_in_backward"] == 0 for a in late["accounts"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_staging_is_a_ring_of_chunk_buffers_or_one_copy_of_the_shard_or_two_with_the_delayed_update(stage):
    """By default (offload_optimizer.staging_chunks 4) the host staging is four chunk-sized buffers, each taking a
    chunk's gradient and then its new parameters; with staging_chunks 0 one buffer per chunk, one working-dtype copy
    of the shard; the delayed update keeps a second copy (its update waits there while the next backward's gradients
    come down), and no ring."""
    for delayed, staging in ((False, None), (False, 0), (True, None)):
        torch.manual_seed(0)
        offload = {"device": "cpu", "delayed_update": delayed}
        if staging is not None:
            offload["staging_chunks"] = staging
        cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "device": "cpu", "bf16": {"enabled": True},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
               "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000,
                                     "stage3_param_persistence_threshold": 0, "offload_optimizer": offload}}
        engine = zkern.Engine(TinyGPT(), cfg)
        host = engine.host_step
        chunks = [c for g in host.host_groups for c in g.chunks]
        shard = sum(c.grad.nbytes for c in chunks)
        assert len(chunks) > 4 and shard > 0
        expected = {(False, None): 4 * max(c.grad.nbytes for c in chunks), (False, 0): shard,
                    (True, None): 2 * shard}[(delayed, staging)]
        assert expected < shard or staging == 0 or delayed
        assert allocated_bytes(host.staging_tensors()) == host.staging_bytes == expected, (delayed, staging, stage)
        assert engine.memory_report()["host"]["offload_buffers"] == expected
        for step in range(3):  # and it trains: the ring's buffers are reused within each step
            ids = torch.randint(0, 67, (2, 16), generator=torch.Generator().manual_seed(step))
            engine.backward(engine(ids, ids))
            engine.step()
        assert engine.host_step.staging_bytes == expected
        engine.destroy()
