"""``python -m pluribus plugins [--json]``: what is installed, what works, how to fix the rest."""

from __future__ import annotations

import argparse
import json
import sys

from .plugins import FIRST_PARTY, availability, backend_specs, plugin_infos


def plugin_rows() -> list[dict]:
    """One row per plugin (and per first-party plugin that is not installed)."""
    rows = []
    specs = backend_specs()
    infos = plugin_infos()
    for name, info in sorted(infos.items()):
        backends = list(info.backends)
        statuses = {b: availability(b) for b in backends}
        rows.append(
            {
                "plugin": name,
                "distribution": info.distribution,
                "version": info.version,
                "builtin": info.builtin,
                "backends": [
                    {
                        "name": b,
                        "available": s.ok,
                        "reason": s.reason,
                        "remedy": s.remedy,
                        "version": s.version,
                        "devices": list(specs[b][0].devices),
                        "details": s.details,
                    }
                    for b, s in statuses.items()
                ],
                "error": info.error,
            }
        )
    for name, dist in FIRST_PARTY.items():
        if name not in infos:
            s = availability(name)
            rows.append(
                {
                    "plugin": name,
                    "distribution": dist,
                    "version": None,
                    "builtin": False,
                    "backends": [
                        {
                            "name": name,
                            "available": False,
                            "reason": s.reason,
                            "remedy": s.remedy,
                            "version": "",
                            "devices": [],
                            "details": {},
                        }
                    ],
                    "error": "not installed",
                }
            )
    return rows


def _print_table(rows: list[dict]) -> None:
    header = ("plugin", "distribution", "version", "backend", "available", "reason / remedy")
    lines = [header]
    notes = []
    for row in rows:
        hooks_only = {"name": "-", "available": None, "reason": "", "remedy": ""}
        for b in row["backends"] or [hooks_only]:
            why = b["reason"] if not b["available"] else (b.get("version") or "")
            if b["available"] is None:
                why = "hooks only (no backend)"
            if b["remedy"] and not b["available"]:
                why = f"{why}; fix: {b['remedy']}"
            lines.append(
                (
                    row["plugin"],
                    row["distribution"] or "-",
                    row["version"] or "-",
                    b["name"],
                    {True: "yes", False: "no", None: "-"}[b["available"]],
                    why,
                )
            )
        if row["error"] and row["error"] != "not installed":
            notes.append(f"plugin {row['plugin']!r} did not load: {row['error']}")
    widths = [max(len(str(line[i])) for line in lines) for i in range(len(header) - 1)]
    for line in lines:
        cells = [str(c).ljust(w) for c, w in zip(line, widths, strict=False)]
        print("  ".join(cells + [str(line[-1])]).rstrip())
    for note in notes:
        print(note)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pluribus")
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser("plugins", help="list plugins, backends and their availability")
    plugins.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.command == "plugins":
        rows = plugin_rows()
        if args.json:
            json.dump(rows, sys.stdout, indent=2)
            print()
        else:
            _print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
