#!/usr/bin/env bash
# Every check that needs an NVIDIA GPU, in one command. Run from the repository root on a machine
# with a GPU (one is enough):
#
#     bash scripts/gpu-checks.sh [output-folder]          # default: $OUT, else /tmp/pluribus-gpu
#     WHEELS=/path/to/wheels bash scripts/gpu-checks.sh   # offline: install from a wheel folder
#     ONLY=conformance,bench bash scripts/gpu-checks.sh   # a subset of the steps below
#
# Steps: setup (a venv that sees the system's packages; cupy, ucxx, mpich from $WHEELS or the
# package index when missing; this tree installed editable), probe (ucc must see CUDA
# transports, nccl must be available), tests (the gpu-marked tests of every distribution but
# nccl), conformance (the conformance suite on cupy arrays: ucc with 2 and 4 processes on one GPU,
# nccl at world size 1, a hybrid cpu:gloo,cuda:ucc group, host staging through gloo and through
# mpi under mpiexec), nccl (plugins/nccl/tests/run_gpu_checks.sh: NCCL's own GPU tests and
# busbw), bench (pluribus-bench all-reduce busbw of ucc on cupy, 1 KiB to 1 GiB, against cupy
# staged through the host on gloo in the same run).
#
# Output: gpu-checks.log (everything), summary.txt (one line per step), bench-ucc-cupy.{json,md,png}
# and nccl-busbw.json in the output folder. The exit status is 0 only when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
DEST=$(mkdir -p "${1:-${OUT:-/tmp/pluribus-gpu}}" && cd "${1:-${OUT:-/tmp/pluribus-gpu}}" && pwd)
VENV=${VENV:-/tmp/pluribus-gpu-venv}
ONLY=${ONLY:-setup,probe,tests,conformance,nccl,bench}
LOG="$DEST/gpu-checks.log"
SUMMARY="$DEST/summary.txt"
: >"$SUMMARY"
exec > >(tee -a "$LOG") 2>&1
export PYTHONUNBUFFERED=1 PLURIBUS_TIMEOUT=300
failed=0

wanted() { [[ ",$ONLY," == *",$1,"* ]]; }
record() {  # record STEP STATUS: one line in the summary; a non-zero status fails the run
    local line
    if [ "$2" -eq 0 ]; then line="PASS  $1"; else line="FAIL  $1 (exit $2)"; failed=1; fi
    echo "$line" | tee -a "$SUMMARY"
}
step() { echo; echo "== $(date -u +%H:%M:%S) $*"; }

