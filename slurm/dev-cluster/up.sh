#!/usr/bin/env bash
# Bring up the 2-node dev Slurm cluster on this machine, or confirm that it is up.
#
# Installs what is missing (Debian: slurm-wlm slurmdbd munge mariadb-server), writes the configs from the templates
# beside this script into the state directory ($MOE_SLURM_DIR, default /tmp/moe-slurm), and starts, all as root:
# munged, mariadbd, slurmdbd, slurmctld, `slurmd -N node1`, `slurmd -N node2`. Then it registers the cluster, an
# account and root in accounting and waits (at most $MOE_SLURM_TIMEOUT s, default 120) until both nodes are idle.
#
# Idempotent: when the cluster is already healthy and its configs are unchanged it returns at once; otherwise it
# stops whatever is left of it (down.sh) and starts it afresh. Clients need `source $MOE_SLURM_DIR/env.sh`.
# Logs of every daemon: $MOE_SLURM_DIR/log/. See README.md beside this script.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${MOE_SLURM_DIR:-/tmp/moe-slurm}
TIMEOUT=${MOE_SLURM_TIMEOUT:-120}
PORT_BASE=${MOE_SLURM_PORT_BASE:-6817}
CLUSTER=moedev
PARTITION=debug
ACCOUNT=dev
NODES=(node1 node2)
PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)

# Ports: slurmctld, slurmdbd (Slurm's defaults, 6817 and 6819), our mariadbd and one per slurmd.
CTLD_PORT=$PORT_BASE
DBD_PORT=$((PORT_BASE + 2))
MYSQL_PORT=$((PORT_BASE + 3))
NODE1_PORT=$((PORT_BASE + 4))
NODE2_PORT=$((PORT_BASE + 5))

log() { echo "moe-slurm: $*"; }
die() {
    echo "moe-slurm: ERROR: $*" >&2
    exit 1
}
usec() { echo "${EPOCHREALTIME//[.,]/}"; }
# Seconds since a usec() stamp, with one decimal.
since() {
    local d=$((($(usec) - $1) / 100000))
    echo "$((d / 10)).$((d % 10))"
}

