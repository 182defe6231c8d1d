#!/usr/bin/env bash
# A real single-node SLURM (slurmctld + slurmd + slurmdbd on MariaDB, munge auth) on this
# machine, for the slurm-marked tests and for trying a sweep before sending it to a cluster.
#
#   slurm/local_cluster.sh start    # prints `export SLURM_CONF=...`; eval it in your shell
#   slurm/local_cluster.sh status   # daemons and sinfo
#   slurm/local_cluster.sh stop     # cancels jobs, stops every daemon it started, by PID
#
# Everything (configs, state, database, logs, sockets, pid files) lives under
# $A3PO_SLURM_DIR (default /tmp/a3po-slurm), so it never touches a system-wide SLURM or
# MariaDB and several clusters can coexist (each picks free ports). Run as root; install
# the packages first with slurm/install_local_cluster.sh.
#
# Accounting (slurmdbd) is not optional: without it `sacct` is empty and submitit, which
# asks sacct for the state of finished jobs, waits forever on a cancelled job.
# -E: the ERR trap of `start` must also fire inside the functions that start each daemon.
set -Eeuo pipefail

DIR=$(realpath -m "${A3PO_SLURM_DIR:-/tmp/a3po-slurm}")
ETC=$DIR/etc
RUN=$DIR/run
LOG=$DIR/log
MUNGE_DIR=$DIR/munge
MUNGE_SOCKET=$MUNGE_DIR/munge.socket
MYSQL_DIR=$DIR/mysql
MYSQL_SOCKET=$MYSQL_DIR/mysqld.sock
SLURM_CONF_FILE=$ETC/slurm.conf
CLUSTER_NAME=a3po
PARTITION=${A3PO_LOCAL_PARTITION:-local}
NODE_NAME=$(hostname -s)

export SLURM_CONF=$SLURM_CONF_FILE
# slurmdbd connects to MariaDB through libmariadb, which takes its default socket from here;
# this keeps the database off TCP (no port to collide with) and on unix-socket root auth.
export MYSQL_UNIX_PORT=$MYSQL_SOCKET

# Daemons in start order.
DAEMONS=(munged mariadbd slurmdbd slurmctld slurmd)

log() { echo "local_cluster: $*" >&2; }

pid_file() {
    echo "$RUN/$1.pid"
}

# The PID from the daemon's pid file, printed only while that process still runs the same
# program: a stale pid file whose number the kernel has reused must never get us to signal
# someone else's process.
live_pid() {
    local name=$1 file pid comm
    file=$(pid_file "$name")
    [ -s "$file" ] || return 1
    pid=$(tr -dc '0-9' < "$file")
    [ -n "$pid" ] || return 1
    [ -r "/proc/$pid/comm" ] || return 1
    comm=$(cat "/proc/$pid/comm" 2>/dev/null) || return 1
    # /proc/PID/comm is truncated to 15 characters.
    [ "$comm" = "${name:0:15}" ] || return 1
    echo "$pid"
}

any_running() {
    local name
    for name in "${DAEMONS[@]}"; do
        if live_pid "$name" >/dev/null; then
            return 0
        fi
    done
    return 1
}

# wait_until WHAT TIMEOUT_S [--pid PID] COMMAND...: retry COMMAND until it succeeds; with
# --pid, give up as soon as that daemon has died instead of waiting out the timeout.
wait_until() {
    local what=$1 timeout_s=$2 watch_pid=""
    shift 2
    if [ "$1" = "--pid" ]; then
        watch_pid=$2
        shift 2
    fi
    local deadline=$((SECONDS + timeout_s))
    until "$@" >/dev/null 2>&1; do
        if [ -n "$watch_pid" ] && ! kill -0 "$watch_pid" 2>/dev/null; then
            log "$what exited while starting"
            return 1
        fi
        if [ "$SECONDS" -ge "$deadline" ]; then
            log "timed out after ${timeout_s}s waiting for $what"
            return 1
        fi
        sleep 0.2
    done
}

# Every daemon runs in the foreground under setsid, detached from the caller's terminal,
# process group and pipes (a test's subprocess.run would otherwise wait for them). $! is
# then the daemon itself, so its pid file is right from the first instant and a daemon
# that dies while starting is noticed at once.
launch() {
    local name=$1
    shift
    setsid "$@" < /dev/null >> "$LOG/$name.stdout" 2>&1 &
    echo "$!" > "$(pid_file "$name")"
    LAUNCHED_PID=$!
}

port_in_use() {
    ss -Htln "sport = :$1" 2>/dev/null | grep -q .
}

