"""Finding plugins, the backends they offer, and whether each can run here."""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points

import pluggy

from . import hookspecs
from .errors import BackendUnavailableError, PluginError
from .hookspecs import hookimpl
from .types import Availability, BackendSpec, PluginInfo

ENTRY_POINT_GROUP = "pluribus"
DISABLE_ENV = "PLURIBUS_DISABLE_PLUGINS"

#: The plugin name of the core's implementation of the operation hooks.
CORE_IMPLEMENTATION = "collectives"

#: Plugins that ship inside the core, registered like any other plugin.
BUILTIN_PLUGINS = {
    "threads": "pluribus.builtin.threads",
    CORE_IMPLEMENTATION: "pluribus.builtin.collectives",
    # Debugging aids: each wraps the collective hooks only while its setting switches it on.
    "debug-detail": "pluribus.debug.detail",
    "trace": "pluribus.debug.trace",
    "flight-recorder": "pluribus.debug.flight_recorder",
}

#: The project's own backend plugins: when one is missing, the remedy is its install command.
FIRST_PARTY = {
    "gloo": "pluribus-gloo",
    "mpi": "pluribus-mpi",
    "ucc": "pluribus-ucc",
    "nccl": "pluribus-nccl",
}


def install_command(backend: str) -> str:
    return f'pip install "pluribus[{backend}]"'


@dataclass
class _Registry:
    manager: pluggy.PluginManager
    plugins: dict[str, PluginInfo]
    specs: dict[str, tuple[BackendSpec, str]] | None = None


_registry: _Registry | None = None
_registry_lock = threading.RLock()
_probe_cache: dict[str, Availability] = {}


def _disabled() -> set[str]:
    return {p.strip() for p in os.environ.get(DISABLE_ENV, "").split(",") if p.strip()}


#: A number that changes whenever a plugin is registered or unregistered, or hook-call
#: monitoring is switched on or off: groups forget which operations may skip pluggy when it
#: moves. Read it as ``plugins.generation``.
generation = 0


def moved() -> None:
    """Move :data:`generation`: what a call runs may have changed."""
    global generation
    generation += 1


class _PluginManager(pluggy.PluginManager):
    """pluggy's manager, moving :data:`generation` on every change of what a hook call runs."""

    monitored = 0

    def register(self, plugin, name=None):
        try:
            return super().register(plugin, name)
        finally:
            moved()

    def unregister(self, plugin=None, name=None):
        try:
            return super().unregister(plugin, name)
        finally:
            moved()

    def add_hookcall_monitoring(self, before, after):
        undo = super().add_hookcall_monitoring(before, after)
        self.monitored += 1
        moved()

        def undo_and_move() -> None:
            undo()
            self.monitored -= 1
            moved()

        return undo_and_move


def core_only(hook_name: str) -> bool:
    """True when the core's own implementation is the only one of ``hook_name`` and nothing
    monitors hook calls: then a synchronous call may skip pluggy, as no plugin can tell."""
    manager = get_plugin_manager()
    impls = getattr(manager.hook, hook_name).get_hookimpls()
    return not manager.monitored and len(impls) == 1 and impls[0].plugin_name == CORE_IMPLEMENTATION


def _load() -> _Registry:
    pm = _PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    disabled = _disabled()
    plugins: dict[str, PluginInfo] = {}
    for name in disabled:
        pm.set_blocked(name)
    pm.register(_DefaultProbe(), name="default-probe")
    for name, module in BUILTIN_PLUGINS.items():
        if name in disabled:
            continue
        pm.register(importlib.import_module(module), name=name)
        plugins[name] = PluginInfo(name, "pluribus", _version("pluribus"), builtin=True)
    seen: set[str] = set()
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in seen:  # the same distribution found twice on sys.path
            continue
        seen.add(ep.name)
        dist = ep.dist.name if ep.dist else None
        version = ep.dist.version if ep.dist else None
        if ep.name in disabled:
            plugins[ep.name] = PluginInfo(
                ep.name, dist, version, error=f"disabled by {DISABLE_ENV}"
            )
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:  # a broken plugin must not break the others
            plugins[ep.name] = PluginInfo(
                ep.name, dist, version, error=f"{type(exc).__name__}: {exc}"
            )
            continue
        plugins[ep.name] = PluginInfo(ep.name, dist, version)
    pm.check_pending()
    return _Registry(pm, plugins)


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def registry() -> _Registry:
    global _registry
    found = _registry  # the fast path of every collective: no lock once loaded
    if found is not None:
        return found
    with _registry_lock:
        if _registry is None:
            _registry = _load()
        return _registry


def get_plugin_manager() -> pluggy.PluginManager:
    """The process's plugin manager: built-in plugins, then the ``pluribus`` entry points."""
    return registry().manager


