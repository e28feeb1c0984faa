"""The digits example: it learns, and a run resumed from its checkpoint equals an unbroken one."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import example_scripts
import numpy as np
import pytest
from pluribus.testing import require_backend, run_ranks

pytest.importorskip(
    "sklearn", reason="the example needs scikit-learn: pip install 'pluribus[examples]'"
)

train_digits = example_scripts.load("train_digits")

pytestmark = pytest.mark.usefixtures("one_blas_thread")


def _args(tmp_path, *extra):
    return train_digits.parse_args(
        ["--checkpoint-dir", str(tmp_path), "--no-progress", *map(str, extra)]
    )


@pytest.mark.timeout(120)
def test_digits_reaches_95_percent_on_two_thread_ranks(tmp_path):
    results = run_ranks(train_digits.train, 2, "threads", args=(_args(tmp_path),))
    assert results[0]["accuracy"] == results[1]["accuracy"] >= 0.95
    assert (tmp_path / "step-20" / "metadata.json").exists()  # pluribus.checkpoint


@pytest.mark.timeout(120)
def test_resuming_from_the_checkpoint_gives_the_same_model_as_an_unbroken_run(tmp_path):
    first = run_ranks(
        train_digits.train,
        2,
        "threads",
        args=(_args(tmp_path / "a", "--epochs", 1, "--batch-size", 128),),
    )
    assert first[0]["start_epoch"] == 0
    resumed = run_ranks(
        train_digits.train,
        2,
        "threads",
        args=(_args(tmp_path / "a", "--epochs", 2, "--batch-size", 128, "--resume"),),
    )
    assert resumed[0]["start_epoch"] == 1
    fresh = run_ranks(
        train_digits.train,
        2,
        "threads",
        args=(_args(tmp_path / "a", "--epochs", 1, "--batch-size", 128),),
    )
    assert fresh[0]["start_epoch"] == 0, "without --resume or a restart a run starts afresh"
    unbroken = run_ranks(
        train_digits.train,
        2,
        "threads",
        args=(_args(tmp_path / "b", "--epochs", 2, "--batch-size", 128),),
    )
    assert unbroken[0]["losses"][-len(resumed[0]["losses"]) :] == resumed[0]["losses"]
    for name, value in unbroken[0]["state"].items():
        np.testing.assert_array_equal(resumed[0]["state"][name], value, err_msg=name)


def _launcher():
    launcher = Path(sys.executable).with_name("pluribus-run")
    if not launcher.exists() or importlib.util.find_spec("pluribus.run") is None:
        pytest.skip("pluribus-run is not installed")
    require_backend("gloo")
    return str(launcher)


@pytest.mark.timeout(240)
def test_pluribus_run_on_gloo_resumes_after_a_rank_crashes(tmp_path):
    """The README's command, with one crash: --max-restarts brings the job back and it resumes
    from the last epoch's checkpoint."""
    cmd = [
        _launcher(),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        str(example_scripts.EXAMPLES / "train_digits.py"),
        "--checkpoint-dir",
        str(tmp_path),
        "--epochs",
        "5",
        "--no-progress",
        "--simulate-failure-at-epoch",
        "2",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert "simulating a crash at epoch 2" in output
    assert "at epoch 2 (restart 1)" in output
    accuracy = float(output.split("held-out accuracy ")[1].split("%")[0])
    assert accuracy >= 95, output


def test_default_checkpoint_folder_is_the_users_cache_not_the_working_directory(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    folder = Path(train_digits.parse_args([]).checkpoint_dir)
    assert folder.is_absolute()
    assert folder == Path("/somewhere/cache/pluribus/checkpoints/digits").resolve()
