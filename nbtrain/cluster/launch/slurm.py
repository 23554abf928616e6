"""Engines as one Slurm job: ipyparallel's Slurm engine launcher, with nbtrain's batch script.

In [1]: cluster = nbtrain.start(launcher="slurm", nodes=2, gpus_per_node=4, partition="gpu",
   ...:                         time="02:00:00")     # %nbtrain start --launcher slurm --nodes 2 ...
nbtrain: slurm job 4711 pending (Resources)
nbtrain: slurm job 4711 running on gpu[01-02]

The controller runs here (the login node); `sbatch` submits one job of `--nodes` nodes with
`--engines-per-node` tasks each (default: `--gpus-per-node`, else 1), and `srun` starts an engine per
task. While the job waits, start says so and why (squeue's reason); when `--timeout` passes, or the
start is interrupted, the job is cancelled (`scancel`). Stopping the cluster cancels the job and waits
until Slurm no longer runs it.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import socket
import subprocess
import time
from collections.abc import Callable
from typing import Any

from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

from nbtrain import net
from nbtrain.cluster import procs
from nbtrain.cluster.launch.base import EngineLaunch, start_engines, stop_here
from nbtrain.cluster.options import LaunchOptions, StartOptions, engines_per_node, require_commands
from nbtrain.cluster.session import Launched, close_client
from nbtrain.errors import ClusterError, ConfigError

log = logging.getLogger("nbtrain")

# job states after which the job runs nothing any more (squeue's long names)
_ENDED = {
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


def batch_script(lo: LaunchOptions) -> str:
    """The sbatch script, as an ipyparallel batch template: {program_and_args}, {output_file} and
    {cluster_id} are filled in by ipyparallel's launcher; the rest is written here."""

    def lit(text: str) -> str:  # a literal inside ipyparallel's template
        return str(text).replace("{", "{{").replace("}", "}}")

    lines = [
        "#!/bin/sh",
        "#SBATCH --job-name=nbtrain-{cluster_id}",
        f"#SBATCH --nodes={int(lo.nodes or 1)}",
        f"#SBATCH --ntasks-per-node={engines_per_node(lo)}",
    ]
    if lo.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={int(lo.gpus_per_node)}")
    if lo.partition:
        lines.append(f"#SBATCH --partition={lit(lo.partition)}")
    if lo.account:
        lines.append(f"#SBATCH --account={lit(lo.account)}")
    if lo.time:
        lines.append(f"#SBATCH --time={lit(lo.time)}")
    lines += ["#SBATCH --output={output_file}", "#SBATCH --export=ALL"]
    lines += [f"#SBATCH {lit(a)}" for a in lo.slurm_args]
    # one engine per task; every task sees all of its node's GPUs and picks cuda:LOCAL_RANK, as
    # under torchrun. An engine that ends does not take the others down: nbtrain reports it.
    lines += ["srun --kill-on-bad-exit=0 {program_and_args}", ""]
    return "\n".join(lines)


def _slurm_env(env: dict[str, str] | None = None) -> dict[str, str]:
    # a notebook that itself runs in a Slurm job (Jupyter started by sbatch) has SLURM_* set; sbatch
    # and srun would take them for the new job's (SLURM_MEM_PER_CPU, SLURM_NTASKS...)
    env = dict(os.environ if env is None else env)
    return {k: v for k, v in env.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}


def _run(command: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        env=_slurm_env(),
        timeout=timeout,
        check=False,
    )


class SlurmEngineSet(SlurmEngineSetLauncher):
    """ipyparallel's Slurm engine set, with sbatch's and scancel's own messages kept for errors.

    The stock launcher lets sbatch's stderr go to the kernel's stderr and raises a bare
    CalledProcessError; the message a user needs ("invalid partition specified: gpu") is that stderr.
    """

    # how ipyparallel names the class in the cluster file: a dotted path it can import back
    entrypoint_name = "nbtrain.cluster.launch.slurm.SlurmEngineSet"
    # ipyparallel removes the output when the job stops; kept until nbtrain's teardown, since a
    # failed start quotes it and points at it
    keep_output = True

    def get_output(self, remove: bool = True) -> str:
        return str(super().get_output(remove=remove and not self.keep_output))

    def stop(self) -> Any:
        if not self.job_id:  # sbatch failed: there is no job to cancel
            return self.notify_stop({"job_id": None, "output": ""})
        return super().stop()

    def _run_command(self, command: list[str], **kwargs: Any) -> str:
        env = _slurm_env(kwargs.pop("env", None))
        try:
            proc = subprocess.run(
                command,
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
                env=env,
                timeout=60,
                check=False,
            )
        except FileNotFoundError:
            require_commands((command[0],))
            raise
        except subprocess.TimeoutExpired:
            msg = f"`{shlex.join(command)}` did not answer within 60 s; is slurmctld up (`sinfo`)?"
            raise ClusterError(msg) from None
        if proc.returncode != 0:
            said = proc.stderr.strip() or proc.stdout.strip() or f"exit {proc.returncode}"
            said = re.sub(rf"(?m)^{re.escape(command[0])}: (error: )?", "", said)
            said = said.replace("\n", "; ")
            if command[0] == "scancel" and "Invalid job id" in said:
                return said  # already gone
            msg = f"{command[0]} refused: {said}.{_submit_hint(said)} Nothing was left running."
            raise ClusterError(msg)
        return proc.stdout


