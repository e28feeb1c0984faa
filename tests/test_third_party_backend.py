"""A third-party backend with only send/recv, installed as a real distribution, is found by its
entry point and passes the conformance suite: the promise the backend-author tutorial makes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "store_backend"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    target = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(target),
            str(EXAMPLE),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert list(target.glob("pluribus_storebackend-*.dist-info/entry_points.txt"))
    return dict(os.environ, PYTHONPATH=str(target))


@pytest.mark.timeout(120)
def test_found_by_entry_point(installed):
    done = subprocess.run(
        [sys.executable, "-m", "pluribus", "plugins", "--json"],
        capture_output=True,
        text=True,
        env=installed,
        timeout=60,
    )
    rows = {r["plugin"]: r for r in json.loads(done.stdout)}
    assert rows["storebackend"]["distribution"] == "pluribus-storebackend"
    assert rows["storebackend"]["backends"][0]["available"]


@pytest.mark.timeout(300)
def test_passes_the_conformance_suite_across_processes(installed):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--pyargs",
            "pluribus.testing.conformance",
            "--pluribus-backend",
            "storebackend",
            "--pluribus-world-sizes",
            "3",
            "--pluribus-mode",
            "processes",
        ],
        capture_output=True,
        text=True,
        env=installed,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
