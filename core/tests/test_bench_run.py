"""pluribus-bench end to end: ranks as threads, spawned ranks, a launched job, peers, plots."""

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pluribus
import pytest
from pluribus.bench import BenchConfig, main, measure, run_benchmark
from pluribus.bench.comms import Comm, PluribusComm
from pluribus.bench.core import COLLECTIVES
from pluribus.bench.launch import BenchError, _Children, free_port, peer_unavailable
from pluribus.bench.report import markdown
from pluribus.store import HashStore
from pluribus.testing import require_backend

SMALL = {
    "min_bytes": 4,
    "max_bytes": 1024,
    "step_factor": 4.0,
    "iters": 3,
    "warmup": 1,
    "timeout": 30.0,
}


def _gloo_or_skip():
    require_backend("gloo")


def _bench_cmd(*args):
    return [sys.executable, "-m", "pluribus.bench", *args]


def _check_document(doc, impl, nranks, collectives):
    assert doc["tool"] == "pluribus-bench" and doc["nranks"] == nranks
    assert doc["wrong"] == 0
    rows = [r for r in doc["rows"] if r["impl"] == impl]
    assert {r["collective"] for r in rows} == set(collectives)
    for row in rows:
        assert row["skipped"] is None, row
        assert row["wrong"] == 0
        assert row["iters"] == len(row["samples_us"]) >= 1
        assert row["time_us_min"] <= row["time_us_median"] <= max(row["samples_us"])
        assert row["busbw_GBps"] > 0 and row["algbw_GBps"] > 0
        assert row["size"] == row["count"] * 4  # float32
    sizes = sorted(r["size"] for r in rows if r["collective"] == "all_reduce")
    assert sizes == [4, 16, 64, 256, 1024]


@pytest.mark.timeout(120)
def test_threads_ranks_measure_every_collective_correctly():
    doc = run_benchmark(BenchConfig(backend="threads", **SMALL), nproc=3)
    _check_document(doc, "pluribus-threads", 3, COLLECTIVES)
    gather = next(r for r in doc["rows"] if r["collective"] == "all_gather" and r["size"] == 12)
    assert gather["count"] == 3  # one element per rank
    assert doc["phases"][0]["load_before"] and doc["comparisons"] == []


class CorruptingComm(Comm):
    """Runs the real collective, then damages one element of rank 1's result."""

    def __init__(self, inner):
        self.inner, self.name = inner, "corrupt"
        self.rank, self.size = inner.rank, inner.size

    def runner(self, collective, case, op, root):
        run = self.inner.runner(collective, case, op, root)

        def damaged():
            run()
            if self.rank == 1:
                case.recv[-1] += 1

        return damaged

    def barrier(self):
        self.inner.barrier()

    def _broadcast_array(self, buf):
        self.inner._broadcast_array(buf)

    def allgather_f64(self, values):
        return self.inner.allgather_f64(values)


@pytest.mark.timeout(60)
def test_direct_backend_calls_are_checked_too():
    doc = run_benchmark(BenchConfig(backend="threads", direct=True, **SMALL), nproc=2)
    _check_document(doc, "pluribus-threads-direct", 2, COLLECTIVES)


@pytest.mark.timeout(60)
def test_repeats_are_pooled():
    config = BenchConfig(backend="threads", collectives=("broadcast",), **SMALL)
    doc = run_benchmark(config, nproc=2, repeat=2)
    assert [p["repeat"] for p in doc["phases"]] == [0, 1]
    assert all(r["iters"] == 6 and len(r["samples_us"]) == 6 for r in doc["rows"])


@pytest.mark.timeout(60)
def test_wrong_results_are_counted():
    config = BenchConfig(backend="threads", collectives=("all_reduce", "all_gather"), **SMALL)
    store, results, errors = HashStore(timeout=30), {}, []

    def rank_main(rank):
        try:
            pluribus.init_process_group("threads", store=store, rank=rank, world_size=2, timeout=30)
            try:
                results[rank] = measure(CorruptingComm(PluribusComm()), config)
            finally:
                pluribus.destroy_process_group()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(50)
    assert not errors
    rows = results[0]
    assert rows and all(r.wrong == 1 for r in rows)  # one element, counted once, on every row
    assert [r.wrong for r in results[1]] == [r.wrong for r in rows]  # every rank agrees


