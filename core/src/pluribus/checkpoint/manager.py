"""Checkpoints of a training loop in one folder: ``step-N/`` per save, the newest complete one
found again after a crash, only the last ``keep_last`` kept.

A step directory is complete when it exists under its final name (the commit renames it into
place with its metadata inside); unfinished saves are ``step-N.tmp-*`` and never count. The
coordinator writes ``latest`` (the newest step's name, for people and tools) and deletes old
steps only after the new one is in place; a step is deleted by first renaming it to
``step-N.deleting-*``, so a crash halfway through a deletion never leaves a directory that
looks complete.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import uuid

from .. import distributed as dist
from . import commit
from .load import load
from .metadata import METADATA_FILE
from .save import async_save, save, wait_for_async

_STEP = re.compile(r"step-(\d+)")
LATEST_FILE = "latest"


class CheckpointManager:
    """``manager.save(step, state)`` after a step; ``manager.load_latest(state)`` at start-up
    returns the step it restored (None when there is none). With ``async_save=True`` saves run
    in the background (:func:`pluribus.checkpoint.async_save`); ``wait()`` finishes the last
    and raises its error."""

    def __init__(
        self,
        directory: str | os.PathLike,
        keep_last: int | None = None,
        *,
        async_save: bool = False,
        process_group=None,
    ):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (or None to keep all), not {keep_last}")
        self.directory = os.path.abspath(os.fspath(directory))
        self.keep_last = keep_last
        self.async_save = async_save
        self.process_group = process_group

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"step-{step}")

    def steps(self) -> list[int]:
        """The complete checkpoints, oldest first."""
        if not os.path.isdir(self.directory):
            return []
        found = []
        for name in os.listdir(self.directory):
            match = _STEP.fullmatch(name)
            if match and os.path.isfile(os.path.join(self.directory, name, METADATA_FILE)):
                found.append(int(match.group(1)))
        return sorted(found)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state_dict: dict) -> concurrent.futures.Future | None:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        publish = lambda: self._after_publish(step)  # noqa: E731
        if self.async_save:
            return async_save(
                state_dict, self.path(step), process_group=self.process_group,
                after_publish=publish,
            )  # fmt: skip
        self.wait()
        save(state_dict, self.path(step), process_group=self.process_group, after_publish=publish)
        return None

    def wait(self) -> None:
        """Finish the save in flight; its error, if any, is raised here."""
        group = self.process_group
        if group is None and dist.is_initialized():
            group = dist.get_default_group()
        wait_for_async(group)

    def load_latest(self, state_dict: dict, *, strict: bool = True) -> int | None:
        """Load the newest complete checkpoint into ``state_dict``; its step, or None."""
        self.wait()
        step = self.latest_step()
        if step is not None:
            load(state_dict, self.path(step), strict=strict, process_group=self.process_group)
        return step

    def _after_publish(self, step: int) -> None:
        commit.crash_point("before-latest", dist.get_rank() if dist.is_initialized() else 0)
        commit.write_text_atomically(os.path.join(self.directory, LATEST_FILE), f"step-{step}\n")
        steps = self.steps()
        doomed = steps[: -self.keep_last] if self.keep_last else []
        for old in doomed:
            if old == step:
                continue
            aside = f"{self.path(old)}.deleting-{uuid.uuid4().hex[:8]}"
            os.rename(self.path(old), aside)
            shutil.rmtree(aside, ignore_errors=True)
        for name in os.listdir(self.directory):  # leftovers of crashed saves and deletions
            if name.startswith("step-") and (commit.TMP_MARK in name or ".deleting-" in name):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
        if doomed:
            commit.fsync_dir(self.directory)
