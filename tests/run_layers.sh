#!/usr/bin/env bash
# `make test`: every layer of the suite (tests/README.md), in two phases.
#   1. the slurm layer and the benchmark smoke runs (`bench`: tests/test_benchmarks.py, e2e) beside
#      the pure layer: the slurm tests mostly wait on the scheduler (a job queued, a node drained
#      and resumed, a requeue) and the benchmarks' --quick runs have no peer timeouts to trip, so
#      they share the cores with the pure tests, which are one busy process;
#   2. then the rest of the dist and e2e layers alone: their process worlds use both cores and
#      time out a peer that stalls.
# Usage: tests/run_layers.sh [PYTHON] [pytest args...]; exits non-zero when any phase failed.
set -u
cd "$(dirname "$0")/.."
py=${1:-.venv/bin/python}
shift || true
work=$(mktemp -d)
pids=""
trap '[ -n "$pids" ] && kill $pids 2>/dev/null; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM

ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }  # 5: nothing collected (a filter left the layer empty)
log() { echo "== $* ($(date +%T)) =="; }

log "phase 1: the pure layer; the slurm layer and the benchmark smoke runs beside it, their logs follow"
"$py" -m pytest -q -m slurm -p no:cacheprovider --basetemp "$work/slurm" "$@" > "$work/slurm.log" 2>&1 &
slurm_pid=$!
"$py" -m pytest -q -m "e2e and bench" -p no:cacheprovider --basetemp "$work/bench" "$@" \
    > "$work/bench.log" 2>&1 &
bench_pid=$!
pids="$slurm_pid $bench_pid"
"$py" -m pytest -q -m pure "$@"
pure=$?
log "pure layer done"
wait "$slurm_pid"
slurm=$?
wait "$bench_pid"
bench=$?
pids=""
log "slurm layer"
cat "$work/slurm.log"
log "benchmark smoke runs (e2e)"
cat "$work/bench.log"
log "phase 2: the dist and e2e layers"
"$py" -m pytest -q -m "not pure and not slurm and not bench" --durations=20 "$@"
rest=$?
log "exit codes: pure $pure, slurm $slurm, bench $bench, dist and e2e $rest"
ok "$pure" && ok "$slurm" && ok "$bench" && ok "$rest"
