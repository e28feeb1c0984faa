"""Saving: take a snapshot of what this rank may write, write its share, and commit together.

The snapshot is local (no collective): the pieces this rank may write, as host arrays, the
description of every key and the plain values. Then every rank agrees on the temporary
directory in one small all-gather, which also carries any rank's bad-input error (so every
rank raises it before a byte is written) and the DTensor boxes that ranks off their mesh may
hold too: from these every rank computes the same writer for each box several ranks hold, so
that it is written once (:mod:`.planning` describes the one path that decides who writes).
Every rank writes and fsyncs its own safetensors file and sends its table of chunks, with the
checksums of the boxes it holds but another rank writes; the coordinator builds the metadata,
checks that the copies of a box agree and that the chunks tile every tensor, writes it last and
publishes the directory (:mod:`.commit`). A last broadcast tells every rank the outcome.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import math
import os
import queue
import shutil
import threading
import uuid
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import distributed as dist
from ..dtensor import Partial
from ..dtensor.boxes import dtensor_box
from . import commit
from .checksums import block_sums, preferred
from .errors import CheckpointError
from .metadata import BLOCK_BYTES, METADATA_FILE, Chunk, Metadata, TensorInfo
from .planning import (
    assign_replicated,
    assign_shared_pieces,
    covers_exactly,
    describe_layout,
    writes_locally,
)
from .safetensors_io import DTYPES, as_bytes, write_file
from .state import ARRAY, DTENSOR, PIECES, VALUE, flatten, is_cupy


@dataclass
class Snapshot:
    """What one rank contributes to a checkpoint."""

    rank: int
    world_size: int
    #: (key, offsets, host array) of each piece this rank writes: its whole arrays, and its
    #: DTensor pieces that no other rank can hold
    pieces: list[tuple[str, tuple[int, ...], np.ndarray]] = field(default_factory=list)
    #: the same of each DTensor piece that a rank off the DTensor's mesh may hold too, and of
    #: each box of a :class:`~pluribus.dtensor.boxes.Pieces`: the holders agree on its writer in
    #: :func:`write_and_commit`
    dtensor_pieces: list[tuple[str, tuple[int, ...], np.ndarray]] = field(default_factory=list)
    #: key -> [global shape, dtype name, saved layout]
    tensors: dict[str, list] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    checksum: str = ""


def _host(array: Any, copy: bool) -> np.ndarray:
    if is_cupy(array):
        array = array.get()  # device -> host is already a copy
        copy = False
    array = np.asarray(array)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    if copy or not array.flags.c_contiguous:
        return array.copy(order="C")  # (ascontiguousarray would make 0-d arrays 1-d)
    return array


def take_snapshot(
    state_dict: dict, rank: int, world_size: int, copy: bool, saving: Sequence[int] = ()
) -> Snapshot:
    """Everything this rank may write; ``copy`` snapshots numpy arrays (for a background
    write), ``saving`` are the global ranks of the saving group. Bad input becomes
    ``snapshot.error`` so that every rank can raise it together."""
    snap = Snapshot(rank, world_size, checksum=preferred())
    savers, mesh_ranks = set(saving), {}
    who = saving[rank] if saving else rank  # the global rank, for messages
    try:
        leaves = flatten(state_dict, who)
        whole = [(leaf.key, int(leaf.value.nbytes)) for leaf in leaves if leaf.kind == ARRAY]
        owners = assign_replicated(whole, world_size)
        for leaf in leaves:
            if leaf.kind == VALUE:
                snap.values[leaf.key] = leaf.value
                continue
            value = leaf.value
            dtype = np.dtype(value.dtype)
            if dtype.name not in DTYPES:
                raise TypeError(
                    f"rank {who}: state dict entry {leaf.key!r} has dtype {dtype}, which "
                    f"safetensors cannot hold; use one of {sorted(DTYPES)}"
                )
            shape = list(value.shape)
            snap.tensors[leaf.key] = [shape, dtype.name, describe_layout(value)]
            if leaf.kind == PIECES:  # boxes other ranks may hold too, as a DTensor's below
                snap.dtensor_pieces += [
                    (leaf.key, offsets, _host(array, copy))
                    for offsets, array in value.pieces
                    if array.size > 0
                ]
            elif leaf.kind == DTENSOR:
                if any(isinstance(p, Partial) for p in value.placements):
                    raise ValueError(
                        f"rank {who}: state dict entry {leaf.key!r} is a DTensor with "
                        f"placements {list(value.placements)}; a Partial tensor is not a "
                        "value yet: redistribute it to Replicate (or Shard) before saving"
                    )
                offsets, sizes = dtensor_box(value)
                if math.prod(sizes) == 0:
                    continue
                local, mesh = value.to_local(), value.device_mesh
                if id(mesh) not in mesh_ranks:  # the state dict keeps its meshes alive
                    mesh_ranks[id(mesh)] = set(mesh.mesh.ravel().tolist())
                writes = writes_locally(leaf.key, value, mesh_ranks[id(mesh)], savers)
                if writes is not None:  # decided here: written or left to a replica on the mesh
                    if writes:
                        snap.pieces.append((leaf.key, offsets, _host(local, copy)))
                else:  # the holders agree on a writer in write_and_commit
                    snap.dtensor_pieces.append((leaf.key, offsets, _host(local, copy)))
            elif owners[leaf.key] == rank and value.size > 0:
                snap.pieces.append((leaf.key, (0,) * len(shape), _host(value, copy)))
    except (TypeError, ValueError) as e:
        snap.error = str(e)
    return snap


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


Piece = tuple[str, tuple[int, ...], np.ndarray]


def _tensor_names(writes: list[Piece]) -> list[str]:
    """The name of each written box in the rank's file: its key, or, for a key of which this
    rank writes several boxes (:class:`~pluribus.dtensor.boxes.Pieces`), the key and the
    box's offsets."""
    count = Counter(key for key, _, _ in writes)
    names = [
        key if count[key] == 1 else f"{key}@{','.join(map(str, offsets))}"
        for key, offsets, _ in writes
    ]
    clash = sorted(name for name, n in Counter(names).items() if n > 1)
    if clash:
        raise ValueError(
            f"the tensor names {clash} would appear twice in one file (a key that looks like "
            "another key's box name, key@offsets); rename that key"
        )
    return names


