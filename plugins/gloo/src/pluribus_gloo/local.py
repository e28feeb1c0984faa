"""Collectives of a group whose ranks all share this host, run on the group's arena.

Each rank copies what its peers need into its own slot once, and every rank then reads its
peers' slots directly with numpy (``out=`` into the destination, no staging buffer, no message):

- all-reduce, small (the ``p - 1`` peers' copies together up to ``ONE_SHOT_BYTES``): every
  rank copies its array into its slot, then reduces all slots in rank order (every rank
  computes every element, in the same order, so all get identical results);
- all-reduce, large: per round of one half's worth of elements, split into ``p`` parts, a rank
  copies the ``p - 1`` parts it does not own into its slot, reduces its own part straight out of
  its input and the peers' slots into its slot and from there at once (still in cache) into its
  array, then copies every peer's reduced part into its array (a reduce-scatter then an
  all-gather, 2 - 1/p copies per byte beside the reduction, about 4 bytes of memory traffic per
  byte at 2 ranks), with the rounds pipelined so that ``K`` rounds take ``K + 1`` syncs;
- all-reduce, large, in place on arrays from :func:`pluribus.empty_symmetric` on every rank:
  no copy in; each rank reduces its part straight out of its peers' arrays into its own, then
  copies their reduced parts out of their arrays (:func:`_all_reduce_symmetric`);
- reduce-scatter: the same first half; all-gather: one copy in, one copy out per byte;
  broadcast: the root copies in, the others copy out; barrier: one phase.

Every round ends its writes with an :meth:`Arena.sync`; :mod:`pluribus_gloo.arena` explains why
two halves per slot are enough.
"""

from __future__ import annotations

import os

import numpy as np
from pluribus.algorithms import chunk_bounds
from pluribus.arrays import byte_view
from pluribus.errors import CollectiveMismatchError, PluribusError

from . import cma, symmetric

#: An all-reduce reduces whole arrays in one phase while the peers' copies that every rank
#: reads beside its own, ``p - 1`` arrays, take at most this many bytes; above, each rank reduces
#: one part and gathers the parts (a ``p``-th of the reading, for one more sync). Measured on
#: 2 cores at 2 ranks (benchmarks/gloo_arena_tuning.py --experiment one-shot): one phase wins up
#: to 192 KiB arrays, two phases by 2-7 % at 256 KiB (a tie in pluribus-bench; one sync fewer is
#: the safer bet on a busy host) and by 10-15 % from 384 KiB.
ONE_SHOT_BYTES = int(os.environ.get("PLURIBUS_GLOO_ONE_SHOT_BYTES", 256 << 10))

#: When the host runs more ranks than cores, a sync costs a context switch, and one phase wins
#: up to this many times the reading (at 4 ranks on 2 cores: up to 256 KiB arrays, two phases
#: by 10-25 % from 384 KiB).
CROWDED_ONE_SHOT_FACTOR = 4


def _reduce_in_order(ufunc, parts: list[np.ndarray], out: np.ndarray) -> None:
    """``out = parts[0] op parts[1] op ...``, left to right (``out`` may alias ``parts[0]`` or
    ``parts[1]`` only)."""
    ufunc(parts[0], parts[1], out=out)
    for part in parts[2:]:
        ufunc(out, part, out=out)


def all_reduce(arena, data: np.ndarray, ufunc, out: np.ndarray | None = None) -> None:
    """Reduce ``data`` into ``out`` (``data`` itself when None); ``data`` is only read when
    ``out`` is another array, which the segment's copy of it makes free.

    Above the one-shot size, an in-place call on an array in a symmetric allocation says so
    (``Arena.announce_shared``; every other call announces none) and syncs; when every rank
    announced the same allocation and offset, the reduction runs on the arrays themselves
    (:func:`_all_reduce_symmetric`). When they disagree (a rank passed a plain array, another
    allocation or another slice), every rank falls back on the copying path instead of
    raising: each can tell from the announcements, and a buffer that is symmetric on some
    ranks only still gets a correct result. The ranks that synced first then copy in, and the
    others, which copied in before their first sync, sync once more
    (:func:`_all_reduce_two_phase`), so that every rank reads only after every copy-in.
    """
    out = data if out is None else out
    reading = data.nbytes * (arena.size - 1)
    bound = ONE_SHOT_BYTES * (CROWDED_ONE_SHOT_FACTOR if arena.crowded else 1)
    if reading <= bound and data.nbytes <= arena.half:
        _all_reduce_one_shot(arena, data, ufunc, out)
        return
    found = symmetric.locate(data, arena) if out is data else None
    if found is None:
        arena.announce_shared(0, 0)
        _all_reduce_two_phase(arena, data, ufunc, out, announced=False)
        return
    peers = _announce_and_agree(arena, data, found)
    if peers is not None:
        _all_reduce_symmetric(arena, peers, ufunc)
    else:
        _all_reduce_two_phase(arena, data, ufunc, out, announced=True)


