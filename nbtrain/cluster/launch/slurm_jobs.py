"""Talking to Slurm's commands for the Slurm launcher: their environment, a job's state and nodes
(squeue, scontrol), waiting until a cancelled job is gone, and what sbatch's refusals and squeue's
pending reasons mean for the user (the hints its messages end with).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time

from nbtrain.cluster.launch import LaunchOptions

log = logging.getLogger(__name__)


# job states after which the job runs nothing any more (squeue's long names)
ENDED = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "REVOKED",
    "SPECIAL_EXIT",
    "TIMEOUT",
}


def slurm_env(env: dict[str, str] | None = None) -> dict[str, str]:
    # a notebook that itself runs in a Slurm job (Jupyter started by sbatch) has SLURM_* set; sbatch
    # and srun would take them for the new job's (SLURM_MEM_PER_CPU, SLURM_NTASKS...)
    env = dict(os.environ if env is None else env)
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def run(command: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=slurm_env(),
        timeout=timeout,
        check=False,
    )


def submit_hint(said: str) -> str:
    low = said.lower()
    if "partition" in low:
        return " Pick a partition that exists and you may use (`sinfo -s` lists them) with --partition."
    if "account" in low or "association" in low:
        return " Pass --account with an account you belong to (`sacctmgr show assoc user=$USER`)."
    if "gres" in low or "gpu" in low:
        return (
            " The partition has no GPUs configured as Slurm GRES: pick a GPU partition with "
            "--partition, or leave --gpus-per-node out on CPU nodes."
        )
    if "time limit" in low or "--time" in low:
        return " Ask for a shorter --time (`sinfo -s` shows each partition's limit)."
    if "node count" in low or "node configuration" in low:
        return " Ask for fewer --nodes (`sinfo -s` shows each partition's nodes)."
    return ""


def pending_hint(reason: str, lo: LaunchOptions) -> str:
    where = f"partition {lo.partition}" if lo.partition else "the default partition"
    if reason.startswith("Partition") and reason not in ("PartitionDown", "PartitionInactive"):
        return (
            f"The job asks for more than {where} allows ({reason}: nodes, GPUs or time). Check "
            "`sinfo -s` and ask for fewer --nodes or --gpus-per-node, or a shorter --time."
        )
    if reason in ("PartitionDown", "PartitionInactive"):
        return f"{where.capitalize()} is down: pick another with --partition (`sinfo -s`)."
    if reason in ("ReqNodeNotAvail", "NodeDown", "BadConstraints"):
        return "The nodes it needs are down, drained or do not match (`sinfo -R`)."
    if "Account" in reason or "Assoc" in reason or "QOS" in reason:
        return f"An account or QOS limit holds it ({reason}): check --account and --slurm-args."
    return (
        "The cluster is busy: give a longer --timeout, ask for fewer nodes, or try again later "
        "(`squeue -u $USER --start` estimates the start)."
    )


def job_state(job_id: str) -> tuple[str, str, str] | None:
    """(state, reason, nodelist) of a job as squeue shows it; None once Slurm has forgotten it."""
    proc = run(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r|%N"])
    line = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not line:
        return None
    state, reason, nodes = (line[0].split("|") + ["", ""])[:3]
    return state, reason, nodes


def expand_nodes(nodelist: str) -> list[str]:
    """gpu[01-02] -> [gpu01, gpu02], as Slurm expands it."""
    if not nodelist or nodelist in ("(null)", "n/a"):
        return []
    proc = run(["scontrol", "show", "hostnames", nodelist])
    names = proc.stdout.split()
    return names or [nodelist]


def wait_job_gone(job_id: str, timeout: float = 30.0) -> None:
    """Wait until Slurm runs nothing of the job any more (cancelled jobs go through COMPLETING)."""
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        found = job_state(job_id)
        if found is None or found[0] in ENDED:
            return
        state = found[0]
        time.sleep(0.25)
    log.warning(
        "nbtrain: slurm job %s is still %s %g s after scancel; check `squeue -j %s` on %s",
        job_id,
        state,
        timeout,
        job_id,
        socket.gethostname(),
    )
