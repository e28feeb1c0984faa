"""pluribus-run starting jobs that succeed: environment, store, secret, output, logs."""

from __future__ import annotations

import json
import os
import re
import socket

import pytest
from launcher_helpers import assert_no_processes, clean_env, run_launcher, write_script
from pluribus.run.launcher import REP_MOVSB_OFF, glibc_tunables_for_ranks

# Each rank reports its environment and proves the launcher's store works: it authenticates with
# the job's secret and meets every other rank there.
ENV_SCRIPT = """
import json, os, sys
from pluribus import TCPStore
store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=30)
rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
store.set(f"hello/{rank}", str(os.getpid()))
store.wait([f"hello/{r}" for r in range(size)], 30)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "PLURIBUS_RESTART_COUNT", "PLURIBUS_AUTH_TOKEN", "PLURIBUS_STORE_SERVED",
        "OMP_NUM_THREADS", "PYTHONUNBUFFERED", "GLIBC_TUNABLES")
print("ENV " + json.dumps({k: os.environ.get(k) for k in keys} | {"argv": sys.argv[1:]}))
print(f"to stderr from {rank}", file=sys.stderr)
"""


def _envs(stdout: str) -> dict[int, dict]:
    found = {}
    for line in stdout.splitlines():
        match = re.match(r"\[r(\d+)\] ENV (.*)", line)
        if match:
            found[int(match.group(1))] = json.loads(match.group(2))
    return found


