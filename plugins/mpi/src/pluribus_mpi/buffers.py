"""Memory as MPI sees it: byte spans over several arrays, overlaps, staging copies, and the
finishers that complete an operation after its request (copy back, average, size check)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from pluribus.arrays import device_of

from .datatypes import MPI


def address(array: Any) -> int:
    if device_of(array) == "cuda":
        return int(array.data.ptr)
    return array.__array_interface__["data"][0]


def span(arrays: list[Any]) -> tuple[Any, list[int], list[int], bool]:
    """One MPI buffer covering ``arrays``: (buffer, byte counts, byte displacements, regular).

    The buffer starts at the lowest array and ends after the highest; MPI touches only the
    counted bytes at each displacement, so separate arrays need no staging copy. ``regular`` is
    true when the arrays are equal, consecutive blocks of one buffer (for Allgather, Alltoall).
    """
    addresses = [address(a) for a in arrays]
    counts = [int(a.nbytes) for a in arrays]
    low = min(addresses)
    high = max(a + n for a, n in zip(addresses, counts, strict=True))
    displacements = [a - low for a in addresses]
    first = counts[0]
    regular = all(n == first for n in counts) and all(
        d == i * first for i, d in enumerate(displacements)
    )
    return MPI.buffer.fromaddress(low, high - low), counts, displacements, regular


def overlaps(array: Any, buffer_low: int, buffer_bytes: int) -> bool:
    low = address(array)
    return low < buffer_low + buffer_bytes and buffer_low < low + array.nbytes


def byte_address(buffer: Any) -> int:
    return buffer.address


def same_memory(a: Any, b: Any) -> bool:
    return address(a) == address(b) and a.nbytes == b.nbytes


def compact(arrays: list[Any]) -> Any:
    """The arrays' bytes, concatenated into one new host or device buffer (a staging copy)."""
    if arrays and device_of(arrays[0]) == "cuda":
        import cupy

        return cupy.concatenate([a.reshape(-1).view(cupy.uint8) for a in arrays])
    if not arrays:
        return np.zeros(0, np.uint8)
    return np.concatenate([a.reshape(-1).view(np.uint8) for a in arrays])


def sync_device(*arrays: Any) -> None:
    """MPI reads device memory directly: finish the kernels that write these arrays first."""
    for a in arrays:
        if a is not None and device_of(a) == "cuda":
            import cupy

            cupy.cuda.get_current_stream().synchronize()
            return


def copier(device_item: Any, host_item: Any) -> Callable[[], None]:
    def copy_back() -> None:
        if isinstance(device_item, list):
            for d, h in zip(device_item, host_item, strict=True):
                if d is not h:
                    copy_into(d, h)
        elif device_item is not None and device_item is not host_item:
            copy_into(device_item, host_item)

    return copy_back


def copy_into(target: Any, source: Any) -> None:
    if device_of(target) == "cuda" and device_of(source) != "cuda":
        target.set(source)
    else:
        target[...] = source


def averager(array: Any, size: int) -> Callable[[], None]:
    def average() -> None:
        np.divide(array, size, out=array)

    return average


def size_checker(rank: int, array: Any, src: int, tag: int, status: Any) -> Callable[[], None]:
    def check() -> None:
        got = status.Get_count(MPI.BYTE)
        if got != array.nbytes:
            raise ValueError(
                f"rank {rank}: rank {src} sent {got} bytes (tag {tag}) but this rank expected "
                f"{array.nbytes}; the ranks passed arrays of different sizes"
            )

    return check


def offsets(counts: list[int]) -> list[int]:
    out, total = [], 0
    for n in counts:
        out.append(total)
        total += n
    return out


def address_of(buffer: Any) -> int:
    return buffer.address if hasattr(buffer, "address") else address(buffer)


def len_of(buffer: Any) -> int:
    return len(buffer) if hasattr(buffer, "address") else int(buffer.nbytes)


def ranges_meet(a: Any, b: Any) -> bool:
    a_low, b_low = address_of(a), address_of(b)
    return a_low < b_low + len_of(b) and b_low < a_low + len_of(a)
