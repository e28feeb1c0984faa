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
