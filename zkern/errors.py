"""The errors zkern raises on purpose; each message names what was wrong and what to do.

Every layer raises these (the config parser, the collectives, the checkpoint reader), so they sit at the bottom of
the house and import nothing. The public names are zkern.ConfigError, zkern.CommError and zkern.CheckpointError.
"""


class ConfigError(ValueError):
    """A config key or value zkern cannot accept; the message names the key path and what to do."""


class CommError(RuntimeError):
    """A collective failed or timed out; the message names the rank, the collective and its purpose."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded: missing, damaged, from another model, or not plain data."""