[[ $DIR == /* ]] || die "MOE_SLURM_DIR must be an absolute path (got '$DIR')"
[[ $DIR != *[[:space:]\|@]* ]] || die "MOE_SLURM_DIR must not contain blanks, '|' or '@' (got '$DIR')"
[[ $(id -u) == 0 ]] || die "run as root: the daemons run as root and missing packages are installed with apt-get"

mkdir -p "$DIR/log" "$DIR/run"
chmod 0755 "$DIR" # mariadbd runs as mysql and must reach its directory below this one

# One up.sh/down.sh at a time per state directory (down.sh, run from here, knows we hold the lock).
# Daemons are started with fd 9 closed, or they would hold the lock for good.
exec 9>"$DIR/.lock"
flock -w "$TIMEOUT" 9 || die "another up.sh or down.sh still holds $DIR/.lock after $TIMEOUT s"
export MOE_SLURM_LOCK_HELD=$DIR

# ---------------------------------------------------------------------------------------------------- install
t_install=$(usec)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -qx 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
    command -v apt-get >/dev/null || die "missing packages (${missing[*]}) and no apt-get to install them"
    log "installing ${missing[*]} (log: $DIR/log/apt.log)"
    # Keep the packages' postinst from starting the system munge/mariadb services: we run our own instances.
    policy=/usr/sbin/policy-rc.d
    if [[ ! -e $policy ]]; then
        printf '#!/bin/sh\n# temporary, from moe-platform slurm/dev-cluster/up.sh\nexit 101\n' >"$policy"
        chmod 0755 "$policy"
        trap 'rm -f "$policy"' EXIT
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >>"$DIR/log/apt.log" 2>&1 || die "apt-get update failed (see $DIR/log/apt.log)"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$DIR/log/apt.log" 2>&1 ||
        die "apt-get install ${missing[*]} failed (see $DIR/log/apt.log)"
    if [[ $(trap -p EXIT) ]]; then
        rm -f "$policy"
        trap - EXIT
    fi
    install_note="install $(since "$t_install") s (${missing[*]})"
else
    install_note="install 0.0 s (all present)"
fi
log "$install_note"

# ---------------------------------------------------------------------------------------------------- /etc/hosts
# Jobs resolve the node names (`scontrol show hostnames $SLURM_JOB_NODELIST`): nodeX is this machine.
add_hosts=()
for n in "${NODES[@]}"; do
    ip=$(getent hosts "$n" | awk '{print $1; exit}') || true
    if [[ -z $ip ]]; then
        add_hosts+=("$n")
    elif [[ $ip != 127.0.0.1 ]]; then
        die "$n resolves to $ip, not 127.0.0.1: fix /etc/hosts"
    fi
done
if ((${#add_hosts[@]})); then
    echo "127.0.0.1 ${add_hosts[*]}  # moe-platform dev Slurm cluster (slurm/dev-cluster/up.sh)" >>/etc/hosts
    log "added '127.0.0.1 ${add_hosts[*]}' to /etc/hosts"
fi

# ---------------------------------------------------------------------------------------------------- configs
# What this machine has, as slurmd sees it; both nodes declare it (they share it), RealMemory split between them.
hw=$(env -u SLURM_CONF slurmd -C | head -n1) || die "slurmd -C failed"
node_hw=$(tr ' ' '\n' <<<"$hw" | grep -E '^(CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=' | tr '\n' ' ')
node_hw=${node_hw% }
mem=$(tr ' ' '\n' <<<"$hw" | sed -n 's/^RealMemory=//p')
[[ $node_hw == CPUs=* && $mem =~ ^[0-9]+$ ]] || die "cannot read the hardware from 'slurmd -C': $hw"
real_memory=$((mem / ${#NODES[@]}))

# The database password, made once per state directory.
if [[ ! -s $DIR/db.pass ]]; then
    (umask 077 && head -c 18 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$DIR/db.pass")
fi
chmod 0600 "$DIR/db.pass"
db_pass=$(cat "$DIR/db.pass")

render() { # template -> stdout
    local out
    out=$(sed -e "s|@DIR@|$DIR|g" -e "s|@CLUSTER@|$CLUSTER|g" -e "s|@PARTITION@|$PARTITION|g" \
        -e "s|@CTLD_PORT@|$CTLD_PORT|g" -e "s|@DBD_PORT@|$DBD_PORT|g" -e "s|@MYSQL_PORT@|$MYSQL_PORT|g" \
        -e "s|@NODE1_PORT@|$NODE1_PORT|g" -e "s|@NODE2_PORT@|$NODE2_PORT|g" -e "s|@NODE_HW@|$node_hw|g" \
        -e "s|@REAL_MEMORY@|$real_memory|g" -e "s|@STORAGE_PASS@|$db_pass|g" "$1")
    if grep -q '@[A-Z_0-9]*@' <<<"$out"; then
        die "unfilled placeholder in $1: $(grep -o '@[A-Z_0-9]*@' <<<"$out" | sort -u | tr '\n' ' ')"
    fi
    printf '%s\n' "$out"
}
staged=$(mktemp -d "$DIR/.staged.XXXXXX")
trap 'rm -rf "$staged"' EXIT
render "$HERE/slurm.conf.in" >"$staged/slurm.conf"
render "$HERE/slurmdbd.conf.in" >"$staged/slurmdbd.conf"
cat >"$staged/my.cnf" <<EOF
# my.cnf of the dev cluster's own mariadbd, written by slurm/dev-cluster/up.sh. Only slurmdbd uses this server.
[mariadbd]
datadir=$DIR/mysql/data
socket=$DIR/mysql/run/mariadbd.sock
pid-file=$DIR/mysql/run/mariadbd.pid
log-error=$DIR/log/mariadbd.log
user=mysql
# Loopback only, on a port of its own: never meets a system MariaDB (3306).
bind-address=127.0.0.1
port=$MYSQL_PORT
skip-name-resolve
# slurmdbd warns below these (its recommended minimums).
innodb_buffer_pool_size=128M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900

[client]
socket=$DIR/mysql/run/mariadbd.sock
EOF

export SLURM_CONF=$DIR/slurm.conf

# ---------------------------------------------------------------------------------------------------- healthy?
# Our daemons, as (name pid-file) pairs.
DAEMONS=(
    "munged $DIR/run/munged.pid"
    "mariadbd $DIR/mysql/run/mariadbd.pid"
    "slurmdbd $DIR/run/slurmdbd.pid"
    "slurmctld $DIR/run/slurmctld.pid"
    "slurmd $DIR/run/slurmd.node1.pid"
    "slurmd $DIR/run/slurmd.node2.pid"
)
# True when the pid file names a live (not zombie) process called $1.
alive() {
    local pid stat
    pid=$(cat "$2" 2>/dev/null) || return 1
    [[ $pid =~ ^[0-9]+$ ]] || return 1
    [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$1" ]] || return 1
    stat=$(cat "/proc/$pid/stat" 2>/dev/null) || return 1
    stat=${stat##*) }
    [[ ${stat%% *} != Z ]]
}
# Prints "node state" lines for our partition.
node_states() { timeout 10 sinfo -h -N -p "$PARTITION" -o '%N %t' 2>/dev/null; }
why_unhealthy=
healthy() {
    local d n states
    for d in "${DAEMONS[@]}"; do
        # shellcheck disable=SC2086
        alive $d || {
            why_unhealthy="$(basename "${d#* }" .pid) is not running"
            return 1
        }
    done
    states=$(node_states) || {
        why_unhealthy="sinfo failed"
        return 1
    }
    for n in "${NODES[@]}"; do
        grep -qE "^$n (idle|alloc|mix|comp)\$" <<<"$states" || {
            why_unhealthy="$n is not up: $(grep "^$n " <<<"$states" || echo 'not listed')"
            return 1
        }
    done
}

same_configs=1
for f in slurm.conf slurmdbd.conf; do cmp -s "$staged/$f" "$DIR/$f" || same_configs=0; done
cmp -s "$staged/my.cnf" "$DIR/mysql/my.cnf" || same_configs=0

summary() {
    echo "moe-slurm: $1: cluster $CLUSTER, partition $PARTITION, nodes ${NODES[*]} (${node_hw%% *}," \
        "RealMemory=$real_memory each); clients: source $DIR/env.sh; $install_note, $2"
}

if healthy; then
    if ((same_configs)); then
        summary "already up" "start 0.0 s (nothing to do)"
        exit 0
    fi
    log "configs changed: restarting the cluster"
    bash "$HERE/down.sh"
else
    # Anything left over (a partial start, a killed daemon) is stopped first, so every start is a clean one.
    running=()
    for d in "${DAEMONS[@]}"; do
        # shellcheck disable=SC2086
        alive $d && running+=("$(basename "${d#* }" .pid)")
    done
    ((${#running[@]})) && log "not healthy ($why_unhealthy; running: ${running[*]}): restarting"
    # Also finds our daemons whose pid files are gone; quiet when there was nothing to stop.
    stopped=$(bash "$HERE/down.sh" 2>&1) || true
    [[ $stopped == *"stopped nothing"* || $stopped == *"nothing to stop"* ]] || echo "$stopped"
fi

# ---------------------------------------------------------------------------------------------------- start
t_start=$(usec)
deadline=$((SECONDS + TIMEOUT))

# wait_for NAME LOGFILE COMMAND...: polls COMMAND until it succeeds; past the deadline, fails naming NAME.
wait_for() {
    local name=$1 logfile=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            echo "moe-slurm: ERROR: $name did not come up within ${TIMEOUT} s (waited for: $*). Log $logfile:" >&2
            tail -n 20 "$logfile" >&2 2>/dev/null || true
            exit 1
        fi
        sleep 0.2
    done
}
# exec_bare COMMAND...: closes every file descriptor above 2 and execs COMMAND; call it in a subshell, ( ... ).
# So a daemon holds neither our lock (fd 9) nor a pipe of whoever ran up.sh (a CI runner waiting for EOF).
exec_bare() {
    local fd
    for fd in "/proc/$BASHPID/fd/"*; do
        fd=${fd##*/}
        if ((fd > 2)); then eval "exec $fd>&-"; fi
    done
    exec "$@"
}
# start NAME LOGFILE COMMAND...: runs a daemon's start command (it forks into the background itself).
start() {
    local name=$1 logfile=$2
    shift 2
    (exec_bare "$@") </dev/null >>"$logfile" 2>&1 || {
        echo "moe-slurm: ERROR: $name failed to start ($*). Log $logfile:" >&2
        tail -n 20 "$logfile" >&2 2>/dev/null || true
        exit 1
    }
}

