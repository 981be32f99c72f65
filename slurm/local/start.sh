#!/usr/bin/env bash
# Start the local 4-node SLURM test cluster on this host, without systemd (docs/architecture.md §4, §6).
#
#   slurm/local/start.sh [--accounting]
#
# One slurmctld and four slurmd (n1..n4, all on 127.0.0.1, ports 17001-17004) authenticated by a
# private munged. Everything (config, munge key and socket, logs, spool, state, pid files) lives under
# one directory, $NEREUS_SLURM_DIR (default /tmp/nereus-slurm): the cluster uses nothing in /etc or /run,
# and stop.sh can find every daemon by its pid file. Debian packages are installed when missing
# (this needs root). --accounting also starts mariadb + slurmdbd, so that `sacct` and submitit's
# job states work.
#
# Idempotent: if the cluster in that directory is already up with the same slurm.conf (and accounting
# setting) it is left alone; a partial or differently configured one is stopped and started afresh.
# On success the last line printed on stdout is `export SLURM_CONF=<dir>/slurm.conf`. Failing, it
# stops what it started and prints one `start.sh: ERROR: ...` line naming the cause.
#
# Environment: NEREUS_SLURM_DIR (state directory), NEREUS_SLURM_WAIT_S (wait for idle nodes, 60).
set -Eeuo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${NEREUS_SLURM_DIR:-/tmp/nereus-slurm}"
CONF="$DIR/slurm.conf"
NODES=(n1 n2 n3 n4)
# Ports of our own, away from SLURM's defaults (6817-6819), so a system SLURM can coexist.
CTLD_PORT=17000
DBD_PORT=17019
DB_PORT=17306
# Seconds to wait for all four nodes to report idle.
WAIT_S="${NEREUS_SLURM_WAIT_S:-60}"

ACCOUNTING=0
for arg in "$@"; do
    case "$arg" in
        --accounting) ACCOUNTING=1 ;;
        -h | --help)
            sed -n '2,/^set /p' "${BASH_SOURCE[0]}" | grep '^#' | sed 's/^# \{0,1\}//'
            exit 0
            ;;
        *)
            echo "start.sh: unknown argument: $arg" >&2
            exit 2
            ;;
    esac
done

log() { echo "start.sh: $*" >&2; }
STARTING=0 # set once this run starts daemons: a failed start then stops them again (logs stay)
die() {
    echo "start.sh: ERROR: $*" >&2
    if ((STARTING)); then "$HERE/stop.sh" >/dev/null 2>&1 || true; fi
    exit 1
}
# Any other failing command (set -e) also ends here, so nothing is left half started.
trap 'die "failed at line $LINENO: $BASH_COMMAND"' ERR

# slurmctld runs as its SlurmUser and slurmd must become the jobs' users: both are root here.
[[ $EUID -eq 0 ]] || die "needs root (the daemons run as root; no systemd, no sudo assumed)"

alive() { # alive PIDFILE: the daemon the file is named after (slurmd.n1.pid: slurmd) runs with that pid
    [[ -s "$1" ]] && [[ "$(cat "/proc/$(cat "$1")/comm" 2>/dev/null)" == "$(basename "$1" | cut -d. -f1)"* ]]
}

# One start/stop at a time per directory (two test sessions may call us at once); start.sh calls
# stop.sh while holding the lock, and says so through NEREUS_SLURM_LOCKED. The daemons are started
# with fd 9 closed (9>&-), or they would hold the lock for as long as they run.
mkdir -p "$DIR"
if [[ -z "${NEREUS_SLURM_LOCKED:-}" ]]; then
    exec 9>"$DIR/.lock"
    flock -w 300 9 || { echo "start.sh: another start/stop of $DIR holds $DIR/.lock" >&2; exit 1; }
    export NEREUS_SLURM_LOCKED=1
fi

