#!/usr/bin/env bash
# Run commands at the same time, one lane each, and print each lane's whole output when it ends
# (never interleaved), with its time; exit non-zero when any lane failed, after all have ended.
#
#   bash scripts/lanes.sh NAME 'COMMAND' [NAME 'COMMAND' ...]
#
# `make test` uses it to run the lanes that mostly wait (the simulated nodes' SSH and engine starts,
# the browser tests) beside the lane that mostly computes, on a 2-core machine.
set -uo pipefail
[ $# -ge 2 ] && [ $(($# % 2)) -eq 0 ] || { echo "usage: $0 NAME 'COMMAND' [NAME 'COMMAND' ...]" >&2; exit 2; }

logs=$(mktemp -d)
# job control: without it, bash starts background commands with SIGINT ignored, and a Python that
# starts with SIGINT ignored has no KeyboardInterrupt (the tests that interrupt a cell need one)
set -m
# ... and each lane is then a process group of its own, which a Ctrl-C here must end too
stop_lanes() {
    for pid in "${pids[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
}
trap 'stop_lanes; exit 130' INT
trap 'stop_lanes; exit 143' TERM
names=()
pids=()
declare -A started
while [ $# -gt 0 ]; do
    name=$1 cmd=$2
    shift 2
    names+=("$name")
    started[$name]=$SECONDS
    echo "=== lane $name started: $cmd"
    bash -c "$cmd" >"$logs/$name.log" 2>&1 &
    pids+=($!)
done

# a lane's output is printed as soon as it ends, whichever ends first
failed=()
left=${#pids[@]}
declare -A done_
while [ "$left" -gt 0 ]; do
    wait -n "${pids[@]}" 2>/dev/null || true
    for i in "${!pids[@]}"; do
        name=${names[$i]}
        [ -n "${done_[$name]:-}" ] && continue
        kill -0 "${pids[$i]}" 2>/dev/null && continue
        wait "${pids[$i]}"
        rc=$?
        done_[$name]=1
        left=$((left - 1))
        took=$((SECONDS - started[$name]))
        echo
        echo "=================== lane $name (${took}s, exit $rc) ==================="
        cat "$logs/$name.log"
        echo "=================== end of lane $name: $([ $rc -eq 0 ] && echo passed || echo FAILED) in ${took}s"
        [ $rc -eq 0 ] || failed+=("$name")
    done
done
rm -rf "$logs"
if [ ${#failed[@]} -gt 0 ]; then
    echo "lanes failed: ${failed[*]}" >&2
    exit 1
fi
