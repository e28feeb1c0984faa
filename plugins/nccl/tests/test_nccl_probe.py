"""The probe: is_nccl_available() and its reason/remedy, with and without cupy, fast on a CPU."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
import types

import pluribus
import pytest
from pluribus import plugins
from pluribus_nccl import runtime
from pluribus_nccl.runtime import format_nccl_version, probe

pytestmark = pytest.mark.timeout(60)

REAL_FIND_SPEC = importlib.util.find_spec


def _hide(monkeypatch, *names: str, present: tuple[str, ...] = ()) -> None:
    """Make find_spec say ``names`` are not installed and ``present`` are."""

    def find_spec(name, *args, **kwargs):
        if name in names:
            return None
        if name in present:
            return importlib.machinery.ModuleSpec(name, None)
        return REAL_FIND_SPEC(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def _fake_cupy(monkeypatch, device_count=None, nccl_available=True, nccl_version=22103):
    """Put a stand-in cupy (with cupy.cuda and cupy.cuda.nccl) into sys.modules."""
    cupy = types.ModuleType("cupy")
    cupy.__version__ = "99.0"
    cuda = types.ModuleType("cupy.cuda")

    def get_device_count():
        if isinstance(device_count, Exception):
            raise device_count
        return device_count

    cuda.runtime = types.SimpleNamespace(getDeviceCount=get_device_count)
    nccl = types.ModuleType("cupy.cuda.nccl")
    nccl.available = nccl_available
    nccl.get_version = lambda: nccl_version
    cuda.nccl = nccl
    cupy.cuda = cuda
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.nccl", nccl)
    _hide(monkeypatch, "nvidia.nccl", "nvidia.cu13", "nvidia.cu12", present=("cupy",))
    monkeypatch.delenv(runtime.NCCL_LIBRARY_ENV, raising=False)


def test_without_cupy_the_probe_says_so_in_milliseconds(monkeypatch):
    _hide(monkeypatch, "cupy")
    had_cupy = "cupy" in sys.modules
    start = time.perf_counter()
    status = probe()
    elapsed = time.perf_counter() - start
    assert not status.ok
    assert "cupy is not installed" in status.reason
    assert "cupy-cuda12x" in status.remedy and "pluribus-nccl[cuda12]" in status.remedy
    assert elapsed < 0.1, f"probe took {elapsed * 1000:.0f} ms"
    assert ("cupy" in sys.modules) == had_cupy, "the probe imported cupy although it is absent"


def test_is_nccl_available_goes_through_the_core(monkeypatch):
    _hide(monkeypatch, "cupy")
    plugins._probe_cache.pop("nccl", None)
    try:
        assert pluribus.is_nccl_available() is False
        status = pluribus.availability("nccl")
        assert "cupy is not installed" in status.reason
        assert "nccl" not in pluribus.available_backends()
    finally:
        plugins._probe_cache.pop("nccl", None)


def test_cupy_without_a_device_is_reported(monkeypatch):
    _fake_cupy(monkeypatch, device_count=RuntimeError("cudaErrorNoDevice: no CUDA-capable device"))
    status = probe()
    assert not status.ok
    assert "no CUDA device is visible" in status.reason
    assert "cudaErrorNoDevice" in status.reason
    assert "nvidia-smi" in status.remedy and "CUDA_VISIBLE_DEVICES" in status.remedy


def test_cupy_with_zero_devices_is_reported(monkeypatch):
    _fake_cupy(monkeypatch, device_count=0)
    status = probe()
    assert not status.ok and "no CUDA device is visible" in status.reason


def test_missing_nccl_library_is_reported(monkeypatch):
    _fake_cupy(monkeypatch, device_count=2, nccl_available=False)
    status = probe()
    assert not status.ok
    assert "NCCL library could not be loaded" in status.reason
    assert "nvidia-nccl-cu12" in status.remedy and runtime.NCCL_LIBRARY_ENV in status.remedy


def test_a_user_nccl_library_is_tried_when_cupy_finds_none(monkeypatch, tmp_path):
    _fake_cupy(monkeypatch, device_count=1, nccl_available=False)
    missing = tmp_path / "libnccl.so.2"
    monkeypatch.setenv(runtime.NCCL_LIBRARY_ENV, str(missing))
    status = probe()
    assert not status.ok
    assert f"loading {missing} failed" in status.reason


def test_a_broken_cupy_import_is_reported(monkeypatch):
    _hide(monkeypatch, present=("cupy",))
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` raise ImportError
    status = probe()
    assert not status.ok and "failed to import" in status.reason
    assert "cupy-cuda12x" in status.remedy


def test_everything_present_is_available_with_versions(monkeypatch):
    _fake_cupy(monkeypatch, device_count=2, nccl_version=22103)
    status = probe()
    assert status.ok, status.reason
    assert status.version == "NCCL 2.21.3, cupy 99.0"
    assert status.details == {"devices": 2}


def test_the_probe_never_raises(monkeypatch):
    def explode(*args, **kwargs):
        raise OSError("disk on fire")

    monkeypatch.setattr(importlib.util, "find_spec", explode)
    status = probe()
    assert not status.ok and "disk on fire" in status.reason


def test_nccl_version_codes():
    assert format_nccl_version(21903) == "2.19.3"
    assert format_nccl_version(23203) == "2.32.3"
    assert format_nccl_version(2804) == "2.8.4"


def test_importing_the_plugin_imports_no_cupy():
    code = (
        "import sys, pluribus_nccl, pluribus_nccl.plugin as p\n"
        "specs = list(p.pluribus_backends())\n"
        "assert [s.name for s in specs] == ['nccl'] and specs[0].devices == ('cuda',)\n"
        "assert specs[0].priority == 60\n"
        "assert 'cupy' not in sys.modules, 'cupy imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_entry_point_registers_the_backend():
    specs = plugins.backend_specs()
    assert "nccl" in specs
    spec, plugin_name = specs["nccl"]
    assert plugin_name == "nccl" and spec.devices == ("cuda",)


def test_a_real_cupy_without_a_device_says_so():
    if REAL_FIND_SPEC("cupy") is None:
        pytest.skip("cupy is not installed here")
    import cupy

    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception:
        count = 0
    if count:
        pytest.skip("a GPU is visible here")
    status = probe()
    assert not status.ok and "no CUDA device is visible" in status.reason
