"""The ucc plugin without ranks: tag layout, probing, lazy imports."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pluribus as pb
import pytest
from pluribus_ucc import probe as probe_module
from pluribus_ucc.transport import LOW_BITS, SPACE_BITS, SRC_BITS, ucx_tag


def test_tags_keep_source_subgroup_and_tag_apart():
    seen = {}
    for src in (0, 1, 7, (1 << SRC_BITS) - 1):
        for space in (0, 1, 5, (1 << SPACE_BITS) - 1):
            for low in (0, 1, (1 << 24) - 1, 1 << 24, (1 << 24) + 1, (1 << LOW_BITS) - 1):
                tag = (space << 40) + low
                value = ucx_tag(src, tag)
                assert 0 <= value < 1 << 64
                assert value not in seen, (src, tag, seen.get(value))
                seen[value] = (src, tag)
    assert ucx_tag(3, 5) >> (SPACE_BITS + LOW_BITS) == 3


@pytest.mark.parametrize(
    "src, tag",
    [(1 << SRC_BITS, 0), (0, 1 << LOW_BITS), (0, (1 << SPACE_BITS) << 40), (0, -1)],
)
def test_tags_that_do_not_fit_are_refused(src, tag):
    with pytest.raises(ValueError, match="64-bit UCX tag"):
        ucx_tag(src, tag)


def test_transports_are_read_from_the_context_description():
    info = """#      resource 0  :  md 0  dev 0  flags -- self/memory
#      resource 1  :  md 1  dev 1  flags -- tcp/eth0
#      resource 2  :  md 1  dev 2  flags -- tcp/lo
#      resource 5  :  md 4  dev 0  flags -- cma/memory
#      resource 6  :  md 5  dev 3  flags -- cuda_ipc/cuda"""
    assert probe_module.transports(info) == {
        "self": ["memory"],
        "tcp": ["eth0", "lo"],
        "cma": ["memory"],
        "cuda_ipc": ["cuda"],
    }


def test_probe_reports_a_missing_ucxx_with_its_remedy(monkeypatch):
    def broken():
        raise ImportError("No module named 'ucxx'")

    monkeypatch.setattr(probe_module, "load_ucxx", broken)
    status = probe_module.probe()
    assert not status.ok
    assert "ucxx cannot be imported" in status.reason and "No module named" in status.reason
    assert "pip install" in status.remedy and "ucc" in status.remedy


@pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="ucxx is not installed here")
def test_probe_lists_the_transports_ucx_found():
    status = pb.availability("ucc")
    assert status.ok, status.reason
    assert "UCX" in status.version
    found = status.details["transports"]
    assert "self" in found and "tcp" in found, found
    assert isinstance(status.details["cuda_transports"], list)
    assert pb.is_ucc_available()


def test_importing_the_plugin_loads_no_ucxx():
    code = (
        "import sys, pluribus, pluribus_ucc.plugin as p; "
        "list(p.pluribus_backends()); pluribus.backend_specs() if hasattr(pluribus, "
        "'backend_specs') else None; "
        "print('ucxx' in sys.modules, 'cupy' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
