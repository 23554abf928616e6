"""Which malloc local CPU engines run with: tcmalloc where the machine has it, else the system's.

A CPU training step allocates and frees many tensors, and glibc's malloc is slow at that. On this
project's 2-core test machine, the same 2-rank LoRA fine-tune under torchrun ran 1.03-1.10x faster with
tcmalloc preloaded (medians of four runs), and no faster with jemalloc (benchmarks/NOTES.md).
PyTorch's own CPU launcher (`torch.backends.xeon.run_cpu`) preloads it too.

A library must be preloaded before the process starts, so nbtrain sets `LD_PRELOAD` in the engines'
environment at launch. GPU machines are left alone: the gain was measured on CPU ranks only.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

from nbtrain.errors import ConfigError

log = logging.getLogger(__name__)

CHOICES = ("auto", "tcmalloc", "system")
# gperftools' libraries: the minimal one (no heap profiler) first
NAMES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so", "libtcmalloc.so")
INSTALL_HINT = (
    "Install it (Debian/Ubuntu: apt-get install libtcmalloc-minimal4; Fedora: dnf install "
    "gperftools-libs; conda: conda install gperftools)"
)
_DIRS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)


def find_tcmalloc() -> str | None:
    """The path of a tcmalloc library on this machine, or None.

    The Python environment's own lib folder first (conda's gperftools), then the linker's cache,
    then the usual system folders.
    """
    return (
        _first_in([Path(sys.prefix, "lib")])
        or _from_linker_cache()
        or _first_in([Path(d) for d in _DIRS])
    )


def _first_in(folders: list[Path]) -> str | None:
    for folder in folders:
        for name in NAMES:
            if (folder / name).is_file():
                return str(folder / name)
    return None


def _from_linker_cache() -> str | None:
    """What `ldconfig -p` lists for NAMES, in NAMES' order (ldconfig is not on every user's PATH)."""
    for ldconfig in ("ldconfig", "/sbin/ldconfig", "/usr/sbin/ldconfig"):
        try:
            out = subprocess.run(
                [ldconfig, "-p"], capture_output=True, text=True, timeout=5, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        found: dict[str, str] = {}
        for line in out.splitlines():
            name, sep, where = line.partition("=>")
            if sep and name.split() and name.split()[0] in NAMES:
                found.setdefault(name.split()[0], where.strip())
        return next((found[n] for n in NAMES if n in found and Path(found[n]).is_file()), None)
    return None


def resolve(choice: str | None) -> str:
    """The allocator setting in force: `choice`, else $NBTRAIN_ALLOCATOR, else "auto"; checked."""
    value = choice if choice is not None else os.environ.get("NBTRAIN_ALLOCATOR", "auto")
    value = value.strip().lower()
    if value not in CHOICES:
        msg = (
            f"allocator {value!r} is not one of {', '.join(CHOICES)} (from "
            f"{'--allocator' if choice is not None else 'NBTRAIN_ALLOCATOR'}). "
            "Use auto (tcmalloc for CPU engines where installed), tcmalloc or system."
        )
        raise ConfigError(msg)
    return value


def engine_env(choice: str, env: dict[str, str], gpus: int) -> dict[str, str]:
    """What to add to local engines' environment for `choice` ("auto", "tcmalloc" or "system").

    `env` is what the engines get already (the user's `env`); `gpus` is this machine's GPU count.
    A preload the user set already (tcmalloc or jemalloc) is left as it is.
    """
    if choice == "system" or (choice == "auto" and gpus > 0):
        return {}
    current = env.get("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))
    if "tcmalloc" in current or "jemalloc" in current:
        return {}
    path = find_tcmalloc()
    if path is None:
        if choice == "tcmalloc":
            msg = (
                f"--allocator tcmalloc: no tcmalloc library on {socket.gethostname()}. "
                f"{INSTALL_HINT}, or use --allocator system."
            )
            raise ConfigError(msg)
        return {}
    out = {"LD_PRELOAD": f"{path}:{current}" if current else path}
    # tcmalloc reports every allocation over 1 GiB on stderr; loading a model makes many
    if "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD" not in env | dict(os.environ):
        out["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] = str(1 << 40)
    return out
