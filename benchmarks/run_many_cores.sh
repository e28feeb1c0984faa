#!/usr/bin/env bash
# The figures that need a machine with more cores than the 2-core development VM, in one run:
# gloo against MPICH on one host (all-reduce bandwidth on plain arrays and empty_symmetric arrays,
# and latency, at 2, 4 and 8 ranks; where the all-reduce should switch from one phase to two
# when every rank has a core; sub-groups at 4; the other collectives at 2) and DTensor
# redistribute against the collective by hand (64 KiB and 16 MiB, 2 and 4 ranks).
# Everything it prints goes to one log under $OUT (default benchmarks/results), with the load
# and the CPU model. Needs mpi4py + mpich in the Python it runs (PYTHON, default .venv's).
#
#   bash benchmarks/run_many_cores.sh
#   RUNS=2 RANKS="2 4" OUT=/tmp/out bash benchmarks/run_many_cores.sh
set -uo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-$(command -v .venv/bin/python || command -v python)}
MPIEXEC=${MPIEXEC:-$(dirname "$PYTHON")/mpiexec}
[ -x "$MPIEXEC" ] || MPIEXEC=mpiexec
RUNS=${RUNS:-3}           # repeats of every gloo-vs-MPICH series
RANKS=${RANKS:-"2 4 8"}   # rank counts of the gloo-vs-MPICH series
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
LOG="$OUT/many-cores-$(date -u +%Y%m%dT%H%M%SZ).log"

{
    echo "# $(date -u) $(nproc) CPUs, $(lscpu | grep 'Model name' | sed 's/ \+/ /g')"
    for n in $RANKS; do
        for i in $(seq "$RUNS"); do
            echo "## gloo vs MPICH, $n ranks, run $i: $(uptime)"
            "$MPIEXEC" -n "$n" "$PYTHON" benchmarks/gloo_vs_mpich.py -C all_reduce -b 256K \
                -e 64M -f 2 --symmetric
        done
    done
    for n in $RANKS; do
        echo "## gloo vs MPICH latency, $n ranks: $(uptime)"
        "$MPIEXEC" -n "$n" "$PYTHON" benchmarks/gloo_vs_mpich.py -C all_reduce -b 256 -e 256K -f 4
    done
    for n in $RANKS; do
        echo "## gloo all-reduce, one phase against two, $n ranks (a core each): $(uptime)"
        "$PYTHON" benchmarks/gloo_arena_tuning.py --experiment one-shot --nproc "$n" \
            --sizes 16384,32768,65536,131072,262144,524288
    done
    echo "## gloo vs MPICH on sub-groups, 4 ranks: $(uptime)"
    "$MPIEXEC" -n 4 "$PYTHON" benchmarks/gloo_vs_mpich.py -C all_reduce -b 256 -e 64M -f 4 \
        --groups 2
    echo "## gloo vs MPICH, the other collectives, 2 ranks: $(uptime)"
    "$MPIEXEC" -n 2 "$PYTHON" benchmarks/gloo_vs_mpich.py \
        -C reduce_scatter,all_gather,broadcast -b 256K -e 64M -f 4
    echo "## DTensor redistribute vs by hand: $(uptime)"
    "$PYTHON" benchmarks/dtensor_redistribute.py --only collectives --ranks 2,4 --seconds 2
    echo "## DTensor fixed cost: $(uptime)"
    "$PYTHON" benchmarks/dtensor_redistribute.py --only overhead
    echo "# end: $(uptime)"
} 2>&1 | tee "$LOG"
echo "log: $LOG"
