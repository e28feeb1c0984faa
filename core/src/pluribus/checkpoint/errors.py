"""The one exception type of ``pluribus.checkpoint``."""

from ..errors import PluribusError


class CheckpointError(PluribusError):
    """A checkpoint could not be saved or loaded: what happened, on which rank, what to do."""
