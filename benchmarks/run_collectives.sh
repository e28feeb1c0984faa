#!/usr/bin/env bash
# pluribus against torch.distributed (gloo) and raw mpi4py (MPICH), collective by collective.
#
# Two ranks on this host, float32, SUM, 4 B to 64 MiB; every phase (pluribus, torch-gloo,
# mpi4py) is repeated and interleaved so that load from other programs hits all of them alike,
# and the report uses medians. Raw JSON, the text report, a Markdown table and a plot go to
# benchmarks/results/. Needs: the backend's plugin, torch==2.13.0 (CPU) and mpi4py + mpich;
# a peer that is not installed is skipped with a note.
#
#   benchmarks/run_collectives.sh                      # gloo, 2 ranks, the four collectives
#   BACKEND=mpi COLLECTIVES="all_reduce" benchmarks/run_collectives.sh
#   NPROC=4 MIN_BYTES=4K STEP=4 PEERS=mpi4py benchmarks/run_collectives.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v .venv/bin/python || command -v python)}
BACKEND=${BACKEND:-gloo}
NPROC=${NPROC:-2}
COLLECTIVES=${COLLECTIVES:-"all_reduce all_gather reduce_scatter broadcast"}
MIN_BYTES=${MIN_BYTES:-4}
MAX_BYTES=${MAX_BYTES:-64M}
STEP=${STEP:-2}           # size factor between rows
PEERS=${PEERS:-"torch-gloo mpi4py"}
ITERS=${ITERS:-50}        # timed iterations per size, at most ...
BUDGET=${BUDGET:-1.5}     # ... and at most this many seconds of them per size
WARM=${WARM:-0.2}         # seconds of untimed calls per size: an idle CPU needs 50-100 ms to
                          # reach its speed (BENCHMARKS.md, "gloo all-reduce at 256-512 KiB")
REPEAT=${REPEAT:-3}       # interleaved repeats of every phase, samples pooled
OUT=${OUT:-benchmarks/results}
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p "$OUT"

plot_args=()
if "$PYTHON" -c "import matplotlib" 2>/dev/null; then
    plot_args=(--plot)
fi

echo "# $(date -u +%FT%TZ) $(uptime)" | tee "$OUT/load-$STAMP.txt"
for collective in $COLLECTIVES; do
    name="$collective-$BACKEND-np$NPROC-$STAMP"
    "$PYTHON" -m pluribus.bench --nproc "$NPROC" --backend "$BACKEND" -C "$collective" \
        -d float32 -o sum -b "$MIN_BYTES" -e "$MAX_BYTES" -f "$STEP" -n "$ITERS" -w 5 --budget "$BUDGET" \
        --warmup-seconds "$WARM" \
        --repeat "$REPEAT" $(printf -- "--compare %s " $PEERS) \
        --save "$OUT/$name.json" --markdown "$OUT/$name.md" \
        ${plot_args[@]+"${plot_args[@]}" "$OUT/$name.png"} \
        | tee "$OUT/$name.txt"
    echo "# $(date -u +%FT%TZ) $(uptime)" | tee -a "$OUT/load-$STAMP.txt"
done
