"""nbtrain's engine entry point against a real ipyparallel controller: a stop is a quiet, clean exit."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


def test_sigterm_stops_an_engine_without_a_traceback(tmp_path):
    import ipyparallel as ipp

    cluster = ipp.Cluster(
        n=0, profile_dir=str(tmp_path / "profile"), cluster_id="boot", log_level=40
    )
    cluster.start_controller_sync()
    try:
        client = cluster.connect_client_sync()
        # how ipyparallel's launchers start an engine (SSH, Slurm and MPI alike), with our entry point
        engine = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nbtrain.engine.boot",
                f"--profile-dir={cluster.profile_dir}",
                f"--cluster-id={cluster.cluster_id}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        client.wait_for_engines(1, timeout=60, interactive=False)
        assert client[:].apply_sync(lambda: 6 * 7) == [42]
        engine.send_signal(signal.SIGTERM)  # what stop sends to an engine
        out, _ = engine.communicate(timeout=30)
        client.close()
    finally:
        cluster.stop_cluster_sync()
    # ipyparallel's own engine ends a SIGTERM with tornado's "Event loop stopped before Future
    # completed" traceback, which then fills every engine log and job output on each stop
    assert "Traceback" not in out, out
    assert engine.returncode == 0, out
    assert "received signal 15, stopping" in out  # it did stop through the signal handler
