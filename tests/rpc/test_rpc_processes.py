"""The RPC API between real processes: rendezvous through a TCPStore, every call across process
boundaries, an RRef passed around three workers, a SIGKILLed worker, and jobs started by
pluribus-run (env:// and the job's secret) and by mpiexec (the mpi plugin's rendezvous)."""

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
import traceback

import mpi_jobs
import numpy as np
import pluribus
import pytest
import rpc_cases as c
from pluribus import PeerError, TCPStore, rpc

pytestmark = pytest.mark.timeout(90)


def _worker(rank, world, port, scenario, conn):
    try:
        store = TCPStore("127.0.0.1", port, timeout=30)
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=world, store=store, timeout=30)
        result = SCENARIOS[scenario](rank, conn)
        start = time.monotonic()
        rpc.shutdown(timeout=5)
        conn.send(("ok", result, time.monotonic() - start))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", 0))


def _api(rank, conn):
    if rank != 0:
        return os.getpid()
    array = np.random.default_rng(1).standard_normal((64, 33)).astype(np.float32)
    pids = {rpc.rpc_sync(w, c.pid) for w in ("w1", "w2")}
    scaled = rpc.rpc_async("w2", c.scale, args=(array, 3.0)).wait()
    counter = rpc.remote("w1", c.Counter, args=(1,))
    counter.rpc_sync().add(41)
    rpc.rpc_sync("w2", c.keep, args=(counter,))  # w2 holds a handle too
    counter.release()
    alive_after_release = rpc.rpc_sync("w1", c.owned_count, args=(counter.id,))
    relayed = rpc.rpc_sync("w2", c.relay, args=(["w1", "w0"], "x"))
    rpc.rpc_sync("w2", c.drop_kept)  # w2's release travels on w2's own connection to w1
    deadline = time.monotonic() + 5
    while (freed := rpc.rpc_sync("w1", c.owned_count, args=(counter.id,))) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.01)
    with rpc.remote("w2", c.array_example) as made:
        fetched = bool(np.array_equal(made.to_here(), c.array_example()))
    info = rpc.get_worker_info("w2")
    try:
        rpc.rpc_sync("w1", c.fail, args=("k",))
        remote_error = None
    except rpc.RemoteError as exc:
        remote_error = (exc.worker, exc.remote_type, "in fail" in exc.remote_traceback)
    return {
        "pids": len(pids | {os.getpid()}),
        "scaled": bool(np.array_equal(scaled, array * 3.0)),
        "alive_after_release": alive_after_release,
        "freed": freed,
        "relayed": relayed,
        "remote_error": remote_error,
        "fetched": fetched,
        "info": (info.name, info.id),
    }


def _kill(rank, conn):
    if rank == 2:
        conn.send(("ready", None, 0))
        time.sleep(60)  # killed by the test
        return None
    futures = [rpc.rpc_async("w2", c.sleep, args=(30,), timeout=60) for _ in range(3)]
    conn.send(("ready", None, 0))
    errors = []
    for future in futures:
        try:
            future.wait()
        except PeerError as exc:
            errors.append(str(exc))
    seen = time.monotonic()
    try:
        rpc.rpc_sync("w2", c.pid)
        later = "no error"
    except PeerError as exc:
        later = str(exc)
    return {"errors": errors, "later": later, "seen": seen}


def _segments_then_kill(rank, conn):
    if rank == 1:
        conn.send(("ready", None, 0))
        time.sleep(60)  # killed by the test, holding a segment of w0's
        return None
    from pluribus.rpc.api import current_agent

    pool = current_agent().segment_pool
    big = np.random.default_rng(2).standard_normal(2**18).astype(np.float32)  # 1 MiB
    out = rpc.rpc_sync("w1", c.scale, args=(big, 2.0))
    rpc.rpc_sync("w1", c.hold, args=(big,))
    lent_before = pool.held()[0]
    conn.send(("ready", None, 0))
    while True:  # until the death is seen
        try:
            rpc.rpc_sync("w1", c.pid, timeout=2)
            time.sleep(0.05)
        except PeerError:
            break
    return {
        "parity": bool(np.array_equal(out, big * 2.0)),
        "in_segment": c.in_segment(out),
        "lent_before": lent_before,
        "lent_after": pool.held()[0],
    }


SCENARIOS = {"api": _api, "kill": _kill, "segments": _segments_then_kill}


