"""Helpers for the Hugging Face tests: a tiny GPT-2 with dropout on (so a resume must restore the generators), a
learnable token task, TrainingArguments, and the rank workers that train it with transformers.Trainer (DDP, the
reference) or zkern.hf.Trainer.
"""

from __future__ import annotations

import json
import os

import torch

VOCAB, SEQ, DIM = 67, 16, 32
SAMPLES = 44  # 11 micro-batches per rank per epoch at world 2: every epoch ends with a short accumulation


def tiny_gpt2(dropout: float = 0.1):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=DIM, n_layer=2, n_head=2, resid_pdrop=dropout,
                        embd_pdrop=dropout, attn_pdrop=dropout, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def dataset(samples: int = SAMPLES, seed: int = 5) -> list[dict]:
    """Counting sequences with a random start and stride: token t+1 = token t + stride (mod VOCAB), so the loss can
    fall far below log(VOCAB) once the model reads the stride from the first tokens."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (samples, 1), generator=g)
    stride = torch.randint(1, 4, (samples, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": x, "labels": x} for x in ids]


def training_args(out: str, **overrides):
    from transformers import TrainingArguments

    values = dict(output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=20,
                  learning_rate=1e-3, logging_steps=1, save_steps=10, report_to=[], seed=0, use_cpu=True,
                  disable_tqdm=True, warmup_steps=3, weight_decay=0.01, max_grad_norm=1.0)
    values.update(overrides)
    return TrainingArguments(**values)


def logged(trainer) -> list[dict]:
    """The per-step training logs: step, loss, learning_rate, grad_norm."""
    return [{k: entry[k] for k in ("step", "loss", "learning_rate", "grad_norm")}
            for entry in trainer.state.log_history if "loss" in entry]


def quiet():
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def compare_worker(rank: int, world: int, out: str, runs: list[dict]) -> dict:
    """Train the same model, data and arguments once per run: {"name", "kind": "ddp" | "zkern", "config"} in the
    same processes; returns each run's logs, and for zkern runs with "save" the engine's full_state_dict."""
    import transformers

    from zkern.hf import Trainer

    quiet()
    results = {}
    for run in runs:
        transformers.set_seed(0)
        model = tiny_gpt2()
        args = training_args(os.path.join(out, run["name"]), **run.get("args", {}))
        if run["kind"] == "ddp":
            trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset())
        else:
            trainer = Trainer(model=model, args=args, train_dataset=dataset(), zkern_config=run["config"])
        trainer.train()
        result = {"logs": logged(trainer)}
        if run.get("save"):
            trainer.save_model(os.path.join(out, run["name"], "final"))
            result["full_state"] = trainer.engine.full_state_dict()
            result["engine_config"] = json.loads(json.dumps(trainer.engine.config.to_dict(), default=str))
            result["engine_is_module"] = trainer.model_wrapped is trainer.engine
        results[run["name"]] = result
    return results


def resume_worker(rank: int, world: int, out: str, config: dict, checkpoint: str) -> list[dict]:
    """A fresh model and Trainer (the initial weights drawn from another seed, so nothing but the checkpoint can
    make them right) resuming from checkpoint."""
    import transformers

    from zkern.hf import Trainer

    quiet()
    transformers.set_seed(1)
    trainer = Trainer(model=tiny_gpt2(), args=training_args(out), train_dataset=dataset(), zkern_config=config)
    trainer.train(resume_from_checkpoint=checkpoint)
    return logged(trainer)


def config_worker(rank: int, world: int, out: str, path: str, overrides: dict) -> dict:
    """Train the tiny GPT-2 on the learnable task through zkern.hf.Trainer with a config file as written."""
    import transformers

    from zkern.hf import Trainer

    quiet()
    transformers.set_seed(0)
    args = training_args(out, max_steps=30, save_steps=1000, learning_rate=3e-3, **overrides)
    trainer = Trainer(model=tiny_gpt2(dropout=0.0), args=args, train_dataset=dataset(samples=64),
                      zkern_config=path)
    trainer.train()
    cfg = trainer.engine.config
    zero = cfg.zero_optimization
    return {"logs": logged(trainer), "precision": cfg.precision, "stage": zero.stage,
            "micro": cfg.train_micro_batch_size_per_gpu, "accumulation": cfg.gradient_accumulation_steps,
            "train_batch": cfg.train_batch_size, "clip": cfg.gradient_clipping,
            "reduce_bucket_size": zero.reduce_bucket_size,
            "prefetch": zero.stage3_prefetch_bucket_size, "persistence": zero.stage3_param_persistence_threshold,
            "lr_max": None if cfg.scheduler is None else cfg.scheduler.warmup_max_lr,
            "optimizer_lr": None if cfg.optimizer is None else cfg.optimizer.lr,
            "group_decay": [g["weight_decay"] for g in trainer.engine.optimizer.param_groups],
            "group_muon": [g.get("use_muon") for g in trainer.engine.optimizer.param_groups]}
