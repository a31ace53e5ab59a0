"""The two ways a checkpoint fails, each with a message naming the path and what to do."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the path and what is wrong."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written (a full disk, a lasting I/O error); earlier checkpoints are intact."""