install -m 0644 "$staged/slurm.conf" "$DIR/slurm.conf"
install -m 0600 -o root -g root "$staged/slurmdbd.conf" "$DIR/slurmdbd.conf"
mkdir -p "$DIR/spool/slurmctld" "$DIR/munge"
for n in "${NODES[@]}"; do mkdir -p "$DIR/spool/slurmd.$n"; done

# munged: our own key and socket. It insists on a 0755 socket directory and a 0600 key owned by its user.
chmod 0755 "$DIR/munge"
if [[ ! -s $DIR/munge/munge.key ]]; then
    (umask 077 && head -c 1024 /dev/urandom >"$DIR/munge/munge.key")
fi
chmod 0600 "$DIR/munge/munge.key"
sock=$DIR/munge/munge.socket
start munged "$DIR/log/munged.log" munged --socket="$sock" --key-file="$DIR/munge/munge.key" \
    --log-file="$DIR/log/munged.log" --pid-file="$DIR/run/munged.pid" --seed-file="$DIR/munge/munged.seed" \
    --num-threads=10
wait_for munged "$DIR/log/munged.log" bash -c "munge -n -S '$sock' | unmunge -S '$sock'"

# mariadbd: datadir made once; it runs as mysql, so its directories and log file belong to mysql.
mkdir -p "$DIR/mysql/data" "$DIR/mysql/run"
install -m 0644 "$staged/my.cnf" "$DIR/mysql/my.cnf"
touch "$DIR/log/mariadbd.log"
chown mysql:mysql "$DIR/mysql/run" "$DIR/log/mariadbd.log"
# (-R only when needed: a reinstalled mariadb-server may have given the mysql user another uid.)
[[ $(stat -c %U "$DIR/mysql/data") == mysql ]] || chown -R mysql:mysql "$DIR/mysql/data"
mycnf=$DIR/mysql/my.cnf
if [[ ! -d $DIR/mysql/data/mysql ]]; then
    start "mariadb-install-db" "$DIR/log/mariadb-install-db.log" \
        mariadb-install-db --defaults-file="$mycnf" --user=mysql --skip-test-db
