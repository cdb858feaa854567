"""Test-wide settings. Where no GPU is present, TRITON_INTERPRET=1 is set before anything imports triton, so
zkern's Triton kernels run on the CPU under the interpreter (on a GPU machine they run compiled)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("ZKERN_BACKEND", None)
for _key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(_key, None)  # world size 1 in this process; spawned ranks set their own