@pytest.mark.timeout(60)
def test_cli_json_in_process(capsys):
    code = main(
        [
            "--backend",
            "threads",
            "--nproc",
            "2",
            "-e",
            "1K",
            "-f",
            "4",
            "-n",
            "3",
            "-w",
            "1",
            "-C",
            "all_reduce,broadcast",
            "--json",
            "-q",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    doc = json.loads(out)
    _check_document(doc, "pluribus-threads", 2, ["all_reduce", "broadcast"])
    assert doc["config"]["collectives"] == ["all_reduce", "broadcast"]


@pytest.mark.timeout(60)
def test_cli_table_has_nccl_tests_columns(capsys):
    assert (
        main(
            [
                "--backend",
                "threads",
                "--nproc",
                "2",
                "-e",
                "64",
                "-n",
                "2",
                "-w",
                "0",
                "-C",
                "reduce_scatter",
                "-q",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "# reduce_scatter on pluribus-threads, 2 ranks, dtype float32, op sum" in out
    assert "algbw(GB/s)" in out and "busbw(GB/s)" in out and "#wrong" in out
    assert "# out of bounds values: 0 OK" in out


def test_cli_rejects_unknown_backend_with_install_hint(capsys):
    assert main(["--backend", "nosuchbackend", "--nproc", "2"]) == 2
    assert "nosuchbackend" in capsys.readouterr().err


def test_cli_rejects_unknown_peer():
    with pytest.raises(SystemExit, match="unknown --compare 'torch-nccl'"):
        main(["--backend", "threads", "--compare", "torch-nccl"])


@pytest.mark.timeout(60)
def test_plot_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed (pip install matplotlib)")
    path = tmp_path / "busbw.png"
    assert (
        main(
            [
                "--backend",
                "threads",
                "--nproc",
                "2",
                "-e",
                "256",
                "-n",
                "2",
                "-w",
                "0",
                "-C",
                "all_reduce,all_gather",
                "-q",
                "--plot",
                str(path),
            ]
        )
        == 0
    )
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    from pluribus.bench.core import Row
    from pluribus.bench.report import plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    rows = [Row("x", "all_reduce", 4, 1, "float32", "sum", None, 2, 1, 0, [1.0])]
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        plot(rows, str(tmp_path / "x.png"))


@pytest.mark.timeout(120)
def test_spawned_gloo_ranks(tmp_path):
    _gloo_or_skip()
    saved = tmp_path / "bench.json"
    proc = subprocess.run(
        _bench_cmd(
            "--nproc",
            "2",
            "--backend",
            "gloo",
            "-e",
            "1K",
            "-f",
            "4",
            "-n",
            "3",
            "-w",
            "1",
            "--json",
            "-q",
            "--save",
            str(saved),
        ),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    _check_document(doc, "pluribus-gloo", 2, COLLECTIVES)
    assert json.loads(saved.read_text())["rows"] == doc["rows"]


@pytest.mark.timeout(120)
def test_symmetric_buffers_are_measured_and_checked():
    """``--symmetric``: pluribus's buffers come from empty_symmetric (gloo's zero-copy
    all-reduce above its one-phase size), the rows say so, and every result is checked."""
    _gloo_or_skip()
    proc = subprocess.run(
        _bench_cmd(*"--nproc 2 --backend gloo -C all_reduce,broadcast -b 1M -e 2M -f 2".split(),
                   *"-n 2 -w 1 --json -q --symmetric".split()),
        capture_output=True,
        text=True,
        timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    rows = doc["rows"]
    assert {r["impl"] for r in rows} == {"pluribus-gloo-symmetric"}
    assert sorted((r["collective"], r["size"]) for r in rows) == [
        ("all_reduce", 1 << 20), ("all_reduce", 2 << 20), ("broadcast", 1 << 20),
        ("broadcast", 2 << 20),
    ]  # fmt: skip
    assert doc["wrong"] == 0 and all(r["wrong"] == 0 and r["skipped"] is None for r in rows)


@pytest.mark.timeout(120)
def test_inside_a_launched_job():
    """As under pluribus-run: the environment names the rank, rank 0 prints the report."""
    _gloo_or_skip()
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2")
    env.pop("PLURIBUS_STORE_SERVED", None)
    args = _bench_cmd(
        "--backend",
        "gloo",
        "-e",
        "1K",
        "-f",
        "4",
        "-n",
        "3",
        "-w",
        "1",
        "-C",
        "all_reduce,all_to_all",
        "--json",
        "-q",
    )
    procs = [
        subprocess.Popen(
            args,
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        outs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    assert outs[1][0] == ""  # only rank 0 reports
    _check_document(json.loads(outs[0][0]), "pluribus-gloo", 2, ["all_reduce", "all_to_all"])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("peer", ["mpi4py", "torch-gloo"])
def test_compare_with_peer(peer):
    reason = peer_unavailable(peer)
    if reason:
        pytest.skip(f"--compare {peer}: {reason}")
    config = BenchConfig(backend="threads", collectives=("all_reduce", "all_gather"), **SMALL)
    doc = run_benchmark(config, nproc=2, compare=[peer])
    _check_document(doc, peer, 2, ["all_reduce", "all_gather"])
    items = [c for c in doc["comparisons"] if c["peer"] == peer]
    assert len(items) == 10  # 5 sizes x 2 collectives
    table = markdown(doc)
    assert f"{peer} µs" in table and "### all_gather" in table and "Load average" in table
    assert table.count("\n| ") == 2 * (1 + 5)  # a header and five sizes per collective
    for item in items:
        assert item["busbw_ratio"] == pytest.approx(
            item["peer_time_us_median"] / item["time_us_median"], rel=1e-4
        )


@pytest.mark.timeout(60)
def test_a_failing_rank_stops_the_phase_and_kills_the_others(tmp_path):
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    failing = [sys.executable, "-c", "import sys; print('rank 1 broke'); sys.exit(3)"]
    start = time.monotonic()
    with pytest.raises(BenchError, match="rank 1 exited with status 3") as info:
        with _Children("demo", tmp_path) as children:
            children.start("rank 0", sleeper, dict(os.environ), False)
            children.start("rank 1", failing, dict(os.environ), False)
            children.wait(time.monotonic() + 30)
    assert "rank 1 broke" in str(info.value)
    assert time.monotonic() - start < 20
    survivor = children.procs[0][1]
    assert survivor.poll() is not None  # killed on the way out


def test_values_survive_json_round_trip():
    config = BenchConfig(backend="threads", collectives=["all_reduce"], budget=0.5)
    again = BenchConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config and isinstance(again.collectives, tuple)
    assert np.dtype(again.dtype) == np.float32


class CountingComm(Comm):
    """One rank whose every collective takes ``seconds`` of a clock of its own (``now``) and is
    counted; what rank 0 broadcasts is recorded."""

    def __init__(self, seconds):
        self.name, self.seconds, self.calls, self.broadcasts, self.now = (
            "counting",
            seconds,
            0,
            [],
            0.0,
        )

    def runner(self, collective, case, op, root):
        def run():
            self.calls += 1
            self.now += self.seconds

        return run

    def barrier(self):
        pass

    def _broadcast_array(self, buf):
        self.broadcasts.append(int(buf[0]))

    def allgather_f64(self, values):
        return values[None, :]


@pytest.mark.timeout(60)
def test_warmup_seconds_keeps_each_size_busy_that_long_before_timing_it(monkeypatch):
    """With ``warmup_seconds`` each size runs untimed for that long (a count every rank takes
    from rank 0) beyond its ``warmup`` iterations; without it, only those."""
    import types

    from pluribus.bench import core

    for seconds, calls in ((0.0, 0), (0.2, 100)):
        comm = CountingComm(0.002)
        clock = types.SimpleNamespace(perf_counter=lambda comm=comm: comm.now)
        monkeypatch.setattr(core, "time", clock)
        config = BenchConfig(
            backend="threads", collectives=("broadcast",), iters=3, warmup=2, check=False,
            warmup_seconds=seconds,
        )  # fmt: skip
        row = core.measure_size(comm, config, "broadcast", 16)
        assert row.iters == 3 and comm.broadcasts == ([comm.calls - 5] if seconds else [])
        assert abs((comm.calls - 5) - calls) <= 1  # 0.2 / 0.002, whichever way it rounds
    with pytest.raises(ValueError, match="non-negative warmup"):
        BenchConfig(warmup_seconds=-1)
