"""pluribus.checkpoint against writing and reading the same bytes by hand, in the same run.

    python benchmarks/checkpoint_io.py --mib 512 --reps 4

The state is 8 float32 tensors of ``(rows, 1024)``, ``Shard(0)`` DTensors over 4 gloo ranks
(processes); ``--mib`` is the whole state. Each repetition, in alternating order:

* save: ``checkpoint.save`` against every rank writing its pieces with ``ndarray.tofile`` to
  its own file and ``fsync``;
* load: ``checkpoint.load`` (checksums verified) into the same layout against every rank
  reading its file back with ``readinto`` into its arrays;
* resharded load: the 4-rank checkpoint loaded by 2 ranks (``Shard(0)`` over 2) against each
  of the 2 ranks reading the rows it needs from the 4 hand-written files;
* async (on the 2 ranks): how long ``async_save`` blocks the caller against copying the
  state in memory.

Times are from a barrier before to a barrier after, on rank 0; ratios are throughput of
pluribus over the hand-written peer (>= 1 is faster), medians over the repetitions. Reads
come from the page cache in both cases (dropping it would need root and disturb other jobs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

COLUMNS = 1024
TENSORS = 8


def _rows(mib: int) -> int:
    return mib * 2**20 // (TENSORS * COLUMNS * 4)


def _state(rows: int, fill: bool):
    import pluribus as pb
    from pluribus.dtensor import Shard, from_local, init_device_mesh, split_sizes

    world, rank = pb.get_world_size(), pb.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    mine = split_sizes(rows, world)[rank]
    rng = np.random.default_rng(rank)
    state = {}
    for t in range(TENSORS):
        local = rng.random((mine, COLUMNS), dtype=np.float32) if fill else np.empty(
            (mine, COLUMNS), np.float32
        )  # fmt: skip
        state[f"layer{t}.weight"] = from_local(
            local, mesh, [Shard(0)], run_check=False, shape=(rows, COLUMNS)
        )
    return state


def _timed(fn) -> float:
    import pluribus as pb

    pb.barrier()
    start = time.perf_counter()
    fn()
    pb.barrier()
    return time.perf_counter() - start


def _write_by_hand(state, path: str) -> None:
    with open(path, "wb") as f:
        for dt in state.values():
            dt.to_local().tofile(f)
        f.flush()
        os.fsync(f.fileno())


def _read_by_hand(state, path: str) -> None:
    with open(path, "rb", buffering=0) as f:
        for dt in state.values():
            f.readinto(memoryview(dt.to_local()).cast("B"))


def _check_load(target, path: str, expected) -> None:
    """Untimed: a load into zeroed arrays gives back every byte (checks the timed loads)."""
    from pluribus import checkpoint

    for dt in target.values():
        dt.to_local()[...] = 0
    checkpoint.load(target, path)
    for key, dt in target.items():
        np.testing.assert_array_equal(dt.to_local(), expected[key])


def save_load_rank(rows: int, reps: int, folder: str) -> dict:
    import pluribus as pb
    from pluribus import checkpoint

    rank = pb.get_rank()
    state = _state(rows, fill=True)
    target = _state(rows, fill=False)
    times: dict[str, list[float]] = {k: [] for k in ("tofile", "save", "readinto", "load")}
    for rep in range(reps):
        hand = os.path.join(folder, f"hand-{rep}-rank{rank}.bin")
        ckpt = os.path.join(folder, f"ckpt-{rep}")
        pairs = [
            ("tofile", lambda hand=hand: _write_by_hand(state, hand)),
            ("save", lambda ckpt=ckpt: checkpoint.save(state, ckpt)),
        ]
        for name, fn in pairs if rep % 2 == 0 else reversed(pairs):
            times[name].append(_timed(fn))
        pairs = [
            ("readinto", lambda hand=hand: _read_by_hand(target, hand)),
            ("load", lambda ckpt=ckpt: checkpoint.load(target, ckpt)),
        ]
        for name, fn in pairs if rep % 2 == 0 else reversed(pairs):
            times[name].append(_timed(fn))
        _check_load(target, ckpt, {k: dt.to_local() for k, dt in state.items()})
    return times


def resharded_rank(rows: int, saved_world: int, folder: str, reps: int) -> dict:
    """Load the last 4-rank checkpoint on this (2-rank) world, against reading the same rows
    from the 4 hand-written files; and async_save's blocking time on 2 ranks."""
    import pluribus as pb
    from pluribus import checkpoint
    from pluribus.dtensor import split_sizes

    target = _state(rows, fill=False)
    saved_sizes = split_sizes(rows, saved_world)
    mine = target["layer0.weight"].layout.local_slices(
        target["layer0.weight"].device_mesh.coordinate
    )[0]
    row_bytes = COLUMNS * 4

    def by_hand(rep: int) -> None:
        start = 0
        for r, size in enumerate(saved_sizes):
            lo, hi = max(start, mine.start), min(start + size, mine.stop)
            if lo < hi:
                with open(os.path.join(folder, f"hand-{rep}-rank{r}.bin"), "rb", buffering=0) as f:
                    for t, dt in enumerate(target.values()):
                        f.seek((t * size + lo - start) * row_bytes)
                        dest = dt.to_local()[lo - mine.start : hi - mine.start]
                        f.readinto(memoryview(dest).cast("B"))
            start += size

    times: dict[str, list[float]] = {"readinto": [], "load": [], "async_blocked": [], "copy": []}
    state = _state(rows, fill=True)
    checkpoint.async_save(state, os.path.join(folder, "async-warm-up")).result()  # its group
    for rep in range(reps):
        # async: how long the caller is blocked, against a plain copy of the state
        pb.barrier()
        start = time.perf_counter()
        future = checkpoint.async_save(state, os.path.join(folder, f"async-{rep}"))
        times["async_blocked"].append(time.perf_counter() - start)
        future.result()
        pb.barrier()
        start = time.perf_counter()
        copies = [dt.to_local().copy() for dt in state.values()]
        times["copy"].append(time.perf_counter() - start)
        del copies
        pairs = [
            ("readinto", lambda rep=rep: by_hand(rep)),
            ("load", lambda rep=rep: checkpoint.load(target, os.path.join(folder, f"ckpt-{rep}"))),
        ]
        for name, fn in pairs if rep % 2 == 0 else reversed(pairs):
            times[name].append(_timed(fn))
        mesh = target["layer0.weight"].device_mesh
        saved = [_pieces_of(r, size) for r, size in enumerate(saved_sizes)]
        whole = {  # this rank's rows of what the 4 saving ranks drew
            key: np.concatenate([pieces[key] for pieces in saved])[
                dt.layout.local_slices(mesh.coordinate)
            ]
            for key, dt in target.items()
        }
        _check_load(target, os.path.join(folder, f"ckpt-{rep}"), whole)
    return times


