"""Start JupyterLab for the UI tests, with a fixture runs registry and a real ipyparallel cluster.

Playwright's ``webServer`` runs this (see labextension/playwright.config.ts). Everything lives under
``$NBTRAIN_UI_DIR`` (default ``tests/_artifacts/ui``), recreated on each start:

- ``home/``: ``NBTRAIN_HOME``, the runs registry, holding the finished fixture run
  ``tests/fixtures/runs/finished-sft`` (copied to ``runs/``), a scaling report linked to it, and a
  two-rank run whose rows carry GPU memory and MFU (see tests/ui/fixtures.py);
- ``ipython/``: ``IPYTHONDIR``, where a one-engine ipyparallel cluster is started, with an nbtrain
  side file, so the sidebar has a cluster to list;
- ``root/``: the server's root folder.

SIGTERM (Playwright's shutdown) stops JupyterLab and the cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "runs" / "finished-sft"


def main() -> int:
    base = Path(os.environ.get("NBTRAIN_UI_DIR", REPO / "tests" / "_artifacts" / "ui")).resolve()
    port = os.environ.get("NBTRAIN_UI_PORT", "8897")
    token = os.environ.get("NBTRAIN_UI_TOKEN", "nbtrain-ui-test")
    for sub in ("home", "ipython", "root", "runs", "runtime", "workspaces", "settings"):
        shutil.rmtree(base / sub, ignore_errors=True)
        (base / sub).mkdir(parents=True)
    os.environ["NBTRAIN_HOME"] = str(base / "home")
    os.environ["IPYTHONDIR"] = str(base / "ipython")
    os.environ["JUPYTER_RUNTIME_DIR"] = str(base / "runtime")

    from nbtrain import runs

    out = base / "runs" / "finished-sft"
    shutil.copytree(FIXTURE, out)
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    run_id = runs.register_run(out, name="finished-sft", total_steps=200)
    runs.update_run(run_id, step=last["step"], loss=last["loss"], tokens_per_s=last["tokens_per_s"])
    runs.finish_run(run_id, "done")
    sys.path.insert(0, str(REPO))
    from tests.ui.fixtures import dpo_run, gpu_run, grpo_run, scaling_report, sweep_runs

    scaling_report(base / "runs" / "scaling-report", run_dir=out, name="scaling 1-4 nodes")
    gpu_run(base / "runs" / "gpu-sft")
    # issue 38: runs of each kind, and a sweep whose settings differ widely, for the charts' tests
    dpo_run(base / "runs" / "dpo-prefs")
    grpo_run(base / "runs" / "grpo-math")
    sweep_runs(base / "runs")

    import ipyparallel as ipp

    profile_dir = base / "ipython" / "profile_default"
    cluster = ipp.Cluster(n=1, profile_dir=str(profile_dir), cluster_id="ui-test", log_level=40)
    cluster.start_cluster_sync()
    host = socket.gethostname()
    side = {
        "cluster_id": "ui-test",
        "profile_dir": str(profile_dir),
        "state": "ready",
        "backend": "gloo",
        "world_size": 1,
        "hosts": [host],
        "ranks": [{"rank": 0, "host": host, "local_rank": 0, "device": "cpu", "pid": os.getpid()}],
        "notebook": "ui-test.ipynb",
        "started": time.time(),
    }
    (profile_dir / "security" / "nbtrain-ui-test.json").write_text(json.dumps(side))

    # no "get notified about Jupyter news?" toast over the screenshots
    notification = base / "settings" / "@jupyterlab" / "apputils-extension"
    notification.mkdir(parents=True)
    (notification / "notification.jupyterlab-settings").write_text('{"fetchNews": "false"}')

    lab = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            f"--port={port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={token}",
            f"--ServerApp.root_dir={base / 'root'}",
            "--ServerApp.log_level=WARN",
            # a fresh layout each time: no panels restored from an earlier test run
            f"--LabApp.workspaces_dir={base / 'workspaces'}",
            f"--LabApp.user_settings_dir={base / 'settings'}",
            "--LabApp.news_url=",
            "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            *(["--allow-root"] if os.geteuid() == 0 else []),
        ]
    )

    def shutdown(signum: int, frame: object) -> None:
        lab.terminate()

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    try:
        code = lab.wait()
    finally:
        if lab.poll() is None:
            lab.kill()
        cluster.stop_cluster_sync()
    return code


if __name__ == "__main__":
    sys.exit(main())
