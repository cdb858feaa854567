"""The one error a checkpoint raises: what is wrong, in which file and tensor, and what to do."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded: missing, damaged, from another model, or not plain data."""
