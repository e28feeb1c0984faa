#!/usr/bin/env bash
# Run the mpi plugin's MPI tests and the core conformance suite on the mpi backend, with pytest
# itself started by mpiexec (every pytest process is one rank), at 2, 3 and 4 ranks.
#
#   plugins/mpi/tests/run_mpi_tests.sh            # sizes 2 3 4
#   SIZES="2" plugins/mpi/tests/run_mpi_tests.sh  # one size
#   PYTHON=/path/to/python MPIEXEC=/path/to/mpiexec plugins/mpi/tests/run_mpi_tests.sh
#
# Fails when any run fails, times out (LIMIT seconds each), or runs no test at all (pytest's
# exit code 5, or output without a "passed" count).
set -u
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../../.." && pwd)
PYTHON=${PYTHON:-$repo/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=$(command -v python3)
MPIEXEC=${MPIEXEC:-$(dirname "$PYTHON")/mpiexec}
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec || true)
SIZES=${SIZES:-"2 3 4"}
LIMIT=${LIMIT:-150}
# REPORTS=DIR: rank 0 of each run writes a junit report there (CI sums them up)
REPORTS=${REPORTS:-}
if [ -z "$MPIEXEC" ]; then
    echo "run_mpi_tests.sh: no mpiexec found; pip install mpich (or load your MPI module)" >&2
    exit 1
fi
cd "$repo" || exit 1
log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
for n in $SIZES; do
    echo "== mpiexec -n $n: plugin tests and conformance suite on the mpi backend"
    tests=("$here/test_mpi_collectives.py" "$here/test_mpi_conformance.py")
    # data-parallel and fully sharded training on MPI: the same model as one process on the whole batch
    case "$n" in 2 | 4) tests+=("$repo/tests/ddp/test_ddp_mpi.py" "$repo/tests/fsdp/test_fsdp_mpi.py") ;; esac
    report=""
    [ -n "$REPORTS" ] && report="$REPORTS/mpi-n$n.xml"
    timeout -k 10 "$LIMIT" "$MPIEXEC" -n "$n" env PLURIBUS_JUNIT="$report" \
        "$PYTHON" "$here/pytest_rank.py" -q -p no:cacheprovider -m mpi "${tests[@]}" \
        --pluribus-backend mpi --pluribus-mode inplace >"$log" 2>&1
    rc=$?
    tail -n 25 "$log"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
        echo "!! mpiexec -n $n: timed out after ${LIMIT}s" >&2
        status=1
    elif [ "$rc" -eq 5 ] || ! grep -q " passed" "$log"; then
        echo "!! mpiexec -n $n: no tests ran (exit code $rc)" >&2
        status=1
    elif [ "$rc" -ne 0 ]; then
        echo "!! mpiexec -n $n: failed (exit code $rc)" >&2
        status=1
    fi
done
[ "$status" -eq 0 ] && echo "== all MPI runs passed ($SIZES ranks)"
exit "$status"
