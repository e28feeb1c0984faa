"""``python -m pluribus.checkpoint consolidate`` writes one file any safetensors reader loads
whole; ``inspect`` lists a checkpoint and, with --verify, finds a damaged byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from ckpt_cases import REPLICATED, SHARDED, plain_values, random_layout, reference, save_body
from pluribus.testing import run_ranks

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cli") / "c")
    layout = random_layout(np.random.default_rng(8), 4, (2, 2))
    assert run_ranks(save_body, 4, args=(layout, path)) == [True] * 4
    return path


def _cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "pluribus.checkpoint", *args],
        capture_output=True,
        text=True,
        timeout=50,
    )


def test_consolidate_writes_whole_tensors_any_reader_loads(saved, tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import load_file

    out = tmp_path / "model.safetensors"
    done = _cli("consolidate", saved, str(out))
    assert done.returncode == 0, done.stderr
    tensors = load_file(str(out))
    ref = reference()
    assert set(tensors) == set(SHARDED) | set(REPLICATED)
    for key, value in ref.items():
        np.testing.assert_array_equal(tensors[key], value, err_msg=key)
    with safe_open(str(out), "np") as f:
        assert json.loads(f.metadata()["step"]) == plain_values()["step"]


def test_inspect_lists_and_verifies(saved, tmp_path):
    listing = _cli("inspect", saved)
    assert listing.returncode == 0, listing.stderr
    assert "saved by 4 rank(s)" in listing.stdout and "model.layers.0.weight" in listing.stdout
    assert "7x5" in listing.stdout and "step" in listing.stdout
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", saved, str(damaged)], check=True)
    name = sorted(n for n in os.listdir(damaged) if n.endswith(".safetensors"))[0]
    with open(damaged / name, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\x00\xff")
    check = _cli("inspect", str(damaged), "--verify")
    assert check.returncode == 1 and "checksum mismatch" in check.stderr and name in check.stderr
    missing = _cli("inspect", str(tmp_path / "none"))
    assert missing.returncode == 1 and "is not a checkpoint" in missing.stderr
