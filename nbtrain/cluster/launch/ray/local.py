"""Why the private Ray of `--address local` did not start, read from its own logs.

Ray's raylet waits a fixed 15 s for each of its Python agents (the dashboard agent, which serves the
metrics, and the runtime-env agent) to write its port to a file in the session folder. On a busy
machine an agent can take longer to import and start; the raylet then stops itself ("Check failed
... Timed out waiting for file .../metrics_agent_port_<node>") and `ray.init` says only "The current
node timed out during startup". Ray 2.60 has no setting for that wait (`agent_register_timeout_ms`,
in `_system_config` or as RAY_agent_register_timeout_ms, governs another wait: the raylet still stops
after 15 s), and it cannot be skipped: the dashboard agent starts with `include_dashboard=False` too.
So `RayLaunch.connect` starts the private Ray again while `--timeout` lasts, and when it still fails,
names this cause and the log that says so.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)

# the raylet's wait for an agent's port file (ray/src/ray/util/port_persistence.h), not configurable
AGENT_PORT_WAIT_S = 15

_TIMED_OUT = re.compile(r"Timed out waiting for file (\S+)")
# a port file is `{port name}_{node id in hex}`
_PORT_FILE = re.compile(r"^(?P<port>[a-z_]+?)_[0-9a-f]{16,}$")
# which agent writes which port file, and its log in the session's logs folder
_AGENTS = {
    "metrics_agent_port": ("dashboard agent (Ray's metrics agent)", "dashboard_agent.log"),
    "metrics_export_port": ("dashboard agent (Ray's metrics agent)", "dashboard_agent.log"),
    "dashboard_agent_listen_port": ("dashboard agent", "dashboard_agent.log"),
    "runtime_env_agent_port": ("runtime-env agent", "runtime_env_agent.log"),
}


@dataclass(frozen=True)
class StartFailure:
    """Why a private Ray's start failed: one sentence, the log file that says so, and whether
    another start may work (an agent that was only slow)."""

    cause: str
    log: str
    slow_agent: bool


def logs_folder(temp_dir: str) -> str:
    """The logs folder of the newest session under `temp_dir` (Ray links it as session_latest)."""
    latest = os.path.join(temp_dir, "session_latest")
    return os.path.join(os.path.realpath(latest), "logs")


def _tail(path: str, size: int = 256 * 1024) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - size))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def diagnose(temp_dir: str) -> StartFailure | None:
    """What the raylet of the private Ray under `temp_dir` logged when it stopped during its
    start; None when its log says nothing that explains the failure."""
    logs = logs_folder(temp_dir)
    for name in ("raylet.out", "raylet.err"):
        path = os.path.join(logs, name)
        text = _tail(path)
        found = _TIMED_OUT.search(text)
        if found:
            port_file = os.path.basename(found.group(1))
            m = _PORT_FILE.match(port_file)
            port = m.group("port") if m else port_file
            agent, agent_log = _AGENTS.get(port, ("agent", "dashboard_agent.log"))
            agent_log = os.path.join(logs, agent_log)
            said = (
                f"the agent's own log: {agent_log}"
                if os.path.exists(agent_log)
                else f"the agent had not yet written its log, {agent_log}"
            )
            cause = (
                f"Ray's raylet stopped after waiting {AGENT_PORT_WAIT_S} s for its {agent} to "
                f"write its port ({port}): the agent, a Python process, was slower than that to "
                f"start, as on a busy machine, and Ray has no setting for this wait ({said})"
            )
            return StartFailure(cause, path, slow_agent=True)
        for line in text.splitlines():
            if "Check failed" in line:
                said = line.split("Check failed", 1)[1].strip(" :")
                return StartFailure(f"Ray's raylet stopped: Check failed: {said}", path, False)
    return None


__all__ = ["AGENT_PORT_WAIT_S", "StartFailure", "diagnose", "logs_folder"]
