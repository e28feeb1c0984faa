"""Cross-memory attach: copy a peer process's array straight into ours with Linux's
``process_vm_readv``, one copy per byte, where the shared segment costs two (the sender's copy
in, the receiver's copy out). MPICH and Open MPI use the same call for large messages between
the ranks of one host.

The kernel allows it where this process may ptrace the peer (same user, and no Yama or seccomp
rule against it), so a group checks it once, when it opens its segment (:func:`agree`): every
rank reads a word from every peer, and the group reads in place only when all succeeded (a
peer in another pid namespace, whose number means another process here, fails that check).
``PLURIBUS_GLOO_CMA=0`` (or the backend option ``cma=False``) turns it off.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np

CMA_ENV = "PLURIBUS_GLOO_CMA"


class _IOVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def _load():
    try:
        readv = ctypes.CDLL(None, use_errno=True).process_vm_readv  # libc, as futex.py loads it
    except (OSError, AttributeError):  # not Linux, or a libc without it
        return None
    readv.restype = ctypes.c_ssize_t
    readv.argtypes = [
        ctypes.c_int,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.POINTER(_IOVec),
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return readv


_readv = _load()


def wanted(options: dict) -> bool:
    setting = options.get("cma", os.environ.get(CMA_ENV, "1"))
    return _readv is not None and str(setting).lower() not in ("0", "false", "off", "no")


def read(pid: int, out: np.ndarray, address: int) -> None:
    """Fill the contiguous ``out`` from ``out.nbytes`` bytes at ``address`` in process ``pid``;
    OSError when the kernel refuses or the peer is gone."""
    total, done = out.nbytes, 0
    base = out.ctypes.data
    while done < total:
        here = _IOVec(base + done, total - done)
        there = _IOVec(address + done, total - done)
        got = _readv(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
        if got < 0:
            number = ctypes.get_errno()
            raise OSError(number, f"process_vm_readv from process {pid}: {os.strerror(number)}")
        if got == 0:
            raise OSError(
                f"process_vm_readv from process {pid} read nothing at {address + done:#x}"
            )
        done += got


def _magic(pid: int) -> int:
    return 0x706C7572_69627573 ^ pid


def agree(store, rank: int, size: int, timeout: float, options: dict) -> list[int] | None:
    """Every member's process id when every member can read every other's memory, else None:
    each rank offers a word holding a value the others can predict, reads every peer's, and
    says whether all matched (through the group's store, like the segment's own agreement)."""
    pid = os.getpid()
    probe = np.array([_magic(pid)], dtype=np.uint64)  # alive until every peer has read it
    offer = f"{pid} {probe.ctypes.data}" if wanted(options) else ""
    store.set(f"arena/cma/{rank}", offer)
    offers = [store.get(f"arena/cma/{r}", timeout).decode() for r in range(size)]
    able = all(offers)
    if able:
        for r, text in enumerate(offers):
            if r == rank:
                continue
            peer, address = (int(word) for word in text.split())
            seen = np.zeros(1, dtype=np.uint64)
            try:
                read(peer, seen, address)
            except OSError:
                able = False
                break
            able = int(seen[0]) == _magic(peer)
            if not able:
                break
    store.set(f"arena/cma_ok/{rank}", "1" if able else "0")
    agreed = all(store.get(f"arena/cma_ok/{r}", timeout) == b"1" for r in range(size))
    del probe  # every peer said whether it read it, so none reads it any more
    return [int(text.split()[0]) for text in offers] if agreed else None
