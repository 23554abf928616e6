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
import subprocess
import time
from collections.abc import Callable
from typing import Any

from ipyparallel.cluster.launcher import SlurmEngineSetLauncher

from nbtrain import net, procs
from nbtrain.cluster.launch import LaunchOptions
from nbtrain.cluster.launch.base import NETWORK, PYTHON, EngineLaunch, start_engines, stop_here
from nbtrain.cluster.launch.slurm_jobs import (
    ENDED,
    expand_nodes,
    job_state,
    pending_hint,
    run,
    slurm_env,
    submit_hint,
    wait_job_gone,
)
from nbtrain.cluster.options import (
    Option,
    StartOptions,
    check_time,
    engines_per_node,
    require_commands,
)
from nbtrain.cluster.session import Launched, close_client
from nbtrain.errors import ClusterError, ConfigError

log = logging.getLogger(__name__)

_NAME = re.compile(r"[A-Za-z0-9_.+-]+(?:,[A-Za-z0-9_.+-]+)*")


def _slurm_name(flag: str) -> Any:
    def check(value: str) -> str:
        if not _NAME.fullmatch(value):
            msg = (
                f"{flag} {value!r} is not a Slurm name (letters, digits, _ . + -; a comma-separated "
                f"list for several partitions). `sinfo -s` lists the partitions, "
                "`sacctmgr show assoc user=$USER` your accounts."
            )
            raise ConfigError(msg)
        return value

    return check


def _sbatch_lines(args: list[str]) -> list[str]:
    for arg in args:
        if not arg.startswith("-") or "\n" in arg:
            msg = (
                f"--slurm-args {arg!r}: each one is an sbatch option such as --qos=high or "
                "--constraint=a100, written as `--option=value`."
            )
            raise ConfigError(msg)
    return args


#: what --launcher slurm does, in --launcher's help
SUMMARY = "as one sbatch job"
OPTIONS = (
    Option(
        "nodes",
        "nodes to allocate (default 1)",
        kind="count",
        default=1,
        example="2",
        metavar="N",
        label="Nodes",
    ),
    Option(
        "gpus_per_node",
        "GPUs per node (sbatch --gpus-per-node); one engine per GPU",
        kind="count0",
        example="4",
        metavar="G",
        default_doc="none (CPU nodes)",
        label="GPUs per node",
        placeholder="none (CPU nodes)",
    ),
    Option(
        "engines_per_node",
        "engines (Slurm tasks) per node (default: --gpus-per-node, or 1 on CPU nodes)",
        kind="count",
        example="2",
        metavar="E",
        default_doc="G, or 1 on CPU nodes",
        label="Engines per node",
        placeholder="one per GPU, else 1",
    ),
    Option(
        "partition",
        "partition (default: the cluster's default)",
        metavar="P",
        default_doc="the cluster's default",
        label="Partition",
        placeholder="the default partition",
        check=_slurm_name("--partition"),
    ),
    Option(
        "account",
        "account to charge the job to",
        metavar="A",
        default_doc="your default",
        label="Account",
        placeholder="your default account",
        check=_slurm_name("--account"),
    ),
    Option(
        "time",
        "time limit: 90 (minutes), 02:00:00, 1-12:00:00",
        metavar="T",
        default_doc="the partition's default",
        label="Time limit",
        placeholder="the partition's default, e.g. 02:00:00",
        check=check_time,
    ),
    Option(
        "slurm_args",
        'more sbatch options, e.g. "--qos=high --constraint=a100"',
        kind="args",
        default=[],
        metavar="ARGS",
        doc='more sbatch options, each becomes an `#SBATCH` line: `"--qos=high --constraint=a100"`',
        label="Extra sbatch lines",
        placeholder="--qos=high\n--constraint=a100",
        check=_sbatch_lines,
    ),
    *NETWORK,
    PYTHON,
)
HINT = "give --nodes and --gpus-per-node (or --engines-per-node)"


def validate(lo: LaunchOptions) -> None:
    """No more engines per node than GPUs; Slurm's commands are here."""
    if lo.gpus_per_node and lo.engines_per_node and lo.engines_per_node > lo.gpus_per_node:
        msg = (
            f"--engines-per-node {lo.engines_per_node} is more than --gpus-per-node "
            f"{lo.gpus_per_node}; NCCL needs one GPU per engine. Leave --engines-per-node out (one "
            "engine per GPU), or use --backend gloo with no --gpus-per-node."
        )
        raise ConfigError(msg)
    require_commands()


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
        env = slurm_env(kwargs.pop("env", None))
        log.debug("slurm: %s", shlex.join(command))
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
            msg = f"{command[0]} refused: {said}.{submit_hint(said)} Nothing was left running."
            raise ClusterError(msg)
        return proc.stdout


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
            out = run(cmd, timeout=15).stdout
        except subprocess.TimeoutExpired:
            out = ""
        addrs = list(dict.fromkeys(ln.split()[-1] for ln in out.splitlines() if ln.split()))[:8]
        if not addrs and self.lo.partition:
            known = run(["sinfo", "-h", "-o", "%R"], timeout=15).stdout.split()
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
        if found is None or found[0] in ENDED:
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
                + pending_hint(found[1], self.lo)
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
            # the message below names the short nodes without the engines' own answer
            log.debug("the registered engines did not say their nodes", exc_info=True)
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
            run(["scancel", str(job_id)])
        batch_file = getattr(es, "batch_file", None)
        if batch_file:
            try:
                os.remove(batch_file)
            except OSError:
                pass
        if job_id:
            wait_job_gone(str(job_id))

    def restart_hint(self) -> str:
        return "%nbtrain start --force --launcher slurm with the same settings (a new job)"


def start(options: StartOptions, lo: LaunchOptions | None, quiet: bool = True) -> Launched:
    """Engines with --launcher slurm; a controller here; the group across them."""
    assert lo is not None
    return start_engines(SlurmLaunch(lo), options, quiet=quiet)
