"""Turning measured rows into nccl-tests-style tables, comparisons with peers, JSON and a plot."""

from __future__ import annotations

import math
from typing import Any

from .core import COLLECTIVES, Row


def merge_rows(rows: list[Row]) -> list[Row]:
    """Rows of repeated phases with the same implementation, collective and size, pooled."""
    merged: dict[tuple, Row] = {}
    for row in rows:
        key = (row.impl, row.collective, row.size)
        if key not in merged:
            merged[key] = Row.from_dict(row.to_dict())
            merged[key].samples_us = list(row.samples_us)
            continue
        into = merged[key]
        into.samples_us.extend(row.samples_us)
        into.iters += row.iters
        into.wrong += row.wrong
        into.skipped = into.skipped or row.skipped
    return list(merged.values())


def _num(x: float, fmt: str) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_table(rows: list[Row]) -> str:
    """One nccl-tests-style block per implementation and collective; times are per operation."""
    lines: list[str] = []
    header = (
        f"#{'size':>12} {'count':>12} {'type':>9} {'redop':>6} {'root':>5} "
        f"{'time(us)':>10} {'min(us)':>10} {'median(us)':>10} {'algbw(GB/s)':>11} "
        f"{'busbw(GB/s)':>11} {'#wrong':>7} {'iters':>6}"
    )
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.impl, row.collective), []).append(row)
    for (impl, collective), group in groups.items():
        first = group[0]
        lines.append(
            f"# {collective} on {impl}, {first.nranks} ranks, dtype {first.dtype}"
            + (f", op {first.op}" if first.op != "-" else "")
        )
        lines.append(header)
        for row in sorted(group, key=lambda r: r.size):
            root = "-" if row.root is None else str(row.root)
            if row.skipped:
                lines.append(
                    f" {row.size:>12} {row.count:>12} {row.dtype:>9} {row.op:>6} "
                    f"{root:>5}   skipped: {row.skipped}"
                )
                continue
            lines.append(
                f" {row.size:>12} {row.count:>12} {row.dtype:>9} {row.op:>6} {root:>5} "
                f"{_num(row.time_us, '10.2f')} {_num(row.time_us_min, '10.2f')} "
                f"{_num(row.time_us_median, '10.2f')} {_num(row.algbw(), '11.3f')} "
                f"{_num(row.busbw(), '11.3f')} {row.wrong:>7} {row.iters:>6}"
            )
        wrong = sum(r.wrong for r in group)
        lines.append(f"# out of bounds values: {wrong} {'OK' if wrong == 0 else 'FAILED'}")
        lines.append("")
    return "\n".join(lines)


def _ratio(x: float) -> str:
    """Three significant digits without an exponent: 3620, 18.4, 0.123, 0.00412."""
    if not x or math.isnan(x) or math.isinf(x):
        return str(x)
    decimals = max(0, 2 - math.floor(math.log10(abs(x))))
    return f"{x:.{decimals}f}"


def _sig(x: float) -> float:
    """``x`` to six significant digits: small bandwidths keep their digits, times stay short."""
    return float(f"{x:.6g}")


def comparisons(rows: list[Row], base_prefix: str = "pluribus-") -> list[dict[str, Any]]:
    """pluribus against every other implementation, size by size, on median times.

    ``busbw_ratio`` is pluribus' bus bandwidth over the peer's (above 1: pluribus is faster);
    ``latency_ratio`` is pluribus' time over the peer's (below 1: pluribus is faster).
    """
    by_key = {(r.impl, r.collective, r.size): r for r in rows}
    out = []
    impls = list(dict.fromkeys(r.impl for r in rows))
    bases = [i for i in impls if i.startswith(base_prefix)]
    peers = [i for i in impls if not i.startswith(base_prefix)]

    def order(item):
        (_, collective, size), _ = item
        rank = COLLECTIVES.index(collective) if collective in COLLECTIVES else len(COLLECTIVES)
        return rank, size

    for base in bases:
        for (impl, collective, size), mine in sorted(by_key.items(), key=order):
            if impl != base or not mine.samples_us:
                continue
            for peer in peers:
                theirs = by_key.get((peer, collective, size))
                if theirs is None or not theirs.samples_us:
                    continue
                t_mine, t_theirs = mine.time_us_median, theirs.time_us_median
                out.append(
                    {
                        "collective": collective,
                        "size": size,
                        "impl": base,
                        "peer": peer,
                        "time_us_median": _sig(t_mine),
                        "peer_time_us_median": _sig(t_theirs),
                        "latency_ratio": _sig(t_mine / t_theirs),
                        "busbw_GBps": _sig(mine.busbw(t_mine)),
                        "peer_busbw_GBps": _sig(theirs.busbw(t_theirs)),
                        "busbw_ratio": _sig(t_theirs / t_mine),
                    }
                )
    return out


