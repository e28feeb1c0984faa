"""Whether the ``ucc`` backend can run here: ucxx imports, UCX loads, and its transports."""

from __future__ import annotations

import os
import re

from pluribus import Availability

INSTALL = 'pip install "pluribus[ucc]"  (pulls ucxx-cu12 and libucx-cu12 from the package index)'

_RESOURCE = re.compile(r"resource\s+\d+\s*:\s*md\s+\d+\s+dev\s+\d+\s+flags\s+\S*\s+([\w-]+)/(\S+)")


def load_ucxx():
    """Import ucxx's core (Cython) API quietly; raises ImportError/OSError when it cannot load."""
    # ucxx sets UCX_MEMTYPE_CACHE, which this UCX no longer knows: keep UCX from warning about it.
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    import ucxx  # noqa: F401  (loads libucx/libucxx from their wheels and sets UCX defaults)
    from ucxx._lib import libucxx

    return libucxx


def transports(context_info: str) -> dict[str, list[str]]:
    """Transport name -> devices, read from a UCX context's ``ucp_context_print_info`` text."""
    found: dict[str, list[str]] = {}
    for tl, dev in _RESOURCE.findall(context_info):
        found.setdefault(tl, [])
        if dev not in found[tl]:
            found[tl].append(dev)
    return found


def probe() -> Availability:
    try:
        ucx = load_ucxx()
    except Exception as exc:  # ImportError, or OSError when libucx cannot be loaded
        return Availability(
            False,
            f"ucxx cannot be imported: {type(exc).__name__}: {exc}",
            INSTALL,
        )
    import ucxx

    version = f"ucxx {ucxx.__version__}, UCX {ucxx.__ucx_version__}"
    try:
        context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        info = context.info
        built_with_cuda = bool(context.cuda_support)
        del context
    except Exception as exc:
        return Availability(
            False,
            f"ucxx imports but UCX failed to start: {type(exc).__name__}: {exc}",
            "check UCX_TLS / UCX_NET_DEVICES in the environment (unset them to let UCX choose), "
            f"or reinstall: {INSTALL}",
            version,
        )
    found = transports(info)
    if not found:
        return Availability(
            False,
            "UCX started but found no transport",
            "unset UCX_TLS (or include tcp, sm and self in it)",
            version,
            {"transports": {}},
        )
    return Availability(
        True,
        version=version,
        details={
            "transports": found,
            # UCX may be built with CUDA (the wheels are) yet find no GPU: only the transports
            # found say whether cupy arrays can go device to device here.
            "cuda_transports": sorted(t for t in found if t.startswith(("cuda", "gdr"))),
            "ucx_built_with_cuda": built_with_cuda,
        },
    )
