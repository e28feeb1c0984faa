"""pytest plugin (auto-loaded through the ``pytest11`` entry point): options and fixtures for
the conformance suite and for tests that need ranks."""

from __future__ import annotations

import os

import pytest

from .harness import RankPool


def require_backend(name: str) -> None:
    """Skip the calling test when no installed plugin offers backend ``name``; fail it when one
    does but the backend cannot run here, so that a broken install never hides behind a skip."""
    from ..plugins import availability, backend_specs

    status = availability(name)
    if name not in backend_specs():
        pytest.skip(f"backend {name!r} is not installed ({status.remedy or status.reason})")
    if not status.ok:
        pytest.fail(
            f"backend {name!r} is installed but cannot run: {status.reason}; {status.remedy}"
        )


def gpu_unavailable(*backends: str) -> str | None:
    """Why GPU tests on ``backends`` cannot run here (no cupy, no GPU, a backend unavailable),
    or None when they can: the reason for ``pytest.mark.skipif``."""
    from ..plugins import availability

    try:
        import cupy
    except ImportError:
        return "cupy is not installed (pip install cupy-cuda12x)"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA GPU visible"
    except Exception as exc:  # no driver
        return f"no usable CUDA GPU: {exc}"
    for name in backends:
        status = availability(name)
        if not status.ok:
            return f"backend {name} unavailable: {status.reason} ({status.remedy})"
    return None


def needs_gpu(*backends: str) -> pytest.MarkDecorator:
    """``@needs_gpu("ucc")``: skip the test, with :func:`gpu_unavailable`'s reason, where it
    cannot run."""
    reason = gpu_unavailable(*backends)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


def pytest_addoption(parser):
    group = parser.getgroup("pluribus", "pluribus backend conformance")
    group.addoption(
        "--pluribus-backend",
        default=None,
        help="backend to check with the conformance suite (e.g. threads, gloo)",
    )
    group.addoption(
        "--pluribus-world-sizes",
        default="1,2,3,4",
        help="comma-separated world sizes to check (default 1,2,3,4)",
    )
    group.addoption(
        "--pluribus-mode",
        default=None,
        choices=["threads", "processes", "inplace"],
        help="how ranks run: threads of pytest, spawned processes, or inplace "
        "(pytest itself runs under mpiexec); default: threads for the threads backend",
    )
    group.addoption(
        "--pluribus-env",
        action="append",
        default=[],
        help="KEY=VALUE set in every rank process (repeatable)",
    )
    group.addoption(
        "--pluribus-device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the checks' arrays live: cpu (numpy, default) or cuda (cupy; for backends "
        "whose devices include cuda, or hybrid groups such as cpu:gloo,cuda:nccl)",
    )
    group.addoption(
        "--pluribus-backend-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="backend option passed to init_process_group(backend_options=...) (repeatable)",
    )
    group.addoption(
        "--pluribus-timeout",
        type=float,
        default=120.0,
        help="seconds a check may take on all ranks",
    )


def pytest_generate_tests(metafunc):
    if "pluribus_pool" in metafunc.fixturenames:
        config = metafunc.config
        if config.getoption("--pluribus-mode") == "inplace":
            sizes = ["job"]
        else:
            sizes = [int(s) for s in config.getoption("--pluribus-world-sizes").split(",") if s]
        metafunc.parametrize(
            "pluribus_world_size",
            sizes,
            indirect=True,
            ids=[f"world{s}" for s in sizes],
            scope="session",
        )


@pytest.fixture(scope="session")
def pluribus_world_size(request):
    return request.param


@pytest.fixture(scope="session")
def _pluribus_pools():
    pools: dict = {}
    yield pools
    for pool in pools.values():
        pool.close()


@pytest.fixture
def pluribus_pool(request, pluribus_world_size, _pluribus_pools):
    """A :class:`RankPool` for ``--pluribus-backend`` at the parametrised world size."""
    config = request.config
    backend = config.getoption("--pluribus-backend")
    if backend is None:
        pytest.skip("no backend named: pass --pluribus-backend NAME to run the conformance suite")
    import pluribus
    from pluribus.distributed import _parse_backend

    for name in dict.fromkeys(_parse_backend(backend).values()):  # each of "cpu:X,cuda:Y"
        status = pluribus.availability(name)
        if not status.ok:
            pytest.fail(f"backend {name!r} is not available: {status.reason}; {status.remedy}")
    env = dict(item.split("=", 1) for item in config.getoption("--pluribus-env"))
    options = dict(item.split("=", 1) for item in config.getoption("--pluribus-backend-option"))
    from .checks import DEVICE_ENV

    device = config.getoption("--pluribus-device")
    if device == "cuda":
        _require_cupy_device()
    # threads and in-place ranks read it from this process, spawned ones inherit it
    os.environ[DEVICE_ENV] = env[DEVICE_ENV] = device
    mode = config.getoption("--pluribus-mode")
    key = (backend, pluribus_world_size, mode)
    pool = _pluribus_pools.get(key)
    if pool is None:
        size = 1 if pluribus_world_size == "job" else pluribus_world_size
        pool = _pluribus_pools[key] = RankPool(
            size,
            backend,
            mode,
            timeout=config.getoption("--pluribus-timeout"),
            env=env,
            backend_options=options or None,
        )
    return pool


def _require_cupy_device() -> None:
    """Fail (not skip) a cupy run that cannot see a GPU: it was asked for by name."""
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        pytest.fail(f"--pluribus-device cuda needs cupy and a CUDA GPU: {exc}")
    if count < 1:
        pytest.fail("--pluribus-device cuda: cupy sees no CUDA GPU")
