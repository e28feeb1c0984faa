"""The core's backend conformance suite on the mpi backend, one rank per pytest process.

Run under mpiexec with ``--pluribus-backend mpi --pluribus-mode inplace`` (run_mpi_tests.sh does).
"""

import pytest
from pluribus.testing.conformance import test_conformance  # noqa: F401  (collected here)

pytestmark = pytest.mark.mpi
