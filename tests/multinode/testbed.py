"""Simulated nodes on this machine, for multi-node tests that use real SSH and real networking.

Each node is a network namespace with its own address (a veth whose other end sits in a Linux bridge
in the root namespace), its own host name (a UTS namespace) and its own sshd, which lets a test bed
key log in as root. The root namespace, where the notebook and the controller run, has an address on
the bridge too. Everything stays on this machine, in a private subnet used for nothing else.

    python -m tests.multinode.testbed up 2      # for manual use; prints the ssh command
    python -m tests.multinode.testbed status
    python -m tests.multinode.testbed down      # idempotent; also cleans up after a crash

Node names resolve through a marked block in /etc/hosts. That is the one mechanism every consumer
honours: ssh, Python's resolver, ipyparallel, gloo's own host name lookup, and processes inside the
nodes (they share this machine's /etc). An ssh config alone would only cover ssh; a per-namespace
/etc/netns/<ns>/hosts would not cover the root namespace. The block is delimited by BEGIN/END lines,
is rewritten in place (Docker bind-mounts /etc/hosts, so it cannot be replaced by a rename) and is
removed by `down`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
# the nodes share this machine's filesystem: they run the Python that runs the tests
NODE_PYTHON = Path(sys.executable)
DEPS_SCRIPT = REPO / "scripts" / "testbed-deps.sh"

# 192.168.213.0/24 is used for nothing else on this machine or in CI; change all three together.
SUBNET = "192.168.213.0/24"
HEAD_ADDRESS = "192.168.213.1"
HEAD_NAME = "nbt-head"
PREFIX_LEN = 24
NODE_PREFIX = "nbt-node"  # also the network namespace names: nbt-node1, nbt-node2, ...
BRIDGE = "nbtbr0"
VETH_PREFIX = "nbtv"  # root-namespace end of node i's veth: nbtv1, nbtv2, ...
NODE_IFACE = "eth0"  # the node end, renamed inside the namespace, as on a real machine
SSH_PORT = 22
MAX_NODES = 50

STATE_DIR = Path(os.environ.get("NBTRAIN_TESTBED_DIR", "/run/nbtrain-testbed"))
HOSTS_FILE = Path(os.environ.get("NBTRAIN_TESTBED_HOSTS", "/etc/hosts"))
# lock files live beside the state dir, which `down` removes
MUTATE_LOCK = Path(f"{STATE_DIR}.lock")
SESSION_LOCK = Path(f"{STATE_DIR}.session.lock")
HOSTS_BEGIN = "# BEGIN nbtrain-testbed (tests/multinode/testbed.py; removed by `down`)"
HOSTS_END = "# END nbtrain-testbed"

SSHD = "/usr/sbin/sshd"


class TestbedError(RuntimeError):
    """The test bed could not be brought up or used."""


@dataclass(frozen=True)
class Node:
    """One simulated node: its host name is also its namespace name and resolves to `address`."""

    index: int
    name: str
    address: str
    iface: str = NODE_IFACE
    veth: str = ""  # the root-namespace end, in the bridge; `cut` takes it down

    @property
    def netns(self) -> str:
        return self.name


def _node(i: int) -> Node:
    return Node(i, f"{NODE_PREFIX}{i}", f"192.168.213.{10 + i}", NODE_IFACE, f"{VETH_PREFIX}{i}")


def _run(
    argv: Sequence[str], *, check: bool = True, timeout: float = 30, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, input=input, check=False
    )
    if check and proc.returncode != 0:
        msg = f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout}"
        raise TestbedError(msg)
    return proc


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (a skip reason), or None when the test bed can run."""
    if sys.platform != "linux":
        return f"simulated nodes need Linux network namespaces; this is {sys.platform}"
    if os.geteuid() != 0:
        return (
            "simulated nodes need root (network namespaces, a bridge, sshd); run the tests as root"
        )
    for tool in ("ip", "unshare", "nsenter"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed; run scripts/testbed-deps.sh"
    probe = "nbt-probe"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    made = subprocess.run(
        ["ip", "netns", "add", probe], capture_output=True, text=True, check=False
    )
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        uts = subprocess.run(
            ["ip", "netns", "exec", probe, "unshare", "--uts", "hostname", "nbt-probe"],
            capture_output=True,
            text=True,
            check=False,
        )
        if uts.returncode != 0:
            return f"cannot create a UTS namespace in a network namespace: {uts.stderr.strip()}"
        veth = subprocess.run(
            ["ip", "link", "add", "nbtprobe0", "type", "veth", "peer", "name", "nbtprobe1"],
            capture_output=True,
            text=True,
            check=False,
        )
        if veth.returncode != 0:
            return f"cannot create a veth pair: {veth.stderr.strip()}"
        subprocess.run(["ip", "link", "del", "nbtprobe0"], capture_output=True, check=False)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def ensure_deps() -> None:
    """Install sshd and friends with scripts/testbed-deps.sh when missing (idempotent, quiet)."""
    if Path(SSHD).exists() and shutil.which("ssh") and shutil.which("ssh-keygen"):
        return
    proc = subprocess.run(["sh", str(DEPS_SCRIPT)], capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not Path(SSHD).exists():
        msg = (
            f"openssh-server is missing and {DEPS_SCRIPT} could not install it:\n"
            f"{proc.stderr.strip()}\nInstall it by hand: apt-get install openssh-server"
        )
        raise TestbedError(msg)


@contextlib.contextmanager
def _flock(path: Path, timeout: float, what: str) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    msg = (
                        f"another process holds the test bed ({what}, lock {path}) for more than "
                        f"{timeout:.0f} s; wait for it to finish or stop it"
                    )
                    raise TestbedError(msg) from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def session_lock(timeout: float = 600) -> Iterator[None]:
    """Hold the test bed for one user (a pytest session) so parallel sessions take turns."""
    with _flock(SESSION_LOCK, timeout, "a pytest session"):
        yield


# -- /etc/hosts ------------------------------------------------------------------------------------


def _hosts_without_block(text: str) -> str:
    out, inside = [], False
    for line in text.splitlines(keepends=True):
        if line.rstrip("\n") == HOSTS_BEGIN:
            inside = True
            continue
        if inside:
            if line.rstrip("\n") == HOSTS_END:
                inside = False
            continue
        out.append(line)
    return "".join(out)


def _write_hosts(block: str) -> None:
    old = HOSTS_FILE.read_text() if HOSTS_FILE.exists() else ""
    new = _hosts_without_block(old)
    if block:
        if new and not new.endswith("\n"):
            new += "\n"
        new += block
    if new != old:
        # in place, not by rename: /etc/hosts is often a bind mount
        with open(HOSTS_FILE, "r+" if HOSTS_FILE.exists() else "w") as f:
            f.seek(0)
            f.write(new)
            f.truncate()


# -- the test bed ----------------------------------------------------------------------------------


@dataclass
class Testbed:
    """N simulated nodes, up. Build with `up(n)`; `down()` removes everything."""

    nodes: list[Node]
    state_dir: Path = STATE_DIR
    head_address: str = HEAD_ADDRESS
    head_name: str = HEAD_NAME
    bridge: str = BRIDGE
    subnet: str = SUBNET
    remote_python: str = str(NODE_PYTHON)
    _pids: dict[str, int] = field(default_factory=dict, repr=False)

    __test__ = False  # not a pytest test class, despite the name

    # paths
    @property
    def ssh_config(self) -> Path:
        return self.state_dir / "ssh_config"

    @property
    def ssh_key(self) -> Path:
        return self.state_dir / "id_ed25519"

    @property
    def ssh_args(self) -> list[str]:
        """Arguments for ssh (and scp) that select the test bed's config, key and known hosts.

        ipyparallel: `SSHEngineSetLauncher(ssh_args=tb.ssh_args, scp_args=tb.ssh_args, ...)`.
        """
        return ["-F", str(self.ssh_config)]

    @property
    def ssh_cmd(self) -> list[str]:
        return ["ssh", *self.ssh_args]

    @property
    def scp_cmd(self) -> list[str]:
        return ["scp", *self.ssh_args]

    @property
    def names(self) -> list[str]:
        return [n.name for n in self.nodes]

    @property
    def addresses(self) -> dict[str, str]:
        return {n.name: n.address for n in self.nodes}

    def node(self, which: str | int | Node) -> Node:
        """A node by name ("nbt-node1"), 1-based index, or the Node itself."""
        if isinstance(which, Node):
            return which
        for n in self.nodes:
            if which in (n.name, n.index, n.address):
                return n
        msg = f"no node {which!r} in the test bed; nodes: {', '.join(self.names)}"
        raise KeyError(msg)

    # use
    def ssh(
        self, node: str | int | Node, command: str, *, timeout: float = 30, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run `command` on `node` through real SSH (as root, with the test bed's key)."""
        n = self.node(node)
        proc = subprocess.run(
            [*self.ssh_cmd, n.name, command],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            msg = f"ssh {n.name} {command!r} failed ({proc.returncode}): {proc.stderr.strip()}"
            raise TestbedError(msg)
        return proc

    def nsenter_argv(self, node: str | int | Node) -> list[str]:
        """Prefix that runs a command inside `node` (its network, host name and /sys), without ssh."""
        n = self.node(node)
        pid = self._sshd_pid(n)
        return ["nsenter", "-t", str(pid), "-n", "-u", "-m", "--"]

    def exec(
        self,
        node: str | int | Node,
        argv: Sequence[str],
        *,
        timeout: float = 30,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        """Run `argv` inside `node` directly (nsenter), for set-up that should not depend on ssh."""
        return _run([*self.nsenter_argv(node), *argv], timeout=timeout, check=check)

    def cut(self, node: str | int | Node) -> None:
        """Pull node's cable: its bridge port goes down, packets to and from it are lost (no RST).

        The node keeps its address and routes, so established connections hang as they do when a
        real node drops off the network; `restore` plugs it back in.
        """
        _run(["ip", "link", "set", self.node(node).veth, "down"])

    def restore(self, node: str | int | Node, timeout: float = 10) -> None:
        """Undo `cut` and wait until the node's sshd answers again."""
        n = self.node(node)
        _run(["ip", "link", "set", n.veth, "up"])
        _wait_port(n.address, SSH_PORT, timeout)

    def is_cut(self, node: str | int | Node) -> bool:
        out = _run(["ip", "-j", "link", "show", self.node(node).veth]).stdout
        return "UP" not in json.loads(out)[0].get("flags", [])

    def _sshd_pid(self, n: Node) -> int:
        pid = self._pids.get(n.name)
        if pid is None:
            pidfile = self.state_dir / f"sshd-{n.name}.pid"
            try:
                pid = int(pidfile.read_text().strip())
            except (OSError, ValueError) as e:
                msg = f"no sshd pid for {n.name} ({pidfile}): is the test bed up?"
                raise TestbedError(msg) from e
            self._pids[n.name] = pid
        return pid

    def to_json(self) -> str:
        d = {
            "nodes": [asdict(n) for n in self.nodes],
            "state_dir": str(self.state_dir),
            "head_address": self.head_address,
            "head_name": self.head_name,
            "bridge": self.bridge,
            "subnet": self.subnet,
            "remote_python": self.remote_python,
            "ssh_config": str(self.ssh_config),
            "ssh_args": self.ssh_args,
        }
        return json.dumps(d, indent=2)

    def down(self) -> None:
        down()

    def __enter__(self) -> Testbed:
        return self

    def __exit__(self, *exc: object) -> None:
        down()


@contextlib.contextmanager
def ssh_cluster(tb: Testbed, per_node: int, nodes: int = 2, timeout: float = 120) -> Iterator[Any]:
    """An nbtrain cluster over SSH with `per_node` engines on each of the first `nodes` nodes, stopped
    on exit once ipyparallel's SSH watcher threads have ended (each polls its node, and the session's
    test bed may go down under them otherwise)."""
    import threading

    import nbtrain

    hosts = ",".join(f"{n.name}:{per_node}" for n in tb.nodes[:nodes])
    cluster = nbtrain.start(
        hosts=hosts,
        launcher="ssh",
        ssh_args=tb.ssh_args,
        remote_python=tb.remote_python,
        timeout=timeout,
        force=True,
    )
    try:
        yield cluster
    finally:
        cluster.stop()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(
            t.name.startswith("wait(host=") for t in threading.enumerate()
        ):
            time.sleep(0.2)


def load() -> Testbed:
    """The test bed that is up now (from its state file), for a second process or the CLI."""
    state = STATE_DIR / "state.json"
    try:
        d = json.loads(state.read_text())
    except OSError as e:
        msg = f"the test bed is not up ({state} missing); run `python -m tests.multinode.testbed up 2`"
        raise TestbedError(msg) from e
    nodes = [Node(**n) for n in d["nodes"]]
    return Testbed(nodes=nodes, state_dir=Path(d["state_dir"]), remote_python=d["remote_python"])


def _wait_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError as e:
            last = e
            time.sleep(0.1)
    msg = f"nothing answers on {host}:{port} after {timeout:.0f} s ({last})"
    raise TestbedError(msg)


def _node_env() -> str:
    """sshd's SetEnv for the tests' PYTHONPATH: a node then imports the nbtrain under test (a work
    tree run with PYTHONPATH) rather than whatever the Python has installed."""
    path = os.environ.get("PYTHONPATH")
    return f"SetEnv PYTHONPATH={path}\n" if path and " " not in path else ""


def _sshd_config(n: Node, state: Path, key: Path) -> str:
    return f"""\
# sshd for simulated node {n.name}; written by tests/multinode/testbed.py
ListenAddress {n.address}:{SSH_PORT}
HostKey {key}
PidFile {state}/sshd-{n.name}.pid
AuthorizedKeysFile {state}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
# the key and authorized_keys live outside any home directory; the state dir itself is 0700
StrictModes no
MaxStartups 100:30:200
MaxSessions 100
X11Forwarding no
PrintMotd no
PrintLastLog no
LogLevel ERROR
{_node_env()}# scp speaks SFTP since OpenSSH 9; ipyparallel's SSH launcher uses scp for connection files
Subsystem sftp internal-sftp
# simulated nodes are CPU nodes: on a machine with a GPU they would all see the one real GPU
SetEnv CUDA_VISIBLE_DEVICES=-1
"""


def _ssh_config(tb: Testbed) -> str:
    hosts = " ".join([*tb.names, *(n.address for n in tb.nodes)])
    return f"""\
# ssh client config for the nbtrain test bed; use with `ssh -F {tb.ssh_config}`
Host {hosts}
    User root
    Port {SSH_PORT}
    IdentityFile {tb.ssh_key}
    IdentitiesOnly yes
    UserKnownHostsFile {tb.state_dir}/known_hosts
    GlobalKnownHostsFile /dev/null
    StrictHostKeyChecking yes
    BatchMode yes
    ConnectTimeout 5
    ServerAliveInterval 5
    ServerAliveCountMax 3
    LogLevel ERROR
"""


def up(n: int = 2, *, timeout: float = 20) -> Testbed:
    """Bring up `n` simulated nodes (after removing any left-over test bed) and return them."""
    if not 1 <= n <= MAX_NODES:
        msg = f"the test bed takes 1 to {MAX_NODES} nodes, not {n}"
        raise ValueError(msg)
    reason = unavailable_reason()
    if reason:
        raise TestbedError(reason)
    ensure_deps()
    with _flock(MUTATE_LOCK, 120, "bringing it up or down"):
        _down_locked()
        try:
            return _up_locked(n, timeout)
        except BaseException:
            _down_locked()
            raise


def _up_locked(n: int, timeout: float) -> Testbed:
    state = STATE_DIR
    state.mkdir(mode=0o700, parents=True)
    tb = Testbed(nodes=[_node(i) for i in range(1, n + 1)], state_dir=state)

    # keys made for the test bed only: root's own ~/.ssh is never read or written
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "nbtrain-testbed", "-f", tb.ssh_key])
    host_key = state / "ssh_host_ed25519_key"
    _run(
        [
            "ssh-keygen",
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-C",
            "nbtrain-testbed-host",
            "-f",
            host_key,
        ]
    )
    (state / "authorized_keys").write_text(tb.ssh_key.with_suffix(".pub").read_text())
    host_pub = " ".join(Path(f"{host_key}.pub").read_text().split()[:2])
    known = ",".join([*tb.names, *(n.address for n in tb.nodes)])
    (state / "known_hosts").write_text(f"{known} {host_pub}\n")
    tb.ssh_config.write_text(_ssh_config(tb))
    # privilege separation directory sshd insists on (a package install normally makes it)
    Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)

    _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    _run(["ip", "addr", "add", f"{HEAD_ADDRESS}/{PREFIX_LEN}", "dev", BRIDGE])
    _run(["ip", "link", "set", BRIDGE, "up"])

    lines = [HOSTS_BEGIN, f"{HEAD_ADDRESS}\t{HEAD_NAME}"]
    lines += [f"{node.address}\t{node.name}" for node in tb.nodes]
    _write_hosts("\n".join([*lines, HOSTS_END]) + "\n")

    for node in tb.nodes:
        ns = node.netns
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", node.veth, "type", "veth", "peer", "name", f"{node.veth}p"])
        _run(["ip", "link", "set", f"{node.veth}p", "netns", ns])
        _run(["ip", "link", "set", node.veth, "master", BRIDGE])
        _run(["ip", "link", "set", node.veth, "up"])
        _run(["ip", "-n", ns, "link", "set", f"{node.veth}p", "name", node.iface])
        _run(["ip", "-n", ns, "addr", "add", f"{node.address}/{PREFIX_LEN}", "dev", node.iface])
        _run(["ip", "-n", ns, "link", "set", node.iface, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        cfg = state / f"sshd-{node.name}.conf"
        cfg.write_text(_sshd_config(node, state, host_key))
        # sshd daemonizes; its sessions inherit the node's network and UTS namespaces
        _run(
            [
                "ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                'hostname "$1" && exec "$2" -f "$3" -E "$4"', "sh",
                node.name, SSHD, str(cfg), str(state / f"sshd-{node.name}.log"),
            ]
        )  # fmt: skip
    for node in tb.nodes:
        _wait_port(node.address, SSH_PORT, timeout)
    (state / "state.json").write_text(tb.to_json())
    return tb


def _netns_names() -> list[str]:
    out = _run(["ip", "netns", "list"], check=False).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if re.fullmatch(rf"{NODE_PREFIX}\d+", n)]


def _link_names() -> list[str]:
    out = _run(["ip", "-j", "link", "show"], check=False).stdout or "[]"
    names = [link["ifname"] for link in json.loads(out)]
    return [n for n in names if n == BRIDGE or re.fullmatch(rf"{VETH_PREFIX}\d+p?", n)]


def _kill(pids: set[int], grace: float = 3.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if Path(f"/proc/{p}").exists() and not _is_zombie(p)}
            time.sleep(0.05)
        if not pids:
            return


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def _our_sshd_pids() -> set[int]:
    """sshd daemons started from our state dir's pid files, in case their namespace is gone."""
    pids = set()
    for pidfile in STATE_DIR.glob("sshd-*.pid") if STATE_DIR.exists() else []:
        with contextlib.suppress(OSError, ValueError):
            pid = int(pidfile.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            if str(STATE_DIR) in cmdline:
                pids.add(pid)
    return pids


def down() -> None:
    """Remove the test bed: every process in the nodes, namespaces, bridge, veths, hosts, keys.

    Idempotent, and it works from what is on the machine, not from the state file, so it also cleans
    up after a crashed or killed session.
    """
    if os.geteuid() != 0:
        return
    with _flock(MUTATE_LOCK, 120, "bringing it up or down"):
        _down_locked()


def _down_locked() -> None:
    namespaces = _netns_names()
    pids = _our_sshd_pids()
    for ns in namespaces:
        # sshd, and whatever ran over ssh there (engines): all started by the test bed's users
        out = _run(["ip", "netns", "pids", ns], check=False).stdout
        pids |= {int(p) for p in out.split()}
    _kill(pids)
    for ns in namespaces:
        _run(["ip", "netns", "del", ns], check=False)
    for link in _link_names():
        _run(["ip", "link", "del", link], check=False)
    if HOSTS_FILE.exists():
        _write_hosts("")
    shutil.rmtree(STATE_DIR, ignore_errors=True)


def leftovers() -> list[str]:
    """What of a test bed is still on this machine (empty after a clean `down`)."""
    found = [f"netns {ns}" for ns in _netns_names()]
    found += [f"link {link}" for link in _link_names()]
    if HOSTS_FILE.exists() and HOSTS_BEGIN in HOSTS_FILE.read_text():
        found.append(f"block in {HOSTS_FILE}")
    if STATE_DIR.exists():
        found.append(f"state dir {STATE_DIR}")
    for pid in _pids_with(str(STATE_DIR)):
        found.append(f"process {pid}")
    return found


def _pids_with(needle: str) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in proc.joinpath("cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(proc.name))
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.multinode.testbed",
        description="Simulated nodes (network namespaces with sshd) for nbtrain's multi-node tests.",
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="bring up N nodes (removing any left-over test bed first)")
    p_up.add_argument("n", type=int, nargs="?", default=2, help="number of nodes (default 2)")
    sub.add_parser("down", help="remove everything the test bed made (idempotent)")
    sub.add_parser("status", help="print the test bed that is up, and any leftovers")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            tb = up(args.n)
            print(tb.to_json())
            print(f"try: ssh -F {tb.ssh_config} {tb.nodes[0].name} hostname", file=sys.stderr)
        elif args.cmd == "down":
            down()
            left = leftovers()
            if left:
                print("left behind: " + ", ".join(left), file=sys.stderr)
                return 1
        else:
            if (STATE_DIR / "state.json").exists():
                print(load().to_json())
            print("on this machine: " + (", ".join(leftovers()) or "nothing"), file=sys.stderr)
    except TestbedError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
