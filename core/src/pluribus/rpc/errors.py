"""The error a remote handler's exception becomes at the caller."""

from __future__ import annotations

from ..errors import PluribusError


class RemoteError(PluribusError):
    """A call raised on another worker. ``worker`` names it, ``remote_type`` is the exception's
    type name and ``remote_traceback`` the remote traceback text (nothing is unpickled)."""

    def __init__(self, worker: str, remote_type: str, message: str, remote_traceback: str):
        self.worker = worker
        self.remote_type = remote_type
        self.remote_message = message
        self.remote_traceback = remote_traceback
        text = f"worker {worker!r} raised {remote_type}: {message}"
        if remote_traceback:
            text += f"\n--- remote traceback (worker {worker!r}) ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


#: Why a peer's connection ended, as error messages say it.
DIED = "died (its connection closed without a goodbye: the process exited or was killed)"
LEFT = "shut down"