def _submit_hint(said: str) -> str:
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


def _pending_hint(reason: str, lo: LaunchOptions) -> str:
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
    proc = _run(["squeue", "-h", "-j", str(job_id), "-o", "%T|%r|%N"])
    line = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not line:
        return None
    state, reason, nodes = (line[0].split("|") + ["", ""])[:3]
    return state, reason, nodes


def expand_nodes(nodelist: str) -> list[str]:
    """gpu[01-02] -> [gpu01, gpu02], as Slurm expands it."""
    if not nodelist or nodelist in ("(null)", "n/a"):
        return []
    proc = _run(["scontrol", "show", "hostnames", nodelist])
    names = proc.stdout.split()
    return names or [nodelist]


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path) as f:
            text = f.read().splitlines()[-lines:]
    except OSError:
        return ""
    return "\n".join(text)


class SlurmLaunch(EngineLaunch):
    """Engines as one Slurm job of --nodes nodes × --engines-per-node tasks (sbatch + srun)."""

    what = "as one Slurm job"

    def __init__(self, lo: LaunchOptions) -> None:
        super().__init__(lo)
        self.per_node = engines_per_node(lo)
        self.total = int(lo.nodes or 1) * self.per_node
        self._last_state: tuple[str, str] | None = None
        self._next_poll = 0.0
        self.job_id: str | None = None

    def listen(self) -> net.ListenChoice:
        if self.lo.ip:
            return net.ListenChoice(self.lo.ip, net.interface_of(self.lo.ip), "given with --ip")
        # the job's nodes are not known before it runs; the partition's nodes are: listen on the
        # address that routes to them (their NodeAddr, as slurmctld reaches them)
        cmd = ["sinfo", "-h", "-N", "-o", "%N %o"]
        if self.lo.partition:
            cmd += ["-p", str(self.lo.partition)]
        try:
            out = _run(cmd, timeout=15).stdout
        except subprocess.TimeoutExpired:
            out = ""
        addrs = list(dict.fromkeys(ln.split()[-1] for ln in out.splitlines() if ln.split()))[:8]
        if not addrs and self.lo.partition:
            known = _run(["sinfo", "-h", "-o", "%R"], timeout=15).stdout.split()
            if known and not set(str(self.lo.partition).split(",")) & set(known):
                msg = (
                    f"--partition {self.lo.partition}: this Slurm cluster has no such partition; "
                    f"its partitions: {', '.join(dict.fromkeys(known))}. Nothing was started."
                )
                raise ConfigError(msg)
        if not addrs:
            msg = (
                "cannot tell which network reaches the Slurm nodes (`sinfo -N` lists no node"
                f"{' in partition ' + str(self.lo.partition) if self.lo.partition else ''}). Pass "
                "--ip with an address of this machine the compute nodes can reach."
            )
            raise ClusterError(msg)
        try:
            choice = net.listen_address(addrs)
        except ClusterError as e:
            msg = f"{e} (the Slurm nodes' addresses, from `sinfo -N -o '%N %o'`)"
            raise ClusterError(msg) from None
        return choice

    def prepare(self, options: StartOptions, remaining: Callable[[], float], say: Any) -> int:
        lo = self.lo
        if options.backend == "nccl" and not lo.gpus_per_node:
            msg = (
                "--backend nccl needs GPUs, and the job asks for none: pass --gpus-per-node (one "
                "engine per GPU), or use --backend gloo (or auto)."
            )
            raise ConfigError(msg)
        what = [f"{lo.nodes} node(s) × {self.per_node} engine(s)"]
        if lo.gpus_per_node:
            what.append(f"{lo.gpus_per_node} GPU(s) per node")
        for label, value in (
            ("partition", lo.partition),
            ("account", lo.account),
            ("time", lo.time),
        ):
            if value:
                what.append(f"{label} {value}")
        say("submitting a Slurm job: " + ", ".join(what))
        return self.total

    def launcher_class(self) -> Any:
        return SlurmEngineSet

    def configure(self, ipp_cluster: Any, options: StartOptions) -> None:
        cfg = ipp_cluster.config.SlurmEngineSet
        cfg.batch_template = batch_script(self.lo)
        # ipyparallel writes the script into the kernel's working folder by default; keep it with
        # the cluster's other files, one per cluster
        cfg.batch_file_name = os.path.join(
            ipp_cluster.profile_dir, "log", f"slurm-{ipp_cluster.cluster_id}.sbatch"
        )
        os.makedirs(os.path.dirname(cfg.batch_file_name), exist_ok=True)
        cfg.engine_cmd = [self.lo.remote_python, "-m", "nbtrain.engine.boot"]

    def watch(self, ipp_cluster: Any, say: Any, force: bool = False) -> None:
        now = time.monotonic()
        if now < self._next_poll and not force:
            return
        self._next_poll = now + 2.0
        es = self._engine_set(ipp_cluster)
        self.job_id = job_id = getattr(es, "job_id", None) or self.job_id
        if not job_id:
            return
        found = job_state(job_id)
        if found is None or found[0] in _ENDED:
            state = found[0] if found else "ended"
            out = _tail(getattr(es, "output_file", "") or "")
            msg = (
                f"slurm job {job_id} {state.lower()} before its engines registered."
                + (f" Its output ({es.output_file}):\n{out}\n" if out else " ")
                + "Check that --python names a Python with nbtrain on the compute nodes. Nothing "
                "was left running."
            )
            raise ClusterError(msg)
        state, reason, nodes = found
        if (state, reason) != self._last_state:
            self._last_state = (state, reason)
            if state == "PENDING":
                why = f" ({reason})" if reason not in ("None", "") else ""
                say(f"slurm job {job_id} pending{why}")
            else:
                say(f"slurm job {job_id} {state.lower()} on {nodes}")

    def registered(self, ipp_cluster: Any, say: Any) -> None:
        # the engines can register within one poll of the job leaving the queue: say where it runs
        self.watch(ipp_cluster, say, force=True)

    def raise_missing(
        self, client: Any, ipp_cluster: Any, listen: net.ListenChoice, timeout: float
    ) -> None:
        es = self._engine_set(ipp_cluster)
        job_id = getattr(es, "job_id", None) or self.job_id
        found = job_state(job_id) if job_id else None
        if found is not None and found[0] == "PENDING":
            msg = (
                f"slurm job {job_id} was still pending after --timeout {timeout:g} s (reason: "
                f"{found[1]}). It was cancelled (scancel {job_id}); nothing is left running. "
                + _pending_hint(found[1], self.lo)
            )
            raise ClusterError(msg)
        from nbtrain.engine import network

        got: dict[str, int] = {}
        try:
            ids = list(client.ids)
            if ids:
                slots = client.direct_view(targets=ids).apply_async(network.launch_slot).get(10)
                for s in slots:
                    got[s.get("label") or "?"] = got.get(s.get("label") or "?", 0) + 1
        except Exception:
            pass
        nodes = expand_nodes(found[2]) if found else []
        short = [
            f"{h} ({got.get(h, 0)} of {self.per_node})"
            for h in nodes
            if got.get(h, 0) < self.per_node
        ]
        where = f" missing on {', '.join(short)}" if short else ""
        msg = (
            f"slurm job {job_id} runs, but not every engine registered within --timeout "
            f"{timeout:g} s ({len(got)} of {self.total}){where}. Engines on the compute nodes could "
            f"not reach the controller at {listen.address}: pass --ip with an address of this "
            "machine they can reach (a firewall between the login and compute nodes?), or give a "
            f"longer --timeout. The engines' output is in {getattr(es, 'output_file', '?')}. The job "
            "was cancelled; nothing is left running."
        )
        raise ClusterError(msg)

    def teardown(
        self, ipp_cluster: Any, client: Any, engine_pids: dict[str, list[int]], remove_logs: bool
    ) -> None:
        close_client(client)
        es = self._engine_set(ipp_cluster)
        job_id = getattr(es, "job_id", None) or self.job_id
        if es is not None:
            es.keep_output = not remove_logs
        # ipyparallel's stop runs scancel JOB, then stops the controller
        if not stop_here(ipp_cluster, procs.controller_pids(ipp_cluster)) and job_id:
            _run(["scancel", str(job_id)])
        batch_file = getattr(es, "batch_file", None)
        if batch_file:
            try:
                os.remove(batch_file)
            except OSError:
                pass
        if job_id:
            _wait_job_gone(str(job_id))

    def restart_hint(self) -> str:
        return "%nbtrain start --force --launcher slurm with the same settings (a new job)"


def _wait_job_gone(job_id: str, timeout: float = 30.0) -> None:
    """Wait until Slurm runs nothing of the job any more (cancelled jobs go through COMPLETING)."""
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        found = job_state(job_id)
        if found is None or found[0] in _ENDED:
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


def start(options: StartOptions, lo: LaunchOptions | None, quiet: bool = True) -> Launched:
    """Engines with --launcher slurm; a controller here; the group across them."""
    assert lo is not None
    return start_engines(SlurmLaunch(lo), options, quiet=quiet)
