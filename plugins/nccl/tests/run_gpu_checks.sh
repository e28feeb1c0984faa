#!/usr/bin/env bash
# The NCCL checks that need a GPU, in one go. Run from the repository root on a machine with
# one or more NVIDIA GPUs:
#
#     bash plugins/nccl/tests/run_gpu_checks.sh [output-folder]
#
# It uses the cupy already installed (cupy-cuda12x or cupy-cuda13x, with an NCCL that cupy
# finds, e.g. from the nvidia-nccl-cu12/-cu13 wheel); with none it installs cupy-cuda12x and
# nvidia-nccl-cu12, from $WHEELS (a folder of wheels) when set, else from PyPI. pluribus itself
# and the plugins of this tree are installed editable without dependencies, so an offline
# machine needs nothing else. Logs, the busbw table and its JSON go to the output folder
# (default $OUT, else /tmp/nccl-gpu-checks). The exit status is that of the first failing step.
set -uo pipefail

PY=${PYTHON:-python3}
DEST=${1:-${OUT:-/tmp/nccl-gpu-checks}}
mkdir -p "$DEST"
status=0
step() { echo; echo "== $*"; }

step "GPUs"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv 2>&1 \
    | tee "$DEST/gpus.txt" || true

step "cupy"
if ! "$PY" -c "import cupy" 2>/dev/null; then
    if [ -n "${WHEELS:-}" ]; then
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" cupy-cuda12x nvidia-nccl-cu12
    else
        "$PY" -m pip install -q "cupy-cuda12x>=13" "nvidia-nccl-cu12>=2.18"
    fi || { echo "could not install cupy"; exit 2; }
fi
"$PY" -c "import cupy; print('cupy', cupy.__version__, 'devices', cupy.cuda.runtime.getDeviceCount())"

step "install pluribus and its plugins from this tree"
packages=(-e core -e plugins/nccl)
for plugin in gloo mpi ucc; do
    [ -f "plugins/$plugin/pyproject.toml" ] && packages+=(-e "plugins/$plugin")
done
# Offline, the build must use the setuptools and wheel already installed; online, pip may
# fetch them into an isolated build environment instead.
"$PY" -m pip install -q --no-deps --no-build-isolation "${packages[@]}" \
    || "$PY" -m pip install -q --no-deps "${packages[@]}" || exit 2

step "probe"
"$PY" -m pluribus plugins 2>&1 | tee "$DEST/plugins.txt"
"$PY" -c "import pluribus; s = pluribus.availability('nccl'); print(s); assert s.ok" || exit 3

step "tests (the gpu-marked ones, then the CPU ones of the plugin)"
export PYTHONUNBUFFERED=1
"$PY" -m pytest plugins/nccl/tests -m gpu -v -rs -p no:cacheprovider 2>&1 \
    | tee "$DEST/pytest-gpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=4
"$PY" -m pytest plugins/nccl/tests -m "not gpu" -q -p no:cacheprovider 2>&1 \
    | tee "$DEST/pytest-cpu.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || [ "$status" -ne 0 ] || status=5

step "busbw, 1 KiB to 1 GiB, one rank per visible GPU"
"$PY" plugins/nccl/benchmarks/nccl_busbw.py -b 1K -e 1G -f 2 -n 20 -w 5 \
    -C all_reduce,all_gather,reduce_scatter,broadcast --json "$DEST/busbw.json" 2>&1 \
    | tee "$DEST/busbw.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || [ "$status" -ne 0 ] || status=6

step "done: status $status, results in $DEST"
exit "$status"
