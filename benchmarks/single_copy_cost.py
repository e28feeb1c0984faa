"""What a single-copy read of a peer's array would cost gloo's shared-memory all-reduce.

The arena moves a peer's bytes with two copies (the owner into the shared segment, the reader
out of it). Linux's cross-memory attach (``process_vm_readv``) reads another process's private
array in one system call, as MPICH's large-message path can. Here a child process holds a
float64 array and this process reads it both ways, ``--rounds`` times each:

    python benchmarks/single_copy_cost.py --mib 4

Printed: fastest and median microseconds of a CMA read in chunks of each size, of two numpy
copies through a buffer (the arena's way) and of one numpy copy.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import time

import numpy as np


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _owner(nbytes: int, to_parent, from_parent) -> None:
    array = np.random.default_rng(0).random(nbytes // 8)
    to_parent.put((os.getpid(), array.ctypes.data))
    from_parent.get()  # keep the array alive until the parent is done


def _cma_read(libc, pid: int, dst: np.ndarray, address: int, chunk: int) -> None:
    local, remote = _Iovec(), _Iovec()
    for offset in range(0, dst.nbytes, chunk):
        n = min(chunk, dst.nbytes - offset)
        local.base, local.len = dst.ctypes.data + offset, n
        remote.base, remote.len = address + offset, n
        got = libc.process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if got != n:
            raise OSError(ctypes.get_errno(), f"process_vm_readv read {got} of {n} bytes")


def _time(fn, rounds: int) -> tuple[float, float]:
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return min(samples) * 1e6, float(np.median(samples)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    nbytes = args.mib << 20
    libc = ctypes.CDLL(None, use_errno=True)
    to_parent, from_parent = mp.Queue(), mp.Queue()
    child = mp.Process(target=_owner, args=(nbytes, to_parent, from_parent))
    child.start()
    try:
        pid, address = to_parent.get(timeout=30)
        dst, src, buffer = (np.empty(nbytes // 8) for _ in range(3))
        print(f"# {args.mib} MiB, load {os.getloadavg()}")
        for chunk in (64 << 10, 256 << 10, 1 << 20, nbytes):
            best, median = _time(lambda c=chunk: _cma_read(libc, pid, dst, address, c), args.rounds)
            print(
                f"CMA read, {chunk >> 10} KiB per call: {best:.0f} us fastest, {median:.0f} median"
            )

        def two_copies():
            np.copyto(buffer, src)
            np.copyto(dst, buffer)

        best, median = _time(two_copies, args.rounds)
        print(f"two numpy copies through a buffer: {best:.0f} us fastest, {median:.0f} median")
        best, median = _time(lambda: np.copyto(dst, buffer), args.rounds)
        print(f"one numpy copy: {best:.0f} us fastest, {median:.0f} median")
    finally:
        from_parent.put(None)
        child.join(30)


if __name__ == "__main__":
    main()
