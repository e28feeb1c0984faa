"""Per-repeat medians of a saved ``pluribus.bench --save`` run with ``--repeat`` and
``--compare``: the repeats of each implementation alternate, so repeat k of ours and of the peer
ran back to back and saw about the same machine load (printed per phase). On a machine shared
with other work, a repeat that ran while it was quiet is then visible on its own.

    python benchmarks/bench_by_repeat.py benchmarks/results/all_reduce-gloo-np4-....json
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("result", help="a JSON file written by pluribus.bench --save")
    parser.add_argument("--max-bytes", type=int, default=1 << 40)
    args = parser.parse_args()
    with open(args.result) as f:
        run = json.load(f)
    iters = run["config"]["iters"]
    impls = list(dict.fromkeys(row["impl"] for row in run["rows"]))
    for phase in run["phases"]:
        print(
            f"# {phase['impl']:>14} repeat {phase['repeat'] + 1}: load before "
            f"{phase['load_before'][0]:.2f}, after {phase['load_after'][0]:.2f}"
        )
    by_size: dict[int, dict[str, list[float]]] = {}
    for row in run["rows"]:
        if row["size"] > args.max_bytes or not row.get("samples_us"):
            continue
        samples = row["samples_us"]
        medians = [float(np.median(samples[k : k + iters])) for k in range(0, len(samples), iters)]
        by_size.setdefault(row["size"], {})[row["impl"]] = medians
    ours, peer = impls[0], impls[-1]
    repeats = max(len(m) for sizes in by_size.values() for m in sizes.values())
    head = " ".join(
        f"{'r' + str(k + 1) + ' ours/peer us':>22} {'ratio':>6}" for k in range(repeats)
    )
    print(f"# {'bytes':>10} {head}   ({ours} / {peer})")
    for size, medians in sorted(by_size.items()):
        cells = []
        for k in range(repeats):
            a, b = medians.get(ours, [])[k : k + 1], medians.get(peer, [])[k : k + 1]
            if a and b:
                cells.append(f"{a[0]:>10.1f} / {b[0]:>9.1f} {a[0] / b[0]:>6.2f}")
        print(f"  {size:>10} " + " ".join(cells))


if __name__ == "__main__":
    main()
