"""The one exception type for checkpoint problems."""


class CheckpointError(ValueError):
    """A checkpoint cannot be found, read or matched to the model; the message names the cause and fix."""