# -- setup ----------------------------------------------------------------------------------------
if wanted setup || [ ! -x "$VENV/bin/python" ]; then
    step "setup: venv $VENV (with the system's packages), GPU stack, this tree"
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv || true
    python3 -m venv --system-site-packages "$VENV" || exit 2
    PY="$VENV/bin/python"
    # python3 may itself be a venv (the GPU images' is): see its packages too, behind ours
    python3 -c "import site; print('\n'.join(site.getsitepackages()))" \
        >"$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/zz-host.pth"
    if [ -n "${WHEELS:-}" ]; then
        "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
    else
        missing=()
        "$PY" -c "import cupy" 2>/dev/null || missing+=("cupy-cuda12x>=13" "nvidia-nccl-cu12>=2.18")
        "$PY" -c "import ucxx" 2>/dev/null || missing+=("ucxx-cu12>=0.45" "libucx-cu12>=1.19")
        [ -x "$VENV/bin/mpiexec" ] || command -v mpiexec >/dev/null || missing+=(mpich)
        "$PY" -c "import mpi4py" 2>/dev/null || missing+=(mpi4py)
        "$PY" -c "import pytest_timeout, ml_dtypes" 2>/dev/null || missing+=(pytest-timeout ml_dtypes)
        [ ${#missing[@]} -eq 0 ] || "$PY" -m pip install -q "${missing[@]}"
    fi
    rc=$?
    packages=(-e core -e plugins/gloo -e plugins/mpi -e plugins/ucc -e plugins/nccl)
    # Offline, the build uses the setuptools already installed; online, pip may fetch it.
    "$PY" -m pip install -q --no-deps --no-build-isolation "${packages[@]}" \
        || "$PY" -m pip install -q --no-deps "${packages[@]}" || rc=2
    "$PY" -c "import cupy; print('cupy', cupy.__version__, 'GPUs', cupy.cuda.runtime.getDeviceCount())" \
        || rc=2
    record setup "$rc"
    [ "$rc" -eq 0 ] || exit 2
fi
PY="$VENV/bin/python"
export PATH="$VENV/bin:$PATH"

# -- probe ----------------------------------------------------------------------------------------
if wanted probe; then
    step "probe: what pluribus finds here"
    "$PY" -m pluribus plugins
    "$PY" - <<'EOF'
import pluribus
ucc, nccl = pluribus.availability("ucc"), pluribus.availability("nccl")
print("ucc:", ucc.ok, ucc.details)
print("nccl:", nccl.ok, nccl.details)
assert ucc.ok and ucc.details.get("cuda_transports"), "ucc must see UCX's CUDA transports"
assert nccl.ok, f"nccl unavailable: {nccl.reason}"
EOF
    record probe $?
fi

# A skipped gpu test on a GPU machine is a failure unless its reason is in this list.
ALLOWED_SKIPS='needs 2 or more visible GPUs'
no_unexpected_skips() {  # no_unexpected_skips JUNIT.xml
    "$PY" - "$1" "$ALLOWED_SKIPS" <<'EOF'
import sys
import xml.etree.ElementTree as ET

allowed = sys.argv[2].split("|")
bad = []
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    for skip in case.iter("skipped"):
        reason = skip.get("message", "")
        if not any(a in reason for a in allowed):
            bad.append(f"{case.get('classname')}.{case.get('name')}: {reason}")
for line in bad:
    print("unexpected skip on a GPU machine:", line)
sys.exit(1 if bad else 0)
EOF
}

# -- the gpu-marked tests ---------------------------------------------------------------------------
if wanted tests; then
    step "tests: every distribution's gpu-marked tests (nccl's run in the nccl step)"
    junit=$(mktemp --suffix .xml)
    "$PY" -m pytest -p no:cacheprovider -m "gpu and not mpi" -v -rs --junitxml="$junit" \
        core/tests plugins/gloo/tests plugins/ucc/tests plugins/mpi/tests tests
    rc=$?
    no_unexpected_skips "$junit" || [ "$rc" -ne 0 ] || rc=3
    echo "-- pluribus.nn against torch (forward and gradients), where torch is installed"
    "$PY" -m pytest -p no:cacheprovider -q -rs --junitxml="$junit" \
        core/tests/test_nn_torch_parity.py || [ "$rc" -ne 0 ] || rc=5
    if "$PY" -c "import torch" 2>/dev/null; then
        no_unexpected_skips "$junit" || [ "$rc" -ne 0 ] || rc=3
    fi
    echo "-- the gpu-marked mpi tests, under mpiexec -n 2"
    timeout -k 10 300 "$(command -v mpiexec)" -n 2 env PLURIBUS_JUNIT="$junit" "$PY" \
        plugins/mpi/tests/pytest_rank.py -q -p no:cacheprovider -m "gpu and mpi" -rs \
        plugins/mpi/tests/test_mpi_collectives.py || [ "$rc" -ne 0 ] || rc=4
    no_unexpected_skips "$junit" || [ "$rc" -ne 0 ] || rc=3
    rm -f "$junit"
    record tests "$rc"
fi

# -- the conformance suite on cupy arrays -----------------------------------------------------------
conformance() {  # conformance NAME PYTEST-ARGS...: one run of the suite on cupy arrays
    local name=$1
    shift
    step "conformance on cupy: $name"
    "$PY" -m pytest -p no:cacheprovider -q --pyargs pluribus.testing.conformance \
        --pluribus-device cuda --pluribus-timeout 300 "$@"
    record "conformance $name" $?
}
if wanted conformance; then
    conformance "ucc, 2 and 4 processes on one GPU" --pluribus-backend ucc \
        --pluribus-world-sizes 2,4 --pluribus-mode processes --pluribus-backend-option ucc_cuda=true
    conformance "nccl, world size 1" --pluribus-backend cpu:gloo,cuda:nccl \
        --pluribus-world-sizes 1 --pluribus-mode processes
    conformance "hybrid cpu:gloo,cuda:ucc, 2 processes" --pluribus-backend cpu:gloo,cuda:ucc \
        --pluribus-world-sizes 2 --pluribus-mode processes --pluribus-backend-option ucc_cuda=true
    conformance "gloo with host staging, 2 and 3 processes" --pluribus-backend gloo \
        --pluribus-world-sizes 2,3 --pluribus-mode processes --pluribus-env PLURIBUS_GPU_STAGING=1
    step "conformance on cupy: mpi with host staging, mpiexec -n 2"
    MPIEXEC=$(command -v mpiexec)
    timeout -k 10 600 "$MPIEXEC" -n 2 env PLURIBUS_GPU_STAGING=1 "$PY" \
        plugins/mpi/tests/pytest_rank.py -q -p no:cacheprovider --pyargs \
        pluribus.testing.conformance --pluribus-backend mpi --pluribus-mode inplace \
        --pluribus-device cuda
    record "conformance mpi with host staging, mpiexec -n 2" $?
fi

# -- NCCL's own checks ------------------------------------------------------------------------------
if wanted nccl; then
    step "nccl: plugins/nccl/tests/run_gpu_checks.sh"
    scratch=$(mktemp -d)
    PYTHON="$PY" bash plugins/nccl/tests/run_gpu_checks.sh "$scratch"
    rc=$?
    cp "$scratch/busbw.json" "$DEST/nccl-busbw.json" 2>/dev/null
    rm -rf "$scratch"
    record nccl "$rc"
fi

# -- busbw ------------------------------------------------------------------------------------------
if wanted bench; then
    step "bench: all_reduce on cupy, ucc against gloo with host staging, 2 ranks on one GPU"
    "$PY" -m pluribus.bench --nproc 2 --device cuda --backend ucc -C all_reduce -d float32 \
        -b 1K -e 1G -f 4 -n 20 -w 3 --budget 2 --compare staged-gloo \
        --save "$DEST/bench-ucc-cupy.json" --markdown "$DEST/bench-ucc-cupy.md" \
        --plot "$DEST/bench-ucc-cupy.png"
    record bench $?
fi

echo
echo "== summary (also in $SUMMARY)"
cat "$SUMMARY"
exit "$failed"