def _announce_and_agree(arena, data: np.ndarray, found) -> list[np.ndarray] | None:
    """Announce where ``data`` lies (``found``: its allocation and offset, or None for none),
    sync, and return every rank's array at that place when every rank announced the same one;
    None otherwise, in which case every rank can tell and takes its copying path."""
    number, offset = (0, 0) if found is None else (found[0].number, found[1])
    arena.announce_shared(number, offset)
    arena.sync()
    if number and all(place == (number, offset) for place in arena.shared_places()):
        return found[0].peer_arrays(data, offset)
    return None


#: Broadcast, all-gather and reduce-scatter whose bytes in all (the whole array, every output,
#: every input) reach this size announce where their input lies and run zero-copy when every
#: rank's input is the same place of one symmetric allocation. Below, the announcement's sync
#: costs more than the copy it saves.
ZERO_COPY_BYTES = int(os.environ.get("PLURIBUS_GLOO_ZERO_COPY_BYTES", 1 << 20))

#: Above this a zero-copy broadcast loses: one rank (each non-root) does all the copying from
#: memory, where the copying path splits it between the root's copy-in and the non-roots'
#: copy-out, overlapped, through slots that stay in cache. Measured on 2 cores at 2 ranks:
#: zero-copy 0.63x the copying path's time at 1 MiB, 0.72x at 4 MiB, 1.1x at 16 MiB, 1.25x at
#: 64 MiB (BENCHMARKS.md).
BROADCAST_ZERO_COPY_MAX_BYTES = 8 << 20


def _symmetric_inputs(arena, data: np.ndarray | None):
    """The zero-copy decision of broadcast, all-gather and reduce-scatter, taken by every rank
    of a call whose bytes in all lie between :data:`ZERO_COPY_BYTES` and the collective's
    limit (the same on every rank: the sizes are the call's, not this rank's; smaller calls
    skip it and pay nothing). ``data`` is the input peers would read (None when this rank's
    call cannot run zero-copy); every rank announces where it lies, syncs once, and gets every
    rank's ``data`` when all agree, else None: every rank takes the copying path, and as every
    rank synced once the syncs still pair up. The copying path pays that sync inside the
    window, a few microseconds beside a megabyte's copies, and needs no pairing rule."""
    found = None if data is None else symmetric.locate(data, arena)
    return _announce_and_agree(arena, data, found)


def _all_reduce_one_shot(arena, data: np.ndarray, ufunc, out: np.ndarray) -> None:
    halves = arena.next_half(data.dtype)
    n = data.size
    halves[arena.rank][:n] = data
    arena.sync()
    if arena.size == 2:
        ufunc(halves[0][:n], halves[1][:n], out=out)
    elif n == 1:
        ufunc.reduce(arena.first_elements(data.dtype), axis=0, out=out)
    else:
        _reduce_in_order(ufunc, [h[:n] for h in halves], out)


