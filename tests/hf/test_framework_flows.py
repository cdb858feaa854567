"""Two frameworks' ZeRO-3 flows end to end on zkern, each against a single-process torch run doing the same:

- LLaMA-Factory's: a Mixtral built partitioned (zkern.init_sharded, as its loader does under zero.Init), its
  parameters counted with `ds_numel` (0 of them without it), its MoE blocks flagged as leaf modules
  (set_z3_leaf_modules, so every rank gathers every expert of a block), its embeddings resized to a padded vocabulary
  under GatheredParameters(modifier_rank=0) with the new rows set to the old rows' mean, then trained.
- OpenRLHF's: an actor engine and a reference engine without an optimizer built from the same weights; each step
  the actor's loss holds a KL-style term against the reference's log-probabilities, then the actor's states go to
  host memory for the rollout (offload_states) and come back (reload_states), and the actor's weights stream to a
  stand-in inference model on rank 0 in small buckets, which then computes what the actor computes.

    python -m pytest tests/hf/test_framework_flows.py -q
"""

from __future__ import annotations

import pytest
import torch

import zkern
from zkern.testing import TinyGPT, spawn
from zkern.testing.compare import compare_params

WORLD = 2
STAGE3 = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "device": "cpu", "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 2000}}
OLD_VOCAB, NEW_VOCAB = 60, 64  # a tokenizer that grew, padded to a multiple of 64 as LLaMA-Factory pads it


def _ids(step: int, rank: int, vocab: int, length: int = 12) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(100 * step + rank))


# -- LLaMA-Factory ------------------------------------------------------------------------------------------------
def tiny_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=OLD_VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32,
        tie_word_embeddings=False, router_aux_loss_coef=0.0))


def resize_with_mean_rows(model) -> int:
    """LLaMA-Factory's resize: read the size, resize, set the new rows (here to the old rows' mean: deterministic)."""
    size = model.get_input_embeddings().weight.size(0)
    model.resize_token_embeddings(NEW_VOCAB, mean_resizing=False)
    with torch.no_grad():
        for weight in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
            weight[size:] = weight[:size].mean(0)
    return size


def _llamafactory_worker(rank, world):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    torch.manual_seed(0)
    with zkern.init_sharded(STAGE3):
        model = tiny_mixtral()
    out = {"counted": sum(p.ds_numel if p.numel() == 0 and hasattr(p, "ds_numel") else p.numel()
                          for p in model.parameters()),  # LLaMA-Factory's count_parameters
           "plain_numel": sum(p.numel() for p in model.parameters()),
           "leaves": len(zkern.set_z3_leaf_modules(model, [MixtralSparseMoeBlock]))}
    embeddings = [model.get_input_embeddings().weight, model.get_output_embeddings().weight]
    with zkern.GatheredParameters(embeddings, modifier_rank=0):
        out["old_size"] = resize_with_mean_rows(model)
    engine = zkern.Engine(model, STAGE3)
    out["units"] = [u.plan.name for u in engine.runtime.units]
    for step in range(3):
        ids = _ids(step, rank, NEW_VOCAB)
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        engine.step()
    out["state"] = engine.full_state_dict(rank0_only=True)
    engine.destroy()
    return out


