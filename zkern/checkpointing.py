"""`zkern.checkpointing`: DeepSpeed's name (`deepspeed.checkpointing`) for activation checkpointing, which lives in
zkern/activation_checkpointing.py (beside zkern/checkpoint/, the training checkpoints). This module *is* that one:
configure() and stats() act on the same state whichever name imported them."""

import sys

from zkern import activation_checkpointing

sys.modules[__name__] = activation_checkpointing
