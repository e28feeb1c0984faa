"""Testing tools for pluribus and for backend authors.

* :func:`run_ranks` / :class:`RankPool` run a function on every rank of a fresh group, as
  threads of this process or as real processes, and raise one error naming each failed rank.
* The conformance suite (``pluribus.testing.conformance``) checks a backend by name; the pytest
  plugin (``pluribus.testing.plugin``, auto-loaded) adds ``--pluribus-backend`` and friends.
"""

from .harness import RankPool, RanksFailed, run_ranks
from .plugin import gpu_unavailable, needs_gpu, require_backend

__all__ = [
    "RankPool",
    "RanksFailed",
    "gpu_unavailable",
    "needs_gpu",
    "require_backend",
    "run_ranks",
]
