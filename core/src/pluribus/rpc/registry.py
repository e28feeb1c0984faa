"""What a worker agrees to run: functions and classes registered with ``@expose``, by name.

A call names what to run; it never carries code. The name is the function's module and
qualified name (``"mymodule.step"``) unless ``@expose(name=...)`` gives another, so every worker
that imports the same module registers the same names. Methods can be called only on instances
of exposed classes, and only public ones (no leading underscore).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_lock = threading.Lock()
_exposed: dict[str, Callable[..., Any]] = {}
NAME_ATTRIBUTE = "__pluribus_rpc_name__"


def expose(fn: F | None = None, *, name: str | None = None):
    """Register a function or class so that other workers may call it by name.

    ``@expose`` or ``@expose(name="ps.get")``; returns ``fn`` unchanged (with its RPC name in
    ``fn.__pluribus_rpc_name__``). Registering a different object under a taken name is an
    error, so two modules cannot shadow each other's functions.
    """

    def register(target: F) -> F:
        if not callable(target):
            raise TypeError(f"@expose registers functions and classes, not {type(target).__name__}")
        key = name or f"{target.__module__}.{target.__qualname__}"
        if "<locals>" in key or "<lambda>" in key:
            raise TypeError(
                f"@expose: {key} has no stable name that other workers could import; define it "
                "at module level or give it one with @expose(name=...)"
            )
        with _lock:
            known = _exposed.get(key)
            if known is not None and known is not target and _identity(known) != _identity(target):
                raise ValueError(
                    f"@expose: the name {key!r} is already taken by {_identity(known)}; pass "
                    "another with @expose(name=...)"
                )
            _exposed[key] = target
        setattr(target, NAME_ATTRIBUTE, key)
        return target

    if fn is None:
        return register
    return register(fn)


def _identity(target: Any) -> str:
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', '?')}"


def name_of(fn: Any, who: str) -> str:
    """The name a call sends for ``fn`` (an exposed function or class, or a name)."""
    if isinstance(fn, str):
        if not fn:
            raise ValueError(f"{who}: the function name is empty")
        return fn
    key = getattr(fn, NAME_ATTRIBUTE, None)
    if key is None or lookup(key) is not fn:
        raise TypeError(
            f"{who}: {_identity(fn) if callable(fn) else repr(fn)[:80]} is not registered for "
            "RPC; decorate it with @pluribus.rpc.expose (in a module every worker imports), or "
            "pass the registered name as a string"
        )
    return key


def lookup(key: str) -> Callable[..., Any] | None:
    return _exposed.get(key)


def resolve(key: str) -> Callable[..., Any]:
    """The exposed callable for ``key``; LookupError naming what is registered otherwise."""
    target = _exposed.get(key)
    if target is None:
        known = sorted(_exposed)
        shown = ", ".join(known[:20]) + (" ..." if len(known) > 20 else "")
        raise LookupError(
            f"{key!r} is not registered on this worker (registered: {shown or 'nothing'}); "
            "expose it with @pluribus.rpc.expose in a module this worker imports"
        )
    return target


def method_of(obj: Any, method: str) -> Callable[..., Any]:
    """A public method of an instance of an exposed class; LookupError for anything else."""
    if not isinstance(method, str) or not method or method.startswith("_"):
        raise LookupError(f"{method!r} is not a public method name")
    exposed_class = any(
        isinstance(target, type) and isinstance(obj, target) for target in _exposed.values()
    )
    if not exposed_class:
        raise LookupError(
            f"methods can be called only on instances of exposed classes, and this object is a "
            f"{type(obj).__qualname__}; expose its class with @pluribus.rpc.expose"
        )
    bound = getattr(obj, method, None)
    if bound is None or not callable(bound):
        raise LookupError(f"{type(obj).__qualname__} has no method {method!r}")
    return bound
