"""DTensor redistribute against the one collective written by hand, its fixed cost per call,
and the tensor-parallel GPT MLP's speed-up of 2 ranks over 1.

    python benchmarks/dtensor_redistribute.py                  # everything below, gloo
    python benchmarks/dtensor_redistribute.py --only overhead  # the fixed cost only
    python benchmarks/dtensor_redistribute.py --only mlp --embd 768 --tokens 256
    python benchmarks/dtensor_redistribute.py --only collectives --device cuda --backend ucc
    python benchmarks/dtensor_redistribute.py --only gap --ranks 1,2  # Python between calls
    python benchmarks/dtensor_redistribute.py --only floor  # what any cached dispatch adds
    python benchmarks/dtensor_redistribute.py --only route  # a plan through Shard on 2 x 2

The ranks are processes on gloo (one BLAS thread each), or on ``--backend`` with cupy arrays
under ``--device cuda`` (each call then ends with a synchronisation of the stream). Each
comparison alternates the two calls in rounds, so that machine load hits both alike, and prints
the median (and fastest) time per call; ratio = redistribute / by hand.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

SIZES = {"64 KiB": 64 << 10, "16 MiB": 16 << 20}
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
#: the most calls :func:`_rounds` makes of one function: warm-up, one timed call, and at most
#: 100 rounds of 500
MOST_CALLS = 3 + 1 + 100 * 500


def _rounds(fns: dict, seconds: float) -> dict:
    """Median and fastest seconds per call of each function, measured in alternating batches,
    and (under ``"ratio"``, for two functions) the median over rounds of first / second: each
    round's two batches run back to back, so that ratio sees the same load on both sides."""
    import pluribus as pb

    for fn in fns.values():
        for _ in range(3):
            fn()
    pb.barrier()
    start = time.perf_counter()
    next(iter(fns.values()))()
    once = max(time.perf_counter() - start, 1e-6)
    per = pb.broadcast_object(int(min(500, max(1, 0.01 / once))))  # see MOST_CALLS
    times: dict[str, list[float]] = {k: [] for k in fns}
    rounds = max(5, int(seconds / (once * per * len(fns)) + 1))
    rounds = pb.broadcast_object(min(rounds, 100))
    for n in range(rounds):
        # alternate the order: the first batch after a barrier pays for the ranks' skew
        for name, fn in list(fns.items())[:: 1 if n % 2 else -1]:
            pb.barrier()
            start = time.perf_counter()
            for _ in range(per):
                fn()
            times[name].append((time.perf_counter() - start) / per)
    out = {k: (float(np.median(v)), float(np.min(v))) for k, v in times.items()}
    if len(fns) == 2:
        first, second = times.values()
        out["ratio"] = float(np.median(np.array(first) / np.array(second)))
    return out


