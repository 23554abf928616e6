"""%nbtrain start and stop with no cluster of this module's running: the message before a start, a
start that times out, --force, a comment after the options. Apart from tests/magics/test_magics.py,
whose tests share one running cluster: run among them in a random order, these stopped it under the
tests after them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nbtrain.errors import ClusterError, NoClusterError
from tests.conftest import cluster_processes, wait_gone

pytestmark = pytest.mark.timeout(180)


def test_distributed_before_start_says_what_to_run(ip):
    import nbtrain

    if nbtrain.current_cluster() is not None:
        nbtrain.current_cluster().stop()
    with pytest.raises(NoClusterError, match="%nbtrain start"):
        ip.run_cell_magic("distributed", "", "print(1)")


def test_gang_start_timeout_leaves_nothing(ip):
    import nbtrain

    if nbtrain.current_cluster() is not None:
        nbtrain.current_cluster().stop()
    before = {p.pid for p in cluster_processes()}
    with pytest.raises(ClusterError, match="within --timeout 0.5 s.*Nothing was left running"):
        ip.run_line_magic("nbtrain", "start -n 2 --timeout 0.5")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and {p.pid for p in cluster_processes()} - before:
        time.sleep(0.2)
    assert {p.pid for p in cluster_processes()} - before == set()
    assert nbtrain.current_cluster() is None


def test_force_replaces_and_stop_leaves_nothing(ip):
    import nbtrain

    first = nbtrain.start(n=1)
    first_pids = list(first._pids)
    second = nbtrain.start(n=1, force=True)
    assert first.stopped and nbtrain.current_cluster() is second
    assert wait_gone(first_pids) == []
    pids = list(second._pids)
    cid = second.cluster_id
    # the hub's engine-state file, which ipyparallel itself never removes
    state = Path(second.ipp_cluster.profile_dir) / "log" / f"engines{cid}.json"
    assert state.is_file()
    # the FileStore the ranks met through (a local cluster's rendezvous, in the security folder)
    [store] = {Path(p) for p in second.run(lambda: __import__("os").environ["NBTRAIN_STORE_FILE"])}
    assert store.parent.name == "security" and store.is_file()
    ip.run_line_magic("nbtrain", "stop")
    assert wait_gone(pids) == []
    assert cluster_processes(cid) == []
    assert not state.exists()
    assert not store.exists(), "stop left the group's store file"


def test_a_comment_after_the_options_is_ignored(ip, capsys):
    # `%nbtrain start -n 2  # two ranks` in a notebook: the comment is the user's, not an option
    import nbtrain

    if nbtrain.current_cluster() is not None:
        nbtrain.current_cluster().stop()
    ip.run_line_magic("nbtrain", "stop  # nothing is running yet")
    assert "no cluster is running" in capsys.readouterr().out
    with pytest.raises(Exception, match="no nbtrain cluster is running"):
        ip.run_cell_magic("distributed", "--output all  # every rank's output", "print(1)")
