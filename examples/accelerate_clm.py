"""Train a causal LM with an Accelerate script written for Accelerate+DeepSpeed, on zkern: the only change is the
import. Its shape is accelerate's examples/by_feature/deepspeed_with_config_support.py: DummyOptim/DummyScheduler when
the config has those sections (else AdamW and a transformers scheduler), accelerator.accumulate, checkpoints every N
steps with save_state, resume with load_state + skip_first_batches, evaluation with gather_for_metrics, the best
checkpoint reloaded, and a final save_pretrained that transformers loads without zkern.

    accelerate launch --config_file accel.yaml examples/accelerate_clm.py --output_dir out
        (accel.yaml: distributed_type: DEEPSPEED, deepspeed_config: {deepspeed_config_file: ...}; a CPU-only machine
         exports ACCELERATE_USE_CPU, use torchrun there)
    ACCELERATE_USE_DEEPSPEED=true ACCELERATE_DEEPSPEED_CONFIG_FILE=examples/ds_config_zero3_auto.json \\
        torchrun --nproc-per-node 2 examples/accelerate_clm.py --output_dir out
    ZKERN_EXAMPLE_ACCELERATOR=accelerate torchrun --nproc-per-node 2 examples/accelerate_clm.py ...  # plain DDP

The model is a small GPT-2 built from a config and the data a learnable counting task (nothing is downloaded).
--log_file writes one JSON line per micro-step (the tests compare them with the plain-Accelerate run).
"""

import argparse
import json
import math
import os

import torch
from accelerate.utils import DataLoaderConfiguration, DummyOptim, DummyScheduler, set_seed
from torch.utils.data import DataLoader
from transformers import GPT2Config, GPT2LMHeadModel, default_data_collator, get_scheduler

if os.environ.get("ZKERN_EXAMPLE_ACCELERATOR", "zkern") == "accelerate":
    from accelerate import Accelerator  # the same script on plain Accelerate (DDP): the tests' reference
else:
    from zkern.hf import Accelerator

VOCAB, SEQ = 67, 16


