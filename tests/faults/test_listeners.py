"""A job on one host listens on loopback only: no rank's socket is reachable from other hosts
(the store, gloo's mesh, ucc's lifelines and UCX's own transports)."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

import numpy as np
import pluribus as pb
import pytest
from pluribus import is_available
from pluribus.testing import run_ranks


def _address(hex_address: str) -> str:
    host, _, port = hex_address.partition(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return f"{socket.inet_ntop(socket.AF_INET, raw[::-1])}:{int(port, 16)}"
    words = struct.unpack("<4I", raw)
    return f"[{socket.inet_ntop(socket.AF_INET6, struct.pack('>4I', *words))}]:{int(port, 16)}"


def _my_listeners() -> list[str]:
    """The addresses this process listens on (TCP, IPv4 and IPv6), from /proc."""
    x = np.ones(4, np.float32)
    pb.all_reduce(x)  # every transport is up
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    found.append(_address(fields[1]))
    return found


def _is_loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    return ipaddress.ip_address(host).is_loopback


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["gloo", "ucc"])
def test_a_one_host_job_listens_on_loopback_only(backend):
    if not is_available(backend):
        pytest.skip(f"{backend} is not available here")
    per_rank = run_ranks(_my_listeners, 4, backend, "processes", timeout=60)
    for rank, addresses in enumerate(per_rank):
        exposed = [a for a in addresses if not _is_loopback(a)]
        assert not exposed, f"rank {rank} listens on {exposed}"
