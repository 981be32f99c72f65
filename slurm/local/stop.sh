#!/usr/bin/env bash
# Stop the local SLURM test cluster started by slurm/local/start.sh.
#
# Cancels what still runs, then kills each daemon by the pid file it left in $NEREUS_SLURM_DIR
# (default /tmp/nereus-slurm): the four slurmd, slurmctld, slurmdbd and mariadb (when started with
# --accounting), munged. Removes the pid files; keeps config, logs and the munge key. Idempotent:
# stopping a stopped cluster does nothing.
set -euo pipefail

DIR="${NEREUS_SLURM_DIR:-/tmp/nereus-slurm}"
export SLURM_CONF="$DIR/slurm.conf"

# One start/stop at a time per directory (two test sessions may call us at once); start.sh calls
# stop.sh while holding the lock, and says so through NEREUS_SLURM_LOCKED.
[[ -d "$DIR" ]] || exit 0
if [[ -z "${NEREUS_SLURM_LOCKED:-}" ]]; then
    exec 9>"$DIR/.lock"
    flock -w 300 9 || { echo "stop.sh: another start/stop of $DIR holds $DIR/.lock" >&2; exit 1; }
    export NEREUS_SLURM_LOCKED=1
fi

log() { echo "stop.sh: $*" >&2; }

ours() { # ours PID PIDFILE: the pid runs the daemon the file is named after (slurmd.n1.pid: slurmd), so
    # a stale pid file whose pid was reused by another process never gets that process killed
    [[ "$(cat "/proc/$1/comm" 2>/dev/null)" == "$(basename "$2" | cut -d. -f1)"* ]]
}

alive() { [[ -s "$1" ]] && ours "$(cat "$1")" "$1"; }

stop_pidfiles() { # stop_pidfiles FILE...: TERM them all, wait up to 10 s, KILL the rest; remove the files
    # In parallel: each daemon takes 1-5 s to shut down (slurmctld saves its state).
    local f pid pids=() names=()
    for f in "$@"; do
        [[ -e "$f" ]] || continue
        pid="$(cat "$f" 2>/dev/null || true)"
        if [[ -n "$pid" ]] && ours "$pid" "$f" && kill -TERM "$pid" 2>/dev/null; then
            pids+=("$pid")
            names+=("$(basename "$f" .pid) ($pid)")
        fi
    done
    local i left
    for _ in $(seq 100); do
        left=0
        for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
        ((left)) || break
        sleep 0.1
    done
    for i in "${!pids[@]}"; do
        if kill -0 "${pids[$i]}" 2>/dev/null; then
            log "${names[$i]} ignored TERM; killing it"
            kill -KILL "${pids[$i]}" 2>/dev/null || true
        fi
        log "stopped ${names[$i]}"
    done
    rm -f "$@"
}

# Jobs first, while slurmctld and the slurmd still run: their slurmstepd (detached from slurmd) and
# the job processes are only reached through SLURM. KillWait is 2 s, so give them a few seconds.
if alive "$DIR/slurmctld.pid" && command -v scancel >/dev/null; then
    jobs="$(squeue -h -t running,pending,completing,suspended,requeued -o %i 2>/dev/null || true)"
    if [[ -n "$jobs" ]]; then
        # shellcheck disable=SC2086  # one argument per job id
        scancel --quiet $jobs 2>/dev/null || true
        for _ in $(seq 50); do
            [[ -z "$(squeue -h -t running,completing -o %i 2>/dev/null)" ]] && break
            sleep 0.2
        done
    fi
fi

# The SLURM daemons first (they need munge until the end), then the database and munged.
stop_pidfiles "$DIR"/slurmd.n*.pid "$DIR/slurmctld.pid" "$DIR/slurmdbd.pid"
stop_pidfiles "$DIR/mariadb.pid" "$DIR/munged.pid"
rm -f "$DIR/accounting"