def _pairs(mesh, nbytes: int, xp) -> dict:
    """For each collective: (redistribute, the same collective by hand) on ``nbytes`` of
    arrays of namespace ``xp`` (numpy or cupy)."""
    import pluribus as pb
    from pluribus.dtensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    whole = xp.zeros((nbytes // 4 // 256, 256), xp.float32)
    shard = distribute_tensor(whole, mesh, [Shard(0)])
    partial = distribute_tensor(whole, mesh, [Partial()])
    local, term = shard.to_local(), partial.to_local()
    buffer = whole.copy()
    donated = iter([DTensor(buffer, mesh, partial.layout) for _ in range(MOST_CALLS)])
    donated_again = iter([DTensor(buffer, mesh, partial.layout) for _ in range(MOST_CALLS)])
    # what a training loop hands the hand-written call: a new array object each step (a fresh
    # gradient), here a new view of the same buffer, so that both sides read the same memory
    fresh = iter([buffer[...] for _ in range(MOST_CALLS)])
    p, rows = pb.get_world_size(), local.shape[0]
    cols = whole.shape[1] // p

    def all_to_all_by_hand():
        """Shard(0) -> Shard(1) as one would write it: column blocks out, row blocks in."""
        out = xp.empty((whole.shape[0], cols), xp.float32)
        sends = [xp.ascontiguousarray(local[:, k * cols : (k + 1) * cols]) for k in range(p)]
        pb.all_to_all([out[k * rows : (k + 1) * rows] for k in range(p)], sends)

    return {
        "all_gather": (
            lambda: shard.redistribute(placements=[Replicate()]),
            lambda: pb.all_gather(xp.empty(whole.shape, whole.dtype), local),
        ),
        "all_reduce": (
            lambda: partial.redistribute(placements=[Replicate()]),
            lambda: pb.all_reduce(buffer),
        ),
        # the same, against the hand-written call that also leaves its input intact
        "all_reduce vs out=": (
            lambda: partial.redistribute(placements=[Replicate()]),
            lambda: pb.all_reduce(term, out=xp.empty(term.shape, term.dtype)),
        ),
        # a donated DTensor cannot be used again, so each call takes a new one, made before
        # the timing starts: making it is the caller's work, not redistribute's
        "all_reduce donated": (
            lambda: next(donated).redistribute(placements=[Replicate()], donate=True),
            lambda: pb.all_reduce(buffer),
        ),
        # the same, with a new operand object on both sides: the reused buffer above stays in
        # the cache, a new DTensor per call does not
        "donated vs fresh": (
            lambda: next(donated_again).redistribute(placements=[Replicate()], donate=True),
            lambda: pb.all_reduce(next(fresh)),
        ),
        "reduce_scatter": (
            lambda: partial.redistribute(placements=[Shard(0)]),
            lambda: pb.reduce_scatter(xp.empty(local.shape, local.dtype), buffer),
        ),
        "all_to_all": (
            lambda: shard.redistribute(placements=[Shard(1)]),
            all_to_all_by_hand,
        ),
    }


def _synchronized(fn):
    """``fn`` followed by a wait for the GPU's current stream: a call's time is its whole work."""
    import cupy

    def call():
        fn()
        cupy.cuda.get_current_stream().synchronize()

    return call


def _collectives(seconds: float, ops: list[str] | None, device: str = "cpu", sizes=None):
    import pluribus as pb
    from pluribus.dtensor import init_device_mesh

    mesh = init_device_mesh(device, (pb.get_world_size(),))
    xp = np
    if device == "cuda":
        import cupy as xp
    out = []
    for label, nbytes in SIZES.items():
        if sizes and label not in sizes:
            continue
        for op, (ours, hand) in _pairs(mesh, nbytes, xp).items():
            if ops and op not in ops:
                continue
            if device == "cuda":
                ours, hand = _synchronized(ours), _synchronized(hand)
            t = _rounds({"redistribute": ours, "hand": hand}, seconds)
            out.append((label, op, t["redistribute"], t["hand"], t["ratio"]))
    return out


def _out_of_place_sweep(seconds: float):
    """Partial -> Replicate without donating (one all-reduce into a new array) against the
    all-reduce by hand, in place on a kept buffer and into a new array, 16 KiB to 16 MiB."""
    import pluribus as pb
    from pluribus.dtensor import Partial, Replicate, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    out = []
    for kib in (16, 64, 128, 256, 512, 1024, 4096, 16384):
        whole = np.zeros((kib, 256), np.float32)
        buffer = whole.copy()
        x = distribute_tensor(whole, mesh, [Partial()])
        term = x.to_local()
        fns = {
            "redistribute": lambda x=x: x.redistribute(placements=[Replicate()]),
            "in place": lambda buffer=buffer: pb.all_reduce(buffer),
            "out=": lambda term=term: pb.all_reduce(term, out=np.empty(term.shape, term.dtype)),
        }
        times = _rounds(fns, seconds)
        ratios = {}
        for way in ("in place", "out="):
            pair = {"redistribute": fns["redistribute"], way: fns[way]}
            ratios[way] = _rounds(pair, seconds)["ratio"]
        out.append((kib, times, ratios))
    return out


def _gap(seconds: float):
    """What a little Python between two back-to-back collectives costs: a 4 KiB in-place
    all-reduce alone, and after a busy loop of 1, 2 and 5 µs (redistribute's own work sits in
    such a gap)."""
    import pluribus as pb

    buffer = np.zeros(1024, np.float32)

    def after(us: float):
        def call():
            end = time.perf_counter() + us * 1e-6
            while time.perf_counter() < end:
                pass
            pb.all_reduce(buffer)

        return call

    fns = {"alone": lambda: pb.all_reduce(buffer)} | {f"{us} us": after(us) for us in (1, 2, 5)}
    return _rounds(fns, seconds)


def _through_shard(seconds: float):
    """Whether a plan should go through a placement that is in neither the source nor the
    target: ``[Partial(), Partial()] -> [Replicate(), Replicate()]`` on a 2 x 2 mesh as the
    planner runs it (an all-reduce per mesh dimension) against a route through ``Shard(0)`` on
    the first (reduce-scatter, an all-reduce of half the bytes, all-gather), which moves 3/4
    of the bytes in a ring model. Each result is checked against the other first."""
    import pluribus as pb
    from pluribus.dtensor import Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2))
    results = {}
    for label, nbytes in {"64 KiB": 64 << 10, "1 MiB": 1 << 20, "16 MiB": 16 << 20}.items():
        whole = np.ones((nbytes // 4 // 256, 256), np.float32)
        x = distribute_tensor(whole, mesh, [Partial(), Partial()])
        both = [Replicate(), Replicate()]

        def planned(x=x, both=both):
            return x.redistribute(placements=both)

        def routed(x=x, both=both):
            y = x.redistribute(placements=[Shard(0), Partial()])
            y = y.redistribute(placements=[Shard(0), Replicate()], donate=True)
            return y.redistribute(placements=both, donate=True)

        np.testing.assert_array_equal(planned().to_local(), routed().to_local())
        pb.barrier()
        results[label] = _rounds({"planned": planned, "through Shard(0)": routed}, seconds)
    return results


def _floor(seconds: float):
    """What any cached dispatch would add at 64 KiB, Shard(0) -> Replicate: each stand-in timed
    against the all-gather by hand in rounds of its own (the median per-round ratio), from the
    hand-written call against itself (the measurement's resolution) through the compiled
    function alone, with a new DTensor, a method of redistribute's signature that runs the
    remembered plan with no checks, a bare cached lookup-and-call, to redistribute itself,
    with and without building the placement list."""
    import pluribus as pb
    from pluribus.dtensor import DTensor, Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    whole = np.zeros(((64 << 10) // 4 // 256, 256), np.float32)
    shard = distribute_tensor(whole, mesh, [Shard(0)])
    local, group = shard.to_local(), mesh.get_group(0)
    shard.redistribute(placements=[Replicate()])
    _, _, _, _, _, layout, run = shard.layout.last_redistribute
    empty, all_gather, shape, dtype = np.empty, pb.all_gather, whole.shape, whole.dtype

    def found(piece, async_op):
        out = empty(shape, dtype)
        all_gather(out, piece, group, async_op)
        return DTensor(out, mesh, layout)

    cache = {(shard.layout, (Replicate(),), np.ndarray, dtype, False): found}

    def cached_call(self, device_mesh=None, placements=None, *, async_op=False, donate=False):
        piece = self.to_local()
        return cache[(self.layout, tuple(placements), type(piece), piece.dtype, donate)](
            piece, async_op
        )

    def unchecked(self, device_mesh=None, placements=None, *, async_op=False, donate=False):
        made = object.__new__(DTensor)
        made._local = run(self._local, False)
        made._mesh, made._layout = self._mesh, layout
        made._pending = made._readers = None
        return made

    def hand():
        return pb.all_gather(np.empty(whole.shape, whole.dtype), local)

    replicated = [Replicate()]
    stand_ins = {
        "by hand, again": lambda: pb.all_gather(np.empty(whole.shape, whole.dtype), local),
        "its compiled function alone": lambda: run(local, False),
        "that and a new DTensor": lambda: DTensor(run(local, False), mesh, layout),
        "a method, no checks": lambda: unchecked(shard, placements=replicated),
        "a bare cached lookup and call": lambda: cached_call(shard, placements=replicated),
        "redistribute, list made once": lambda: shard.redistribute(placements=replicated),
        "redistribute": lambda: shard.redistribute(placements=[Replicate()]),
    }
    out = {}
    for name, fn in stand_ins.items():
        t = _rounds({name: fn, "by hand": hand}, seconds)
        out[name] = (t["ratio"], t[name][0], t["by hand"][0])
    return out


def _overhead():
    """Microseconds per call of the work redistribute adds to its collectives: placement
    checks, the cached plan's lookup and the new DTensor (a plan with no collective)."""
    import pluribus as pb
    from pluribus.dtensor import Replicate, Shard, distribute_tensor, init_device_mesh

    mesh = init_device_mesh("cpu", (pb.get_world_size(),))
    x = distribute_tensor(np.ones((64, 64), np.float32), mesh, [Shard(0)])
    same, to_local = [Shard(0)], [Replicate()]
    y = x.redistribute(placements=to_local)
    results = {}
    for name, fn in {
        "no-op redistribute (check, plan lookup, new DTensor)": lambda: x.redistribute(
            placements=same
        ),
        "Replicate -> Shard(0), 64x64 float32 (local slice)": lambda: y.redistribute(
            placements=same
        ),
    }.items():
        samples = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(20000):
                fn()
            samples.append((time.perf_counter() - start) / 20000 * 1e6)
        results[name] = (float(np.median(samples)), float(np.min(samples)))
    # one rank: the collectives cost next to nothing, so the difference is redistribute's own
    for op, (ours, hand) in _pairs(mesh, 4096, np).items():
        t = _rounds({"redistribute": ours, "hand": hand}, 1.0)
        extra = (t["redistribute"][0] - t["hand"][0]) * 1e6
        results[f"{op} step, 4 KiB on 1 rank: extra over the collective"] = (
            extra,
            (t["redistribute"][1] - t["hand"][1]) * 1e6,
        )
    return results


def _mlp(embd: int, tokens: int, steps: int):
    import pluribus as pb
    from pluribus import nn
    from pluribus.dtensor import init_device_mesh
    from pluribus.parallel import MLPParallel, parallelize_module

    block = nn.TransformerBlock(embd, 1, rng=0)
    mlp = block.mlp
    p = pb.get_world_size()
    if p > 1:
        parallelize_module(mlp, init_device_mesh("cpu", (p,)), MLPParallel())
    x = np.random.default_rng(1).normal(size=(1, tokens, embd)).astype(np.float32)

    def step():
        mlp.backward(mlp.forward(x))
        mlp.zero_grad()

    return _rounds({"step": step}, steps)["step"]


def main() -> None:
    from pluribus.testing import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only", choices=["collectives", "overhead", "mlp", "sweep", "gap", "floor", "route"]
    )
    parser.add_argument("--ops", help="comma-separated subset of the collectives")
    parser.add_argument("--ranks", default="2,4")
    parser.add_argument("--sizes", help=f"comma-separated subset of {', '.join(SIZES)}")
    parser.add_argument("--seconds", type=float, default=3.0, help="per comparison")
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="collectives")
    parser.add_argument("--backend", default="gloo", help="collectives (ucc for cuda)")
    args = parser.parse_args()
    run = {"collectives", "overhead", "mlp"} if args.only is None else {args.only}
    ops = [name.strip() for name in args.ops.split(",")] if args.ops else None
    sizes = [s.strip() for s in args.sizes.split(",")] if args.sizes else None
    ranks = [int(s) for s in args.ranks.split(",")]
    if "overhead" in run:
        for name, (med, best) in run_ranks(_overhead, 1, backend="gloo", env=ENV)[0].items():
            print(f"overhead  {name}: {med:.2f} us (fastest {best:.2f})")
    if "collectives" in run:
        for p in ranks:
            options = (
                {"ucc_cuda": True} if args.backend == "ucc" and args.device == "cuda" else None
            )
            rows = run_ranks(_collectives, p, backend=args.backend, env=ENV, timeout=600,
                             args=(args.seconds, ops, args.device, sizes),
                             backend_options=options)[0]  # fmt: skip
            for label, op, ours, hand, ratio in rows:
                print(
                    f"{args.backend} {args.device} {p} ranks  {label:>6}  {op:<18}  redistribute "
                    f"{ours[0] * 1e6:9.1f} us"
                    f" (fastest {ours[1] * 1e6:9.1f})  by hand {hand[0] * 1e6:9.1f} us (fastest "
                    f"{hand[1] * 1e6:9.1f})  ratio of medians {ours[0] / hand[0]:.3f}, median "
                    f"ratio {ratio:.3f} (fastest {ours[1] / hand[1]:.3f})"
                )
    if "sweep" in run:
        for p in ranks:
            rows = run_ranks(_out_of_place_sweep, p, backend="gloo", env=ENV, timeout=600,
                             args=(args.seconds / 4,))[0]  # fmt: skip
            for kib, t, ratios in rows:
                print(
                    f"gloo {p} ranks  Partial->Replicate {kib:>6} KiB  redistribute "
                    f"{t['redistribute'][0] * 1e6:8.1f} us  all_reduce by hand in place "
                    f"{t['in place'][0] * 1e6:8.1f} us, out= {t['out='][0] * 1e6:8.1f} us  "
                    f"median ratio to by hand: in place {ratios['in place']:.3f}, "
                    f"out= {ratios['out=']:.3f}"
                )
    if "gap" in run:
        for p in ranks:
            times = run_ranks(_gap, p, backend="gloo", env=ENV, timeout=600,
                              args=(args.seconds,))[0]  # fmt: skip
            for name, (med, best) in times.items():
                print(f"gap  gloo {p} ranks  4 KiB all_reduce, {name:>5}: {med * 1e6:6.2f} us "
                      f"(fastest {best * 1e6:6.2f})")  # fmt: skip
    if "floor" in run:
        for p in ranks:
            times = run_ranks(_floor, p, backend="gloo", env=ENV, timeout=600,
                              args=(args.seconds,))[0]  # fmt: skip
            for name, (ratio, med, hand) in times.items():
                print(
                    f"floor  gloo {p} ranks  64 KiB Shard(0) -> Replicate, {name:>29}: "
                    f"median ratio to by hand {ratio:.3f} ({med * 1e6:6.2f} us, by hand "
                    f"{hand * 1e6:6.2f} us)"
                )
    if "route" in run:
        results = run_ranks(_through_shard, 4, backend="gloo", env=ENV, timeout=600,
                            args=(args.seconds,))[0]  # fmt: skip
        for label, t in results.items():
            print(
                f"route  gloo 4 ranks (2 x 2)  {label:>6}  [P, P] -> [R, R]: planned "
                f"{t['planned'][0] * 1e6:8.1f} us, through Shard(0) "
                f"{t['through Shard(0)'][0] * 1e6:8.1f} us, median ratio planned / through "
                f"{t['ratio']:.3f}"
            )
    if "mlp" in run:
        times = {}
        for p in (1, 2):
            times[p] = run_ranks(_mlp, p, backend="gloo", env=ENV, timeout=600,
                                 args=(args.embd, args.tokens, 4 * args.seconds))[0]  # fmt: skip
            print(
                f"TP MLP C={args.embd} hidden={4 * args.embd} tokens={args.tokens}, {p} rank(s): "
                f"{times[p][0] * 1e3:.1f} ms per forward+backward (fastest {times[p][1] * 1e3:.1f})"
            )
        print(
            f"TP MLP speed-up 2 ranks over 1: {times[1][0] / times[2][0]:.2f}x "
            f"(fastest {times[1][1] / times[2][1]:.2f}x)"
        )


if __name__ == "__main__":
    main()
