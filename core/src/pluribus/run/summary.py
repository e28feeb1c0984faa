"""How a finished rank is described, which one failed first, and the summary a user reads.

A :class:`RankOutcome` is plain data (it travels between the launchers of a multi-node job as
JSON). The root cause is the rank that failed earliest on its own: a rank's failure time is when
it recorded its uncaught exception or its non-zero ``sys.exit`` (its error file) or, without
one, when the launcher saw it exit; ranks the launcher stopped are victims, not causes.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..debug.flight_recorder import dump_path, stuck_in


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass
class RankOutcome:
    rank: int
    local_rank: int
    node_rank: int
    host: str
    pid: int
    returncode: int | None = None
    exit_time: float | None = None
    stopped_by_launcher: bool = False
    error: dict[str, Any] | None = None
    collective: str | None = None
    stderr_tail: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode is not None and self.returncode < 0 else None

    @property
    def stopped_while_exiting(self) -> bool:
        """Raised an uncaught exception, and the launcher's signal came before it could exit."""
        return bool(self.error and self.stopped_by_launcher and self.signal)

    @property
    def exit_code(self) -> int:
        """What a shell reports for this rank: the code, or 128 + the signal's number (for a
        rank stopped while exiting after an uncaught exception, Python's 1)."""
        if self.returncode is None or self.stopped_while_exiting:
            return self.requested_exit_code or 1
        return 128 + self.signal if self.signal else self.returncode

    @property
    def requested_exit_code(self) -> int | None:
        """The code of the rank's ``sys.exit``, when that is how it failed (``sys.exit("text")``
        exits with 1, as Python does)."""
        if not self.error or self.error.get("exc_type") != "SystemExit":
            return None
        message = (self.error.get("message") or "").strip()
        return int(message) if message.lstrip("-").isdigit() else 1

    @property
    def failure_time(self) -> float:
        if self.error and "time" in self.error:
            return float(self.error["time"])
        return self.exit_time if self.exit_time is not None else float("inf")

    def failed_on_its_own(self, stop_time: float | None) -> bool:
        """Failed, and not merely because the launcher stopped it after another rank failed."""
        if self.ok or self.returncode is None:
            return False
        if not self.stopped_by_launcher:
            return True
        return stop_time is not None and self.failure_time < stop_time

    def how(self) -> str:
        if self.returncode is None:
            return "did not exit"
        if self.stopped_while_exiting and self.requested_exit_code is not None:
            return (
                f"exited with code {self.requested_exit_code} (then was stopped by the launcher "
                "while its interpreter shut down)"
            )
        if self.stopped_while_exiting:
            return (
                f"raised {self.error.get('exc_type')} (then was stopped by the launcher while "
                "exiting)"
            )
        if self.error and self.error.get("exc_type") != "SystemExit":
            return f"raised {self.error.get('exc_type')} (exit code {self.exit_code})"
        return self.how_exited()

    def how_exited(self) -> str:
        if self.signal:
            return f"killed by {signal_name(self.signal)} (exit code {self.exit_code})"
        return f"exited with code {self.returncode}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RankOutcome:
        return cls(**data)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collective_status(directory: Path, rank: int) -> str | None:
    """From a rank's flight-recorder dump: the collective it was in, or its last one."""
    record = read_json(dump_path(directory, rank))
    if not record or not record.get("entries"):
        return None
    entry = stuck_in(record)
    if entry is not None:
        waited = float(record.get("time", time.time())) - float(entry["start"])
        return (
            f"was in {entry['description']} #{entry['seq']} on group {entry['group']!r} for "
            f"{waited:.1f}s"
        )
    last = record["entries"][-1]
    state = "failed" if last["state"] == "failed" else "completed"
    return (
        f"last collective {last['description']} #{last['seq']} on group {last['group']!r} {state}"
    )


def root_cause(outcomes: list[RankOutcome], stop_time: float | None) -> RankOutcome | None:
    candidates = [o for o in outcomes if o.failed_on_its_own(stop_time)]
    if not candidates:
        return None
    return min(candidates, key=lambda o: (o.failure_time, o.rank))


def _rank_state(o: RankOutcome) -> str:
    """One line on how a rank other than the root cause ended."""
    if o.ok:
        state = "finished (exit code 0)"
    elif o.error:
        message = (o.error.get("message") or "").strip().splitlines()
        first = message[0] if message else ""
        if len(first) > 120:
            first = first[:117] + "..."
        state = f"raised {o.error.get('exc_type')}: {first}".rstrip(": ")
        state += (
            ", then stopped by the launcher while exiting"
            if o.stopped_while_exiting
            else f", {o.how_exited()}"
        )
    elif o.stopped_by_launcher and o.signal:
        state = f"stopped by the launcher ({signal_name(o.signal)})"
    else:
        state = o.how()
    if o.collective:
        state += f"; {o.collective}"
    return state


def _indent(text: str, prefix: str = "    ") -> str:
    return "\n".join(prefix + line for line in text.rstrip("\n").splitlines())


def format_summary(
    root: RankOutcome | None,
    outcomes: list[RankOutcome],
    attempt: int,
    attempts: int,
    where: str | None,
    interrupted: str | None = None,
) -> str:
    """The failure summary: root cause with its traceback, then one line per other rank."""
    bar = "=" * 72
    lines = [bar]
    if interrupted and root is None:
        lines.append(f"pluribus-run: the job was stopped by {interrupted}")
    elif root is not None:
        lines.append(
            f"pluribus-run: the job failed (attempt {attempt + 1} of {attempts}); root cause: "
            f"rank {root.rank} {root.how()}"
        )
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(root.failure_time))
        lines.append(
            f"  rank {root.rank}: host {root.host}, node {root.node_rank}, local rank "
            f"{root.local_rank}, pid {root.pid}, at {stamp}"
        )
        if root.collective:
            lines.append(f"  rank {root.rank} {root.collective}")
        if root.error and root.error.get("traceback"):
            lines.append(_indent(root.error["traceback"]))
        elif root.stderr_tail:
            lines.append(
                "  no Python traceback (it died in native code or was killed); its last "
                "lines of stderr:"
            )
            lines.append(_indent("\n".join(root.stderr_tail)))
        else:
            lines.append("  no Python traceback: it was killed or exited without raising")
    others = [
        o for o in sorted(outcomes, key=lambda o: o.rank) if root is None or o.rank != root.rank
    ]
    if others:
        lines.append("  other ranks:" if root is not None else "  ranks:")
        for o in others:
            lines.append(f"    rank {o.rank} (host {o.host}): {_rank_state(o)}")
    if where:
        lines.append(f"  rank logs, error files and flight recorder dumps: {where}")
    lines.append(bar)
    return "\n".join(lines)
