"""Small records that plugins yield and the core passes around."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import Backend
    from .store import Store


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


@dataclass(frozen=True)
class PluginInfo:
    """One row of ``python -m pluribus plugins``."""

    name: str
    distribution: str | None
    version: str | None
    backends: tuple[str, ...] = ()
    error: str | None = None
    builtin: bool = False
