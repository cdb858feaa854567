"""Fine-tune a tiny GPT-2 with Hugging Face's Trainer, sharded by zkern (ZeRO stage 3), with a DeepSpeed config
full of "auto":

    torchrun --nproc-per-node 2 examples/hf_trainer.py
    accelerate launch --num_processes 2 examples/hf_trainer.py
    python examples/hf_trainer.py                               # one process

The model is built from a config (nothing is downloaded). The only change from a DeepSpeed script: zkern.hf.Trainer
and zkern_config= in place of transformers.Trainer and TrainingArguments(deepspeed=...).
"""

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import zkern.hf

HERE = os.path.dirname(os.path.abspath(__file__))
VOCAB, SEQ = 64, 32


def counting_task(n: int = 512) -> list[dict]:
    """Sequences that count with a random stride: learnable, so the loss falls well below log(VOCAB)."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": x, "labels": x} for x in ids]


def main(output_dir: str) -> None:
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                             max_steps=40, learning_rate=3e-3, warmup_steps=5, weight_decay=0.01, logging_steps=10,
                             eval_strategy="steps", eval_steps=20, save_steps=20, report_to=[], seed=0,
                             disable_tqdm=True, use_cpu=not torch.cuda.is_available())
    data = counting_task()
    trainer = zkern.hf.Trainer(model=model, args=args, train_dataset=data[:448], eval_dataset=data[448:],
                               zkern_config=os.path.join(HERE, "ds_config_zero3_auto.json"))
    trainer.train()
    print(f"rank {args.process_index}: eval loss {trainer.evaluate()['eval_loss']:.3f} (log(vocab) = "
          f"{torch.log(torch.tensor(VOCAB)).item():.3f})")
    trainer.save_model(os.path.join(output_dir, "final"))  # an HF model directory: from_pretrained loads it


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "hf_trainer_output")
    # torchrun hygiene: a gloo group left to interpreter shutdown can abort the process ("terminate called
    # without an active exception", pytorch/pytorch#190489) after the work is done.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
