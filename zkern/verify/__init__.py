"""zkern's self-test against an independent single-process reference: the differential fuzzer of the crossings of
features (draws.py, runner.py, single.py, check.py, harness.py) and `python -m zkern.verify` for a user's machines.

    python -m zkern.verify                       # a short matrix on this machine (CPU ranks, or the GPUs)
    python -m zkern.verify.fuzz --draws 2000     # random crossings, each a copy-pasteable repro if it fails
"""

from zkern.verify.draws import Draw, random_draw
from zkern.verify.harness import Outcome, verify_draw

__all__ = ["Draw", "Outcome", "random_draw", "verify_draw"]
