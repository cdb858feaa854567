"""Helpers for the TRL tests: a word-level tokenizer built here (nothing is downloaded), a learnable text task and
a preference task, and the rank worker that trains TRL's SFTTrainer or DPOTrainer on DDP (TRL as its users run
it) or on zkern (the same trainer class with zkern.hf.Trainer mixed in first: the documented two-line change).
"""

from __future__ import annotations

import copy
import os

import torch
from hf_runs import logged, quiet, tiny_gpt2

WORDS = 64  # tokens t0..t63, then <eos>, <pad>, <unk>: 67 = the tiny GPT-2's vocabulary


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(WORDS)}
    vocab.update({"<eos>": WORDS, "<pad>": WORDS + 1, "<unk>": WORDS + 2})
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")


def _counting(g: torch.Generator, length: int) -> list[str]:
    start, stride = int(torch.randint(0, WORDS, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
    return [f"t{(start + stride * i) % WORDS}" for i in range(length)]


def texts(samples: int = 32, seed: int = 5) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"text": " ".join(_counting(g, 12))} for _ in range(samples)]


def preferences(samples: int = 32, seed: int = 7) -> list[dict]:
    """The prompt is a counting sequence's start; chosen continues it, rejected is random words."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(samples):
        seq = _counting(g, 10)
        rejected = [f"t{int(t)}" for t in torch.randint(0, WORDS, (4,), generator=g)]
        rows.append({"prompt": " ".join(seq[:6]), "chosen": " ".join(seq[6:]), "rejected": " ".join(rejected)})
    return rows


def trl_worker(rank: int, world: int, out: str, runs: list[dict]) -> dict:
    """Each run: {"name", "trainer": "sft" | "dpo", "kind": "ddp" | "zkern", "config", "args"}. Returns the logs,
    DPO's logged reward margins, and what holds the reference model."""
    import datasets
    import transformers
    import trl

    import zkern.hf

    quiet()
    results = {}
    for run in runs:
        transformers.set_seed(0)
        model = tiny_gpt2(dropout=0.1 if run["trainer"] == "sft" else 0.0)
        common = dict(output_dir=os.path.join(out, run["name"]), per_device_train_batch_size=2,
                      gradient_accumulation_steps=2, max_steps=6, learning_rate=1e-3, logging_steps=1,
                      save_strategy="no", report_to=[], seed=0, use_cpu=True, disable_tqdm=True, max_length=16,
                      bf16=False, **run.get("args", {}))
        if run["trainer"] == "sft":
            base, args = trl.SFTTrainer, trl.SFTConfig(**common)
            kwargs = {"train_dataset": datasets.Dataset.from_list(texts())}
        else:
            base, args = trl.DPOTrainer, trl.DPOConfig(**common)
            kwargs = {"train_dataset": datasets.Dataset.from_list(preferences()), "ref_model": copy.deepcopy(model)}
        if run["kind"] == "ddp":
            trainer = base(model=model, args=args, processing_class=tokenizer(), **kwargs)
        else:
            class ZkernTrainer(zkern.hf.Trainer, base):  # the documented change: zkern.hf.Trainer first
                pass

            trainer = ZkernTrainer(model=model, args=args, processing_class=tokenizer(),
                                   zkern_config=run["config"], **kwargs)
        try:
            trainer.train()
        except Exception as e:  # noqa: BLE001 - the test reads the refusal
            results[run["name"]] = {"error": f"{type(e).__name__}: {e}"}
            continue
        result = {"logs": logged(trainer), "margins": [e["rewards/margins"] for e in trainer.state.log_history
                                                        if "rewards/margins" in e]}
        ref = getattr(trainer, "ref_model", None)
        if ref is not None:
            result["reference"] = type(ref).__name__
            module = getattr(ref, "module", ref)
            params = list(module.parameters())
            # elements this rank holds at rest: its partition at stage 3 (the parameter itself is empty there)
            result["reference_held"] = sum((p.ds_tensor if hasattr(p, "ds_tensor") else p).numel() for p in params)
            result["reference_full"] = sum(getattr(p, "ds_numel", p.numel()) for p in params)
            result["reference_trainable"] = any(p.requires_grad for p in params)
        results[run["name"]] = result
    return results
