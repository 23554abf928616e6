"""The per-user registry of training runs: what the JupyterLab sidebar lists and may stop.

Each `finetune` registers its `output_dir` here (rank 0 only). A run is one small JSON file,
``<registry>/<run_id>.json``, rewritten atomically; a stop request is the file ``<run_id>.stop``,
which `finetune` checks at step boundaries. The registry lives in ``$NBTRAIN_HOME/runs``
(default ``~/.local/share/nbtrain/runs``, or under ``$XDG_DATA_HOME``).

The server reads only folders registered here: a run's metrics are ``<output_dir>/metrics.jsonl``;
a record with a ``scaling`` folder (a scaling report, see `record_scaling`) also has its
``scaling.json`` and ``scaling.png`` read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from nbtrain import atomic

log = logging.getLogger(__name__)

#: how a run ends: "stopped" on a stop request, "preempted" by SIGTERM/SIGUSR1 (with a checkpoint)
STATES = ("running", "done", "failed", "stopped", "preempted")

#: what a training run's record says it trained ("finetune" in records written before kinds);
#: "tinker" is a model trained through the Tinker service (`nbtrain.serve_tinker`)
RUN_KINDS = ("sft", "dpo", "grpo", "tinker")
#: what a scaling report's record says it is (`record_scaling`)
SCALING_KIND = "scaling"
#: the unit of a kind's `loss` where it has a true one, as the run panel, compare and the notebook
#: plot title its axis: SFT's is the mean token cross-entropy; DPO's (a mean over pairs of a
#: log-sigmoid) and GRPO's (a policy objective) have none, and their axes say "loss"
LOSS_UNITS = {"sft": "nats/token"}


def loss_unit(kind: str | None) -> str:
    """The y axis title of a run's loss: "nats/token" for SFT (and records from before kinds),
    "loss" for the kinds whose loss has no unit."""
    if kind in (None, "finetune"):
        kind = "sft"
    return LOSS_UNITS.get(kind, "loss")


# the files of a run folder (a finetune's output_dir) that more than one side reads
#: the run's settings, the SFTConfig as a dict (written at the start and into every checkpoint)
CONFIG_FILE = "sft_config.json"
#: one JSON row per logged step, appended by rank 0
METRICS_FILE = "metrics.jsonl"
#: completions sampled during training (`SFTConfig.sample_prompts`), one JSON row per prompt and step,
#: appended by rank 0: {"step", "index", "prompt", "completion", "reference", "tokens", "seconds"}
SAMPLES_FILE = "samples.jsonl"
#: the MLflow run a resume continues (`nbtrain.telemetry.tracking`), {"run_id", "tracking_uri"}
MLFLOW_RUN_FILE = "mlflow_run.json"
#: the exported PEFT adapter's folder and the merged model's (`nbtrain.model.checkpoint`), read by
#: `generate` and by run comparison
ADAPTER_DIR = "adapter"
MERGED_DIR = "merged"
#: PEFT's names for an adapter folder's two files (its settings, its LoRA tensors), which nbtrain
#: writes and reads in checkpoints, exports, the Tinker service's saves and the vLLM process
ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
#: a scaling report's files (`nbtrain.cluster.scaling.report`); the Jupyter server reads the last two
SCALING_MD, SCALING_JSON, SCALING_PNG = "scaling.md", "scaling.json", "scaling.png"


# the files of an ipyparallel profile's security/ folder that nbtrain writes or reads
def cluster_file_name(cluster_id: str) -> str:
    """The name of a cluster's side file (nbtrain's record of it: rank table, backend, the attached
    kernel), which `nbtrain.cluster.registry` writes beside ipyparallel's own cluster file and the
    Jupyter server reads; `cluster_file_name("*")` is a glob of them all."""
    return f"nbtrain-{cluster_id}.json"


def cluster_side_file(profile_dir: str | os.PathLike[str], cluster_id: str) -> Path:
    """``<profile_dir>/security/nbtrain-<cluster_id>.json``: the side file of cluster `cluster_id`."""
    return Path(profile_dir) / "security" / cluster_file_name(cluster_id)


def ipp_cluster_file_name(cluster_id: str) -> str:
    """ipyparallel's own cluster file, beside the side file (its controller's pid and state)."""
    return f"cluster-{cluster_id}.json"


def nbtrain_home() -> Path:
    """This user's nbtrain folder: $NBTRAIN_HOME, else $XDG_DATA_HOME/nbtrain (~/.local/share/nbtrain)."""
    home = os.environ.get("NBTRAIN_HOME")
    if home:
        return Path(home)
    data = os.environ.get("XDG_DATA_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "share"
    )
    return Path(data) / "nbtrain"


