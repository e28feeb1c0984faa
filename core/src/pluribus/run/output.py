"""Carrying the ranks' output to the terminal and log files, one prefixed line at a time.

One thread reads every rank's stdout and stderr pipe (``selectors``), cuts the bytes into lines,
and writes each complete line as ``[r3] text`` to the launcher's stdout or stderr, so that lines
of different ranks never interleave mid-line. With a log directory each rank's lines also go to
``rank_<r>.log``; with ``quiet_ranks`` only rank 0 reaches the terminal. The last lines of each
rank's stderr are kept for the failure summary of a rank that died without a Python traceback.
"""

from __future__ import annotations

import collections
import os
import selectors
import sys
import threading
from pathlib import Path
from typing import BinaryIO

TAIL_LINES = 20


class _Stream:
    def __init__(self, rank: int, fd: int, is_err: bool):
        self.rank = rank
        self.fd = fd
        self.is_err = is_err
        self.partial = b""


class OutputPump:
    def __init__(
        self,
        log_dir: str | os.PathLike | None = None,
        quiet_ranks: bool = False,
        prefix: bool = True,
        stdout: BinaryIO | None = None,
        stderr: BinaryIO | None = None,
    ):
        self.log_dir = Path(log_dir) if log_dir else None
        self.quiet_ranks = quiet_ranks
        self.prefix = prefix
        self.stdout = stdout or sys.stdout.buffer
        self.stderr = stderr or sys.stderr.buffer
        self.tails: dict[int, collections.deque[bytes]] = {}
        self._logs: dict[int, BinaryIO] = {}
        self._selector = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._open = 0
        self._drained = threading.Condition(self._lock)
        self._wakeup_r, self._wakeup_w = os.pipe()
        self._selector.register(self._wakeup_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._loop, name="pluribus-run-output", daemon=True)
        self._thread.start()

    def log_path(self, rank: int) -> Path | None:
        return self.log_dir / f"rank_{rank}.log" if self.log_dir else None

    def add(self, rank: int, stdout_fd: int, stderr_fd: int, header: str | None = None) -> None:
        """Start carrying a rank's pipes (the pump closes them at end of file)."""
        with self._lock:
            self.tails[rank] = collections.deque(maxlen=TAIL_LINES)
            if self.log_dir is not None:
                old = self._logs.pop(rank, None)
                if old is not None:
                    old.close()
                self.log_dir.mkdir(parents=True, exist_ok=True)
                log = open(self.log_path(rank), "ab")
                if header:
                    log.write(header.encode() + b"\n")
                    log.flush()
                self._logs[rank] = log
            for fd, is_err in ((stdout_fd, False), (stderr_fd, True)):
                os.set_blocking(fd, False)
                self._selector.register(fd, selectors.EVENT_READ, _Stream(rank, fd, is_err))
                self._open += 1
        os.write(self._wakeup_w, b"x")

    def wait_drained(self, timeout: float) -> bool:
        """Wait until every pipe added so far reached end of file (all output written)."""
        with self._drained:
            return self._drained.wait_for(lambda: self._open == 0, timeout)

    def tail(self, rank: int) -> list[str]:
        with self._lock:
            lines = list(self.tails.get(rank, ()))
        return [line.decode(errors="replace").rstrip("\n") for line in lines]

    def _loop(self) -> None:
        while True:
            for key, _ in self._selector.select():
                if key.data is None:
                    os.read(self._wakeup_r, 4096)
                    continue
                stream: _Stream = key.data
                try:
                    chunk = os.read(stream.fd, 1 << 16)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    self._emit(stream, chunk)
                else:
                    self._close(stream)

    def _emit(self, stream: _Stream, chunk: bytes) -> None:
        data = stream.partial + chunk
        cut = data.rfind(b"\n") + 1
        stream.partial = data[cut:]
        if cut:
            self._write(stream, data[:cut].splitlines(keepends=True))

    def _close(self, stream: _Stream) -> None:
        if stream.partial:
            self._write(stream, [stream.partial + b"\n"])
            stream.partial = b""
        self._selector.unregister(stream.fd)
        os.close(stream.fd)
        with self._drained:
            self._open -= 1
            self._drained.notify_all()

    def _write(self, stream: _Stream, lines: list[bytes]) -> None:
        rank = stream.rank
        with self._lock:
            if stream.is_err:
                self.tails[rank].extend(lines)
            log = self._logs.get(rank)
        if log is not None:
            log.writelines(lines)
            log.flush()
        if self.quiet_ranks and rank != 0:
            return
        out = self.stderr if stream.is_err else self.stdout
        tag = f"[r{rank}] ".encode() if self.prefix else b""
        text = b"".join(tag + line for line in lines)
        try:
            out.write(text)
            out.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        with self._lock:
            for log in self._logs.values():
                log.close()
            self._logs.clear()
