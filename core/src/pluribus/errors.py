"""Exceptions. Each message says what happened, on which rank, and what to do."""

from __future__ import annotations


class PluribusError(RuntimeError):
    """Base class of every error pluribus raises on purpose."""


class BackendUnavailableError(PluribusError):
    """The named backend is not installed or cannot run here."""


class PluginError(PluribusError):
    """A plugin is broken or two plugins conflict."""


class DistTimeoutError(PluribusError, TimeoutError):
    """A blocking call did not finish within its timeout."""


class PeerError(PluribusError, ConnectionError):
    """A peer rank died, closed its connection or reported an error."""

    def __init__(self, message: str, peer: int | None = None):
        super().__init__(message)
        self.peer = peer


class CollectiveMismatchError(PluribusError):
    """Ranks called different collectives, dtypes or sizes at the same step."""


class NotInitializedError(PluribusError):
    """A collective was called before ``init_process_group``."""


class AuthenticationError(PluribusError, PermissionError):
    """A connection did not pass the shared-secret handshake."""
