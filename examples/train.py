"""Train a small language model with zkern, as a DeepSpeed script would:

    python examples/train.py                                  # one process
    torchrun --nproc-per-node 2 examples/train.py             # two ranks (gloo on a CPU, nccl on GPUs)
    accelerate launch --num_processes 2 examples/train.py     # accelerate as the launcher

The model and the data are plain PyTorch, defined here; ds_config.json is a DeepSpeed config used as is.
"""

import os

import torch
from torch import nn

import zkern

VOCAB, SEQ = 64, 32


class TinyLM(nn.Module):
    """A two-layer pre-norm transformer language model."""

    def __init__(self, dim: int = 64, layers: int = 2, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.position = nn.Parameter(torch.zeros(SEQ, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        causal = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1], device=tokens.device)
        h = self.blocks(self.embed(tokens) + self.position[: tokens.shape[1]], mask=causal, is_causal=True)
        logits = self.head(self.norm(h))
        return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


class CountingTask(torch.utils.data.Dataset):
    """Sequences that count with a random stride: learnable, so the loss falls well below log(VOCAB)."""

    def __init__(self, n: int = 4096):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, VOCAB, (n, 1), generator=g)
        stride = torch.randint(1, 4, (n, 1), generator=g)
        self.tokens = (start + stride * torch.arange(SEQ + 1)) % VOCAB

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, i):
        return self.tokens[i, :-1], self.tokens[i, 1:]


def main() -> None:
    torch.manual_seed(0)
    config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")
    model = TinyLM()
    engine, optimizer, loader, _ = zkern.initialize(model=model, model_parameters=model.parameters(), config=config,
                                                    training_data=CountingTask())
    for tokens, targets in loader:
        loss = engine(tokens.to(engine.device), targets.to(engine.device))
        engine.backward(loss)
        engine.step()  # updates the parameters at the end of each accumulation of gradient_accumulation_steps
        stepped = engine.pending_micro_steps == 0
        if stepped and engine.rank == 0 and engine.global_steps % 10 == 0:
            print(f"step {engine.global_steps} loss {loss.item():.3f} lr {optimizer.param_groups[0]['lr']:.2e}")
        if stepped and engine.global_steps == 60:
            break
    if engine.rank == 0:
        print(f"final loss {loss.item():.3f} (log(vocab) = {torch.log(torch.tensor(VOCAB)).item():.3f})")


if __name__ == "__main__":
    main()
    # torchrun hygiene: a gloo group left to interpreter shutdown can abort the process ("terminate called
    # without an active exception", pytorch/pytorch#190489) after the work is done.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
