"""Plugin discovery through entry points, failures that are recorded not fatal, blocking,
duplicate backends, the plugin listing, and cheap probes. Each case runs in a fresh interpreter
with fake distributions on its path, as a user's environment would have them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

GOOD_PLUGIN = """
import pluribus

@pluribus.hookimpl
def pluribus_backends():
    yield pluribus.BackendSpec(
        name="{backend}",
        create=lambda ctx: None,
        probe=lambda: pluribus.Availability({ok}, "{reason}", "{remedy}", version="9.9"),
    )
"""


def make_distribution(root: Path, dist: str, plugin: str, module: str, source: str) -> None:
    """A minimal installed distribution: its module and a dist-info with the entry point."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n")
    (info / "entry_points.txt").write_text(f"[pluribus]\n{plugin} = {module}\n")


def run_python(code: str, path: Path | None = None, **env) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, **env)
    if path is not None:
        full_env["PYTHONPATH"] = str(path)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=60,
    )


def listing(path: Path | None = None, **env) -> list[dict]:
    code = "import sys, pluribus.__main__ as m; sys.exit(m.main(['plugins', '--json']))"
    done = run_python(code, path, **env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_entry_point_plugin_is_found_and_listed(tmp_path):
    src = GOOD_PLUGIN.format(backend="fakenet", ok=True, reason="", remedy="")
    make_distribution(tmp_path, "fakenet-dist", "fakenet", "fakenet_plugin", src)
    rows = {r["plugin"]: r for r in listing(tmp_path)}
    row = rows["fakenet"]
    assert row["distribution"] == "fakenet-dist" and row["version"] == "1.2.3"
    assert row["backends"][0]["name"] == "fakenet" and row["backends"][0]["available"]
    assert rows["threads"]["builtin"]
    code = "import pluribus; print(pluribus.is_available('fakenet'), pluribus.available_backends())"
    out = run_python(code, tmp_path).stdout
    assert out.startswith("True") and "fakenet" in out


def test_broken_plugin_is_recorded_not_fatal(tmp_path):
    make_distribution(tmp_path, "broken-dist", "broken", "broken_plugin", "raise ImportError('x')")
    src = GOOD_PLUGIN.format(backend="fine", ok=True, reason="", remedy="")
    make_distribution(tmp_path, "fine-dist", "fine", "fine_plugin", src)
    rows = {r["plugin"]: r for r in listing(tmp_path)}
    assert "ImportError" in rows["broken"]["error"]
    assert rows["fine"]["backends"][0]["available"]
    table = run_python("import pluribus.__main__ as m; m.main(['plugins'])", tmp_path).stdout
    assert "plugin 'broken' did not load: ImportError" in table


def test_disable_plugins_blocks_them(tmp_path):
    src = GOOD_PLUGIN.format(backend="fakenet", ok=True, reason="", remedy="")
    make_distribution(tmp_path, "fakenet-dist", "fakenet", "fakenet_plugin", src)
    rows = {r["plugin"]: r for r in listing(tmp_path, PLURIBUS_DISABLE_PLUGINS="fakenet,threads")}
    assert "PLURIBUS_DISABLE_PLUGINS" in rows["fakenet"]["error"]
    assert rows["fakenet"]["backends"] == [] and "threads" not in rows
    out = run_python(
        "import pluribus; print(pluribus.is_available('fakenet'))",
        tmp_path,
        PLURIBUS_DISABLE_PLUGINS="fakenet",
    ).stdout
    assert out.strip() == "False"


def test_two_plugins_with_one_backend_name_is_an_error_naming_both(tmp_path):
    src = GOOD_PLUGIN.format(backend="samename", ok=True, reason="", remedy="")
    make_distribution(tmp_path, "first-dist", "first", "first_plugin", src)
    make_distribution(tmp_path, "second-dist", "second", "second_plugin", src)
    done = run_python(
        "import pluribus; pluribus.init_process_group('samename', rank=0, "
        "world_size=1, store=pluribus.HashStore())",
        tmp_path,
    )
    assert done.returncode != 0
    assert "first-dist" in done.stderr and "second-dist" in done.stderr
    assert "PLURIBUS_DISABLE_PLUGINS" in done.stderr


def test_unavailable_backend_reports_reason_and_remedy(tmp_path):
    src = GOOD_PLUGIN.format(
        backend="needslib", ok=False, reason="libfoo missing", remedy="apt install libfoo"
    )
    make_distribution(tmp_path, "needslib-dist", "needslib", "needslib_plugin", src)
    rows = {r["plugin"]: r for r in listing(tmp_path)}
    b = rows["needslib"]["backends"][0]
    assert not b["available"] and b["reason"] == "libfoo missing"
    assert b["remedy"] == "apt install libfoo"
    done = run_python(
        "import pluribus; pluribus.init_process_group('needslib', rank=0, "
        "world_size=1, store=pluribus.HashStore())",
        tmp_path,
    )
    assert "libfoo missing" in done.stderr and "apt install libfoo" in done.stderr


def test_probe_that_raises_becomes_a_reason(tmp_path):
    src = """
    import pluribus
    def probe():
        raise OSError("driver exploded")
    @pluribus.hookimpl
    def pluribus_backends():
        yield pluribus.BackendSpec(name="crashy", create=lambda ctx: None, probe=probe)
    """
    make_distribution(tmp_path, "crashy-dist", "crashy", "crashy_plugin", src)
    out = run_python(
        "import pluribus; s = pluribus.availability('crashy'); print(s.ok, s.reason)", tmp_path
    ).stdout
    assert out.startswith("False") and "driver exploded" in out


def test_missing_first_party_plugins_say_how_to_install(monkeypatch):
    code = """
    import time, pluribus
    for name in ("gloo", "mpi", "ucc", "nccl"):
        t = time.perf_counter()
        s = pluribus.availability(name)
        ok = getattr(pluribus, f"is_{name}_available")()
        print(name, s.ok == ok, f"{(time.perf_counter() - t) * 1000:.1f}", s.remedy)
    """
    out = run_python(code, PLURIBUS_DISABLE_PLUGINS="gloo,mpi,ucc,nccl").stdout.splitlines()
    assert len(out) == 4
    for line in out:
        name, consistent, ms, remedy = line.split(" ", 3)
        assert consistent == "True"
        assert float(ms) < 500, f"probing {name} took {ms} ms"
    # blocked plugins report as disabled; the unblocked-but-uninstalled case says pip install
    rows = {r["plugin"]: r for r in listing(PLURIBUS_DISABLE_PLUGINS="nccl")}
    if rows["nccl"]["error"] == "not installed":
        assert rows["nccl"]["backends"][0]["remedy"] == 'pip install "pluribus[nccl]"'


def test_unknown_backend_error_lists_installed_and_install_command():
    done = run_python(
        "import pluribus; pluribus.init_process_group('nosuch', rank=0, "
        "world_size=1, store=pluribus.HashStore())"
    )
    assert "nosuch" in done.stderr and "threads" in done.stderr
    assert 'pip install "pluribus[gloo]"' in done.stderr


def test_import_pluribus_loads_no_heavy_library():
    code = """
    import sys, pluribus, pluribus.distributed
    print([m for m in ("mpi4py", "ucxx", "cupy", "torch") if m in sys.modules])
    """
    assert run_python(code).stdout.strip() == "[]"


@pytest.mark.parametrize("variant", ["table", "json"])
def test_cli_runs_as_module(variant):
    args = ["plugins"] + (["--json"] if variant == "json" else [])
    done = subprocess.run(
        [sys.executable, "-m", "pluribus", *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    if variant == "json":
        assert any(r["plugin"] == "threads" for r in json.loads(done.stdout))
    else:
        assert done.stdout.splitlines()[0].split()[:4] == [
            "plugin",
            "distribution",
            "version",
            "backend",
        ]