def _all_reduce_symmetric(arena, arrays: list[np.ndarray], ufunc) -> None:
    """Reduce in place on every rank's own array (``arrays[j]``, rank ``j``'s, all mapped
    here), after the sync that exchanged the announcements (so every array holds its rank's
    input): rank ``r`` reduces part ``r`` of every array into its own part ``r``, syncs, copies
    every other part ``q`` out of rank ``q``'s array into its own, and syncs again.

    No region is written by one rank while another reads it in the same phase: in the first,
    rank ``r`` writes only part ``r`` of its own array and reads only parts ``r`` (its peers
    read parts ``q != r`` of it); in the second, it writes only parts ``q != r`` of its own
    array and reads only part ``q`` of rank ``q``'s (its peers read only part ``r`` of it,
    final since the first sync). The last sync keeps every rank in the call until no peer
    reads its array any more: its caller may overwrite it at once. About 2.5 bytes of memory
    traffic per byte reduced at 2 ranks, against 4 for the copying path."""
    p, r = arena.size, arena.rank
    mine = arrays[r]
    bounds = chunk_bounds(mine.size, p)
    lo, hi = bounds[r], bounds[r + 1]
    _reduce_in_order_into_own(ufunc, [a[lo:hi] for a in arrays], r)
    arena.sync()
    for q in range(p):
        if q != r:
            lo, hi = bounds[q], bounds[q + 1]
            mine[lo:hi] = arrays[q][lo:hi]
    arena.sync()


#: The block through which a rank's own part is reduced when it is not among the first two
#: operands.
_BLOCK_BYTES = 64 << 10


