"""A torchrun script for tests/engine/test_engine_api.py: train two stage-3 steps, then report, from the last exit hook
to run, how many gloo worker threads are still alive in this rank (two a group).

    python -m torch.distributed.run --nproc-per-node 2 tests/exit_script.py OUT {zkern_group,user_group}

zkern_group: zkern creates the default group. user_group: the script creates it, as Accelerate does, and destroys
it itself at the end, as the examples do.
"""

import atexit
import os
import sys

OUT, WHO = sys.argv[1], sys.argv[2]


def gloo_threads() -> list[str]:
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except FileNotFoundError:  # a thread that ended while we looked
            pass
    return [n for n in names if "gloo" in n]


def report() -> None:
    with open(f"{OUT}.{os.environ['RANK']}", "w") as f:
        f.write(str(sum(n == "pt_gloo_runloop" for n in gloo_threads())))  # a gloo group runs two


atexit.register(report)  # registered before zkern is imported: runs after zkern's own exit hooks

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import zkern  # noqa: E402

if WHO == "user_group":
    dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
engine = zkern.Engine(model, {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0, "device": "cpu",
                              "zero_optimization": {"stage": 3},
                              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
for _ in range(2):
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    engine.step()
torch._dynamo.reset()  # torch imports torch.distributed.nn lazily, here with dynamo: after the group exists
if WHO == "user_group":
    dist.destroy_process_group()
