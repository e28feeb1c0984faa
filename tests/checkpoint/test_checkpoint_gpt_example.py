"""The GPT example resumes from pluribus.checkpoint under --parallel fsdp (sharded model and
optimizer state) with the same losses and model as a run that never stopped, and a checkpoint
written under one parallelism resumes under another (ddp on 2 ranks, tp on 2 x 2) as if the
run had not stopped. (Under ddp alone the same is tested in tests/ddp/test_gpt_example.py.)"""

import example_scripts
import numpy as np
import pytest
from pluribus.testing import run_ranks

train_gpt = example_scripts.load("train_gpt")

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_blas_thread")]


def _args(folder, *extra, parallel="fsdp"):
    small = ["--preset", "tiny", "--train-windows", 128, "--eval-windows", 16, "--epochs", 2]
    small += ["--batch-size", 8, "--lr", 1e-2, "--warmup-steps", 2, "--sample-chars", 0]
    small += ["--parallel", parallel, *extra]
    return train_gpt.parse_args(["--checkpoint-dir", str(folder), *map(str, small)])


def test_fsdp_run_resumed_from_its_checkpoint_equals_an_unbroken_one(tmp_path):
    run_ranks(train_gpt.train, 2, "threads", args=(_args(tmp_path / "a", "--epochs-this-run", 1),))
    resumed = run_ranks(train_gpt.train, 2, "threads", args=(_args(tmp_path / "a", "--resume"),))
    assert resumed[0]["start_epoch"] == 1
    assert (tmp_path / "a" / "step-2" / "metadata.json").exists()
    unbroken = run_ranks(train_gpt.train, 2, "threads", args=(_args(tmp_path / "b"),))
    for r in range(2):
        tail = unbroken[r]["losses"][-len(resumed[r]["losses"]) :]
        np.testing.assert_allclose(resumed[r]["losses"], tail, rtol=1e-6)
    for name, value in unbroken[0]["state"].items():
        np.testing.assert_allclose(resumed[0]["state"][name], value, rtol=1e-6, err_msg=name)


# tp and fsdp-tp: 2 (data) x 2 (tensor), the data split of ddp on 2
RANKS = {"ddp": 2, "tp": 4, "fsdp-tp": 4}


@pytest.mark.parametrize(
    "saved_by, resumed_by",
    [("ddp", "tp"), ("tp", "ddp"), ("tp", "tp"), ("fsdp-tp", "ddp"), ("tp", "fsdp-tp")],
)
def test_a_checkpoint_resumes_under_another_parallelism(tmp_path, saved_by, resumed_by):
    first = _args(tmp_path / "a", "--epochs-this-run", 1, parallel=saved_by)
    run_ranks(train_gpt.train, RANKS[saved_by], "threads", args=(first,))
    then = _args(tmp_path / "a", "--resume", parallel=resumed_by)
    resumed = run_ranks(train_gpt.train, RANKS[resumed_by], "threads", args=(then,))
    assert resumed[0]["start_epoch"] == 1
    unbroken = run_ranks(
        train_gpt.train, 2, "threads", args=(_args(tmp_path / "b", parallel="ddp"),)
    )
    per = RANKS[resumed_by] // 2  # resumed ranks per ddp rank
    for r, result in enumerate(resumed):
        tail = unbroken[r // per]["losses"][-len(result["losses"]) :]
        np.testing.assert_allclose(result["losses"], tail, rtol=1e-4)
    for name, value in unbroken[0]["state"].items():
        np.testing.assert_allclose(resumed[0]["state"][name], value, rtol=1e-3, atol=1e-4)
