"""The README's example: python examples/train.py, or torchrun --nproc_per_node=2 examples/train.py."""
import os

import zkern
from zkern.testing import TinyGPT, make_batches

here = os.path.dirname(os.path.abspath(__file__))
model = TinyGPT(vocab=67, dim=64, n_layer=2, n_head=4, seq=32)
engine = zkern.Engine(model, os.path.join(here, "ds_config.json"))
rank = int(os.environ.get("RANK", 0))
for step, micro_batches in enumerate(make_batches(0, steps=20, accumulation=engine.gradient_accumulation_steps,
                                                  world=engine.world_size, micro_batch=4, seq=32, vocab=67)):
    for micro in micro_batches:
        idx, targets = micro[rank]
        loss = engine(idx.to(engine.device), targets.to(engine.device))
        engine.backward(loss)
        engine.step()
    if rank == 0 and step % 5 == 0:
        print(f"step {engine.global_steps} loss {loss.item():.3f} lr {engine.optimizer.param_groups[0]['lr']:.2e}")
