"""A draw trained by zkern.hf.Trainer, as a Hugging Face user runs it: TrainingArguments that agree with the config
(the Trainer checks), the config's optimizer and scheduler (or, for a "client" optimizer, the Trainer's own AdamW,
and for no scheduler its constant one), HF's decay/no-decay groups, train() over the draw's global batches in order,
a compute_loss of the user's own (the model returns its loss), and an overflow planted in it. The Trainer runs the
whole loop itself, so a Trainer draw has no events between steps (loads, evaluations, writes).

    python -m zkern.verify.fuzz --draw '{"frontend": "trainer", "stage": 2, "accumulation": 2, "groups": true}'
"""

from __future__ import annotations

import tempfile

import torch

from zkern.verify import recipes
from zkern.verify.draws import Draw
from zkern.verify.observe import quantized_units, working_digest


def training_arguments(draw: Draw, world: int, device: str):
    """TrainingArguments saying what the config says (fill_auto refuses a contradiction)."""
    from transformers import TrainingArguments

    params = recipes.optimizer_params(draw)
    betas = params.get("betas", (0.9, 0.999))
    mixed = {"bf16": draw.precision == "bf16", "fp16": draw.precision == "fp16"}
    return TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="zkern-trainer-draw-"), per_device_train_batch_size=draw.global_size //
        (world * draw.accumulation), gradient_accumulation_steps=draw.accumulation, max_steps=draw.steps,
        learning_rate=params["lr"], weight_decay=params["weight_decay"], adam_beta1=betas[0], adam_beta2=betas[1],
        adam_epsilon=params.get("eps", 1e-8), max_grad_norm=draw.clip, optim="adamw_torch",
        lr_scheduler_type="constant", warmup_steps=0, logging_strategy="no", save_strategy="no", report_to=[],
        disable_tqdm=True, use_cpu=device == "cpu", remove_unused_columns=False, seed=draw.seed, **mixed)


def train(draw: Draw, model: torch.nn.Module, cfg: dict, batches: list, world: int, rank: int, device: str,
          out: dict):
    """Train the draw through zkern.hf.Trainer on this rank; fills out's losses, gradient norms and hashes per step
    as runner.train_step does. Returns the engine."""
    import transformers
    from torch.utils.data import SequentialSampler

    from zkern.hf import Trainer

    transformers.utils.logging.set_verbosity_error()
    # In order: accelerate deals the loader's batches of `per` round-robin to the ranks, so batch k of the loader
    # is micro-step (k // world) % accumulation of rank k % world, as runner.micro_batches cuts each global batch.
    samples = [{"idx": idx[i], "tgt": tgt[i]} for idx, tgt in batches[:draw.steps] for i in range(len(idx))]
    losses: list[float] = []

    class DrawTrainer(Trainer):
        def _get_train_sampler(self, train_dataset=None):
            return SequentialSampler(train_dataset if train_dataset is not None else self.train_dataset)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss = model(inputs["idx"], inputs["tgt"])
            step, micro = self.state.global_step, len(losses)
            losses.append(loss.item())
            if step == draw.overflow_at and micro == draw.overflow_micro and rank == draw.overflow_rank:
                loss = loss * float("nan" if draw.overflow_nan else "inf")
            return loss

    class Record(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step - 1
            out["losses"][step] = sum(losses) / len(losses)
            out["grad_norms"][step] = trainer.engine.last_grad_norm
            out["hashes"][step] = working_digest(trainer.engine)
            losses.clear()

    trainer = DrawTrainer(model=model, args=training_arguments(draw, world, device), train_dataset=samples,
                          zkern_config=cfg, callbacks=[Record()])
    trainer.train()
    if draw.qwz:
        out.setdefault("qwz_units", {})[0] = quantized_units(trainer.engine)
    return trainer.engine