def _reduce_in_order_into_own(ufunc, parts: list[np.ndarray], r: int) -> None:
    """``parts[r] = parts[0] op parts[1] op ...`` in rank order, as the copying path computes
    it. For ``r >= 2`` the result would overwrite ``parts[r]`` before it is read, so the sum
    goes through a small block that stays in cache."""
    if r < 2:
        _reduce_in_order(ufunc, parts, parts[r])
        return
    out = parts[r]
    step = max(1, _BLOCK_BYTES // out.itemsize)
    block = np.empty(min(step, out.size), out.dtype)
    for lo in range(0, out.size, step):
        hi = min(lo + step, out.size)
        scratch = block[: hi - lo]
        _reduce_in_order(ufunc, [part[lo:hi] for part in parts], scratch)
        out[lo:hi] = scratch


def _all_reduce_two_phase(arena, data: np.ndarray, ufunc, out: np.ndarray, announced: bool) -> None:
    """Reduce-scatter + all-gather in rounds, software-pipelined: in one phase a rank copies out
    round ``k - 2``, reduces its part of round ``k - 1`` and copies in round ``k``, so ``K`` rounds
    take ``K + 1`` syncs. Part ``q`` of every round lives in region ``q`` of each half, so the
    copy-in of round ``k`` (the regions a rank does not own) never touches what its peers read in
    the copy-out of round ``k - 2`` (the region it owns) in the same phase. Rounds read ``data``
    and write ``out``, which may be the same array.

    ``announced``: this rank synced once already to exchange symmetric announcements (see
    :func:`all_reduce`); a rank that did not, but sees a peer's, syncs once more after its first
    copy-in, so that the syncs still pair up."""
    p, r = arena.size, arena.rank
    region = arena.half // (p * data.itemsize)
    per_round = region * p
    starts = list(range(0, data.size, per_round))
    rounds: list = [None] * len(starts)
    for phase in range(len(starts) + 2):
        if phase >= 2:
            _copy_out(rounds[phase - 2], region, r, p)
            rounds[phase - 2] = None
        if 1 <= phase <= len(starts):
            _reduce_own_part(rounds[phase - 1], region, r, p, ufunc)
        if phase < len(starts):
            window = slice(starts[phase], starts[phase] + per_round)
            rounds[phase] = _copy_in(arena, data[window], out[window], region, r, p)
        if phase <= len(starts):
            arena.sync()
        if phase == 0 and not announced and _peer_announced_shared(arena):
            arena.sync()


def _peer_announced_shared(arena) -> bool:
    return any(number for number, _ in arena.shared_places())


def _copy_in(arena, chunk: np.ndarray, result: np.ndarray, region: int, r: int, p: int):
    """Copy the parts of ``chunk`` that the peers reduce into their regions of this rank's half;
    ``result`` is where the round's reduction goes."""
    slots = arena.next_half(chunk.dtype)
    bounds = chunk_bounds(chunk.size, p)
    mine = slots[r]
    for q in range(p):
        if q != r:
            lo, hi = bounds[q], bounds[q + 1]
            mine[q * region : q * region + hi - lo] = chunk[lo:hi]
    return chunk, result, bounds, slots


def _reduce_own_part(state, region: int, r: int, p: int, ufunc) -> None:
    """Reduce part ``r`` (in rank order) into region ``r`` of this rank's half, for the peers,
    and copy it into the result at once, while it is still in cache (the peers' parts follow in
    :func:`_copy_out`). The input's part ``r`` has been read by then, and no peer reads the
    input, so an in-place call may overwrite it."""
    chunk, result, bounds, slots = state
    lo, hi = bounds[r], bounds[r + 1]
    at = r * region
    reduced = slots[r][at : at + hi - lo]
    parts = [chunk[lo:hi] if j == r else slots[j][at : at + hi - lo] for j in range(p)]
    _reduce_in_order(ufunc, parts, reduced)
    result[lo:hi] = reduced


def _copy_out(state, region: int, r: int, p: int) -> None:
    """Copy every peer's reduced part (region ``q`` of rank ``q``'s half) into the result."""
    _, result, bounds, slots = state
    for q in range(p):
        if q != r:
            lo, hi = bounds[q], bounds[q + 1]
            result[lo:hi] = slots[q][q * region : q * region + hi - lo]


def reduce_scatter(arena, out: np.ndarray, ins: list[np.ndarray], ufunc, counts: list[int]) -> None:
    """``counts``: the sizes of ``ins``."""
    if sum(counts) * out.itemsize >= ZERO_COPY_BYTES:
        whole = _one_array(ins)
        if whole is not None and any(
            np.shares_memory(out, x) for q, x in enumerate(ins) if q != arena.rank
        ):
            whole = None  # peers would read what this rank writes
        peers = _symmetric_inputs(arena, whole)
        if peers is not None:
            _reduce_scatter_symmetric(arena, out, counts, peers, ufunc)
            return
    _reduce_scatter_copying(arena, out, ins, ufunc, max(counts))


def _one_array(ins: list[np.ndarray]) -> np.ndarray | None:
    """``ins`` as one flat array when they lie back to back in memory (as a split input does),
    else None: the symmetric path reads peers' blocks at the same offsets in their arrays."""
    first = ins[0]
    address = first.__array_interface__["data"][0]
    for x in ins:
        if x.dtype != first.dtype or (x.size and x.__array_interface__["data"][0] != address):
            return None
        address += x.nbytes
    total = sum(x.size for x in ins)
    if first.size == 0:
        return None
    return np.lib.stride_tricks.as_strided(first, (total,), (first.itemsize,), writeable=False)


def _reduce_scatter_symmetric(arena, out, sizes: list[int], arrays: list[np.ndarray], ufunc):
    """Reduce block ``r`` of every rank's input (``arrays[j]``, rank ``j``'s, after the
    announcement's sync) into ``out`` in rank order, then sync so that no rank returns, and
    lets its input be overwritten, while a peer still reads it.

    No region is written by one rank while another reads it: rank ``r`` writes only ``out``,
    which overlaps none of its input but block ``r`` (checked before announcing), and its peers
    read only their own blocks ``q != r``."""
    r = arena.rank
    lo = sum(sizes[:r])
    hi = lo + sizes[r]
    if hi > lo:
        parts = [a[lo:hi] for a in arrays]
        own = parts.pop(r)
        # own first: the output may be the input's memory
        _reduce_in_order(ufunc, [own, *parts], out[: hi - lo])
    arena.sync()


def _reduce_scatter_copying(
    arena, out: np.ndarray, ins: list[np.ndarray], ufunc, longest: int
) -> None:
    p, r = arena.size, arena.rank
    per_block = max(1, arena.half // (out.itemsize * p))
    if longest <= per_block:  # one round: the small call's few steps
        slots = arena.next_half(out.dtype)
        mine = slots[r]
        for q, block in enumerate(ins):
            if q != r:
                mine[q * per_block : q * per_block + block.size] = block
        arena.sync()
        start, m = r * per_block, ins[r].size
        theirs = [slot[start : start + m] for j, slot in enumerate(slots) if j != r]
        # own first: the output may be the input's memory
        _reduce_in_order(ufunc, [ins[r], *theirs], out)
        return
    others = [j for j in range(p) if j != r]
    for lo in range(0, longest, per_block):
        slots = arena.next_half(out.dtype)
        mine = slots[r]
        for q in others:
            block = ins[q][lo : lo + per_block]
            mine[q * per_block : q * per_block + block.size] = block
        arena.sync()
        own = ins[r][lo : lo + per_block]
        m = own.size
        if m == 0:
            continue
        start = r * per_block
        theirs = [slots[j][start : start + m] for j in others]
        # own first: the output may be the input's memory
        _reduce_in_order(ufunc, [own, *theirs], out[lo : lo + m])


def all_gather(arena, outs: list[np.ndarray], src: np.ndarray, counts: list[int]) -> None:
    """Every rank's ``src`` into ``outs`` (``counts``: their sizes), this rank's own too. The
    copying path fills this rank's output from its slot, after ``src`` went there, so ``src``
    may be any part of the outputs."""
    r = arena.rank
    if sum(counts) * src.itemsize >= ZERO_COPY_BYTES:
        same_sizes = all(n == src.size for n in counts)
        overlaps = any(np.shares_memory(o, src) for q, o in enumerate(outs) if q != r)
        peers = _symmetric_inputs(arena, src if same_sizes and not overlaps else None)
        if peers is not None:
            # Rank r reads every peer's input and writes only its outputs q != r, which
            # overlap no input (checked before announcing); the sync keeps it until no peer
            # reads its input, which its own output may then overwrite.
            for q, out in enumerate(outs):
                if q != r:
                    out[...] = peers[q]
            arena.sync()
            if not np.shares_memory(outs[r], src):
                np.copyto(outs[r], src)
            return
    per_round = max(1, arena.half // src.itemsize)
    longest = max(counts)
    if longest <= per_round:  # one round: the small call's few steps
        slots = arena.next_half(src.dtype)
        slots[r][: src.size] = src
        arena.sync()
        for out, slot, n in zip(outs, slots, counts, strict=True):
            out[...] = slot[:n]
        return
    for lo in range(0, longest, per_round):
        slots = arena.next_half(src.dtype)
        piece = src[lo : lo + per_round]
        slots[r][: piece.size] = piece
        arena.sync()
        for out, slot in zip(outs, slots, strict=True):
            dest = out[lo : lo + per_round]
            dest[...] = slot[: dest.size]


#: Bytes at the start of each all-to-all region, before the block's elements: the block's size
#: and what its sender needs (a cache line of its own, which keeps the elements aligned).
_HEADER_BYTES = 64
_WORD = np.dtype(np.int64)


def all_to_all_fits(arena) -> bool:
    """Whether a half holds a region per peer with room for a header and some elements."""
    return arena.half // (arena.size - 1) >= 2 * _HEADER_BYTES


def all_to_all(arena, outs: list[np.ndarray], ins: list[np.ndarray]) -> None:
    """Rank ``r``'s ``ins[q]`` into rank ``q``'s ``outs[r]``, through one region per peer in
    each rank's half. The first round's headers carry, per block, its size, the size its
    receiver expects from the sender (so that both ranks of a pair that disagree raise), the
    rounds the sender needs, and, for a block too large for one round where the group may read
    its members' memory (:mod:`pluribus_gloo.cma`), the block's address: its receiver copies
    it from there, once, and the block takes no round. After that round's sync every rank knows
    the most rounds any rank needs and all take that many, and one sync more at the end when
    any block was read in place (its sender keeps it until then). A rank copies its own block
    after its others went to the segment, so its own output may overlap the blocks it sends in
    one round."""
    p, r = arena.size, arena.rank
    dtype = ins[r].dtype
    region = arena.half // (p - 1) // _HEADER_BYTES * _HEADER_BYTES  # bytes
    step, head = region // dtype.itemsize, _HEADER_BYTES // dtype.itemsize  # in elements
    per_round, wstep = step - head, region // _WORD.itemsize
    # region k of a rank's half goes to its k-th peer: here, where rank q reads what we send it
    # and where we read what rank q sends us
    to_peer = [(q, q - (q > r), r - (r > q)) for q in arena.peers]
    in_place = _read_in_place(arena, outs, ins, per_round)
    longest = max([0 if q in in_place else ins[q].size for q in arena.peers])
    rounds = max(1, -(-longest // per_round))  # own block: no round
    slots = arena.next_half(dtype)
    words = arena.current_half(_WORD)
    mine, my_words = slots[r], words[r]
    for q, there, _ in to_peer:
        block, at, w = ins[q], there * step + head, there * wstep
        if q in in_place:
            my_words[w + 3] = block.ctypes.data
        else:
            n = min(block.size, per_round)
            mine[at : at + n] = block[:n]
            my_words[w + 3] = 0
        my_words[w] = block.size
        my_words[w + 1] = outs[q].size
        my_words[w + 2] = rounds
        my_words[w + 4] = len(in_place)
    if not np.shares_memory(outs[r], ins[r]):
        np.copyto(outs[r], ins[r])
    arena.sync()
    pulled, final_sync = {}, bool(in_place)
    for q, _, here in to_peer:
        sent, expected, needed, address, offered = words[q][
            here * wstep : here * wstep + 5
        ].tolist()
        if sent != outs[q].size or expected != ins[q].size:
            arena.raise_error(
                CollectiveMismatchError(
                    f"rank {r}: all_to_all on group {arena.group_name!r}: rank {q} sends this "
                    f"rank {sent} elements and expects {expected} from it, but this rank "
                    f"receives {outs[q].size} (outputs[{q}]) and sends {ins[q].size} "
                    f"(inputs[{q}]); outputs[j] on rank i must have the size of inputs[i] on "
                    "rank j"
                ),
                "mismatch",
            )
        rounds = max(rounds, needed)
        final_sync = final_sync or bool(offered)
        if address:
            pulled[q] = address
    for q, address in pulled.items():
        try:
            cma.read(arena.pids[q], outs[q], address)
        except OSError as exc:
            arena.raise_error(
                PluribusError(
                    f"rank {r}: all_to_all on group {arena.group_name!r} could not copy rank "
                    f"{q}'s block out of its memory ({exc}); set {cma.CMA_ENV}=0 to send large "
                    "blocks through the shared segment instead"
                ),
                "cma",
            )
    for k in range(rounds):
        lo = k * per_round
        if k:
            slots = arena.next_half(dtype)
            mine = slots[r]
            for q, there, _ in to_peer:
                piece = ins[q][lo : lo + per_round]
                if piece.size and q not in in_place:
                    mine[there * step + head : there * step + head + piece.size] = piece
            arena.sync()
        for q, _, here in to_peer:
            dest = outs[q][lo : lo + per_round]
            if dest.size and q not in pulled:
                dest[...] = slots[q][here * step + head : here * step + head + dest.size]
    if final_sync:
        arena.sync()


def _read_in_place(arena, outs: list[np.ndarray], ins: list[np.ndarray], per_round: int):
    """The peers whose blocks from this rank they will copy out of its memory: blocks too large
    for one round, where the group may (``arena.pids``) and no output of this rank overlaps
    them (this rank writes its outputs while peers read)."""
    if arena.pids is None:
        return ()
    large = [q for q in arena.peers if ins[q].size > per_round]
    if any(np.may_share_memory(ins[q], out) for q in large for out in outs):
        return ()
    return frozenset(large)


def broadcast(arena, data: np.ndarray, src: int) -> None:
    if ZERO_COPY_BYTES <= data.nbytes <= BROADCAST_ZERO_COPY_MAX_BYTES:
        peers = _symmetric_inputs(arena, data)
        if peers is not None:
            # Only the non-roots write, each its own array, which no peer reads; the sync keeps
            # the root until no peer reads its array.
            if arena.rank != src:
                data[...] = peers[src]
            arena.sync()
            return
    if data.nbytes <= arena.half:  # one round: the small call's few steps
        slot = arena.next_half(data.dtype)[src][: data.size]
        if arena.rank == src:
            slot[...] = data
            arena.sync()
        else:
            arena.sync()
            data[...] = slot
        return
    raw = byte_view(data)
    for lo in range(0, raw.size, arena.half):
        slots = arena.next_half(raw.dtype)
        piece = raw[lo : lo + arena.half]
        if arena.rank == src:
            slots[src][: piece.size] = piece
        arena.sync()
        if arena.rank != src:
            piece[...] = slots[src][: piece.size]


def barrier(arena) -> None:
    arena.sync()