@pytest.mark.dist
def test_a_llamafactory_style_moe_flow_counts_resizes_and_trains_as_one_process():
    results = spawn(_llamafactory_worker, WORLD)
    torch.manual_seed(0)
    model = tiny_mixtral()
    count = sum(p.numel() for p in model.parameters())
    resize_with_mean_rows(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(3):
        opt.zero_grad()
        losses = [model(input_ids=_ids(step, r, NEW_VOCAB), labels=_ids(step, r, NEW_VOCAB)).loss
                  for r in range(WORLD)]
        torch.stack(losses).mean().backward()
        opt.step()
    for r in results:
        assert r["counted"] == count and r["plain_numel"] == 0  # every parameter partitioned, and counted whole
        assert r["leaves"] == 2 and r["old_size"] == OLD_VOCAB
        experts = [u for u in r["units"] if ".experts" in u or ".gate" in u]
        assert not experts and "model.layers.0.mlp" in r["units"], r["units"]  # each MoE block is one unit
    assert results[0]["state"]["model.embed_tokens.weight"].shape == (NEW_VOCAB, 32)
    assert compare_params(results[0]["state"], model.state_dict(), lr=1e-2, steps=3) == []


# -- OpenRLHF -----------------------------------------------------------------------------------------------------
KL_COEF = 0.1


def _rl_loss(logits: torch.Tensor, reference_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Next-token NLL plus a KL-style penalty toward the reference's log-probabilities."""
    logp = logits.float().log_softmax(-1)
    nll = torch.nn.functional.nll_loss(logp[:, :-1].reshape(-1, logp.shape[-1]), ids[:, 1:].reshape(-1))
    return nll + KL_COEF * (logp - reference_logits.float().log_softmax(-1)).pow(2).mean()


def _openrlhf_worker(rank, world):
    torch.manual_seed(0)
    actor_model, reference_model = TinyGPT(), TinyGPT()
    reference_model.load_state_dict(actor_model.state_dict())
    actor = zkern.Engine(actor_model, STAGE3)
    reference = zkern.Engine(reference_model, {k: v for k, v in STAGE3.items() if k != "optimizer"})
    inference = TinyGPT() if rank == 0 else None  # the stand-in inference engine, fed by rank 0
    received = {"buckets": 0, "over": [], "names": set()}

    def load(bucket):
        if inference is None:
            assert bucket == []
            return
        received["buckets"] += 1
        distinct = {id(t): t for _, t in bucket}.values()  # a tied tensor comes under both names, once
        size = sum(t.numel() * t.element_size() for t in distinct)
        if size > 4096 and len(distinct) > 1:  # only a tensor larger than a bucket may exceed it, alone
            received["over"].append(size)
        with torch.no_grad():
            for name, tensor in bucket:
                inference.state_dict()[name].copy_(tensor)
                received["names"].add(name)

    for step in range(3):
        ids = _ids(step, rank, 67, length=16)
        with torch.no_grad():
            reference_logits = reference(ids)
        actor.backward(_rl_loss(actor(ids), reference_logits, ids))
        actor.step()
        actor.offload_states()  # the rollout phase takes the device
        actor.reload_states()
        actor.stream_full_weights(bucket_bytes=4096, rank0_only=True, on=load)
    probe = _ids(9, 0, 67, length=16)
    with torch.no_grad():
        actor_logits = actor(probe)
        matches = None if inference is None else torch.equal(inference(probe), actor_logits)
    out = {"state": actor.full_state_dict(rank0_only=True), "matches": matches, "received": received,
           "reference_moved": reference.full_state_dict()["blocks.0.fc.weight"].sum().item()}
    actor.destroy()
    reference.destroy()
    return out


@pytest.mark.dist
def test_an_openrlhf_style_flow_trains_as_one_process_through_offloads_and_weight_syncs():
    results = spawn(_openrlhf_worker, WORLD)
    torch.manual_seed(0)
    actor, reference = TinyGPT(), TinyGPT()
    reference.load_state_dict(actor.state_dict())
    initial_fc = reference.blocks[0].fc.weight.sum().item()
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2, weight_decay=0.0)
    for step in range(3):
        opt.zero_grad()
        losses = []
        for r in range(WORLD):
            ids = _ids(step, r, 67, length=16)
            with torch.no_grad():
                reference_logits = reference(ids)
            losses.append(_rl_loss(actor(ids), reference_logits, ids))
        torch.stack(losses).mean().backward()
        opt.step()
    assert compare_params(results[0]["state"], actor.state_dict(), lr=1e-2, steps=3) == []
    got = results[0]
    assert got["matches"] is True  # the inference model computes exactly what the actor computes
    assert got["received"]["names"] == set(actor.state_dict()) - {n for n, _ in actor.named_buffers()}
    assert got["received"]["over"] == [] and got["received"]["buckets"] >= 3 * 8  # small buckets, three syncs
    assert results[1]["matches"] is None
    assert abs(got["reference_moved"] - initial_fc) < 1e-6  # the reference never moves
