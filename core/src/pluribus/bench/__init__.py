"""``pluribus-bench``: collective benchmarks in the manner of nccl-tests, for every backend.

``main`` is the command line; ``run_benchmark`` runs it from Python and returns the JSON
document; ``measure`` times and checks collectives on any initialised
:class:`~pluribus.bench.comms.Comm` inside an existing job (a pytest process, a launched rank).
"""

from .cli import main, render, run_benchmark
from .core import COLLECTIVES, BenchConfig, Case, Row, bus_factor, measure, parse_size
from .launch import BenchError, run_phase, run_threads

__all__ = [
    "COLLECTIVES",
    "BenchConfig",
    "BenchError",
    "Case",
    "Row",
    "bus_factor",
    "main",
    "measure",
    "parse_size",
    "render",
    "run_benchmark",
    "run_phase",
    "run_threads",
]
