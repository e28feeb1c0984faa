"""pytest for one rank of an MPI job: rank 0 alone writes the junit report named by
$PLURIBUS_JUNIT (every rank runs the same tests, so one report counts them once)."""

import os
import sys

import pytest

args = sys.argv[1:]
report = os.environ.get("PLURIBUS_JUNIT")
rank = os.environ.get("PMI_RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
if report and rank == "0":
    args.append(f"--junitxml={report}")
sys.exit(pytest.main(args))
