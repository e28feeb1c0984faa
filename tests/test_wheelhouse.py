"""The extras the README names install working backends: every distribution's wheel is built into
a wheelhouse, and in a fresh virtual environment ``pip install --find-links <wheelhouse>
"pluribus[gloo,mpi]"`` gives a two-rank job on gloo (under pluribus-run) and on mpi (under the
mpiexec of the mpich wheel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DISTRIBUTIONS = ["core", "plugins/gloo", "plugins/mpi", "plugins/ucc", "plugins/nccl"]

JOB = """
import sys
import numpy as np
import pluribus

pluribus.init_process_group(sys.argv[1])
x = np.full(4, pluribus.get_rank() + 1.0)
pluribus.all_reduce(x)
assert x.tolist() == [3.0] * 4, x
print(f"{sys.argv[1]} rank {pluribus.get_rank()} ok", flush=True)
pluribus.destroy_process_group()
"""


def _run(*command, timeout=600, **kwargs):
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, command))}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.timeout(900)
def test_extras_install_working_backends_from_a_wheelhouse(tmp_path):
    wheels = tmp_path / "wheelhouse"
    _run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--quiet",
        "--no-deps",
        "--no-build-isolation",
        "--wheel-dir",
        str(wheels),
        *[str(ROOT / d) for d in DISTRIBUTIONS],
    )
    built = sorted(p.name.split("-")[0] for p in wheels.glob("*.whl"))
    assert built == ["pluribus", "pluribus_gloo", "pluribus_mpi", "pluribus_nccl", "pluribus_ucc"]

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    bin_dir = env_dir / "bin"
    python = str(bin_dir / "python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PLURIBUS_", "PYTHON"))}
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env.pop("VIRTUAL_ENV", None)
    _run(
        python,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--find-links",
        str(wheels),
        "pluribus[gloo,mpi]",
        "mpich",
        env=env,
        cwd=tmp_path,
    )
    rows = {
        r["plugin"]: r
        for r in json.loads(_run(python, "-m", "pluribus", "plugins", "--json", env=env))
    }
    for name in ("gloo", "mpi"):
        assert rows[name]["backends"][0]["available"], rows[name]
    assert rows["ucc"]["version"] is None, "only the extras asked for are installed"

    job = tmp_path / "job.py"
    job.write_text(JOB)
    out = _run(
        str(bin_dir / "pluribus-run"),
        "--nproc-per-node",
        "2",
        str(job),
        "gloo",
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert "gloo rank 0 ok" in out and "gloo rank 1 ok" in out
    out = _run(
        str(bin_dir / "mpiexec"),
        "-n",
        "2",
        python,
        str(job),
        "mpi",
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert "mpi rank 0 ok" in out and "mpi rank 1 ok" in out
