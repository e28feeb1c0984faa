"""The GPT example with ``--parallel fsdp`` trains the same model as with ``--parallel ddp``."""

import example_scripts
import numpy as np
import pytest
from pluribus.testing import run_ranks

train_gpt = example_scripts.load("train_gpt")

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_blas_thread")]


def _args(parallel):
    small = ["--preset", "tiny", "--train-windows", 128, "--eval-windows", 16, "--epochs", 1]
    small += ["--batch-size", 8, "--lr", 1e-2, "--warmup-steps", 2, "--sample-chars", 10]
    return train_gpt.parse_args(["--checkpoint-dir", "", "--parallel", parallel, *map(str, small)])


def test_gpt_example_under_fsdp_equals_ddp():
    ddp = run_ranks(train_gpt.train, 2, "threads", args=(_args("ddp"),))
    fsdp = run_ranks(train_gpt.train, 2, "threads", args=(_args("fsdp"),))
    for r in range(2):
        np.testing.assert_allclose(fsdp[r]["losses"], ddp[r]["losses"], rtol=1e-4)
    assert fsdp[0]["held_out"] == pytest.approx(ddp[0]["held_out"], rel=1e-4)
    for name, value in ddp[0]["state"].items():  # the whole parameters on every rank
        np.testing.assert_array_equal(fsdp[1]["state"][name], fsdp[0]["state"][name])
        np.testing.assert_allclose(fsdp[0]["state"][name], value, rtol=1e-3, atol=1e-5)


def _uneven_eval_args(parallel):
    small = ["--preset", "tiny", "--train-windows", 64, "--eval-windows", 17, "--epochs", 1]
    small += ["--batch-size", 8, "--lr", 1e-2, "--warmup-steps", 2, "--sample-chars", 0]
    return train_gpt.parse_args(["--checkpoint-dir", "", "--parallel", parallel, *map(str, small)])


@pytest.mark.parametrize("parallel, world", [("fsdp", 2), ("fsdp-tp", 4)])
def test_held_out_windows_that_give_the_data_ranks_different_batch_counts(parallel, world):
    """17 windows over 2 data-parallel ranks: 9 (two batches of 8) and 8 (one). Every FSDP
    forward gathers over the data-parallel ranks, so each runs as many forwards."""
    ddp = run_ranks(train_gpt.train, 2, "threads", args=(_uneven_eval_args("ddp"),))
    got = run_ranks(train_gpt.train, world, "threads", args=(_uneven_eval_args(parallel),))
    assert got[0]["held_out"] == pytest.approx(ddp[0]["held_out"], rel=1e-4)