@pytest.mark.timeout(90)
def test_four_ranks_get_their_environment_and_the_served_store(tmp_path):
    script = write_script(tmp_path, "env_job.py", ENV_SCRIPT)
    result = run_launcher("--nproc-per-node", "4", str(script), "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    envs = _envs(result.stdout)
    assert sorted(envs) == [0, 1, 2, 3]
    tunables = glibc_tunables_for_ranks(clean_env())  # this host's: set on AMD only
    ports = {e["MASTER_PORT"] for e in envs.values()}
    tokens = {e["PLURIBUS_AUTH_TOKEN"] for e in envs.values()}
    assert len(ports) == 1 and int(ports.pop()) > 0  # port 0 became a real port, one for all
    assert len(tokens) == 1 and re.fullmatch(r"[0-9a-f]{32}", tokens.pop())
    for rank, env in envs.items():
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "4"
        assert env["MASTER_ADDR"] == "127.0.0.1"
        assert env["PLURIBUS_RESTART_COUNT"] == "0"
        assert env["PLURIBUS_STORE_SERVED"] == "1"
        assert env["PYTHONUNBUFFERED"] == "1"
        assert env["argv"] == ["--lr", "0.1"]
        assert env["GLIBC_TUNABLES"] == (tunables or clean_env().get("GLIBC_TUNABLES"))
    for rank in range(4):
        assert f"[r{rank}] to stderr from {rank}" in result.stderr
    assert_no_processes(str(tmp_path))


@pytest.mark.timeout(90)
def test_port_zero_jobs_side_by_side_get_different_ports(tmp_path):
    from launcher_helpers import start_launcher

    script = write_script(tmp_path, "env_job.py", ENV_SCRIPT)
    jobs = [start_launcher("--nproc-per-node", "2", str(script)) for _ in range(2)]
    outputs = [job.communicate(timeout=60) for job in jobs]
    assert [job.returncode for job in jobs] == [0, 0], [err for _, err in outputs]
    ports = [{e["MASTER_PORT"] for e in _envs(out).values()} for out, _ in outputs]
    assert all(len(p) == 1 for p in ports) and ports[0] != ports[1]
    tokens = [{e["PLURIBUS_AUTH_TOKEN"] for e in _envs(out).values()} for out, _ in outputs]
    assert tokens[0] != tokens[1]  # a fresh secret per job


@pytest.mark.timeout(60)
def test_explicit_port_and_user_secret_are_used(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = write_script(tmp_path, "env_job.py", ENV_SCRIPT)
    env = clean_env(
        PLURIBUS_AUTH_TOKEN="my-own-secret",
        OMP_NUM_THREADS="3",
        GLIBC_TUNABLES="glibc.cpu.x86_rep_movsb_threshold=8192",
    )
    result = run_launcher("--nproc-per-node", "2", "--master-port", str(port), str(script), env=env)
    assert result.returncode == 0, result.stderr
    envs = _envs(result.stdout)
    assert {e["MASTER_PORT"] for e in envs.values()} == {str(port)}
    assert {e["PLURIBUS_AUTH_TOKEN"] for e in envs.values()} == {"my-own-secret"}
    assert {e["OMP_NUM_THREADS"] for e in envs.values()} == {"3"}  # the user's choice stays
    assert "OMP_NUM_THREADS=1" not in result.stderr
    tunables = {e["GLIBC_TUNABLES"] for e in envs.values()}
    assert tunables == {"glibc.cpu.x86_rep_movsb_threshold=8192"}  # the user's choice stays


@pytest.mark.timeout(10)
def test_ranks_on_amd_start_without_rep_movsb():
    """On AMD x86 the ranks' memmove avoids ``rep movsb`` (10x slower copies at one distance),
    after any tunables the user set; elsewhere, or when the user chose the threshold, nothing
    changes."""
    amd, intel = "vendor_id\t: AuthenticAMD\n", "vendor_id\t: GenuineIntel\n"
    assert glibc_tunables_for_ranks({}, amd) == REP_MOVSB_OFF
    assert glibc_tunables_for_ranks({}, intel) is None
    assert glibc_tunables_for_ranks({}, "") is None
    mine = {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}
    assert glibc_tunables_for_ranks(mine, amd) == f"glibc.malloc.arena_max=2:{REP_MOVSB_OFF}"
    chosen = {"GLIBC_TUNABLES": "glibc.cpu.x86_rep_movsb_threshold=2048"}
    assert glibc_tunables_for_ranks(chosen, amd) is None


@pytest.mark.timeout(60)
def test_more_ranks_than_cores_get_one_omp_thread_with_a_note(tmp_path):
    cores = len(os.sched_getaffinity(0))
    script = write_script(tmp_path, "env_job.py", ENV_SCRIPT)
    result = run_launcher("--nproc-per-node", str(cores + 1), str(script), timeout=120)
    assert result.returncode == 0, result.stderr
    assert {e["OMP_NUM_THREADS"] for e in _envs(result.stdout).values()} == {"1"}
    assert "note: OMP_NUM_THREADS=1" in result.stderr


@pytest.mark.timeout(60)
def test_module_mode_runs_a_module_with_its_arguments(tmp_path):
    package = tmp_path / "launcher_demo_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "job.py").write_text(
        "import os, sys\nprint('module rank', os.environ['RANK'], __name__, sys.argv[1:])\n"
    )
    result = run_launcher(
        "--nproc-per-node", "2", "-m", "launcher_demo_pkg.job", "x", "--y", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        assert f"[r{rank}] module rank {rank} __main__ ['x', '--y']" in result.stdout


@pytest.mark.timeout(60)
def test_log_dir_gets_every_rank_and_quiet_ranks_shows_only_rank_0(tmp_path):
    script = write_script(
        tmp_path,
        "talk.py",
        """
        import os, sys
        rank = os.environ["RANK"]
        print(f"out of rank {rank}")
        print(f"err of rank {rank}", file=sys.stderr)
        sys.stdout.write("no newline at the end")
        """,
    )
    logs = tmp_path / "logs"
    result = run_launcher(
        "--nproc-per-node", "3", "--log-dir", str(logs), "--quiet-ranks", str(script)
    )
    assert result.returncode == 0, result.stderr
    assert "[r0] out of rank 0" in result.stdout
    assert "[r0] no newline at the end" in result.stdout
    assert "[r0] err of rank 0" in result.stderr
    assert "rank 1" not in result.stdout + result.stderr
    assert "rank 2" not in result.stdout + result.stderr
    for rank in range(3):
        text = (logs / f"rank_{rank}.log").read_text()
        assert f"out of rank {rank}" in text and f"err of rank {rank}" in text
        assert "[r" not in text  # files hold the rank's own lines, unprefixed


@pytest.mark.timeout(30)
def test_bad_arguments_are_refused_before_anything_starts(tmp_path):
    result = run_launcher("--nproc-per-node", "2", str(tmp_path / "missing.py"))
    assert result.returncode == 2 and "not found" in result.stderr
    result = run_launcher("--nnodes", "2", "--master-port", "0", str(tmp_path))
    assert result.returncode == 2 and "--master-port" in result.stderr


# The launcher's store outlives a default group: one started again must not read the keys of
# the one before (the gloo arena's segment name, which is gone by then).
RESTART_SCRIPT = """
import numpy as np
import pluribus as pb
for round in range(3):
    pb.init_process_group("gloo", timeout=30)
    x = np.ones(4)
    pb.all_reduce(x)
    sub = pb.new_group([0, 1])
    y = np.ones(4)
    pb.all_reduce(y, group=sub)
    pb.destroy_process_group()
    print(f"round {round}: {x[0]} {y[0]}")
"""


@pytest.mark.timeout(90)
def test_a_process_group_started_again_after_destroy_works(tmp_path):
    pytest.importorskip("pluribus_gloo")
    script = write_script(tmp_path, "restart_job.py", RESTART_SCRIPT)
    result = run_launcher("--nproc-per-node", "2", str(script))
    assert result.returncode == 0, result.stderr
    for rank in range(2):
        for round in range(3):
            assert f"[r{rank}] round {round}: 2.0 2.0" in result.stdout
    assert_no_processes(str(tmp_path))