def _pieces_of(rank: int, rows: int) -> dict:
    """The pieces ``_state(fill=True)`` draws on ``rank``."""
    rng = np.random.default_rng(rank)
    return {
        f"layer{t}.weight": rng.random((rows, COLUMNS), dtype=np.float32) for t in range(TENSORS)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="size of the whole state")
    parser.add_argument(
        "--reps", type=int, default=4, help="even, so that each order runs as often"
    )
    parser.add_argument("--folder", default=None, help="where to write (default: a temp folder)")
    args = parser.parse_args()
    from pluribus.testing import run_ranks

    folder = tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.folder)
    rows = _rows(args.mib)
    try:
        four = run_ranks(
            save_load_rank, 4, "gloo", mode="processes", args=(rows, args.reps, folder),
            timeout=600,
        )[0]  # fmt: skip
        two = run_ranks(
            resharded_rank, 2, "gloo", mode="processes", args=(rows, 4, folder, args.reps),
            timeout=600,
        )[0]  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    med = {
        k: statistics.median(v)
        for k, v in {**four, **{f"re_{k}": v for k, v in two.items()}}.items()
    }
    mib = rows * COLUMNS * 4 * TENSORS / 2**20
    result = {
        "state_mib": round(mib, 1),
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "save_vs_tofile_fsync": round(med["tofile"] / med["save"], 3),
        "load_vs_readinto": round(med["readinto"] / med["load"], 3),
        "resharded_4_to_2_vs_readinto": round(med["re_readinto"] / med["re_load"], 3),
        "async_blocked_over_copy": round(med["re_async_blocked"] / med["re_copy"], 3),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