def format_comparisons(items: list[dict[str, Any]]) -> str:
    """One block per collective: pluribus and each peer side by side, medians, with ratios."""
    if not items:
        return ""
    lines: list[str] = []
    blocks: dict[tuple[str, str], list[dict]] = {}
    for item in items:
        blocks.setdefault((item["impl"], item["collective"]), []).append(item)
    for (impl, collective), group in blocks.items():
        peers = list(dict.fromkeys(i["peer"] for i in group))
        lines.append(
            f"# {collective}: {impl} vs {', '.join(peers)} (median time per op; "
            "bw ratio = ours/peer busbw, lat ratio = our time/peer time)"
        )
        head = f"#{'size':>12} {'ours(us)':>10} {'busbw':>8}"
        for peer in peers:
            head += f" | {peer + '(us)':>16} {'busbw':>8} {'bw ratio':>8} {'lat ratio':>9}"
        lines.append(head)
        sizes = sorted({i["size"] for i in group})
        for size in sizes:
            at = {i["peer"]: i for i in group if i["size"] == size}
            any_item = next(iter(at.values()))
            line = f" {size:>12} {any_item['time_us_median']:>10.2f} {any_item['busbw_GBps']:>8.3f}"
            for peer in peers:
                i = at.get(peer)
                if i is None:
                    line += f" | {'n/a':>16} {'':>8} {'':>8} {'':>9}"
                else:
                    line += (
                        f" | {i['peer_time_us_median']:>16.2f} {i['peer_busbw_GBps']:>8.3f} "
                        f"{_ratio(i['busbw_ratio']):>8} {_ratio(i['latency_ratio']):>9}"
                    )
            lines.append(line)
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    """busbw (from median times) against size, log2 x axis, one panel per collective and one
    line per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "pluribus-bench --plot needs matplotlib: pip install matplotlib "
            '(or pip install "pluribus[plot]")'
        ) from None
    collectives = list(dict.fromkeys(r.collective for r in rows))
    cols = min(3, len(collectives)) or 1
    nrows = math.ceil(len(collectives) / cols) or 1
    fig, axes = plt.subplots(nrows, cols, figsize=(5.5 * cols, 4 * nrows), squeeze=False)
    for ax, collective in zip(axes.flat, collectives, strict=False):
        impls = dict.fromkeys(r.impl for r in rows if r.collective == collective)
        for impl in impls:
            series = sorted(
                (r for r in rows if r.collective == collective and r.impl == impl and r.samples_us),
                key=lambda r: r.size,
            )
            if series:
                ax.plot(
                    [r.size for r in series],
                    [r.busbw(r.time_us_median) for r in series],
                    marker="o",
                    markersize=3,
                    label=impl,
                )
        ax.set_xscale("log", base=2)
        ax.set_title(collective)
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s, median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    for ax in list(axes.flat)[len(collectives) :]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _human_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def markdown(doc: dict[str, Any]) -> str:
    """The comparison tables of a ``run_benchmark`` document as Markdown, with how they were
    measured (command, ranks, load averages), for BENCHMARKS-style pages."""
    cfg = doc["config"]
    lines = [
        f"Command: `{' '.join(doc['command'])}`",
        "",
        f"{doc['nranks']} ranks on {doc['host']['hostname']} ({doc['host']['cpus']} cpus), "
        f"{doc['date']}; dtype {cfg['dtype']}, op {cfg['op']}; up to {cfg['iters']} timed "
        f"iterations per size after {cfg['warmup']} warmup"
        + (f" and at least {cfg['warmup_seconds']:g}s" if cfg.get("warmup_seconds") else "")
        + (f", at most {cfg['budget']:g}s per size" if cfg["budget"] else "")
        + f"; {1 + max((p['repeat'] for p in doc['phases']), default=0)} interleaved "
        "repeat(s) pooled. Times are medians per operation (each iteration counts the slowest "
        "rank); busbw uses nccl-tests' factors. bw ratio = pluribus busbw / peer busbw "
        "(higher is better for pluribus), lat ratio = pluribus time / peer time (lower is "
        "better).",
        "",
        "Implementations: "
        + "; ".join(
            dict.fromkeys(
                f"{p['impl']} ({p['library']})" if p.get("library") else p["impl"]
                for p in doc["phases"]
            )
        )
        + ".",
        "",
        "Load average (1/5/15 min) around each phase: "
        + "; ".join(
            f"{p['impl']} #{p['repeat'] + 1}: {p['load_before'][0]:.2f}/"
            f"{p['load_before'][1]:.2f}/{p['load_before'][2]:.2f} -> "
            f"{p['load_after'][0]:.2f}/{p['load_after'][1]:.2f}/{p['load_after'][2]:.2f}"
            for p in doc["phases"]
        ),
        "",
    ]
    blocks: dict[tuple[str, str], list[dict]] = {}
    for item in doc["comparisons"]:
        blocks.setdefault((item["impl"], item["collective"]), []).append(item)
    for (impl, collective), group in blocks.items():
        peers = list(dict.fromkeys(i["peer"] for i in group))
        lines.append(f"### {collective}")
        lines.append("")
        head = f"| size | {impl} µs | busbw GB/s |"
        rule = "|---:|---:|---:|"
        for peer in peers:
            head += f" {peer} µs | busbw GB/s | bw ratio | lat ratio |"
            rule += "---:|---:|---:|---:|"
        lines += [head, rule]
        for size in sorted({i["size"] for i in group}):
            at = {i["peer"]: i for i in group if i["size"] == size}
            first = next(iter(at.values()))
            line = (
                f"| {_human_size(size)} | {first['time_us_median']:.1f} | "
                f"{first['busbw_GBps']:.3f} |"
            )
            for peer in peers:
                i = at.get(peer)
                line += (
                    " n/a | | | |"
                    if i is None
                    else f" {i['peer_time_us_median']:.1f} | {i['peer_busbw_GBps']:.3f} | "
                    f"{_ratio(i['busbw_ratio'])} | {_ratio(i['latency_ratio'])} |"
                )
            lines.append(line)
        lines.append("")
    return "\n".join(lines)
