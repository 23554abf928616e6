"""`%nbtrain check`: every node's host, CPUs, GPUs and versions in one table, the odd ones marked.

In [1]: nbtrain.check()                               # this machine (launcher="local")
In [2]: nbtrain.check(hosts="node1,node2")            # before a start: over SSH, in parallel
In [3]: nbtrain.check(partition="gpu", nodes=2)       # before a start: one srun task per node
In [4]: cluster.check()                               # a running cluster: one engine per host

Each node runs `nbtrain.engine.facts.node_facts()` (in an engine, or as
`python -m nbtrain.engine.facts` before any engine exists). The nodes are compared the way the
start's preflight compares them (`launch.preflight.compare`), plus their GPUs: a value most nodes
do not have is marked, and `CheckResult.advice()` says how to fix it.

Pre-start sources are a registry, `CHECKERS`: launcher name -> a function taking that launcher's
settings as keywords (and `timeout`) and returning one facts dict per node (a node that could not
be asked: `{"hostname": ..., "error": "why"}`). A launcher adds its own in one line, as the Ray
launcher does with `launch.ray.check_nodes` (one Ray task per node, pinned to it, returning
`node_facts()`), plus its options in the `check` subcommand's parser (`nbtrain/magics/check.py`).
"""

from __future__ import annotations

import inspect
import json
import logging
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from nbtrain import net, procs
from nbtrain.cluster.launch import LaunchOptions, preflight
from nbtrain.cluster.launch import ray as ray_launch
from nbtrain.cluster.launch.base import ssh_run
from nbtrain.cluster.launch.preflight import FATAL_MARK, WARN_MARK, Check, Mismatch
from nbtrain.cluster.options import require_commands
from nbtrain.cluster.session import Session
from nbtrain.engine import facts as engine_facts
from nbtrain.errors import ClusterError, ConfigError

log = logging.getLogger(__name__)

PROBE = "nbtrain.engine.facts"  # run as `python -m PROBE` on each node before a start

# what is compared: the preflight's fatal checks and CUDA (same verdicts as a start), and the GPUs
_SHOWN = ("python", "torch", "cuda", "nccl", "nbtrain")
NODE_CHECKS: tuple[Check, ...] = tuple(c for c in preflight.CHECKS if c.key in _SHOWN) + (
    Check("gpus", "GPUs", False, preflight.gpu_summary),
)


def _cpus(r: dict[str, Any]) -> str:
    cpus, usable = r.get("cpus"), r.get("cpus_usable")
    if cpus is None:
        return "-"
    return str(cpus) if usable in (None, cpus) else f"{usable} of {cpus}"


@dataclass
class CheckResult:
    """Every node's facts (`nodes`), what differs between them (`odd`), and the nodes that did not
    answer (`failed`). `str()` is the table and the advice; in a notebook it shows as HTML."""

    nodes: list[dict[str, Any]]  # one facts dict per node, rank 0's (or the first host's) first
    source: str  # "cluster", or the launcher whose checker asked: "local", "ssh", "slurm", ...
    compared: preflight.PreflightResult = field(repr=False)
    failed: dict[str, str] = field(default_factory=dict)  # node -> why it gave no facts

    @property
    def odd(self) -> list[Mismatch]:
        """Each property that differs: its key and label, the expected value, the odd nodes'."""
        return self.compared.mismatches

    @property
    def ok(self) -> bool:
        """True when every node answered and they all agree."""
        return not self.odd and not self.failed

    def advice(self) -> list[str]:
        """One line per odd thing or failed node: what differs where, and the fix."""
        lines = []
        for m in self.odd:
            odd = "; ".join(f"{_value(v)} on {n}" for n, v in m.odd.items())
            where = "elsewhere" if len(m.expected_on) > 1 else f"on {m.expected_on[0]}"
            lines.append(f"{m.label} {odd} but {_value(m.expected)} {where}: {fix(m)}")
        for node, why in self.failed.items():
            lines.append(f"{node}: no answer ({why})")
        return lines

    def table(self) -> str:
        """The nodes as a plain-text table, odd values marked."""
        header, rows = self._rows()
        text = preflight.render_text(header, rows)
        if self.odd:
            text += f"\n{_LEGEND}"
        return text

    def _rows(self) -> tuple[list[str], preflight.Rows]:
        header = ["node", "CPUs"] + [c.label for c in NODE_CHECKS]
        rows: preflight.Rows = []
        for label, r in self.compared.reports.items():
            cells = [(label, ""), (_cpus(r), "")]
            for c in NODE_CHECKS:
                value = (c.shown or c.value)(r)
                m = self.compared.odd_value(label, c.key)
                mark = "" if m is None else FATAL_MARK if m.fatal else WARN_MARK
                cells.append(("-" if value is None else str(value), mark))
            row_mark = "!" if any(mark for _, mark in cells) else ""
            rows.append((row_mark, cells))
        for node in self.failed:
            rows.append(("x", [(node, ""), ("no answer", "")] + [("-", "")] * (len(header) - 2)))
        return header, rows

    def __str__(self) -> str:
        lines = [self.table(), *self.advice()]
        if self.ok:
            many = len(self.nodes) > 1
            lines.append(f"{len(self.nodes)} node(s){' agree' if many else ''}: nothing odd.")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        header, rows = self._rows()
        return preflight.render_html(header, rows, "\n".join(self.advice()), "nbtrain-check")


