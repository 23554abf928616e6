#!/bin/sh
# A real single-machine Slurm for the tests: munged, slurmctld and slurmd on this machine, with
# this host as the only node (its CPUs, no GPUs), in a folder of their own.
#
#   sh scripts/slurm-testbed.sh up DIR     # start (stopping a left-over one in DIR first); prints
#                                          # SLURM_CONF=DIR/slurm.conf once the node is idle
#   sh scripts/slurm-testbed.sh down DIR   # stop the daemons started in DIR
#
# Needs root and Debian's slurm-wlm and munge (scripts/testbed-deps.sh installs them). Everything
# is private to DIR: its own munge socket and key, its own ports ($NBTRAIN_SLURM_PORT, default
# 16817, and the next one), its own state and logs; a system Slurm or munge is left alone.
# Partitions: `debug` (default, up) and `closed` (down: jobs there stay pending).
set -eu

cmd=${1:-}
dir=${2:-}
if [ -z "$cmd" ] || [ -z "$dir" ]; then
    echo "usage: $0 up|down DIR" >&2
    exit 2
fi
port=${NBTRAIN_SLURM_PORT:-16817}

stop_pidfile() {
    # only the process the pid file names, and only if it is the daemon we started
    f=$1
    name=$2
    [ -f "$f" ] || return 0
    pid=$(cat "$f" 2>/dev/null || true)
    rm -f "$f"
    [ -n "$pid" ] || return 0
    case "$(cat "/proc/$pid/comm" 2>/dev/null || true)" in
    "$name"*) kill "$pid" 2>/dev/null || true ;;
    *) return 0 ;;
    esac
    i=0
    while [ -d "/proc/$pid" ] && [ "$(cut -d' ' -f3 "/proc/$pid/stat" 2>/dev/null || echo Z)" != Z ]; do
        i=$((i + 1))
        if [ $i -gt 50 ]; then
            kill -9 "$pid" 2>/dev/null || true
            break
        fi
        sleep 0.1
    done
}

down() {
    if [ -f "$dir/slurm.conf" ] && [ -f "$dir/slurmctld.pid" ]; then
        # jobs first, so slurmd's steps end with their jobs
        SLURM_CONF="$dir/slurm.conf" scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    fi
    stop_pidfile "$dir/slurmd.pid" slurmd
    stop_pidfile "$dir/slurmctld.pid" slurmctld
    stop_pidfile "$dir/munged.pid" munged
}

if [ "$cmd" = down ]; then
    down
    exit 0
fi
if [ "$cmd" != up ]; then
    echo "usage: $0 up|down DIR" >&2
    exit 2
fi
for exe in /usr/sbin/munged /usr/sbin/slurmctld /usr/sbin/slurmd /usr/bin/sbatch; do
    if [ ! -x "$exe" ]; then
        echo "slurm-testbed: $exe is missing; install slurm-wlm and munge (sh scripts/testbed-deps.sh)" >&2
        exit 3
    fi
done
if [ "$(id -u)" != 0 ]; then
    echo "slurm-testbed: needs root (slurmd runs jobs as their users)" >&2
    exit 3
fi

mkdir -p "$dir"
down
# munged checks that the folders it uses are not writable by others
chmod 0755 "$dir"
mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
chmod 0700 "$dir/munge"
if [ ! -s "$dir/munge/munge.key" ]; then
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1 count=1024 2>/dev/null
fi
chmod 0600 "$dir/munge/munge.key"
node=$(hostname -s)
cpus=$(nproc)
cat >"$dir/slurm.conf" <<EOF
ClusterName=nbtrain-testbed
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
SlurmctldPort=$port
SlurmdPort=$((port + 1))
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
KillWait=5
InactiveLimit=0
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE OverSubscribe=YES State=UP
PartitionName=closed Nodes=$node MaxTime=INFINITE State=DOWN
EOF

/usr/sbin/munged --force --socket="$dir/munge/munge.socket" --key-file="$dir/munge/munge.key" \
    --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munge/seed"
# -c: no saved state (a clean queue, job ids from 1)
/usr/sbin/slurmctld -c -f "$dir/slurm.conf"
/usr/sbin/slurmd -f "$dir/slurm.conf"
i=0
until SLURM_CONF="$dir/slurm.conf" sinfo -h -p debug -o %T 2>/dev/null | grep -q idle; do
    i=$((i + 1))
    if [ $i -gt 100 ]; then
        echo "slurm-testbed: the node did not become idle within 20 s; logs in $dir" >&2
        tail -n 20 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 2>/dev/null || true
        down
        exit 1
    fi
    sleep 0.2
done
echo "SLURM_CONF=$dir/slurm.conf"
