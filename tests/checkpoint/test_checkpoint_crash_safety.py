"""A rank SIGKILLed at each phase of a save (real gloo processes): the previous checkpoint
still loads and verifies, the unfinished one is never reported as the latest, and the next
save succeeds and clears the leftovers. Also a round trip between process worlds."""

from __future__ import annotations

import os

import numpy as np
import pytest
from ckpt_cases import load_body, manager_load_body, manager_save_body, random_layout, save_body
from pluribus.checkpoint.commit import CRASH_ENV
from pluribus.testing import RanksFailed, require_backend, run_ranks

pytestmark = pytest.mark.timeout(120)

LAYOUT2 = random_layout(np.random.default_rng(11), 2, (2,))
LAYOUT3 = random_layout(np.random.default_rng(12), 3, (3,))


@pytest.mark.parametrize(
    "phase, rank, new_step_visible",
    [
        ("writing", 1, False),  # a rank dies with half its file written
        ("writing", 0, False),
        ("before-metadata", 0, False),  # all data fsynced, no metadata yet
        ("before-rename", 0, False),  # metadata written, not yet renamed into place
        ("before-latest", 0, True),  # renamed: complete, only `latest` and retention left
    ],
)
def test_a_rank_killed_at_each_phase_leaves_the_previous_checkpoint(
    tmp_path, phase, rank, new_step_visible
):
    require_backend("gloo")
    directory = str(tmp_path / "run")
    assert run_ranks(manager_save_body, 2, args=(directory, 1, LAYOUT2, 2)) == [True, True]
    with pytest.raises(RanksFailed) as excinfo:
        run_ranks(
            manager_save_body,
            2,
            "gloo",
            env={CRASH_ENV: f"{phase}:{rank}"},
            timeout=60,
            args=(directory, 2, LAYOUT2, 2),
        )
    assert excinfo.value.kinds()[rank] == "died"
    leftovers = sorted(os.listdir(directory))
    latest = 2 if new_step_visible else 1
    if not new_step_visible:
        assert any(".tmp-" in name for name in leftovers) or phase == "writing", leftovers
        assert "step-2" not in leftovers
    # the newest complete checkpoint loads and verifies, in another world size
    assert run_ranks(manager_load_body, 3, args=(directory, LAYOUT3)) == [latest] * 3
    assert run_ranks(manager_save_body, 2, args=(directory, 3, LAYOUT2, 2)) == [True, True]
    assert sorted(os.listdir(directory)) == sorted([f"step-{latest}", "step-3", "latest"])
    with open(os.path.join(directory, "latest")) as f:
        assert f.read().strip() == "step-3"
    assert run_ranks(manager_load_body, 1, args=(directory, random_layout(
        np.random.default_rng(0), 1, (1,)))) == [3]  # fmt: skip


def test_processes_round_trip_two_d_uneven_to_three_ranks(tmp_path):
    require_backend("gloo")
    path = str(tmp_path / "c")
    layout = random_layout(np.random.default_rng(21), 4, (2, 2))
    layout["tensors"]["model.layers.0.weight"] = [[0, [6, 1]], [1, [2, 3]]]
    assert run_ranks(save_body, 4, "gloo", args=(layout, path)) == [True] * 4
    assert run_ranks(load_body, 3, "gloo", args=(LAYOUT3, path)) == [True] * 3