def _write_pieces(
    snap: Snapshot, writes: list[Piece], copies: list[Piece], directory: str, global_rank: int
) -> tuple[list, list]:
    """Write ``writes`` to this rank's file, their checksums computed while the kernel takes
    the bytes, and those of ``copies`` (boxes another rank writes) too, so that the
    coordinator can check that the copies of a box agree. ``[key, chunk as JSON]`` of each
    written box, and ``[key, box and checksums]`` of each copy."""
    name = _rank_file(snap.rank)

    def crash_while_writing():
        commit.crash_point("writing", global_rank)

    names = _tensor_names(writes)
    file = os.path.join(directory, name)
    tensors = [(n, a) for n, (_, _, a) in zip(names, writes, strict=True)]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        written = None
        if writes:  # a rank that writes nothing leaves no file
            written = pool.submit(
                write_file, file, tensors, {"format": "pluribus"}, crash_while_writing
            )
        sums = [block_sums(as_bytes(a), BLOCK_BYTES, snap.checksum) for _, _, a in writes]
        copy_sums = [block_sums(as_bytes(a), BLOCK_BYTES, snap.checksum) for _, _, a in copies]
        if written is not None:
            written.result()
    chunks = [
        [key, Chunk(tuple(offsets), tuple(array.shape), name, n, tuple(s)).to_json()]
        for (key, offsets, array), n, s in zip(writes, names, sums, strict=True)
    ]
    copied = [
        [key, {"offsets": list(offsets), "sizes": list(array.shape), "checksums": s}]
        for (key, offsets, array), s in zip(copies, copy_sums, strict=True)
    ]
    return chunks, copied


