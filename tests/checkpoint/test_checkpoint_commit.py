"""Saving over an existing checkpoint: the new one replaces the old in one step, and where the
kernel cannot swap directories, a crash between the two renames is repaired on load."""

from __future__ import annotations

import os

import numpy as np
import pytest
from pluribus import checkpoint
from pluribus.checkpoint import commit

pytestmark = pytest.mark.timeout(30)


def _load(path):
    state = {"x": np.zeros(3), "step": 0}
    checkpoint.load(state, path)
    return state["step"], state["x"].tolist()


def test_overwriting_swaps_in_the_new_checkpoint_and_leaves_nothing_else(tmp_path):
    path = tmp_path / "c"
    checkpoint.save({"x": np.ones(3), "step": 1}, path)
    checkpoint.save({"x": np.full(3, 2.0), "step": 2}, path)
    assert _load(path) == (2, [2.0, 2.0, 2.0])
    assert os.listdir(tmp_path) == ["c"]


def test_without_an_atomic_swap_a_crash_between_the_renames_is_repaired(tmp_path, monkeypatch):
    path = str(tmp_path / "c")
    checkpoint.save({"x": np.ones(3), "step": 1}, path)
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    checkpoint.save({"x": np.full(3, 2.0), "step": 2}, path)  # the fallback, uninterrupted
    assert _load(path) == (2, [2.0, 2.0, 2.0])
    assert os.listdir(tmp_path) == ["c"]

    rename = os.rename

    def crash_after_first_rename(src, dst):  # the old one moved aside, the new one not in place
        rename(src, dst)
        if commit.OLD_MARK in dst:
            raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(commit.os, "rename", crash_after_first_rename)
    with pytest.raises(KeyboardInterrupt):  # not an Exception: nothing cleans up, as in a crash
        checkpoint.save({"x": np.full(3, 3.0), "step": 3}, path)
    monkeypatch.undo()
    assert not os.path.exists(path)
    assert _load(path) == (2, [2.0, 2.0, 2.0])  # load put the old one back
    checkpoint.save({"x": np.full(3, 4.0), "step": 4}, path)  # and the next save works
    assert _load(path) == (4, [4.0, 4.0, 4.0])
    leftovers = [n for n in os.listdir(tmp_path) if n != "c"]
    assert all(commit.TMP_MARK in n for n in leftovers)  # the crashed save's folder, never loaded