# Three consecutive free TCP ports (slurmctld, slurmd, slurmdbd), so a second cluster or a
# system SLURM on the same machine does not steal our daemons' ports.
pick_port_base() {
    local base=${A3PO_SLURM_PORT:-6817}
    if [ -n "${A3PO_SLURM_PORT:-}" ]; then
        echo "$base"
        return
    fi
    while port_in_use "$base" || port_in_use $((base + 1)) || port_in_use $((base + 2)); do
        base=$((base + 10))
    done
    echo "$base"
}

# The node advertises what slurmd detects on this machine, so jobs are scheduled against
# the real cores and memory (a node configured larger than it is gets drained).
node_hardware() {
    slurmd -C | head -1 | tr ' ' '\n' \
        | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore|RealMemory)=' \
        | tr '\n' ' '
}

write_configs() {
    local port_base hardware
    port_base=$(pick_port_base)
    hardware=$(node_hardware)
    cat > "$SLURM_CONF_FILE" <<EOF
# Written by slurm/local_cluster.sh; regenerated on every start from a stopped state.
ClusterName=$CLUSTER_NAME
SlurmctldHost=$NODE_NAME(127.0.0.1)
SlurmctldPort=$port_base
SlurmdPort=$((port_base + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$DIR/state/slurmctld
SlurmdSpoolDir=$DIR/state/slurmd
SlurmctldPidFile=$(pid_file slurmctld)
SlurmdPidFile=$(pid_file slurmd)
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroup hierarchy to rely on in a container: track processes through /proc.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
ReturnToService=2
# submitit requeues preempted/timed-out jobs with \`scontrol requeue\`.
JobRequeue=1
# Short kill wait and scheduling intervals bring a requeue cycle to ~10 s instead of minutes.
KillWait=5
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# A job that asks for no memory would otherwise reserve the whole node and serialise the queue.
DefMemPerCPU=1024
# Debian ships no mailer; the default MailProg would only log an error at every start.
MailProg=/bin/true
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
Waittime=0
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((port_base + 2))
# With a non-default munge socket this is how slurmctld finds it when talking to slurmdbd.
AccountingStoragePass=$MUNGE_SOCKET
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$NODE_NAME NodeAddr=127.0.0.1 $hardware State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    # slurmdbd finds slurmdbd.conf beside $SLURM_CONF and refuses it unless it is 0600.
    (
        umask 077
        cat > "$ETC/slurmdbd.conf" <<EOF
# Written by slurm/local_cluster.sh.
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((port_base + 2))
SlurmUser=root
PidFile=$(pid_file slurmdbd)
LogFile=$LOG/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
    )
}

munge_works() {
    munge -n -S "$MUNGE_SOCKET" | unmunge -S "$MUNGE_SOCKET"
}

start_munged() {
    if [ ! -s "$MUNGE_DIR/munge.key" ]; then
        (umask 077 && dd if=/dev/urandom of="$MUNGE_DIR/munge.key" bs=1024 count=1 status=none)
    fi
    chmod 400 "$MUNGE_DIR/munge.key"
    launch munged munged --foreground --key-file="$MUNGE_DIR/munge.key" --socket="$MUNGE_SOCKET" \
        --pid-file="$(pid_file munged)" --log-file="$LOG/munged.log" \
        --seed-file="$MUNGE_DIR/munged.seed" --force
    wait_until "munged" 20 --pid "$LAUNCHED_PID" munge_works
}

mysql_ping() {
    mariadb-admin --no-defaults --socket="$MYSQL_SOCKET" --user=root ping
}

start_mariadbd() {
    if [ ! -d "$MYSQL_DIR/data/mysql" ]; then
        mariadb-install-db --no-defaults --datadir="$MYSQL_DIR/data" --user=root \
            --auth-root-authentication-method=socket --skip-test-db \
            > "$LOG/mariadb-install.log" 2>&1
    fi
    launch mariadbd mariadbd --no-defaults --datadir="$MYSQL_DIR/data" --socket="$MYSQL_SOCKET" \
        --pid-file="$(pid_file mariadbd)" --log-error="$LOG/mariadb.log" \
        --skip-networking --user=root --innodb-lock-wait-timeout=900
    wait_until "mariadbd" 60 --pid "$LAUNCHED_PID" mysql_ping
}

start_slurmdbd() {
    # slurmdbd reads slurmdbd.conf from the directory of $SLURM_CONF.
    launch slurmdbd slurmdbd -D
    wait_until "slurmdbd" 60 --pid "$LAUNCHED_PID" sacctmgr -n list cluster
    if ! sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER_NAME"; then
        sacctmgr -i add cluster "$CLUSTER_NAME" > /dev/null
    fi
}

start_slurmctld() {
    launch slurmctld slurmctld -D -f "$SLURM_CONF_FILE"
    wait_until "slurmctld" 30 --pid "$LAUNCHED_PID" scontrol ping
}

node_ready() {
    local state
    state=$(sinfo -h -N -n "$NODE_NAME" -o %T)
    case $state in
        idle* | mixed* | allocated*) return 0 ;;
        *) return 1 ;;
    esac
}