def _metadata(
    reports: list[dict], world_size: int, checksum: str, ranks: list[int] | None = None
) -> Metadata:
    """The coordinator's table of contents from every rank's report (``ranks``: their global
    ranks, for errors); ranks that disagree on a key's shape or dtype, copies of a box that
    differ, or chunks that do not tile a tensor, are an error."""
    name = ranks if ranks is not None else list(range(len(reports)))
    first = reports[0]
    tensors: dict[str, TensorInfo] = {}
    for r, report in enumerate(reports):
        if set(report["tensors"]) != set(first["tensors"]) or set(report["values"]) != set(
            first["values"]
        ):
            theirs = set(report["tensors"]) | set(report["values"])
            ours = set(first["tensors"]) | set(first["values"])
            raise CheckpointError(
                f"ranks disagree on the state dict's keys: rank {name[r]} has "
                f"{sorted(theirs - ours)} that rank {name[0]} lacks and lacks "
                f"{sorted(ours - theirs)}; "
                "every rank must save the same keys"
            )
        for key, (shape, dtype, layout) in report["tensors"].items():
            info = tensors.setdefault(key, TensorInfo(tuple(shape), dtype, layout))
            if info.shape != tuple(shape) or info.dtype != dtype:
                raise CheckpointError(
                    f"ranks disagree on {key!r}: rank {name[0]} saves {list(info.shape)} "
                    f"{info.dtype}, rank {name[r]} {shape} {dtype}"
                )
    # Every box that several ranks hold is written by one of them; the others send its
    # checksums. Copies that differ mean the ranks saved different values under one key, and
    # keeping either would lose the other unnoticed.
    seen: dict[tuple, tuple[int, tuple]] = {}
    written: set[tuple] = set()
    for r, report in enumerate(reports):
        held = [(key, Chunk.from_json(c), True) for key, c in report["chunks"]]
        held += [
            (key, Chunk.from_json({**c, "file": "", "name": key}), False)
            for key, c in report["copies"]
        ]
        for key, c, writes in held:
            box = (key, c.offsets, c.sizes)
            if box not in seen:
                seen[box] = (r, c.checksums)
            elif seen[box][1] != c.checksums:
                raise CheckpointError(
                    f"ranks {name[seen[box][0]]} and {name[r]} save different values for the "
                    f"same piece of {key!r} (offsets {list(c.offsets)}, sizes {list(c.sizes)}); "
                    "the ranks holding it must hold the same values (replicas that drifted "
                    "apart, or a DTensor on a sub-mesh whose ranks outside it hold another "
                    "array under this key)"
                )
            if writes and box not in written:
                written.add(box)
                tensors[key].chunks.append(c)
    for key, info in tensors.items():
        if not covers_exactly(info):
            raise CheckpointError(
                f"the pieces of {key!r} ({[(c.offsets, c.sizes) for c in info.chunks]}) do "
                f"not tile its global shape {list(info.shape)}; the ranks' layouts disagree"
            )
    values, rank_values = {}, {}
    for key in first["values"]:
        each = [report["values"][key] for report in reports]
        if all(v == each[0] for v in each):
            values[key] = each[0]
        else:
            rank_values[key] = each
    return Metadata(
        world_size, tensors, values, rank_values, block_bytes=BLOCK_BYTES, checksum=checksum
    )


def _exchange(group, obj: Any) -> list[Any]:
    return [obj] if group is None else dist.all_gather_object(obj, group=group)


def _failures(items: list[dict], group) -> list[str]:
    ranks = group.ranks if group is not None else [0]
    return [f"rank {ranks[r]}: {item['error']}" for r, item in enumerate(items) if item["error"]]


