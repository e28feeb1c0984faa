"""Small records that plugins yield and the core passes around."""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import Backend
    from .store import Store


#: The array devices a backend can carry.
DEVICES = ("cpu", "cuda")
_BACKEND_NAME = re.compile(r"[a-z][a-z0-9_-]*")


class ReduceOp(enum.Enum):
    """How a reducing collective combines the ranks' values (torch.distributed's names)."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"
    BAND = "band"
    BOR = "bor"
    BXOR = "bxor"

    @property
    def bitwise(self) -> bool:
        return self in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR)


@dataclass(frozen=True)
class Availability:
    """Whether a backend can be used here; when not, why and what fixes it."""

    ok: bool
    reason: str = ""
    remedy: str = ""
    version: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.ok, bool):
            raise TypeError(f"Availability.ok must be True or False, not {self.ok!r}")
        for name in ("reason", "remedy", "version"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(
                    f"Availability.{name} must be a string, not {getattr(self, name)!r}"
                )
        if not self.ok and not self.reason:
            raise ValueError(
                "Availability(False) needs a reason saying why the backend cannot run here "
                "(and a remedy saying what fixes it)"
            )


@dataclass(frozen=True)
class BackendContext:
    """Everything a backend's ``create`` gets: who this rank is and how to reach the others.

    ``store`` is already scoped to this group (a prefix view), so keys a backend writes cannot
    collide with another group's. ``options`` carries backend-specific settings passed to
    ``init_process_group(..., backend_options=...)``.
    """

    rank: int
    size: int
    store: Store
    timeout: float
    group_name: str = "default"
    device: str = "cpu"
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BackendSpec:
    """A backend a plugin offers.

    ``create(ctx: BackendContext) -> Backend`` builds one rank's endpoint; ``probe() ->
    Availability`` must be cheap, must not raise, and is where a plugin imports its heavy library.
    ``devices`` lists the array devices the backend carries ("cpu", "cuda"). Among available
    backends for a device, the highest ``priority`` is picked when the user names none.
    """

    name: str
    create: Callable[[BackendContext], Backend]
    probe: Callable[[], Availability] = lambda: Availability(True)
    devices: tuple[str, ...] = ("cpu",)
    priority: int = 0
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _BACKEND_NAME.fullmatch(self.name):
            raise ValueError(
                f"BackendSpec name {self.name!r} must be lower-case letters, digits, '-' or '_', "
                "starting with a letter (users type it: init_process_group('gloo'))"
            )
        if not callable(self.create) or not callable(self.probe):
            raise TypeError(f"BackendSpec {self.name!r}: create and probe must be callables")
        devices = self.devices
        if isinstance(devices, str) or not devices or not set(devices) <= set(DEVICES):
            raise ValueError(
                f"BackendSpec {self.name!r}: devices={devices!r} must be a non-empty tuple of "
                f"{', '.join(repr(d) for d in DEVICES)}"
            )
        object.__setattr__(self, "devices", tuple(devices))
        if not isinstance(self.priority, int) or isinstance(self.priority, bool):
            raise TypeError(f"BackendSpec {self.name!r}: priority must be an int")


@dataclass(frozen=True)
class PluginInfo:
    """One row of ``python -m pluribus plugins``."""

    name: str
    distribution: str | None
    version: str | None
    backends: tuple[str, ...] = ()
    error: str | None = None
    builtin: bool = False
