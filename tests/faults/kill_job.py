"""The rank program of the kill-a-rank runs: ``python kill_job.py BACKEND OUTDIR``.

Every rank of an env:// job (rank 0 serves the store), or of an mpiexec job, loops ``all_reduce``
of 1 MiB float32 (``KILL_JOB_ELEMENTS`` elements) until it raises; the driver (:mod:`killing`)
SIGKILLs one rank meanwhile. Each survivor writes what it raised, when (wall clock), and how long
one more collective took to fail afterwards, to ``OUTDIR/rank<r>.json``. An mpi rank also writes
the MPICH shared-memory segments it maps (``OUTDIR/segments<r>``): none may be left after the
job.
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np
import pluribus as pb


def main(backend: str, outdir: str) -> None:
    pb.init_process_group(backend, timeout=float(os.environ.get("KILL_JOB_TIMEOUT", "20")))
    rank = pb.get_rank()
    x = np.ones(int(os.environ.get("KILL_JOB_ELEMENTS", 1 << 18)), np.float32)  # 1 MiB
    pb.all_reduce(x)
    if backend == "mpi":
        with open(os.path.join(outdir, f"segments{rank}"), "w") as f, open("/proc/self/maps") as m:
            f.writelines(w + "\n" for line in m for w in line.split() if w.startswith("/dev/shm/"))
    with open(os.path.join(outdir, f"ready{rank}"), "w") as f:
        f.write(str(os.getpid()))
    result: dict = {"rank": rank}
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            x[...] = 1
            pb.all_reduce(x)
            if x[0] != pb.get_world_size():
                result["wrong"] = float(x[0])
        result["error"] = "none: all_reduce kept succeeding"
    except Exception as exc:
        result["raised_at"] = time.time()
        result["error"] = type(exc).__name__
        result["message"] = str(exc)
        result["peer"] = getattr(exc, "peer", None)
    start = time.monotonic()
    try:
        pb.barrier()
        result["later"] = "returned"
    except Exception as exc:
        result["later"] = type(exc).__name__
    result["later_seconds"] = time.monotonic() - start
    with open(os.path.join(outdir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    try:
        pb.destroy_process_group()
    except Exception:
        pass


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
