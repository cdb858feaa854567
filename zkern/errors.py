"""The errors zkern raises on purpose; each message names what was wrong and what to do.

Every layer raises these (the config parser, the collectives, the checkpoint reader), so they sit at the bottom of
the house and import nothing. The public names are zkern.ConfigError, zkern.CommError, zkern.CheckpointError,
zkern.LossScaleAtMinimum and zkern.InvariantError.
"""


class ConfigError(ValueError):
    """A config key or value zkern cannot accept; the message names the key path and what to do."""


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the rank, the collective and its purpose."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded: missing, damaged, from another model, or not plain data."""


class LossScaleAtMinimum(RuntimeError):
    """fp16 overflowed with the loss scale already at fp16.min_loss_scale."""


class InvariantError(RuntimeError):
    """Stage 3's unit bookkeeping broke (a hook that never ran, a stale gathered copy, a unit left gathered at the
    end of a pass). The message names the unit and the modules that gather it. Training past it would use wrong
    weights or leak memory, so zkern stops instead."""