def registry_dir() -> Path:
    """The folder holding this user's run records (created on first use)."""
    path = nbtrain_home() / "runs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def run_id_for(output_dir: str | os.PathLike[str]) -> str:
    """A stable id for a run folder: resuming into the same folder keeps the same run."""
    resolved = str(Path(output_dir).expanduser().resolve())
    return hashlib.sha1(resolved.encode()).hexdigest()[:12]


def get_run(run_id: str) -> dict[str, Any] | None:
    """The record of one run, or None when no such run is registered."""
    if not run_id.isalnum():
        return None
    path = registry_dir() / f"{run_id}.json"
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def list_runs() -> list[dict[str, Any]]:
    """Every registered run, newest first."""
    runs = []
    for path in registry_dir().glob("*.json"):
        try:
            runs.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue
    runs.sort(key=lambda r: r.get("started") or 0, reverse=True)
    return runs


def register_run(
    output_dir: str | os.PathLike[str],
    *,
    name: str | None = None,
    total_steps: int | None = None,
    cluster_id: str | None = None,
    world_size: int = 1,
    kind: str = "sft",
) -> str:
    """Record a run as running and return its id; clears any stale stop request.

    `kind` is what it trains: one of `RUN_KINDS` (its loss's unit is `loss_unit(kind)`)."""
    if kind not in RUN_KINDS:
        msg = f"run kind {kind!r}: a training run is one of {', '.join(RUN_KINDS)}"
        raise ValueError(msg)
    out = Path(output_dir).expanduser().resolve()
    record = _new_record(
        out,
        name=name,
        kind=kind,
        total_steps=total_steps,
        cluster_id=cluster_id,
        world_size=world_size,
    )
    clear_stop(record["id"])
    atomic.write_json(registry_dir() / f"{record['id']}.json", record, sort_keys=True)
    return record["id"]


def _new_record(
    out: Path,
    *,
    name: str | None,
    kind: str,
    total_steps: int | None = None,
    cluster_id: str | None = None,
    world_size: int = 1,
) -> dict[str, Any]:
    return {
        "id": run_id_for(out),
        "kind": kind,
        "name": name or out.name,
        "output_dir": str(out),
        "state": "running",
        "step": 0,
        "total_steps": total_steps,
        "loss": None,
        "tokens_per_s": None,
        "started": time.time(),
        "ended": None,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "cluster_id": cluster_id,
        "world_size": world_size,
    }


#: a "running" record whose process this machine cannot check (it ran on another host) is taken for
#: dead once neither it nor its metrics changed for this long: a live run rewrites its record at
#: every logged step
STALE_AFTER_S = 3600.0


def _last_sign(record: dict[str, Any]) -> float:
    """When the run last wrote: its record (rewritten at every logged step) or its metrics file."""
    times = [record.get("started") or 0.0]
    paths = [registry_dir() / f"{record.get('id')}.json"]
    if record.get("output_dir"):
        paths.append(Path(record["output_dir"]) / METRICS_FILE)
    for path in paths:
        try:
            times.append(path.stat().st_mtime)
        except OSError:
            continue
    return max(times)


