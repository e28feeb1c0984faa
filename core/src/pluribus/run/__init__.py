"""``pluribus-run``, the job launcher (see :mod:`pluribus.run.launcher`).

Kept free of imports: ``import pluribus.run`` should not load the launcher until it runs.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """The ``pluribus-run`` console script."""
    from .launcher import main as launcher_main

    return launcher_main(argv)


__all__ = ["main"]