start_slurmd() {
    launch slurmd slurmd -D -f "$SLURM_CONF_FILE"
    wait_until "slurmd to register node $NODE_NAME" 30 --pid "$LAUNCHED_PID" node_ready
}

dump_logs() {
    local file
    for file in "$LOG"/*.log "$LOG"/*.stdout; do
        [ -f "$file" ] || continue
        log "---- tail of $file"
        tail -n 20 "$file" >&2
    done
}

# A half-started cluster is of no use and would hold ports and sockets: take it down.
on_start_failure() {
    trap - ERR
    log "start failed; stopping what was started"
    dump_logs
    cmd_stop || true
    exit 1
}

cmd_start() {
    local started=$SECONDS name
    # Unix socket paths are limited to 107 bytes; past that munged and mariadbd fail with
    # errors that do not name the cause.
    if [ "${#MYSQL_SOCKET}" -gt 100 ] || [ "${#MUNGE_SOCKET}" -gt 100 ]; then
        log "A3PO_SLURM_DIR=$DIR is too long for unix socket paths; choose a shorter one"
        exit 1
    fi
    mkdir -p "$DIR" "$ETC" "$RUN" "$LOG" "$MUNGE_DIR" "$MYSQL_DIR" \
        "$DIR/state/slurmctld" "$DIR/state/slurmd"
    # munged refuses a socket directory that is not exactly world-readable and traversable.
    chmod 755 "$DIR" "$MUNGE_DIR"
    if ! any_running; then
        write_configs
    fi
    trap on_start_failure ERR
    for name in "${DAEMONS[@]}"; do
        if live_pid "$name" >/dev/null; then
            continue
        fi
        "start_$name"
        log "$name up (pid $LAUNCHED_PID)"
    done
    trap - ERR
    log "cluster $CLUSTER_NAME ready in $((SECONDS - started))s; state in $DIR"
    echo "export SLURM_CONF=$SLURM_CONF_FILE"
}

# SIGTERM, then wait for the processes to exit so a following start (or the removal of
# $DIR) never races a daemon still writing its state; SIGKILL after 30 s. Daemons named
# together stop in parallel: each takes ~2-4 s to shut down.
stop_daemons() {
    local name pid deadline=$((SECONDS + 30))
    local -A pids=()
    for name in "$@"; do
        if pid=$(live_pid "$name"); then
            pids[$name]=$pid
            kill -TERM "$pid" 2>/dev/null || true
        fi
    done
    for name in "${!pids[@]}"; do
        pid=${pids[$name]}
        while kill -0 "$pid" 2>/dev/null; do
            if [ "$SECONDS" -ge "$deadline" ]; then
                log "$name (pid $pid) ignored SIGTERM for 30s; sending SIGKILL"
                kill -KILL "$pid" 2>/dev/null || true
            fi
            sleep 0.1
        done
        log "$name (pid $pid) stopped"
    done
    for name in "$@"; do
        rm -f "$(pid_file "$name")"
    done
}

# slurmstepd and the job's processes outlive slurmd, so jobs are cancelled (and waited
# for) while the controller can still do it.
cancel_jobs() {
    local jobs
    live_pid slurmctld >/dev/null || return 0
    jobs=$(squeue -h -o %A 2>/dev/null) || return 0
    [ -n "$jobs" ] || return 0
    # shellcheck disable=SC2086
    scancel $jobs 2>/dev/null || true
    wait_until "cancelled jobs to end" 30 no_jobs_left \
        || log "jobs still listed after 30s: $(squeue -h -o %A | tr '\n' ' ')"
}

no_jobs_left() {
    [ -z "$(squeue -h -o %A 2>/dev/null | head -1)" ]
}

cmd_stop() {
    if live_pid slurmd >/dev/null; then
        cancel_jobs
    fi
    # Reverse dependency order: slurmctld flushes job records to slurmdbd, which needs
    # MariaDB, while it shuts down.
    stop_daemons slurmd slurmctld
    stop_daemons slurmdbd
    stop_daemons mariadbd munged
}

cmd_status() {
    local name pid down=0
    for name in "${DAEMONS[@]}"; do
        if pid=$(live_pid "$name"); then
            echo "$name: running (pid $pid)"
        else
            echo "$name: stopped"
            down=1
        fi
    done
    echo "SLURM_CONF=$SLURM_CONF_FILE"
    if live_pid slurmctld >/dev/null; then
        sinfo
        squeue
    fi
    return "$down"
}

case "${1:-}" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *)
        echo "usage: $0 start|stop|status   (state under \$A3PO_SLURM_DIR, default /tmp/a3po-slurm)" >&2
        exit 2
        ;;
esac
