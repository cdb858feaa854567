"""zkern checkpoints: layout-free (any world size, stage, offload), atomic, verified, no pickle.

    engine.save_checkpoint("ckpt"); engine.load_checkpoint("ckpt")
    python -m zkern.checkpoint inspect ckpt
    python -m zkern.checkpoint consolidate ckpt out_dir [--tag T] [--dtype fp32|bf16|fp16] [--max-shard-size 5GB]

manifest.py (layout, manifest, `latest`) and tensorfile.py (the safetensors format) need no torch, and neither does
consolidating an fp32 checkpoint into fp32 files: the CLI's memory is a bounded buffer beside Python itself.
"""

from zkern.errors import CheckpointError

__all__ = ["CheckpointError", "load_fp32_state_dict", "load_optimizer_state_dict", "consolidate", "inspect"]


def load_fp32_state_dict(ckpt_dir, tag=None):
    """{name: fp32 tensor} of model.state_dict() from a checkpoint (DeepSpeed's
    get_fp32_state_dict_from_zero_checkpoint), every entry verified."""
    from zkern.checkpoint.consolidate import load_fp32_state_dict as load

    return load(ckpt_dir, tag)


def load_optimizer_state_dict(ckpt_dir, tag=None):
    """{parameter name: {state name: whole tensor or scalar}} of the optimizer in a checkpoint."""
    from zkern.checkpoint.consolidate import load_optimizer_state_dict as load

    return load(ckpt_dir, tag)


def consolidate(ckpt_dir, out_dir, tag=None, dtype="fp32", max_shard_size=None):
    """Write an HF-loadable model.safetensors (or shards and an index) from a checkpoint, a range at a time."""
    from zkern.checkpoint.consolidate import consolidate as run

    return run(ckpt_dir, out_dir, tag=tag, dtype=dtype, max_shard_size=max_shard_size)


def inspect(ckpt_dir, verify=True):
    """Lines describing every tag (step, world, stage, sizes, checksums)."""
    from zkern.checkpoint.consolidate import inspect as run

    return run(ckpt_dir, verify=verify)
