"""Loading cupy and NCCL, and the probe that says whether they can run here.

Nothing here imports cupy at module import time: ``import pluribus_nccl`` stays cheap on a
machine without a GPU, and the probe answers there in milliseconds because it asks
``importlib.util.find_spec`` before importing anything.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
import sys
from contextlib import AbstractContextManager
from typing import Any

from pluribus import Availability

#: Where a user can point the plugin at a libnccl.so.2 of their own.
NCCL_LIBRARY_ENV = "PLURIBUS_NCCL_LIBRARY"

INSTALL_CUPY = 'pip install "pluribus-nccl[cuda12]"  (cupy-cuda12x and nvidia-nccl-cu12)'
INSTALL_NCCL = (
    f"pip install nvidia-nccl-cu12 (pluribus-nccl loads it from the wheel), install libnccl2 "
    f"from NVIDIA's repository, or set {NCCL_LIBRARY_ENV}=/path/to/libnccl.so.2"
)
NO_DEVICE_REMEDY = (
    "run on a machine with an NVIDIA GPU and its driver (nvidia-smi must list the GPU) and "
    "check that CUDA_VISIBLE_DEVICES does not hide it"
)


def _wheel_nccl_library() -> str | None:
    """The libnccl.so.2 of an nvidia-nccl-cu12/-cu13 wheel, or of NCCL_LIBRARY_ENV, if present."""
    explicit = os.environ.get(NCCL_LIBRARY_ENV)
    if explicit:
        return explicit
    for package in ("nvidia.nccl", "nvidia.cu13", "nvidia.cu12"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.submodule_search_locations:
            continue
        for folder in spec.submodule_search_locations:
            candidate = os.path.join(folder, "lib", "libnccl.so.2")
            if os.path.exists(candidate):
                return candidate
    return None


def load_nccl() -> tuple[Any | None, str]:
    """``cupy.cuda.nccl`` with the NCCL library loaded, or ``(None, why not)``.

    cupy finds a system NCCL, and recent cupy also the nvidia-nccl-cu12 wheel. Where it does
    not, the wheel's (or the user's) library is loaded globally and cupy's module imported again,
    so its extension binds to that library.
    """
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # cupy broken in some other way
        return None, f"importing cupy.cuda.nccl failed: {type(exc).__name__}: {exc}"
    if getattr(nccl, "available", True):
        return nccl, ""
    library = _wheel_nccl_library()
    if library is None:
        return None, "cupy could not load libnccl.so.2 and no nvidia-nccl-cu12 wheel is installed"
    try:
        ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        nccl = importlib.reload(sys.modules["cupy.cuda.nccl"])
    except Exception as exc:
        return None, f"loading {library} failed: {type(exc).__name__}: {exc}"
    if not getattr(nccl, "available", True):
        return None, f"cupy could not use the NCCL library at {library}"
    return nccl, ""


def format_nccl_version(code: int) -> str:
    """NCCL's version code as text: 21903 -> "2.19.3" (codes before 2.9 used 1000s)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def probe() -> Availability:
    """Whether the nccl backend can run here: cupy importable, a CUDA device, NCCL loadable."""
    try:
        return _probe()
    except Exception as exc:  # probing must never raise
        reason = f"probing NCCL failed: {type(exc).__name__}: {exc}"
        return Availability(False, reason, INSTALL_CUPY)


def _probe() -> Availability:
    if importlib.util.find_spec("cupy") is None:
        return Availability(
            False,
            "cupy is not installed (the nccl backend drives NCCL through cupy.cuda.nccl)",
            INSTALL_CUPY,
        )
    try:
        import cupy
    except Exception as exc:
        return Availability(
            False,
            f"cupy is installed but failed to import: {type(exc).__name__}: {exc}",
            "reinstall the cupy wheel that matches your CUDA version, e.g. "
            "pip install --force-reinstall cupy-cuda12x",
        )
    try:
        devices = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return Availability(
            False,
            f"cupy is installed but no CUDA device is visible ({type(exc).__name__}: {exc})",
            NO_DEVICE_REMEDY,
        )
    if devices < 1:
        return Availability(
            False, "cupy is installed but no CUDA device is visible", NO_DEVICE_REMEDY
        )
    nccl, why = load_nccl()
    if nccl is None:
        return Availability(False, f"the NCCL library could not be loaded: {why}", INSTALL_NCCL)
    try:
        version = format_nccl_version(int(nccl.get_version()))
    except Exception as exc:
        return Availability(
            False, f"NCCL is present but does not answer: {type(exc).__name__}: {exc}", INSTALL_NCCL
        )
    return Availability(
        True,
        version=f"NCCL {version}, cupy {cupy.__version__}",
        details={"devices": devices},
    )


class CupyRuntime:
    """The few cupy calls the backend makes, in one place so that tests can stand in for them.

    Arrays themselves (slicing, ``astype``, ``/=``, ``[...] =``) are used directly: numpy and
    cupy share that API, and inside ``with stream:`` cupy runs those kernels on ``stream``.
    """

    def __init__(self, cupy: Any, nccl: Any):
        self.cupy = cupy
        self.nccl = nccl

    @classmethod
    def load(cls) -> CupyRuntime:
        from pluribus.errors import BackendUnavailableError

        status = probe()
        if not status.ok:
            raise BackendUnavailableError(
                f"the nccl backend cannot run here: {status.reason}; to fix: {status.remedy}"
            )
        import cupy

        nccl, _ = load_nccl()
        return cls(cupy, nccl)

    def nccl_version(self) -> int:
        try:
            return int(self.nccl.get_version())
        except Exception:
            return 0

    def device_count(self) -> int:
        return int(self.cupy.cuda.runtime.getDeviceCount())

    def device(self, device_id: int) -> AbstractContextManager:
        return self.cupy.cuda.Device(device_id)

    def device_identity(self, device_id: int) -> str:
        """The GPU across the job: this host's name and the device's PCI bus id."""
        import socket

        return f"{socket.gethostname()} {self.cupy.cuda.runtime.deviceGetPCIBusId(device_id)}"

    def use_device(self, device_id: int) -> None:
        """Make ``device_id`` the calling thread's current GPU (where cupy allocates)."""
        self.cupy.cuda.Device(device_id).use()

    def new_stream(self) -> Any:
        return self.cupy.cuda.Stream(non_blocking=True)

    def current_stream(self) -> Any:
        return self.cupy.cuda.get_current_stream()

    def new_event(self) -> Any:
        return self.cupy.cuda.Event(disable_timing=True)

    def pointer(self, array: Any) -> int:
        return int(array.data.ptr)

    def device_of(self, array: Any) -> int:
        return int(array.device.id)

    def empty(self, count: int, dtype: Any) -> Any:
        return self.cupy.empty(count, dtype=dtype)

    def zeros(self, count: int, dtype: Any) -> Any:
        return self.cupy.zeros(count, dtype=dtype)