def liveness(record: dict[str, Any]) -> tuple[bool, str]:
    """Whether a run's process still runs, and why this says so.

    A record stays "running" when its process died without a word (a killed kernel, a rebooted
    machine). On the host that ran it, the recorded pid decides: gone, or now a process that began
    after the run (a pid reused after a reboot), is dead. On another host, a record unchanged for
    `STALE_AFTER_S` is dead. Only a "running" record can be live."""
    state = record.get("state")
    if state != "running":
        return False, f"it is {state}"
    host, pid = record.get("host"), record.get("pid")
    if host == socket.gethostname() and isinstance(pid, int):
        import psutil

        try:
            proc = psutil.Process(pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False, f"its process {pid} on {host} has exited"
            # one second of slack: create_time and the record's start are both rounded clocks
            if proc.create_time() > (record.get("started") or 0.0) + 1.0:
                return False, f"its process {pid} on {host} is gone (the pid is another's now)"
            return True, f"its process {pid} on {host} runs"
        except psutil.NoSuchProcess:
            return False, f"its process {pid} on {host} is gone"
        except psutil.Error:
            pass  # not ours to inspect: fall back on its last write
    quiet = time.time() - _last_sign(record)
    if quiet > STALE_AFTER_S:
        return False, f"it ran on {host} and wrote nothing for {quiet / 60:.0f} min"
    return True, f"it ran on {host} and wrote {quiet:.0f} s ago"


def update_run(run_id: str, **fields: Any) -> None:
    """Merge `fields` (step, loss, tokens_per_s, ...) into a run's record."""
    record = get_run(run_id)
    if record is None:
        return
    record.update(fields)
    atomic.write_json(registry_dir() / f"{run_id}.json", record, sort_keys=True)


def finish_run(run_id: str, state: str, **fields: Any) -> None:
    """Mark a run done, failed, stopped or preempted, with its end time and `fields` (a preempted
    run's `step` and `checkpoint`)."""
    if state not in STATES:
        msg = f"unknown run state {state!r}; expected one of {', '.join(STATES)}"
        raise ValueError(msg)
    update_run(run_id, **fields, state=state, ended=time.time())
    clear_stop(run_id)


def record_scaling(
    out: str | os.PathLike[str], *, name: str, run_dir: str | os.PathLike[str] | None = None
) -> str:
    """List a saved scaling report in the sidebar and link it from the run it measured.

    `out` (the folder holding scaling.json and scaling.png) becomes a finished record of kind
    "scaling", so the report is listed even when the config's own run never ran; when `run_dir` (the
    config's output_dir) is a registered run, that run's record points at the report too. Returns
    the id of the scaling record.
    """
    folder = str(Path(out).expanduser().resolve())
    linked = run_id_for(run_dir) if run_dir is not None else None
    if linked is not None and get_run(linked) is not None:
        update_run(linked, scaling=folder)
    scaling_id = run_id_for(folder)
    if scaling_id == linked and get_run(linked) is not None:
        # the report was saved into the run's own folder: that run's record already links it
        return scaling_id
    record = _new_record(Path(folder), name=name, kind=SCALING_KIND)
    # written finished in one go: the sidebar never sees a scaling report "running"
    measured = str(Path(run_dir).expanduser().resolve()) if run_dir is not None else None
    record.update(state="done", ended=record["started"], scaling=folder, measured=measured)
    atomic.write_json(registry_dir() / f"{scaling_id}.json", record, sort_keys=True)
    return scaling_id


def forget_run(run_id: str) -> None:
    """Remove a run's record and any stop request (a scratch run whose folder is gone, such as a
    scaling size's, or a record the Lab's sidebar deletes); the run folder itself stays."""
    if not run_id.isalnum():
        return
    for name in (f"{run_id}.json", f"{run_id}.stop"):
        (registry_dir() / name).unlink(missing_ok=True)


def request_stop(run_id: str) -> bool:
    """Ask a running run to checkpoint and end at its next step; False if no such run is running."""
    record = get_run(run_id)
    if record is None or record.get("state") != "running":
        return False
    atomic.write_text(registry_dir() / f"{run_id}.stop", str(time.time()))
    return True


def stop_requested(run_id: str) -> bool:
    """True once someone asked this run to stop."""
    return (registry_dir() / f"{run_id}.stop").exists()


def clear_stop(run_id: str) -> None:
    try:
        (registry_dir() / f"{run_id}.stop").unlink()
    except FileNotFoundError:
        pass
