#!/usr/bin/env bash
# `make test`: every layer of the suite (tests/README.md), in two phases.
#   1. the slurm layer beside the pure layer: the slurm tests mostly wait on the scheduler (a job
#      queued, a node drained and resumed, a requeue), so they leave a core free for the pure
#      tests, which are one busy process;
#   2. then the dist and e2e layers alone: their process worlds use both cores and time out a peer
#      that stalls.
# Usage: tests/run_layers.sh [PYTHON] [pytest args...]; exits non-zero when any phase failed.
set -u
cd "$(dirname "$0")/.."
py=${1:-.venv/bin/python}
shift || true
work=$(mktemp -d)
slurm_pid=""
trap '[ -n "$slurm_pid" ] && kill "$slurm_pid" 2>/dev/null; rm -rf "$work"' EXIT
trap 'exit 130' INT TERM

ok() { [ "$1" -eq 0 ] || [ "$1" -eq 5 ]; }  # 5: nothing collected (a filter left the layer empty)

"$py" -m pytest -q -m slurm -p no:cacheprovider --basetemp "$work/slurm" "$@" > "$work/slurm.log" 2>&1 &
slurm_pid=$!
echo "== pure layer (the slurm layer runs beside it; its log follows) =="
"$py" -m pytest -q -m pure "$@"
pure=$?
wait "$slurm_pid"
slurm=$?
slurm_pid=""
echo "== slurm layer =="
cat "$work/slurm.log"
echo "== dist and e2e layers =="
"$py" -m pytest -q -m "not pure and not slurm" --durations=20 "$@"
rest=$?
echo "== exit codes: pure $pure, slurm $slurm, dist and e2e $rest =="
ok "$pure" && ok "$slurm" && ok "$rest"
