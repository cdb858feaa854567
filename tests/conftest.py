"""Test-wide settings. Where no GPU is present, TRITON_INTERPRET=1 is set before anything imports triton, so
zkern's Triton kernels run on the CPU under the interpreter (on a GPU machine they run compiled).

ZKERN_TEST_BACKEND=triton forces one backend for every op in the whole run (spawned ranks inherit it), so that every
view the engine hands a kernel meets the real launcher's checks (slow under the interpreter: a manual run; CI trains
the engine on the Triton path in tests/kernels/test_triton.py)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("ZKERN_BACKEND", None)
if os.environ.get("ZKERN_TEST_BACKEND"):
    os.environ["ZKERN_BACKEND"] = os.environ["ZKERN_TEST_BACKEND"]
for _key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(_key, None)  # world size 1 in this process; spawned ranks set their own
