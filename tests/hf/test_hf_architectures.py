"""Hugging Face architectures other than GPT-2 through the engine at stage 3, world 2, against one process of torch
AdamW on the same global batch: T5 (encoder-decoder, relative attention bias shared across layers, cross attention)
and Mixtral (routed experts that each rank uses differently, the router's auxiliary loss) with gradient
checkpointing, decay/no-decay groups as HF's Trainer builds them. Tiny models built from their configs.

    python -m pytest tests/hf/test_hf_architectures.py -q
"""

from __future__ import annotations

import pytest
import torch

from zkern.testing import assert_params_close, spawn

LR, WD, STEPS, PER_RANK, WORLD = 1e-3, 0.1, 4, 2, 2


def build(name: str):
    import transformers

    torch.manual_seed(0)
    if name == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0))
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1, max_position_embeddings=64,
        router_aux_loss_coef=0.01, output_router_logits=True))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def batch(name: str, step: int, rank: int) -> dict:
    """Rank `rank`'s slice of step `step`'s global batch (every rank and the reference draw the same one)."""
    gen = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, 96, (PER_RANK * WORLD, 12), generator=gen)
    labels = torch.randint(3, 96, (PER_RANK * WORLD, 7), generator=gen) if name == "t5" else ids
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return {"input_ids": ids[rows], "labels": labels[rows]}


def groups(model) -> list[dict]:
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": WD},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


def engine_worker(rank: int, world: int, name: str) -> dict:
    import zkern

    model = build(name)
    config = {"train_micro_batch_size_per_gpu": PER_RANK, "steps_per_print": 0, "gradient_clipping": 0.0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
              "zero_optimization": {"stage": 3, "reduce_bucket_size": 2000, "stage3_prefetch_bucket_size": 1000,
                                    "stage3_param_persistence_threshold": 10}}
    engine, *_ = zkern.initialize(model=model, model_parameters=groups(model), config=config)
    losses = []
    for step in range(STEPS):
        loss = engine(**batch(name, step, rank)).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return {"losses": losses, "state": engine.full_state_dict()}


@pytest.mark.dist
@pytest.mark.parametrize("name", ["t5", "mixtral"])
def test_stage_3_trains_like_one_process(name):
    ranks = spawn(engine_worker, WORLD, name, timeout=300)
    model = build(name)
    optimizer = torch.optim.AdamW(groups(model), lr=LR, weight_decay=WD)
    for step in range(STEPS):
        optimizer.zero_grad()
        losses = []
        for rank in range(WORLD):  # the mean over ranks of each rank's mean loss: the engine's reduction
            loss = model(**batch(name, step, rank)).loss
            (loss / WORLD).backward()
            losses.append(loss.item())
        optimizer.step()
        for rank in range(WORLD):  # each rank's forward saw the same weights and the same tokens
            assert ranks[rank]["losses"][step] == pytest.approx(losses[rank], rel=1e-5), (step, rank)
    assert_params_close(ranks[0]["state"], model.state_dict(), lr=LR, steps=STEPS)