_LEGEND = (
    f"{FATAL_MARK} differs from the other nodes (%nbtrain start refuses it unless "
    f"{preflight.ALLOW_FLAG}); {WARN_MARK} differs (a warning)"
)


def _value(value: str | None) -> str:
    return "missing" if value is None else str(value)


def fix(m: Mismatch) -> str:
    """What to do about one odd property (the preflight's fix, and one for the GPUs)."""
    if m.key == "gpus":
        nodes = ", ".join(m.odd)
        return (
            f"check the GPUs on {nodes} (nvidia-smi: a GPU missing or failed, or hidden by "
            "CUDA_VISIBLE_DEVICES), or give those nodes their own engine counts"
        )
    return m.fix()


def result_of(facts: Sequence[dict[str, Any]], source: str) -> CheckResult:
    """Compare the facts of the nodes that answered; list the ones that did not."""
    good = [f for f in facts if "error" not in f]
    failed = {str(f.get("hostname", "?")): str(f["error"]) for f in facts if "error" in f}
    compared = preflight.compare(good, checks=NODE_CHECKS)
    return CheckResult(list(good), source, compared, failed)


# -- a running cluster -----------------------------------------------------------------------------


def check_cluster(session: Session, timeout: float = 30.0) -> CheckResult:
    """Every host's facts from one of its engines (the first live rank there), compared."""
    first: dict[str, int] = {}
    for r in session.ranks:
        if r.rank not in session.lost:
            first.setdefault(r.host, r.rank)
    ranks = sorted(first.values())
    facts = session.run(engine_facts.node_facts, ranks=ranks, timeout=timeout)
    return result_of(facts, "cluster")


# -- before a start: one checker per launcher ------------------------------------------------------


def parse_facts(text: str) -> list[dict[str, Any]]:
    """The facts every probe printed in `text` (other lines, such as a login banner, skipped)."""
    return [
        json.loads(line[len(engine_facts.MARKER) :])
        for line in text.splitlines()
        if line.startswith(engine_facts.MARKER)
    ]


