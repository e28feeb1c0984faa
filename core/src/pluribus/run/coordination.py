"""How the launchers of a job agree: where the job's store is, when to stop, whether to restart.

On one host there is one launcher and nothing to agree on (:class:`SingleNode`). With several
hosts (:class:`MultiNode`) the launcher of node 0 serves a control store on ``--master-port``
that every other launcher joins; for each attempt it also serves a fresh store for the ranks (a
store's keys must not outlive the attempt that wrote them) and publishes its port there. A
launcher whose rank fails raises a stop flag that the others poll; after an attempt each
launcher posts a report of its ranks, and node 0 decides for everyone (success, restart or
failure, and the root cause) from all reports.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ..errors import PluribusError
from ..store import TCPStore

#: How often a launcher looks at the control store for a stop flag while its ranks run.
POLL_SECONDS = 0.2


class SingleNode:
    """One host: the launcher serves each attempt's store itself."""

    nnodes = 1

    def __init__(self, host: str, port: int, token: str | None, timeout: float):
        self.host = host
        self.port = port
        self.token = token
        self.timeout = timeout
        self.job_store: TCPStore | None = None

    def start_attempt(self, attempt: int) -> tuple[str, int]:
        """Serve a fresh store for the attempt's ranks; return the address they connect to."""
        self.close_job_store()
        self.job_store = TCPStore(
            self.host, self.port, is_master=True, timeout=self.timeout, auth_token=self.token
        )
        return self.host, self.job_store.port

    def stop_requested(self, attempt: int) -> bool:
        return False

    def request_stop(self, attempt: int) -> None:
        pass

    def decide(self, attempt: int, report: dict[str, Any], decide) -> dict[str, Any]:
        return decide([report])

    def close_job_store(self) -> None:
        if self.job_store is not None:
            self.job_store.close()
            self.job_store = None

    def close(self) -> None:
        self.close_job_store()


class MultiNode(SingleNode):
    """Several hosts, joined through the control store served by node 0's launcher."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None,
        timeout: float,
        node_rank: int,
        nnodes: int,
        config: dict[str, Any],
    ):
        super().__init__(host, 0, token, timeout)
        self.node_rank = node_rank
        self.nnodes = nnodes
        self._last_poll = 0.0
        self._stop_seen = False
        self.control = TCPStore(
            host, port, is_master=(node_rank == 0), timeout=timeout, auth_token=token
        )
        self._join(config)

    def _join(self, config: dict[str, Any]) -> None:
        mine = json.dumps(config, sort_keys=True)
        if self.node_rank == 0:
            self.control.set("run/config", mine)
        theirs = self.control.get("run/config", self.timeout).decode()
        if theirs != mine:
            raise PluribusError(
                f"node {self.node_rank}: this launcher was started with {mine}, node 0 with "
                f"{theirs}; start every node's pluribus-run with the same --nnodes and "
                "--nproc-per-node"
            )
        self.control.set(f"run/joined/{self.node_rank}", "1")
        self.control.wait([f"run/joined/{n}" for n in range(self.nnodes)], self.timeout)

    def start_attempt(self, attempt: int) -> tuple[str, int]:
        key = f"run/{attempt}/store_port"
        self._stop_seen = False
        if self.node_rank == 0:
            host, port = super().start_attempt(attempt)
            self.control.set(key, str(port))
            return host, port
        return self.host, int(self.control.get(key, self.timeout))

    def stop_requested(self, attempt: int) -> bool:
        if self._stop_seen:
            return True
        now = time.monotonic()
        if now - self._last_poll < POLL_SECONDS:
            return False
        self._last_poll = now
        self._stop_seen = self.control.check([f"run/{attempt}/stop"])
        return self._stop_seen

    def request_stop(self, attempt: int) -> None:
        self._stop_seen = True
        self.control.add(f"run/{attempt}/stop", 1)

    def decide(self, attempt: int, report: dict[str, Any], decide) -> dict[str, Any]:
        """Post this node's report; node 0 waits for every report and publishes the verdict."""
        self.control.set(f"run/{attempt}/report/{self.node_rank}", json.dumps(report))
        key = f"run/{attempt}/decision"
        if self.node_rank != 0:
            decision = json.loads(self._wait_long(key))
            try:
                self.control.set(f"run/{attempt}/ack/{self.node_rank}", "1")
            except PluribusError:
                pass  # node 0 saw the ack and closed the store before its reply reached us
            return decision
        reports = [report]
        missing = []
        for node in range(1, self.nnodes):
            name = f"run/{attempt}/report/{node}"
            try:
                reports.append(json.loads(self._wait_long(name, stop_aware=True, attempt=attempt)))
            except PluribusError:
                missing.append(node)
        decision = decide(reports, missing_nodes=missing)
        self.control.set(key, json.dumps(decision))
        # Keep serving until the other launchers have read the verdict (they may exit next).
        acks = [f"run/{attempt}/ack/{n}" for n in range(1, self.nnodes) if n not in missing]
        try:
            self.control.wait(acks, min(self.timeout, 30.0))
        except PluribusError:
            pass
        return decision

    def _wait_long(self, key: str, stop_aware: bool = False, attempt: int = 0) -> bytes:
        """Wait for ``key`` while the other nodes' ranks may still be running (a whole job);
        once a stop was requested, give them only ``timeout`` seconds more."""
        deadline = None
        while True:
            if self.control.check([key]):
                return self.control.get(key, self.timeout)
            if stop_aware and deadline is None and self.stop_requested(attempt):
                deadline = time.monotonic() + min(self.timeout, 60.0)
            if deadline is not None and time.monotonic() > deadline:
                raise PluribusError(f"no {key} from the other launcher")
            time.sleep(POLL_SECONDS)

    def close(self) -> None:
        super().close()
        self.control.close()