fi
(exec_bare setsid mariadbd --defaults-file="$mycnf") </dev/null >>"$DIR/log/mariadbd.log" 2>&1 &
wait_for mariadbd "$DIR/log/mariadbd.log" mariadb-admin --defaults-file="$mycnf" ping
mariadb --defaults-file="$mycnf" -e "
    CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$db_pass';
    ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$db_pass';
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" || die "cannot create the slurm database user"

# slurmdbd (reads slurmdbd.conf from SLURM_CONF's directory).
start slurmdbd "$DIR/log/slurmdbd.log" slurmdbd
wait_for slurmdbd "$DIR/log/slurmdbd.log" timeout 10 sacctmgr -n -P show cluster format=cluster

# Accounting: the cluster, an account, root in it (each only when missing; sacctmgr -i fails on "already there").
sacctmgr -n -P show cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null
sacctmgr -n -P show account format=account | grep -qx "$ACCOUNT" ||
    sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER" Description="moe-platform dev" Organization=moe >/dev/null
sacctmgr -n -P show assoc where cluster="$CLUSTER" account="$ACCOUNT" user=root format=user | grep -qx root ||
    sacctmgr -i add user root Account="$ACCOUNT" Cluster="$CLUSTER" >/dev/null

# slurmctld.
start slurmctld "$DIR/log/slurmctld.log" slurmctld
wait_for slurmctld "$DIR/log/slurmctld.log" bash -c "timeout 10 scontrol ping | grep -q 'is UP'"
# Jobs recovered from an earlier run that did not end cleanly (down.sh cancels them) belong to no one any more.
leftover=$(timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ') || true
if [[ -n ${leftover// /} ]]; then
    log "cancelling job(s) left from an earlier run: $leftover"
    # shellcheck disable=SC2086
    timeout 10 scancel $leftover || true
fi

# The two slurmd, one per node name.
for n in "${NODES[@]}"; do
    start "slurmd $n" "$DIR/log/slurmd.$n.log" slurmd -N "$n"
done
# node_idle NODE: true once it is idle. A node that slurmctld remembers as drained or down (e.g. "Kill task
# failed" in an earlier run; ReturnToService=2 only revives nodes that were down for not responding) is resumed.
node_idle() {
    local state
    state=$(timeout 10 sinfo -h -N -n "$1" -o %t 2>/dev/null) || return 1
    case $state in
    idle) return 0 ;;
    drain | drng | down | fail | failg)
        resumed+=("$1 was '$state' ($(sinfo -h -N -n "$1" -o %E 2>/dev/null)): resumed it")
        scontrol update NodeName="$1" State=RESUME >/dev/null 2>&1 || true
        ;;
    esac
    return 1
}
resumed=()
for n in "${NODES[@]}"; do
    wait_for "node $n (slurmd -N $n)" "$DIR/log/slurmd.$n.log" node_idle "$n"
done
for msg in "${resumed[@]}"; do log "$msg"; done

cat >"$DIR/env.sh" <<EOF
# Source this to use the moe-platform dev Slurm cluster (written by slurm/dev-cluster/up.sh).
export SLURM_CONF=$DIR/slurm.conf
export MOE_SLURM_DIR=$DIR
EOF
summary "up" "start $(since "$t_start") s"
