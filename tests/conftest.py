"""Test-wide settings. TRITON_INTERPRET=1 is set before anything imports triton, so Triton kernels (when they
land) run on this CPU-only machine under the interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.pop("ZKERN_BACKEND", None)
for _key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(_key, None)  # world size 1 in this process; spawned ranks set their own
