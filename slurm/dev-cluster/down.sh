#!/usr/bin/env bash
# Stop the dev Slurm cluster that up.sh started: cancel its jobs, then stop slurmd (both nodes), slurmstepd,
# slurmctld, slurmdbd, mariadbd and munged. Every wait is bounded; a zombie (state Z) counts as stopped.
# Keeps the state directory ($MOE_SLURM_DIR, default /tmp/moe-slurm: database, munge key, logs) so the next up.sh
# starts quickly; `down.sh --purge` removes it too. Safe to run when nothing is running.
set -uo pipefail

DIR=${MOE_SLURM_DIR:-/tmp/moe-slurm}
PURGE=0
for arg in "$@"; do
    case $arg in
    --purge) PURGE=1 ;;
    *)
        echo "usage: $0 [--purge]" >&2
        exit 2
        ;;
    esac
done

log() { echo "moe-slurm: $*"; }
t0=$SECONDS

if [[ ! -d $DIR ]]; then
    log "down: nothing to stop ($DIR does not exist)"
    exit 0
fi
export SLURM_CONF=$DIR/slurm.conf
# One up.sh/down.sh at a time (up.sh runs this script while it holds the lock itself).
if [[ ${MOE_SLURM_LOCK_HELD:-} != "$DIR" ]]; then
    exec 9>"$DIR/.lock"
    flock -w 120 9 || {
        log "down: another up.sh or down.sh still holds $DIR/.lock after 120 s"
        exit 1
    }
fi

# state PID: the process state letter (R, S, D, Z, ...), nothing when there is no such process.
state() {
    local s
    s=$(cat "/proc/$1/stat" 2>/dev/null) || return 0
    s=${s##*) }
    echo "${s%% *}"
}
# live PID: the process exists and is not a zombie.
live() {
    local s
    s=$(state "$1")
    [[ -n $s && $s != Z ]]
}
# ours NAME: pids of live processes called NAME that belong to this cluster: named in one of our pid files, or
# with our state directory on their command line (munged, mariadbd), or started with our SLURM_CONF (the Slurm
# daemons, and slurmstepd, which inherits slurmd's environment).
ours() {
    local name=$1 p pid comm
    {
        for p in "$DIR"/run/*.pid "$DIR"/mysql/run/*.pid; do
            [[ -r $p ]] && cat "$p" 2>/dev/null && echo
        done
        for p in /proc/[0-9]*; do
            if ! { read -r comm 2>/dev/null <"$p/comm" && [[ $comm == "$name" ]]; }; then continue; fi
            if { tr '\0' '\n' <"$p/cmdline"; } 2>/dev/null | grep -qF -- "$DIR/" ||
                { tr '\0' '\n' <"$p/environ"; } 2>/dev/null | grep -qxF -- "SLURM_CONF=$DIR/slurm.conf"; then
                echo "${p#/proc/}"
            fi
        done
    } | grep -E '^[0-9]+$' | sort -un | while read -r pid; do
        [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$name" ]] && live "$pid" && echo "$pid"
    done
}

stopped=()
# stop NAME GRACE: SIGTERM, up to GRACE seconds to exit, then SIGKILL and up to 5 s more.
stop() {
    local name=$1 grace=$2 pids pid left t
    mapfile -t pids < <(ours "$name")
    ((${#pids[@]})) || return 0
    kill -TERM "${pids[@]}" 2>/dev/null
    for ((t = 0; t < grace * 5; t++)); do
        left=()
        for pid in "${pids[@]}"; do live "$pid" && left+=("$pid"); done
        ((${#left[@]})) || break
        sleep 0.2
    done
    if ((${#left[@]})); then
        log "$name (pid ${left[*]}) still running ${grace} s after SIGTERM: SIGKILL"
        kill -KILL "${left[@]}" 2>/dev/null
        for ((t = 0; t < 25; t++)); do
            pids=("${left[@]}")
            left=()
            for pid in "${pids[@]}"; do live "$pid" && left+=("$pid"); done
            ((${#left[@]})) || break
            sleep 0.2
        done
        for pid in "${left[@]}"; do log "WARNING: $name pid $pid did not stop (state $(state "$pid"))"; done
    fi
    stopped+=("$name")
}

# Jobs first, through Slurm, so that slurmstepd ends their processes and accounting records them as cancelled.
if [[ -n $(ours slurmctld) && -r $SLURM_CONF ]]; then
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    if [[ -n ${jobs// /} ]]; then
        log "cancelling job(s) $jobs"
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs 2>/dev/null
        for ((t = 0; t < 75; t++)); do
            [[ -z $(timeout 10 squeue -h -o %A 2>/dev/null) ]] && break
            sleep 0.2
        done
        if [[ -n $(timeout 10 squeue -h -o %A 2>/dev/null) ]]; then
            # shellcheck disable=SC2086
            timeout 10 scancel --full --signal=KILL $jobs 2>/dev/null
            sleep 1
        fi
    fi
fi

stop slurmd 10
stop slurmstepd 5
stop slurmctld 15
stop slurmscriptd 5
stop slurmdbd 15
stop mariadbd 30
stop munged 10
rm -f "$DIR"/run/*.pid

if ((PURGE)); then
    rm -rf "$DIR"
    log "down: stopped ${stopped[*]:-nothing (none running)}; removed $DIR in $((SECONDS - t0)) s"
else
    log "down: stopped ${stopped[*]:-nothing (none running)} in $((SECONDS - t0)) s (state kept in $DIR)"
fi
