#!/usr/bin/env bash
# Set up a fresh machine and run every test: the README's second command, and what CI runs.
#
# Installs the whole tree into .venv the way a user would (regular, not editable, installs of each
# distribution), then runs, in order: the unit and integration tests (pytest), the conformance
# suite on every CPU backend at several world sizes, and the MPI tests under mpiexec. A phase that
# collects no tests counts as a failure. The last line sums up every phase.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PYTHON=${PYTHON:-python3}
REPORTS="$ROOT/.ci-reports"
rm -rf "$REPORTS" && mkdir -p "$REPORTS"

echo "== setting up .venv"
"$PYTHON" -m venv .venv || exit 1
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install --quiet --upgrade pip setuptools wheel || exit 1
PLUGINS=(./plugins/gloo ./plugins/mpi ./plugins/ucc ./plugins/nccl ./examples/store_backend)
python -m pip install --quiet --force-reinstall --no-deps ./core "${PLUGINS[@]}" || exit 1
python -m pip install --quiet "./core[test,examples,plot]" "${PLUGINS[@]}" mpich || exit 1
python -m pluribus plugins

failed_phases=()
phase=0
run_pytest() {  # run_pytest NAME ARGS...: pytest with a junit report; exit 5 (no tests) fails
    local name=$1
    shift
    phase=$((phase + 1))
    echo "== phase $phase: $name"
    python -m pytest -p no:cacheprovider -q --junitxml="$REPORTS/$phase-$name.xml" "$@"
    local rc=$?
    if [ $rc -eq 5 ]; then
        echo "phase $name collected no tests: that is a failure"
    fi
    [ $rc -eq 0 ] || failed_phases+=("$name")
}

export PLURIBUS_TIMEOUT=120
run_pytest unit-and-integration
run_pytest conformance-threads --pyargs pluribus.testing.conformance \
    --pluribus-backend threads --pluribus-world-sizes 1,2,3,4
run_pytest conformance-gloo-shm --pyargs pluribus.testing.conformance \
    --pluribus-backend gloo --pluribus-world-sizes 2,3,4 --pluribus-mode processes
run_pytest conformance-gloo-tcp --pyargs pluribus.testing.conformance \
    --pluribus-backend gloo --pluribus-world-sizes 2,3,4 --pluribus-mode processes \
    --pluribus-env PLURIBUS_GLOO_SHM=0

phase=$((phase + 1))
echo "== phase $phase: mpi (under mpiexec)"
REPORTS="$REPORTS" bash plugins/mpi/tests/run_mpi_tests.sh || failed_phases+=("mpi")

python - "$REPORTS" "${failed_phases[@]}" <<'PY'
import sys, glob
import xml.etree.ElementTree as ET

passed = failed = skipped = 0
for path in glob.glob(f"{sys.argv[1]}/*.xml"):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        tests, fail = int(suite.get("tests", 0)), int(suite.get("failures", 0))
        err, skip = int(suite.get("errors", 0)), int(suite.get("skipped", 0))
        passed += tests - fail - err - skip
        failed += fail + err
        skipped += skip
bad = sys.argv[2:]
if bad:
    print("failed phases:", ", ".join(bad))
    failed = max(failed, 1)
print(f"total: {passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed or passed == 0 else 0)
PY