def write_and_commit(
    snap: Snapshot,
    path: str,
    group,
    coordinator: int,
    after_publish: Callable[[], None] | None = None,
) -> None:
    """Write ``snap`` into a fresh temporary directory with the other ranks and publish it
    at ``path``; raises :class:`CheckpointError` on every rank when any rank failed."""
    global_rank = group.global_rank if group is not None else 0
    is_coordinator = snap.rank == coordinator
    path = os.path.abspath(path)
    token, error = uuid.uuid4().hex[:12], snap.error
    if is_coordinator and error is None:
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.mkdir(commit.temporary_dir(path, token))
        except OSError as e:
            error = f"cannot create {commit.temporary_dir(path, token)}: {e}"
    agreed = _exchange(
        group,
        {
            "error": error,
            "token": token,
            "checksum": snap.checksum,
            # the DTensor boxes another rank may hold too, and the bytes this rank writes anyway
            "boxes": [
                [k, list(o), list(a.shape), int(a.nbytes)] for k, o, a in snap.dtensor_pieces
            ],
            "load": sum(int(a.nbytes) for _, _, a in snap.pieces),
        },
    )
    tmp = commit.temporary_dir(path, agreed[coordinator]["token"])
    snap.checksum = agreed[coordinator]["checksum"]  # every rank sums as the coordinator does
    failed = _failures(agreed, group)
    if failed:
        if is_coordinator:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"rank {global_rank}: nothing was saved to {path}: " + "; ".join(failed)
        )
    writer = assign_shared_pieces([a["boxes"] for a in agreed], [a["load"] for a in agreed])
    writes, copies = list(snap.pieces), []
    for piece in snap.dtensor_pieces:
        key, offsets, array = piece
        mine = writer[(key, tuple(offsets), tuple(array.shape))] == snap.rank
        (writes if mine else copies).append(piece)
    report: dict[str, Any] = {"error": None, "tensors": snap.tensors, "values": snap.values}
    try:
        report["chunks"], report["copies"] = _write_pieces(snap, writes, copies, tmp, global_rank)
    except Exception as e:  # every rank must reach the next exchange to hear of it
        report["error"] = f"writing {os.path.join(tmp, _rank_file(snap.rank))}: {e}"
        report["chunks"], report["copies"] = [], []
    reports = _exchange(group, report)
    outcome = None
    if is_coordinator:
        try:
            failed = _failures(reports, group)
            if failed:
                raise CheckpointError("; ".join(failed))
            metadata = _metadata(
                reports,
                snap.world_size,
                agreed[coordinator]["checksum"],
                group.ranks if group is not None else None,
            )
            commit.crash_point("before-metadata", global_rank)
            with open(os.path.join(tmp, METADATA_FILE), "w", encoding="utf-8") as f:
                f.write(metadata.to_json())
                f.flush()
                os.fsync(f.fileno())
            commit.fsync_dir(tmp)
            commit.crash_point("before-rename", global_rank)
            commit.publish(tmp, path, agreed[coordinator]["token"])
        except Exception as e:  # the others wait for the outcome: always send one
            shutil.rmtree(tmp, ignore_errors=True)
            outcome = f"{e}" if isinstance(e, CheckpointError) else f"committing: {e}"
        else:
            if after_publish is not None:
                try:
                    after_publish()
                except Exception as e:
                    outcome = f"saved {path}, but updating its folder failed: {e}"
    if group is not None:
        outcome = dist.broadcast_object(outcome, src=group.ranks[coordinator], group=group)
    if outcome is not None:
        raise CheckpointError(f"rank {global_rank}: saving {path} failed: {outcome}")


def _ranks(group) -> list[int]:
    return list(group.ranks) if group is not None else []


def _group_and_rank(process_group):
    if not dist.is_initialized():
        return None, 0, 1
    group = dist.get_default_group() if process_group is None else process_group
    return group, group.rank, group.size


def save(
    state_dict: dict,
    path: str | os.PathLike,
    *,
    process_group=None,
    coordinator_rank: int = 0,
    after_publish: Callable[[], None] | None = None,
) -> None:
    """Save ``state_dict`` (every rank calls it with its own pieces) as the checkpoint ``path``,
    atomically: afterwards ``path`` holds either the new checkpoint or, on any error or crash,
    whatever it held before. Replicated arrays are written once; DTensor pieces once per
    distinct piece. ``after_publish`` runs on the coordinator once the checkpoint is in place,
    before any rank returns (``CheckpointManager`` moves ``latest`` there)."""
    group, rank, world = _group_and_rank(process_group)
    wait_for_async(group)
    snap = take_snapshot(state_dict, rank, world, False, _ranks(group))
    write_and_commit(snap, os.fspath(path), group, coordinator_rank, after_publish)


