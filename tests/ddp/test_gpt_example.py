"""The GPT example: it learns on the standard library's text, and resuming equals not stopping."""

from pathlib import Path

import example_scripts
import numpy as np
import pytest
from pluribus.testing import run_ranks

train_gpt = example_scripts.load("train_gpt")

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_blas_thread")]


def _args(folder, *extra):
    small = ["--preset", "tiny", "--train-windows", 512, "--eval-windows", 32]
    small += ["--batch-size", 8, "--lr", 1e-2, "--warmup-steps", 5, "--sample-chars", 40]
    return train_gpt.parse_args(["--checkpoint-dir", str(folder), *map(str, small + list(extra))])


def test_gpt_example_beats_the_unigram_baseline_on_two_thread_ranks(tmp_path):
    results = run_ranks(train_gpt.train, 2, "threads", args=(_args(tmp_path, "--epochs", 2),))
    first, second = results
    assert first["losses"] != second["losses"]  # each rank trained on its own share
    assert first["held_out"] == second["held_out"]
    assert first["held_out"][-1] < first["baseline"] - 0.25  # 64 steps of a tiny model
    assert first["sample"].startswith("def ") and len(first["sample"]) == 44
    assert (tmp_path / "step-2" / "metadata.json").exists()  # pluribus.checkpoint
    for name, value in first["state"].items():
        np.testing.assert_array_equal(second["state"][name], value, err_msg=name)


def test_resuming_the_gpt_example_gives_the_same_model_as_an_unbroken_run(tmp_path):
    first_part = _args(tmp_path / "a", "--epochs", 2, "--epochs-this-run", 1)
    run_ranks(train_gpt.train, 2, "threads", args=(first_part,))
    resumed = run_ranks(
        train_gpt.train, 2, "threads", args=(_args(tmp_path / "a", "--epochs", 2, "--resume"),)
    )
    assert resumed[0]["start_epoch"] == 1
    unbroken = run_ranks(
        train_gpt.train, 2, "threads", args=(_args(tmp_path / "b", "--epochs", 2),)
    )
    assert unbroken[0]["losses"][-len(resumed[0]["losses"]) :] == resumed[0]["losses"]
    for name, value in unbroken[0]["state"].items():
        np.testing.assert_array_equal(resumed[0]["state"][name], value, err_msg=name)


def test_the_default_checkpoint_folder_is_the_users_cache(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "/somewhere/cache")
    args = train_gpt.parse_args(["--preset", "10M"])
    assert Path(args.checkpoint_dir) == Path("/somewhere/cache/pluribus/checkpoints/gpt-10M")


def _parallel_args(parallel, *extra):
    small = ["--preset", "tiny", "--train-windows", 128, "--eval-windows", 16, "--epochs", 1]
    small += ["--batch-size", 8, "--lr", 1e-2, "--warmup-steps", 2, "--sample-chars", 10]
    small += ["--parallel", parallel, *extra]
    return train_gpt.parse_args(["--checkpoint-dir", "", *map(str, small)])


@pytest.mark.parametrize("parallel", ["tp", "fsdp-tp"])
@pytest.mark.parametrize("vocab_parallel", [False, True], ids=["blocks", "blocks-and-vocab"])
def test_gpt_example_split_by_tensor_parallelism_trains_the_ddp_model(vocab_parallel, parallel):
    """Four ranks as 2 (data) x 2 (tensor): each pair of tensor-parallel ranks sees what one
    DDP rank sees, and together they train the same model, with the vocabulary split too, and
    with the pieces fully sharded over the data-parallel ranks (2-D)."""
    ddp = run_ranks(train_gpt.train, 2, "threads", args=(_parallel_args("ddp"),))
    extra = ["--vocab-parallel"] if vocab_parallel else []
    tp = run_ranks(train_gpt.train, 4, "threads", args=(_parallel_args(parallel, *extra),))
    for r in range(4):
        np.testing.assert_allclose(tp[r]["losses"], ddp[r // 2]["losses"], rtol=1e-4)
        assert tp[r]["held_out"] == pytest.approx(ddp[0]["held_out"], rel=1e-4)
        sampled = r == 0 and not vocab_parallel  # sampling needs the whole vocabulary
        assert tp[r]["sample"].startswith("def ") if sampled else tp[r]["sample"] == ""
        for name, value in ddp[0]["state"].items():
            np.testing.assert_allclose(tp[r]["state"][name], value, rtol=1e-3, atol=5e-5)


def test_vocab_parallel_needs_tensor_parallelism(capsys):
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--vocab-parallel"])
    assert "--vocab-parallel splits a tensor-parallel model" in capsys.readouterr().err