def reset_plugins() -> None:
    """Forget loaded plugins and probe results (tests, or after installing a plugin)."""
    global _registry
    with _registry_lock:
        _registry = None
        _probe_cache.clear()
        moved()


def plugin_infos() -> dict[str, PluginInfo]:
    reg = registry()
    backend_specs()  # fill in which plugin offers which backend
    return dict(reg.plugins)


def backend_specs() -> dict[str, tuple[BackendSpec, str]]:
    """Every backend offered, by name, with the name of the plugin offering it.

    Two plugins offering the same backend name is an error that names both.
    """
    reg = registry()
    with _registry_lock:
        if reg.specs is not None:
            return reg.specs
        specs: dict[str, tuple[BackendSpec, str]] = {}
        hook = reg.manager.hook.pluribus_backends
        for impl in reversed(hook.get_hookimpls()):
            for spec in impl.function() or ():
                if spec.name in specs:
                    other = specs[spec.name][1]
                    raise PluginError(
                        f"backend {spec.name!r} is offered by two plugins: {other!r} "
                        f"({_dist_of(reg, other)}) and {impl.plugin_name!r} "
                        f"({_dist_of(reg, impl.plugin_name)}); uninstall one or block it with "
                        f"{DISABLE_ENV}={impl.plugin_name}"
                    )
                specs[spec.name] = (spec, impl.plugin_name)
        for name, (_, plugin_name) in specs.items():
            info = reg.plugins.get(plugin_name)
            if info is not None:
                reg.plugins[plugin_name] = PluginInfo(
                    info.name,
                    info.distribution,
                    info.version,
                    info.backends + (name,),
                    info.error,
                    info.builtin,
                )
        reg.specs = specs
        return specs


def _dist_of(reg: _Registry, plugin_name: str) -> str:
    info = reg.plugins.get(plugin_name)
    return (info.distribution or "unknown distribution") if info else "unknown distribution"


class _DefaultProbe:
    """The default ``pluribus_probe_backend``: ask the spec, and turn a crash into a reason."""

    @hookimpl(trylast=True)
    def pluribus_probe_backend(self, spec: BackendSpec) -> Availability:
        try:
            return spec.probe()
        except Exception as exc:
            return Availability(
                False,
                f"probing {spec.name} failed: {type(exc).__name__}: {exc}",
                f"reinstall the plugin: {install_command(spec.name)}",
            )


def availability(name: str) -> Availability:
    """Whether backend ``name`` can run here, why not, and what fixes it. Never raises."""
    cached = _probe_cache.get(name)
    if cached is not None:
        return cached
    try:
        result = _probe(name)
    except Exception as exc:
        result = Availability(False, f"{type(exc).__name__}: {exc}", "")
    _probe_cache[name] = result
    return result


def _probe(name: str) -> Availability:
    specs = backend_specs()
    if name in specs:
        spec = specs[name][0]
        return registry().manager.hook.pluribus_probe_backend(spec=spec)
    reg = registry()
    if name in FIRST_PARTY:
        dist = FIRST_PARTY[name]
        info = reg.plugins.get(name)
        if info is not None and info.error:
            return Availability(
                False,
                f"plugin {name!r} ({dist}) is installed but did not load: {info.error}",
                f"reinstall it: pip install --force-reinstall {dist}",
            )
        return Availability(False, f"the {dist} plugin is not installed", install_command(name))
    known = ", ".join(sorted(specs)) or "none"
    return Availability(
        False,
        f"no installed plugin offers a backend named {name!r} (installed backends: {known})",
        "install the plugin that provides it; "
        + ", ".join(f"{n}: {install_command(n)}" for n in FIRST_PARTY),
    )


def is_available(name: str) -> bool:
    return availability(name).ok


def available_backends() -> list[str]:
    """Names of the backends that can run here, best first."""
    specs = backend_specs()
    ok = [n for n in specs if is_available(n)]
    return sorted(ok, key=lambda n: -specs[n][0].priority)


def resolve_backend(name: str) -> BackendSpec:
    """The spec of an available backend, or an error that says how to get it."""
    status = availability(name)
    specs = backend_specs()
    if not status.ok or name not in specs:
        remedy = f"; to fix: {status.remedy}" if status.remedy else ""
        raise BackendUnavailableError(
            f"backend {name!r} is not available: {status.reason}{remedy}. "
            f"Available here: {', '.join(available_backends()) or 'none'}"
        )
    return specs[name][0]


def default_backend(device: str = "cpu") -> str:
    """The available backend with the highest priority that carries ``device`` arrays."""
    specs = backend_specs()
    for name in available_backends():
        spec = specs[name][0]
        if device in spec.devices and name != "threads":
            return name
    if device == "cpu":
        raise BackendUnavailableError(
            f"no process backend is installed for {device} arrays; {install_command('gloo')}"
        )
    raise BackendUnavailableError(f"no backend here carries {device} arrays")