def check_local(timeout: float = 60.0) -> list[dict[str, Any]]:
    """This machine's facts, from a probe process (the kernel neither imports torch nor CUDA)."""
    try:
        proc = subprocess.run(
            [sys.executable, "-m", PROBE],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except subprocess.TimeoutExpired:
        msg = f"the probe on this machine ({sys.executable} -m {PROBE}) took over {timeout:g} s."
        raise ClusterError(msg) from None
    found = parse_facts(proc.stdout)
    if not found:
        msg = f"the probe on this machine failed (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
        raise ClusterError(msg)
    return found


def _ssh_failure(spec: net.HostSpec, python: str, proc: subprocess.CompletedProcess) -> str:
    err = proc.stderr.strip().splitlines()
    last = err[-1] if err else f"exit {proc.returncode}"
    if proc.returncode == 255:
        return f"cannot log in over SSH: {last}; make `ssh {spec.location} true` work first"
    if proc.returncode == 127:
        return f"no Python at {python}; pass the Python that has nbtrain there (--python)"
    return f"{python} -m {PROBE} failed: {last}; is nbtrain installed there?"


def check_ssh(
    hosts: Any,
    ssh_args: Any = None,
    remote_python: str | None = None,
    timeout: float = 60.0,
) -> list[dict[str, Any]]:
    """Each host's facts over SSH (the SSH launcher's ssh options), all hosts at once.

    A host that cannot be asked comes back as `{"hostname": host, "error": why}`.
    """
    lo = LaunchOptions(
        launcher="ssh",
        hosts=hosts,
        ssh_args=ssh_args or [],
        remote_python=remote_python or sys.executable,
    )
    cmd = f"{shlex.quote(lo.remote_python)} -m {PROBE}"

    def one(spec: net.HostSpec) -> dict[str, Any]:
        try:
            proc = ssh_run(lo, spec.location, cmd, timeout)
        except subprocess.TimeoutExpired:
            return {"hostname": spec.host, "error": f"no answer over SSH within {timeout:g} s"}
        found = parse_facts(proc.stdout)
        if not found:
            return {"hostname": spec.host, "error": _ssh_failure(spec, lo.remote_python, proc)}
        return found[0]

    specs: list[net.HostSpec] = lo.hosts
    with ThreadPoolExecutor(len(specs)) as pool:
        return list(pool.map(one, specs))


#: what the Slurm check takes of the Slurm launcher's options (as `nbtrain.start` takes them)
SRUN_SETTINGS = ("partition", "nodes", "account", "time", "slurm_args", "remote_python")


def srun_command(**settings: Any) -> list[str]:
    """The `srun` that runs the probe once on each of `nodes` nodes, from `SRUN_SETTINGS` (checked as
    a start's)."""
    unknown = sorted(set(settings) - set(SRUN_SETTINGS))
    if unknown:
        msg = f"{', '.join(unknown)}: not a setting of the slurm check; it takes {', '.join(SRUN_SETTINGS)}."
        raise ConfigError(msg)
    given = {k: v for k, v in settings.items() if v is not None}
    lo = LaunchOptions(launcher="slurm", **given)
    cmd = ["srun", f"--nodes={lo.nodes}", "--ntasks-per-node=1", "--job-name=nbtrain-check"]
    for flag, value in (("partition", lo.partition), ("account", lo.account), ("time", lo.time)):
        if value is not None:
            cmd.append(f"--{flag}={value}")
    return [*cmd, *lo.slurm_args, lo.remote_python, "-m", PROBE]


def check_slurm(timeout: float = 120.0, **settings: Any) -> list[dict[str, Any]]:
    """Each allocated node's facts: one srun task per node (`srun_command`, `SRUN_SETTINGS`),
    waiting `timeout` s for the allocation and the probes."""
    require_commands(("srun",))
    cmd = srun_command(**settings)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # srun gives its allocation back when it ends
        procs.signal_process(proc, signal.SIGTERM)
        proc.communicate(timeout=30)
        msg = (
            f"`{shlex.join(cmd[:-3])}` got no nodes or no answer within {timeout:g} s (the "
            "partition busy? `squeue -p` shows its queue). Give a longer timeout, or another "
            "--partition."
        )
        raise ClusterError(msg) from None
    found = parse_facts(out)
    if proc.returncode != 0 or not found:
        msg = (
            f"`{shlex.join(cmd)}` failed (exit {proc.returncode}): {err.strip()[-800:]}. Check the "
            "partition and node count with `sinfo -s`."
        )
        raise ClusterError(msg)
    return sorted(found, key=lambda f: str(f.get("hostname")))


# the registry: launcher name -> its pre-start checker (see the module docstring)
CHECKERS: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "local": check_local,
    "ssh": check_ssh,
    "slurm": check_slurm,
    "ray": ray_launch.check_nodes,
}


def check_settings() -> dict[str, tuple[str, ...]]:
    """Launcher -> the settings its pre-start check takes (names of the launcher's declared options)."""
    out: dict[str, tuple[str, ...]] = {}
    for launcher, checker in CHECKERS.items():
        if launcher == "slurm":
            out[launcher] = SRUN_SETTINGS
        else:
            out[launcher] = tuple(
                p for p in inspect.signature(checker).parameters if p != "timeout"
            )
    return out


def check(
    launcher: str | None = None, timeout: float | None = None, **settings: Any
) -> CheckResult:
    """Check nodes before a start: this machine, `hosts` over SSH, or a Slurm `partition`.

    In [1]: print(nbtrain.check(hosts="node1,node2"))
    In [2]: nbtrain.check(launcher="slurm", partition="gpu", nodes=4).odd

    The launcher defaults to "ray" with `address`, "ssh" with `hosts`, "slurm" with `partition`
    or `nodes`, else "local". Settings are the launcher's (as `nbtrain.start` takes them): hosts,
    ssh_args, remote_python; partition, nodes, account, time, slurm_args; address (auto, local,
    ray://head:10001: each alive Ray node, through a Ray task pinned to it). Twin of `%nbtrain check --hosts ...`; a running
    cluster checks itself with `cluster.check()`.
    """
    given = {k: v for k, v in settings.items() if v is not None}
    if launcher is None:
        launcher = (
            "ray"
            if "address" in given
            else "ssh"
            if "hosts" in given
            else "slurm"
            if {"partition", "nodes"} & set(given)
            else "local"
        )
    checker = CHECKERS.get(launcher)
    if checker is None:
        msg = (
            f"no check before a start for launcher {launcher!r}; choose one of "
            f"{', '.join(CHECKERS)}, or start the cluster and run %nbtrain check on it."
        )
        raise ConfigError(msg)
    takes = (
        set(SRUN_SETTINGS) if launcher == "slurm" else set(inspect.signature(checker).parameters)
    )
    takes -= {"timeout"}
    unknown = sorted(set(given) - takes)
    if unknown:
        msg = (
            f"{', '.join(unknown)}: not a setting of the {launcher} check; it takes "
            f"{', '.join(sorted(takes)) or 'none'}."
        )
        raise ConfigError(msg)
    if timeout is not None:
        given["timeout"] = timeout
    return result_of(checker(**given), launcher)
