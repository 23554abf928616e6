"""A kernel that dies leaves its cluster and job running; a new kernel attaches; an orphan stops itself.

The first kernel is a real separate Python process that starts the cluster (and a finetune) and then is
SIGKILLed, as a crashed notebook kernel would be.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nbtrain.data.examples import instructions_path
from nbtrain.model.tiny import make_tiny_model
from tests.conftest import wait_gone

pytestmark = pytest.mark.timeout(240)


def _cluster_pids(cluster_id: str) -> list[int]:
    """Controller and engine pids of a cluster, from ipyparallel's cluster file (cmdlines do not name it)."""
    from nbtrain.cluster.attach import _profile_dir

    data = json.loads(
        (_profile_dir("nbtrain") / "security" / f"cluster-{cluster_id}.json").read_text()
    )
    pids = [data["controller"]["state"]["pid"]]
    for engine_set in data["engines"]["sets"].values():
        pids += [int(e["pid"]) for e in engine_set["engines"].values()]
    return pids


def _alive(pids: list[int]) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def _doomed_kernel(script: str, env: dict[str, str], ready: Path, timeout: float = 120) -> str:
    """Run `script` in a child Python, wait for it to write `ready`, then SIGKILL it; return its output."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script)],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + timeout
    while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    assert ready.exists(), out
    return ready.read_text()


def test_kernel_death_job_goes_on_and_attach_follows_it(tmp_path, ip, capfd):
    import nbtrain

    if nbtrain.current_cluster() is not None:
        nbtrain.current_cluster().stop()
    model = make_tiny_model(tmp_path / "tiny")
    out = tmp_path / "run"
    cfg = dict(
        model=str(model),
        data=instructions_path(),
        output_dir=str(out),
        max_steps=30,
        per_device_train_batch_size=2,
        learning_rate=5e-3,
        logging_steps=1,
        save_steps=10,
        max_length=64,
        seed=7,
    )
    ready = tmp_path / "ready"
    script = f"""
        import json, time, pathlib, nbtrain
        cluster = nbtrain.start(n=2)
        cluster.push({{"cfg": {cfg!r}}})
        # slow steps down so the job is still running when this kernel dies
        cluster.view().execute(
            "import time, nbtrain, nbtrain.recipes.step as T\\n"
            "_o = T.loss_sum\\n"
            "T.loss_sum = lambda *a, **k: (time.sleep(0.25), _o(*a, **k))[1]\\n"
            "result = nbtrain.finetune(nbtrain.SFTConfig(**cfg))", block=False)
        m = pathlib.Path({str(out / "metrics.jsonl")!r})
        while not (m.exists() and len(m.read_text().splitlines()) >= 3):
            time.sleep(0.1)
        pathlib.Path({str(ready)!r}).write_text(cluster.cluster_id)
        time.sleep(600)
    """
    # a 2 s idle limit: the watchdog must see the orphaned job as busy, then the attached kernel
    cluster_id = _doomed_kernel(script, {"NBTRAIN_IDLE_TIMEOUT": "2"}, ready)
    steps_at_death = len((out / "metrics.jsonl").read_text().splitlines())
    time.sleep(2.0)
    # the job went on without its kernel
    assert len((out / "metrics.jsonl").read_text().splitlines()) > steps_at_death
    # a new kernel (this process) attaches, by magic
    ip.run_line_magic("nbtrain", f"attach {cluster_id} --no-live")
    cluster = nbtrain.current_cluster()
    assert cluster is not None and cluster.cluster_id == cluster_id and cluster.world_size == 2
    # and by its Python twin, at the top of the package
    attached = nbtrain.attach(cluster_id, follow=False)
    assert attached.run is not None and attached.run["output_dir"] == str(out)
    rows = attached.follow(timeout=120, live=False)
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 31))
    assert rows and rows[-1]["step"] == 30
    # the attached cluster is fully usable: cells, and stop leaves nothing
    assert cluster.run(lambda: __import__("os").environ["RANK"]) == ["0", "1"]
    pids = _cluster_pids(cluster_id)
    assert len(_alive(pids)) == 3  # controller and two engines
    capfd.readouterr()
    ip.run_line_magic("nbtrain", "stop")
    out, err = capfd.readouterr()
    # nbtrain's own line, not ipyparallel's log of the attached cluster ("Stopping engine(s): ...")
    assert "cluster stopped" in out and "Stopping" not in out + err, out + err
    assert wait_gone(pids) == []


def test_orphaned_idle_cluster_stops_itself(tmp_path):
    ready = tmp_path / "ready"
    script = f"""
        import pathlib, time, nbtrain
        cluster = nbtrain.start(n=1)
        pathlib.Path({str(ready)!r}).write_text(cluster.cluster_id)
        time.sleep(600)
    """
    t0 = time.monotonic()
    cluster_id = _doomed_kernel(script, {"NBTRAIN_IDLE_TIMEOUT": "4"}, ready)
    killed_at = time.monotonic()
    pids = _cluster_pids(cluster_id)
    assert len(_alive(pids)) == 2, "the cluster must outlive its kernel"
    deadline = time.monotonic() + 40
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    gone_after = time.monotonic() - killed_at
    assert _alive(pids) == [], "the idle orphan cluster did not stop itself"
    assert gone_after > 3.0  # not before its idle timeout
    print(
        f"idle orphan stopped {gone_after:.1f} s after its kernel died (timeout 4 s); start took {killed_at - t0:.1f} s"
    )
    from nbtrain.cluster.attach import _profile_dir, find_clusters

    assert cluster_id not in [s["cluster_id"] for s in find_clusters()]
    # and it leaves no files behind: the side file, and the hub's engine-state file
    profile = _profile_dir("nbtrain")
    files = [profile / "security" / f"nbtrain-{cluster_id}.json"]
    files.append(profile / "log" / f"engines{cluster_id}.json")
    deadline = time.monotonic() + 10
    while any(f.exists() for f in files) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [f for f in files if f.exists()] == []


def test_follow_shows_the_samples_beside_the_metrics(tmp_path, capsys):
    # a finished run's folder, as sampling while training leaves it: its rows and samples replayed
    from nbtrain.cluster.attach import follow_run

    rows = [{"step": s, "loss": 2.0 / s} for s in (1, 2)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    samples = [
        {"step": 0, "index": 0, "prompt": "2+2=", "completion": "22"},
        {"step": 0, "index": 1, "prompt": "3+3=", "completion": "33"},
        {"step": 2, "index": 0, "prompt": "2+2=", "completion": "4"},
    ]
    # the last line half written, as a run being sampled leaves it: not shown yet
    text = "".join(json.dumps(r) + "\n" for r in samples) + '{"step": 2, "ind'
    (tmp_path / "samples.jsonl").write_text(text)
    run = {"id": "not-registered", "output_dir": str(tmp_path), "total_steps": 2}
    assert follow_run(run, live=False, poll=0.01) == rows
    out = capsys.readouterr().out
    assert "step 2/2 | loss 1.0000" in out
    assert "sample at step 0 [1]: '3+3=' -> '33'" in out
    assert "sample at step 2 [0]: '2+2=' -> '4'" in out
    assert out.count("sample at step") == 3