# -- async --------------------------------------------------------------------------------------


class SaveFuture(concurrent.futures.Future):
    """The outcome of an :func:`async_save`. ``result()`` (or ``wait()``) waits and raises its
    error; an error nobody has seen that way is raised by the next save instead."""

    reported = False

    def result(self, timeout: float | None = None):
        self.reported = True
        return super().result(timeout)

    def wait(self, timeout: float | None = None) -> None:
        self.result(timeout)


class _Background:
    """One rank's saves in flight (at most one), the group their collectives use (so that
    they never interleave with the training loop's collectives on the default group), and the
    worker thread that runs them. The worker stays for a while after a save, because starting
    a thread costs the caller milliseconds on a busy machine; it leaves when idle, and a save
    still running when the interpreter exits is waited for."""

    IDLE_SECONDS = 10.0

    def __init__(self) -> None:
        self.future: SaveFuture | None = None
        self.groups: dict[str, Any] = {}
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.worker: threading.Thread | None = None
        self.lock = threading.Lock()

    def submit(self, job: Callable[[], None], name: str) -> None:
        with self.lock:
            self.jobs.put(job)
            if self.worker is None:
                self.worker = threading.Thread(target=self._work, name=name, daemon=True)
                self.worker.start()

    def _work(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=self.IDLE_SECONDS)
            except queue.Empty:
                with self.lock:
                    if self.jobs.empty():
                        self.worker = None
                        return
                continue
            job()


_background: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_background_lock = threading.Lock()


_single_process = _Background()


def _state_for(group) -> _Background:
    if group is None:
        return _single_process
    with _background_lock:
        return _background.setdefault(group, _Background())


def wait_for_async(group) -> None:
    """Wait for this rank's save in flight, raising its error (an error is never dropped)."""
    state = _state_for(group)
    future, state.future = state.future, None
    if future is not None and not future.reported:
        future.result()
    elif future is not None:
        concurrent.futures.wait([future])


def async_save(
    state_dict: dict,
    path: str | os.PathLike,
    *,
    process_group=None,
    coordinator_rank: int = 0,
    after_publish: Callable[[], None] | None = None,
) -> SaveFuture:
    """Like :func:`save`, but return once the state is copied (device -> host for cupy, a
    snapshot for numpy); writing, fsync and commit run on a background thread. The future's
    ``result()`` raises what went wrong; so does the next save, which first waits for this one
    (one save in flight: memory stays at one snapshot)."""
    group, rank, world = _group_and_rank(process_group)
    wait_for_async(group)
    state = _state_for(group)
    if group is None:
        background_group = None
    elif process_group is None or process_group is dist.get_default_group():
        if "world" not in state.groups:
            state.groups["world"] = dist.new_group()  # every rank, in the same order
        background_group = state.groups["world"]
    else:  # its own copy of a sub-group would have to be made by every rank of the world
        raise ValueError(
            f"rank {dist.get_rank()}: async_save(process_group=...) of a sub-group: its "
            "background collectives would share the group with the training loop's; save a "
            "sub-group with save(), or async_save on the whole world (no process_group)"
        )
    snap = take_snapshot(state_dict, rank, world, True, _ranks(group))
    future = SaveFuture()

    def run() -> None:
        try:
            write_and_commit(
                snap, os.fspath(path), background_group, coordinator_rank, after_publish
            )
        except BaseException as e:  # the caller gets it from the future
            future.set_exception(e)
        else:
            future.set_result(None)

    state.future = future
    _in_flight.add(future)
    future.add_done_callback(_in_flight.discard)
    state.submit(run, f"checkpoint-save-rank{rank}")
    return future


_in_flight: set[SaveFuture] = set()


@atexit.register
def _finish_saves_in_flight() -> None:
    concurrent.futures.wait(list(_in_flight))
