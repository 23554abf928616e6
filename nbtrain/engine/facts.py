"""What one node has, for `%nbtrain check`: host, CPUs, GPUs, Python, torch, CUDA, NCCL, nbtrain.

Runs inside an engine (`node_facts()`), or before any engine exists as a plain process on the node,
printing one JSON line (what the SSH and Slurm checks run):

    $ python -m nbtrain.engine.facts
    NBTRAIN_NODE_FACTS {"hostname": "node1", "cpus": 64, ...}

The versions and GPUs come from the preflight report (`preflight.collect`), so the check and the
start compare the same values. torch loads inside the call; importing this module is cheap.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from nbtrain.engine import preflight

log = logging.getLogger(__name__)

MARKER = "NBTRAIN_NODE_FACTS "  # the line a probe prints; anything else (a login banner) is skipped
# the preflight report's keys a check shows; the interfaces and environment stay out of it
KEYS = ("hostname", "python", "python_executable", "torch", "cuda", "nccl", "gpus", "nbtrain")


def node_facts() -> dict[str, Any]:
    """This node's host name, CPUs (all, and usable by this process), GPUs and versions.

    In [1]: from nbtrain.engine.facts import node_facts
    In [2]: node_facts()["cpus"]
    Out[2]: 16
    """
    report = preflight.collect()
    facts = {k: report.get(k) for k in KEYS}
    facts["cpus"] = os.cpu_count() or 0
    try:
        # Slurm and taskset bind a process to fewer CPUs than the node has
        facts["cpus_usable"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        facts["cpus_usable"] = facts["cpus"]
    if "overridden" in report:
        # the test hook of preflight.collect: its values win here too
        facts.update({k: report[k] for k in report["overridden"]})
        facts["overridden"] = report["overridden"]
    return facts


def main() -> int:
    """Print this node's facts as one marked JSON line."""
    print(MARKER + json.dumps(node_facts()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
