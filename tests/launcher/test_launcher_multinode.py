"""One job on two "hosts": two network namespaces joined by a veth pair, a launcher in each.

The addresses are from TEST-NET-1 (192.0.2.0/24, reserved for documentation and tests) and exist
only inside the namespaces the fixture makes. Skips where namespaces cannot be made.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from launcher_helpers import (
    assert_no_processes,
    clean_env,
    job_backends,
    kill_session,
    start_launcher,
    write_script,
)

pytestmark = pytest.mark.netns

NODE_ADDRESSES = ("192.0.2.1", "192.0.2.2")
PORT = "29511"


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture
def two_hosts():
    """Names of two network namespaces that reach each other at NODE_ADDRESSES."""
    if shutil.which("ip") is None:
        pytest.skip("no `ip` binary (iproute2) to make network namespaces")
    if os.geteuid() != 0:
        pytest.skip("making network namespaces needs root")
    tag = f"{os.getpid() % 100000}"
    names = (f"plrb{tag}a", f"plrb{tag}b")
    links = (f"plrb{tag}va", f"plrb{tag}vb")
    made: list[str] = []
    try:
        for name in names:
            result = _ip("netns", "add", name)
            if result.returncode != 0:
                pytest.skip(f"cannot make a network namespace: {result.stderr.strip()}")
            made.append(name)
        steps = [
            ("link", "add", links[0], "type", "veth", "peer", "name", links[1]),
            ("link", "set", links[0], "netns", names[0]),
            ("link", "set", links[1], "netns", names[1]),
        ]
        for name, link, address in zip(names, links, NODE_ADDRESSES, strict=True):
            steps += [
                ("-n", name, "addr", "add", f"{address}/24", "dev", link),
                ("-n", name, "link", "set", link, "up"),
                ("-n", name, "link", "set", "lo", "up"),
            ]
        for step in steps:
            result = _ip(*step)
            if result.returncode != 0:
                pytest.skip(
                    f"cannot set up the test network (ip {' '.join(step)}): {result.stderr.strip()}"
                )
        yield names
    finally:
        for name in made:  # deleting a namespace deletes its end of the veth pair, and the pair
            _ip("netns", "del", name)


def _run_two_nodes(hosts, script, env, nproc: int = 2, timeout: float = 90, extra=()):
    procs = []
    try:
        for node, host in enumerate(hosts):
            procs.append(
                start_launcher(
                    "--nnodes",
                    "2",
                    "--node-rank",
                    str(node),
                    "--nproc-per-node",
                    str(nproc),
                    "--master-addr",
                    NODE_ADDRESSES[0],
                    "--master-port",
                    PORT,
                    "--join-timeout",
                    "30",
                    *extra,
                    str(script),
                    env=env,
                    prefix=("ip", "netns", "exec", host),
                )
            )
        outputs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            kill_session(p)
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs, strict=True)]


JOB = """
import os
import numpy as np
import pluribus
pluribus.init_process_group(os.environ["JOB_BACKEND"], timeout=30)
rank = pluribus.get_rank()
x = np.full(5, rank + 1, dtype=np.int64)
pluribus.all_reduce(x)
print(f"rank {rank} node {os.environ['NODE_RANK']} sum {x.tolist()}")
restart = os.environ["PLURIBUS_RESTART_COUNT"]
if os.environ.get("FAIL_RANK") == str(rank) and restart == os.environ.get("FAIL_IN", restart):
    raise RuntimeError(f"rank {rank} failed on node {os.environ['NODE_RANK']}")
pluribus.barrier()
pluribus.destroy_process_group()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", job_backends())
def test_one_job_across_two_hosts(two_hosts, tmp_path, backend):
    script = write_script(tmp_path, "two_hosts.py", JOB, storewire=True)
    env = clean_env(JOB_BACKEND=backend, PLURIBUS_AUTH_TOKEN="two-host-secret")
    results = _run_two_nodes(two_hosts, script, env)
    both = "\n----- node 1:\n".join(err for _, _, err in results)
    assert [code for code, _, _ in results] == [0, 0], both
    for node, (_, out, _) in enumerate(results):
        for rank in (2 * node, 2 * node + 1):
            assert f"[r{rank}] rank {rank} node {node} sum [10, 10, 10, 10, 10]" in out
    assert_no_processes(str(tmp_path))


@pytest.mark.timeout(120)
def test_failure_on_the_second_host_is_reported_on_both(two_hosts, tmp_path):
    script = write_script(tmp_path, "two_hosts.py", JOB, storewire=True)
    env = clean_env(JOB_BACKEND="storewire", PLURIBUS_AUTH_TOKEN="s", FAIL_RANK="3")
    results = _run_two_nodes(two_hosts, script, env)
    for code, _, err in results:
        assert code == 1, err
        assert "root cause: rank 3 raised RuntimeError (exit code 1)" in err
        assert "RuntimeError: rank 3 failed on node 1" in err
        assert "node 1, local rank 1" in err
    assert_no_processes(str(tmp_path))


@pytest.mark.timeout(120)
def test_restart_across_two_hosts_gets_a_fresh_store(two_hosts, tmp_path):
    script = write_script(tmp_path, "two_hosts.py", JOB, storewire=True)
    env = clean_env(JOB_BACKEND="storewire", PLURIBUS_AUTH_TOKEN="s", FAIL_RANK="2", FAIL_IN="0")
    results = _run_two_nodes(two_hosts, script, env, extra=("--max-restarts", "1"))
    for code, _, err in results:
        assert code == 0, err
        assert "root cause: rank 2 raised RuntimeError (exit code 1)" in err
        assert "restarting the job (restart 1 of 1, PLURIBUS_RESTART_COUNT=1)" in err
    for node, (_, out, _) in enumerate(results):
        for rank in (2 * node, 2 * node + 1):
            assert out.count(f"[r{rank}] rank {rank} node {node} sum [10, 10, 10, 10, 10]") == 2
