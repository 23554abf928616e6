"""A local cluster is reachable from this machine only, its connection files are private, messages signed."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import psutil
import pytest

import nbtrain

pytestmark = pytest.mark.timeout(120)
LOOPBACK = {"127.0.0.1", "::1"}


@pytest.fixture(scope="module")
def cluster():
    c = nbtrain.start(n=2, force=True)
    yield c
    c.stop()


def _listening(pid: int) -> list[tuple[int, str, int]]:
    out = []
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        out += [(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def test_everything_listens_on_loopback_only(cluster):
    # the process group must exist and have run a collective: the store and gloo pairs are up
    assert cluster.run(lambda: __import__("torch.distributed").distributed.get_world_size()) == [
        2,
        2,
    ]
    controller = cluster.ipp_cluster.controller.pid
    sockets = {"controller": _listening(controller)}
    for r in cluster.ranks:
        sockets[f"rank {r.rank}"] = _listening(r.pid)
    assert sockets["controller"], "the controller listens somewhere"
    assert all(sockets[f"rank {r.rank}"] for r in cluster.ranks)
    wide = {who: s for who, s in sockets.items() if any(ip not in LOOPBACK for _, ip, _ in s)}
    assert wide == {}, f"listening beyond loopback: {wide}"
    # torch's TCPStore would listen on every interface: a local cluster uses a file store instead
    env = cluster.run(
        lambda: {
            k: __import__("os").environ.get(k) for k in ("NBTRAIN_STORE_FILE", "GLOO_SOCKET_IFNAME")
        }
    )
    assert env[0]["GLOO_SOCKET_IFNAME"] == "lo"
    assert env[0]["NBTRAIN_STORE_FILE"].startswith(
        str(Path(cluster.ipp_cluster.profile_dir) / "security")
    )


def test_connection_files_private_and_messages_signed(cluster):
    sec = Path(cluster.ipp_cluster.profile_dir) / "security"
    assert stat.S_IMODE(os.stat(sec).st_mode) & 0o077 == 0, "the security folder is private"
    mine = [p for p in sec.iterdir() if cluster.cluster_id in p.name]
    names = {p.name for p in mine}
    assert f"ipcontroller-{cluster.cluster_id}-client.json" in names
    assert f"ipcontroller-{cluster.cluster_id}-engine.json" in names
    assert f"nbtrain-{cluster.cluster_id}.json" in names
    for p in mine:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, f"{p.name} is {oct(p.stat().st_mode)}"
    for kind in ("client", "engine"):
        info = json.loads((sec / f"ipcontroller-{cluster.cluster_id}-{kind}.json").read_text())
        assert len(info["key"]) >= 32 and info["signature_scheme"] == "hmac-sha256"
    # the client signs every message with that key (HMAC-SHA256)
    assert (
        cluster.client.session.key
        == json.loads((sec / f"ipcontroller-{cluster.cluster_id}-client.json").read_text())[
            "key"
        ].encode()
    )