# ---------------------------------------------------------------------------------------------------
# Packages. Debian's slurm-wlm 22.05 has the multiple-slurmd support (slurmd -N) this needs.
apt_install() { # apt_install PKG...: quiet install; `apt-get update` only when the first try fails
    local out
    out="$(mktemp)"
    export DEBIAN_FRONTEND=noninteractive
    log "installing $* ..."
    if ! apt-get install -y -qq --no-install-recommends "$@" >"$out" 2>&1; then
        log "apt-get install failed; running apt-get update and retrying"
        if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends "$@"; } >"$out" 2>&1; then
            tail -n 20 "$out" >&2
            rm -f "$out"
            die "apt-get install $* failed"
        fi
    fi
    rm -f "$out"
}

need=()
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
command -v munged >/dev/null || need+=(munge)
if ((ACCOUNTING)); then
    command -v slurmdbd >/dev/null || need+=(slurmdbd)
    command -v mariadbd >/dev/null || need+=(mariadb-server)
    command -v mariadb >/dev/null || need+=(mariadb-client)
fi
((${#need[@]} == 0)) || apt_install "${need[@]}"

export SLURM_CONF="$CONF"

nodes_idle() { # all four nodes are up and idle (or already running jobs)
    local n
    n="$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^(idle|mix|alloc)$/' | wc -l)" || return 1
    [[ "$n" -eq ${#NODES[@]} ]]
}

cluster_up() { # every daemon of this directory runs and slurmctld answers (nodes in any state: a
    # node a test set DOWN is no reason to restart the cluster under someone else's jobs)
    alive "$DIR/munged.pid" && alive "$DIR/slurmctld.pid" || return 1
    local n
    for n in "${NODES[@]}"; do alive "$DIR/slurmd.$n.pid" || return 1; done
    if ((ACCOUNTING)); then
        [[ -e "$DIR/accounting" ]] && alive "$DIR/mariadb.pid" && alive "$DIR/slurmdbd.pid" || return 1
    else
        [[ ! -e "$DIR/accounting" ]] || return 1
    fi
    [[ "$(sinfo -h -N -o %N 2>/dev/null | wc -l)" -eq ${#NODES[@]} ]]
}

# ---------------------------------------------------------------------------------------------------
# slurm.conf
HOST="$(hostname -s)"
MUNGE_SOCKET="$DIR/munge/munge.socket.2"
slurm_conf() { # the slurm.conf of this cluster, on stdout
    cat <<EOF
# Generated by slurm/local/start.sh: a 4-node test cluster on one host. See that script.
ClusterName=nereus
# slurmctld only starts where its hostname matches; every daemon talks over loopback.
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
# Private munged (not /run/munge). A requeued job may only start again once the credentials of its
# previous run have expired: cred_expire=10 (default 120) makes a requeue take ~12 s.
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10

# All state under $DIR; %n is the node name, so the four slurmd keep separate spool/log/pid files.
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdPidFile=$DIR/slurmd.%n.pid
SlurmdSpoolDir=$DIR/spool/%n
SlurmdLogFile=$DIR/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
# Nobody reads mail here; the default /bin/mail is absent.
MailProg=/bin/true

# No systemd/cgroup here: track processes by parent pid, no CPU binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# The nodes' CPUs come from this file, not from the 2-core hardware (oversubscription).
SlurmdParameters=config_overrides
# Jobs share nodes; one CPU per task, memory is not tracked.
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# MPI is opt-in per step (srun --mpi=pmi2, as nereus' launcher does); pmi2 ships with slurmd.
MpiDefault=none
# A node that stopped responding comes back by itself once its slurmd registers again (a restarted
# slurmd); one set DOWN by an admin (scontrol update state=down) stays down until state=resume.
# (ReturnToService=2 would return even that one at its next ping, a few seconds later, at random.)
ReturnToService=1
# Batch jobs are requeued when their node fails (the launcher's restart path); --no-requeue opts out.
JobRequeue=1

# Short timers so failure tests are fast: KILL follows TERM after 2 s, the controller is not
# restarted by anyone. The tests set nodes down themselves (scontrol), so a silent slurmd need not be
# noticed quickly: it is declared down after 30 s, and an RPC gives up after Slurm's default 10 s, as
# make test runs this cluster beside two busy pytest processes on two cores.
SlurmdTimeout=30
SlurmctldTimeout=10
MessageTimeout=10
KillWait=2
InactiveLimit=0
Waittime=0
# Finished jobs stay visible in squeue/scontrol for 5 minutes: without slurmdbd this is how
# tests and submitit read a job's final state.
MinJobAge=300
# Schedule right away on submit/requeue; retry every 2 s rather than the default 60.
SchedulerParameters=sched_interval=2
SchedulerType=sched/backfill

EOF
    if ((ACCOUNTING)); then
        cat <<EOF
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
# For accounting_storage/slurmdbd this names the munge socket used towards slurmdbd (AuthInfo is not).
AccountingStoragePass=$MUNGE_SOCKET
JobCompType=jobcomp/none
EOF
    else
        cat <<EOF
# No slurmdbd: sacct fails and submitit reads job states as UNKNOWN (results still come back).
AccountingStorageType=accounting_storage/none
EOF
    fi
    cat <<EOF

# Four nodes on this host, one slurmd each (slurmd -N nX) on its own port. CPUs=4 lets each node run
# up to four one-CPU tasks on this 2-core machine.
NodeName=n[1-4] NodeAddr=127.0.0.1 NodeHostname=$HOST Port=[17001-17004] CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=n[1-4] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
}

# Up already, with this very configuration: nothing to do.
if [[ -f "$CONF" ]] && cmp -s "$CONF" <(slurm_conf) && cluster_up; then
    log "cluster in $DIR is already up"
    echo "export SLURM_CONF=$CONF"
    exit 0
fi
# Something of a previous cluster may be half up, or up with another configuration: stop it.
if compgen -G "$DIR/*.pid" >/dev/null; then
    log "stopping the previous (partial) cluster in $DIR"
    "$HERE/stop.sh" >&2
fi

T0=$SECONDS
STARTING=1
mkdir -p "$DIR"/{log,state,spool,munge}
# munged refuses a socket directory that others can write to; 755 also lets any user's srun reach it.
chmod 755 "$DIR" "$DIR/munge"
rm -f "$DIR/accounting"

# ---------------------------------------------------------------------------------------------------
# munge: a private key, socket and pid file, so a system munged (if any) is not disturbed.
if [[ ! -s "$DIR/munge/munge.key" ]]; then
    mungekey --create --keyfile="$DIR/munge/munge.key" 2>/dev/null ||
        dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
fi
chmod 600 "$DIR/munge/munge.key"
rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock"
# --force: run even where munged's strict permission checks of the key/socket/log paths would refuse
# (e.g. a $NEREUS_SLURM_DIR below a group-writable directory); this key only guards a test cluster.
munged --force --socket="$MUNGE_SOCKET" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" \
    </dev/null >>"$DIR/log/munged.log" 2>&1 9>&- || die "munged failed to start; see $DIR/log/munged.log"
for _ in $(seq 50); do [[ -S "$MUNGE_SOCKET" ]] && break; sleep 0.1; done
munge --socket="$MUNGE_SOCKET" -n </dev/null | unmunge --socket="$MUNGE_SOCKET" >/dev/null 2>&1 ||
    die "munge credential round trip failed; see $DIR/log/munged.log"

# ---------------------------------------------------------------------------------------------------
# Accounting (optional): mariadb on its own port and datadir, then slurmdbd.
if ((ACCOUNTING)); then
    DB="$DIR/mysql"
    if [[ ! -d "$DB/mysql" ]]; then
        mkdir -p "$DB"
        mariadb-install-db --no-defaults --user=root --datadir="$DB" --auth-root-authentication-method=socket \
            >"$DIR/log/mariadb-install.log" 2>&1 || die "mariadb-install-db failed; see $DIR/log/mariadb-install.log"
    fi
    # --no-defaults: ignore /etc/mysql; TCP only on loopback, a port of our own. The innodb values are
    # the smallest slurmdbd takes without a (harmless) "not recommended values" error in its log; the
    # buffer pool is only touched as it fills, so 512M costs little memory.
    setsid mariadbd --no-defaults --user=root --datadir="$DB" --socket="$DIR/mysql.sock" \
        --port="$DB_PORT" --bind-address=127.0.0.1 --pid-file="$DIR/mariadb.pid" \
        --log-error="$DIR/log/mariadb.log" --skip-log-bin \
        --innodb-buffer-pool-size=512M --innodb-lock-wait-timeout=900 \
        </dev/null >>"$DIR/log/mariadb.log" 2>&1 9>&- &
    for _ in $(seq 300); do
        mariadb --no-defaults --socket="$DIR/mysql.sock" -uroot -e 'select 1' >/dev/null 2>&1 && break
        sleep 0.1
    done
    mariadb --no-defaults --socket="$DIR/mysql.sock" -uroot -e "
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY 'nereus';
        CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'nereus';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
        GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';" ||
        die "mariadb did not come up; see $DIR/log/mariadb.log"
    # slurmdbd refuses a config file readable by others.
    install -m 600 /dev/null "$DIR/slurmdbd.conf"
    cat >"$DIR/slurmdbd.conf" <<EOF
# Generated by slurm/local/start.sh --accounting.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$DIR/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
# 127.0.0.1 (not localhost) makes the client use TCP, i.e. our own port instead of the system socket.
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=nereus
StorageLoc=slurm_acct_db
EOF
    # slurmdbd has no -f: it reads slurmdbd.conf next to $SLURM_CONF.
    slurmdbd </dev/null >>"$DIR/log/slurmdbd.log" 2>&1 9>&- ||
        die "slurmdbd failed to start; see $DIR/log/slurmdbd.log"
    touch "$DIR/accounting"
fi

slurm_conf >"$CONF"
if ((ACCOUNTING)); then
    # The cluster must be known to slurmdbd before slurmctld registers (root gets an association).
    for _ in $(seq 20); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.5; done
    sacctmgr -i -n list cluster format=cluster | grep -qw nereus ||
        sacctmgr -i add cluster nereus >/dev/null || die "sacctmgr add cluster failed; see $DIR/log/slurmdbd.log"
fi

# ---------------------------------------------------------------------------------------------------
# slurmctld (-c: start from a clean state, no jobs of an earlier session), then the four slurmd.
slurmctld -c -f "$CONF" </dev/null >>"$DIR/log/slurmctld.log" 2>&1 9>&- ||
    die "slurmctld failed to start; see $DIR/log/slurmctld.log"
for n in "${NODES[@]}"; do
    mkdir -p "$DIR/spool/$n"
    slurmd -N "$n" -f "$CONF" </dev/null >>"$DIR/log/slurmd.$n.log" 2>&1 9>&- ||
        die "slurmd -N $n failed to start; see $DIR/log/slurmd.$n.log"
done

deadline=$((SECONDS + WAIT_S))
until nodes_idle; do
    if ((SECONDS >= deadline)); then
        # One line naming each node that is not up and its slurmd's last error (callers show the tail).
        sinfo -N >&2 || true
        why=""
        while read -r node state; do
            [[ "$state" =~ ^(idle|mix|alloc)$ ]] && continue
            why+=" $node ($state): $(grep -h error "$DIR/log/slurmd.$node.log" 2>/dev/null | tail -n 1 | cut -c 27-)."
        done < <(sinfo -h -N -o '%N %t' 2>/dev/null || true)
        die "the 4 nodes are not idle after ${WAIT_S}s (logs in $DIR/log):${why:- slurmctld does not answer.}"
    fi
    sleep 0.5
done
log "4 nodes idle after $((SECONDS - T0))s (state in $DIR)"
echo "export SLURM_CONF=$CONF"