class _Workers:
    def __init__(self, world, scenario):
        ctx = multiprocessing.get_context("spawn")
        self.store = TCPStore("127.0.0.1", 0, is_master=True, timeout=30)
        self.procs, self.conns = [], []
        for rank in range(world):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker, args=(rank, world, self.store.port, scenario, child), daemon=True
            )
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    def receive(self, rank, timeout=60):
        if not self.conns[rank].poll(timeout):
            raise AssertionError(f"worker {rank} said nothing within {timeout}s")
        status, value, seconds = self.conns[rank].recv()
        assert status in ("ok", "ready"), value
        return value, seconds

    def close(self):
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)
        for conn in self.conns:
            conn.close()
        self.store.close()


def test_every_api_across_processes_with_an_rref_passed_between_three_workers():
    workers = _Workers(3, "api")
    try:
        result, shutdown_seconds = workers.receive(0)
        for rank in (1, 2):
            workers.receive(rank)
    finally:
        workers.close()
    assert result == {
        "pids": 3,
        "scaled": True,
        "alive_after_release": 1,
        "freed": 0,
        "relayed": ["w2", "w1", "w0", "x"],
        "remote_error": ("w1", "KeyError", True),
        "fetched": True,
        "info": ("w2", 2),
    }
    assert shutdown_seconds < 5


def test_a_sigkilled_worker_fails_pending_calls_within_seconds_and_shutdown_does_not_hang():
    workers = _Workers(3, "kill")
    try:
        workers.receive(2)
        workers.receive(0)
        workers.receive(1)
        time.sleep(0.3)  # the calls are on their way
        killed = time.monotonic()
        os.kill(workers.procs[2].pid, signal.SIGKILL)
        results = [workers.receive(rank, timeout=30) for rank in (0, 1)]
    finally:
        workers.close()
    for result, shutdown_seconds in results:
        assert len(result["errors"]) == 3
        assert all("worker 'w2' (rank 2) died" in e for e in result["errors"]), result
        assert "worker 'w2'" in result["later"]
        assert result["seen"] - killed < 5.0
        assert shutdown_seconds < 5.5  # shutdown's timeout, whatever the dead worker does


def test_a_job_started_by_pluribus_run_uses_its_rendezvous_and_secret(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, sys
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            import rpc_cases as c
            from pluribus import rpc

            assert os.environ["PLURIBUS_AUTH_TOKEN"]
            me = rpc.init_rpc(f"worker{{os.environ['RANK']}}")
            if me.id == 0:
                print("sum", rpc.rpc_sync("worker1", c.add, args=(20, 22)))
            rpc.shutdown()
            """
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PLURIBUS_")}
    out = subprocess.run(
        [sys.executable, "-m", "pluribus.run", "--nproc-per-node", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sum 42" in out.stdout


def test_a_job_started_by_mpiexec_finds_its_workers_through_mpi(tmp_path):
    if not pluribus.is_available("mpi"):
        pytest.skip("needs the mpi plugin (pip install 'pluribus[mpi]' mpich)")
    mpiexec = mpi_jobs.mpiexec()
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys
            sys.path.insert(0, {os.path.dirname(__file__)!r})
            import rpc_cases as c
            from pluribus import rpc
            from pluribus_mpi.env import launcher_rank_size

            rank, _ = launcher_rank_size()
            me = rpc.init_rpc(f"m{{rank}}")  # rank, world size and store from MPI
            assert me.id == rank
            if rank == 0:
                print("sum", rpc.rpc_sync("m1", c.add, args=(40, 2)), flush=True)
            rpc.shutdown()
            """
        )
    )
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PLURIBUS_")
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    proc = subprocess.Popen(
        [mpiexec, "-n", "2", sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"mpiexec did not finish:\n{out}") from None
    assert proc.returncode == 0, out
    assert "sum 42" in out


def test_large_arrays_cross_processes_in_segments_and_a_killed_holder_leaves_nothing():
    def ours():  # other jobs on this machine may use /dev/shm meanwhile
        return {name for name in os.listdir("/dev/shm") if "rpc" in name}

    before = ours()
    workers = _Workers(2, "segments")
    try:
        workers.receive(1)
        workers.receive(0)
        os.kill(workers.procs[1].pid, signal.SIGKILL)
        result, shutdown_seconds = workers.receive(0, timeout=30)
    finally:
        workers.close()
    assert result["parity"] and result["in_segment"]
    assert result["lent_before"] >= 1  # w1 holds the argument it keeps
    assert result["lent_after"] == 0  # closed once w1 was seen dead, never reused
    assert shutdown_seconds < 5.5
    assert ours() - before == set()  # segments are memfds: no name anywhere, gone with them