def counting_task(n: int, seed: int) -> list[dict]:
    """Sequences that count with a random stride: token t+1 = token t + stride (mod VOCAB)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": x, "labels": x} for x in ids]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output_dir", required=True)
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--per_device_eval_batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=2)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--num_train_epochs", type=int, default=1)
    p.add_argument("--max_train_steps", type=int, default=None)
    p.add_argument("--num_warmup_steps", type=int, default=1)
    p.add_argument("--lr_scheduler_type", default="constant_with_warmup")
    p.add_argument("--train_samples", type=int, default=48)
    p.add_argument("--checkpointing_steps", default=None, help="a number of steps, or 'epoch'")
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log_file", default=None)
    return p.parse_args(argv)


def evaluate(model, loader, accelerator, batch_size: int):
    model.eval()
    losses = []
    for batch in loader:
        with torch.no_grad():
            loss = model(**batch).loss
        losses.append(accelerator.gather_for_metrics(loss.repeat(batch_size)))
    model.train()
    eval_loss = torch.cat(losses).float().mean()
    return math.exp(eval_loss), eval_loss


def main(argv=None) -> dict:
    args = parse_args(argv)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(args.seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=args.dropout,
                        embd_pdrop=args.dropout, attn_pdrop=args.dropout, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    train = DataLoader(counting_task(args.train_samples, 5), shuffle=True, collate_fn=default_data_collator,
                       batch_size=args.per_device_train_batch_size)
    evaluation = DataLoader(counting_task(16, 6), collate_fn=default_data_collator,
                            batch_size=args.per_device_eval_batch_size)

    no_decay = ["bias", "ln_", "LayerNorm.weight"]
    groups = [{"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
               "weight_decay": args.weight_decay},
              {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)],
               "weight_decay": 0.0}]
    plugin = accelerator.state.deepspeed_plugin
    optimizer_cls = torch.optim.AdamW if plugin is None or "optimizer" not in plugin.deepspeed_config else DummyOptim
    optimizer = optimizer_cls(groups, lr=args.learning_rate)

    steps_per_epoch = math.ceil(len(train) / accelerator.gradient_accumulation_steps)
    overrode_max_steps = args.max_train_steps is None
    if overrode_max_steps:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    if plugin is None or "scheduler" not in plugin.deepspeed_config:
        scheduler = get_scheduler(name=args.lr_scheduler_type, optimizer=optimizer,
                                  num_warmup_steps=args.num_warmup_steps, num_training_steps=args.max_train_steps)
    else:
        scheduler = DummyScheduler(optimizer, total_num_steps=args.max_train_steps,
                                   warmup_num_steps=args.num_warmup_steps)

    model, optimizer, train, evaluation, scheduler = accelerator.prepare(model, optimizer, train, evaluation,
                                                                         scheduler)
    steps_per_epoch = math.ceil(len(train) / accelerator.gradient_accumulation_steps)
    if overrode_max_steps:
        args.max_train_steps = args.num_train_epochs * steps_per_epoch
    args.num_train_epochs = math.ceil(args.max_train_steps / steps_per_epoch)
    checkpointing = args.checkpointing_steps
    if checkpointing is not None and checkpointing.isdigit():
        checkpointing = int(checkpointing)

    completed, starting_epoch, resume_step = 0, 0, None
    if args.resume_from_checkpoint:
        accelerator.load_state(args.resume_from_checkpoint)
        accelerator.print(f"resumed from {args.resume_from_checkpoint}")
        name = os.path.basename(os.path.normpath(args.resume_from_checkpoint))
        if name.startswith("epoch_"):
            starting_epoch = int(name[len("epoch_"):]) + 1
            completed = starting_epoch * steps_per_epoch
        else:  # step_<n>: n optimizer steps done, n x accumulation micro-batches consumed
            completed = int(name[len("step_"):])
            starting_epoch = completed // steps_per_epoch
            resume_step = (completed - starting_epoch * steps_per_epoch) * accelerator.gradient_accumulation_steps

    log = open(args.log_file, "a") if args.log_file and accelerator.is_main_process else None
    best, best_dir = None, os.path.join(args.output_dir, "best_checkpoint")
    for epoch in range(starting_epoch, args.num_train_epochs):
        model.train()
        # The epoch decides the seedable sampler's order; a resumed job never iterated the earlier epochs, so say it.
        train.set_epoch(epoch)
        loader = train
        if resume_step is not None and epoch == starting_epoch:
            loader = accelerator.skip_first_batches(train, num_batches=resume_step)
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0) if accelerator.sync_gradients else None
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                if accelerator.sync_gradients:
                    completed += 1
            if log is not None:
                log.write(json.dumps({"step": completed, "loss": loss.item(), "sync": accelerator.sync_gradients,
                                      "lr": scheduler.get_last_lr()[0],
                                      "grad_norm": None if norm is None else float(norm)}) + "\n")
                log.flush()
            if isinstance(checkpointing, int) and accelerator.sync_gradients and completed % checkpointing == 0:
                accelerator.save_state(os.path.join(args.output_dir, f"step_{completed}"))
            if completed >= args.max_train_steps:
                break
        perplexity, eval_loss = evaluate(model, evaluation, accelerator, args.per_device_eval_batch_size)
        accelerator.print(f"epoch {epoch}: perplexity {perplexity:.4f} eval_loss {eval_loss.item():.4f}")
        if checkpointing == "epoch":
            accelerator.save_state(os.path.join(args.output_dir, f"epoch_{epoch}"))
        if best is None or perplexity < best:
            best = perplexity
            accelerator.save_state(best_dir)
        if completed >= args.max_train_steps:
            break

    accelerator.wait_for_everyone()  # plain Accelerate writes on the main process only: let it finish
    accelerator.load_state(best_dir)  # the best checkpoint must evaluate to the same perplexity
    perplexity, eval_loss = evaluate(model, evaluation, accelerator, args.per_device_eval_batch_size)
    if perplexity != best:
        raise AssertionError(f"the best checkpoint's perplexity {best} differs after loading it: {perplexity}")

    accelerator.wait_for_everyone()
    final = os.path.join(args.output_dir, "final")
    accelerator.unwrap_model(model).save_pretrained(final, is_main_process=accelerator.is_main_process,
                                                    save_function=accelerator.save,
                                                    state_dict=accelerator.get_state_dict(model))
    result = {"perplexity": perplexity, "eval_loss": eval_loss.item(), "completed_steps": completed}
    if accelerator.is_main_process:
        with open(os.path.join(args.output_dir, "all_results.json"), "w") as f:
            json.dump(result, f)
    if log is not None:
        log.close()
    accelerator.end_training()
    return result


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # see examples/hf_trainer.py: a clean exit under torchrun
        torch.distributed.destroy_process_group()
