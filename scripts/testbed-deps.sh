#!/bin/sh
# Install what the simulated-node test bed (tests/multinode/testbed.py) needs on Debian/Ubuntu:
# sshd and ssh for real SSH logins, iproute2 for namespaces/veth/bridge, util-linux for unshare/nsenter;
# and for the launcher tests, Slurm and munge (scripts/slurm-testbed.sh starts them on this machine)
# and Open MPI's mpiexec; and tcmalloc for the allocator test.
# Idempotent and quiet: does nothing when everything is present. Needs root.
set -eu

need=""
command -v ip >/dev/null 2>&1 || need="$need iproute2"
[ -x /usr/sbin/sshd ] || need="$need openssh-server"
command -v ssh >/dev/null 2>&1 || need="$need openssh-client"
command -v unshare >/dev/null 2>&1 || need="$need util-linux"
command -v nsenter >/dev/null 2>&1 || need="$need util-linux"
command -v ssh-keygen >/dev/null 2>&1 || need="$need openssh-client"
[ -x /usr/sbin/slurmctld ] || need="$need slurmctld"
[ -x /usr/sbin/slurmd ] || need="$need slurmd"
command -v sbatch >/dev/null 2>&1 || need="$need slurm-client"
[ -x /usr/sbin/munged ] || need="$need munge"
command -v mpiexec >/dev/null 2>&1 || need="$need openmpi-bin"
# tcmalloc: tests/cluster/test_allocator.py checks that CPU engines really run with it
{ ldconfig -p 2>/dev/null || /sbin/ldconfig -p; } | grep -q libtcmalloc_minimal || need="$need libtcmalloc-minimal4"

if [ -z "$need" ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "testbed-deps: need root to install:$need" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
# the test beds run their own sshd per node and their own munged/slurmctld/slurmd
log=$(mktemp)
# shellcheck disable=SC2086
if ! { apt-get update -qq && apt-get install -y -qq --no-install-recommends $need; } >"$log" 2>&1; then
    cat "$log" >&2
    rm -f "$log"
    exit 1
fi
rm -f "$log"
