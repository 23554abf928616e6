"""Reaching a Ray cluster before `ray.init`: where an address points, whether anything there answers
as Ray does, and Ray's own output while it connects sent to a log file.

`ray.init` has no timeout of its own for a GCS that takes a connection and stays silent (it retries for
minutes), so `RayLaunch.connect` asks these first and fails within `--timeout` with one message.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


def resolve(address: str) -> str | None:
    """The host:port `address` names (`auto`: RAY_ADDRESS, else the last `ray start` here);
    None when `auto` finds no cluster."""
    if address.startswith("ray://"):
        return address[len("ray://") :]
    if address != "auto":
        return address
    try:
        from ray._private.services import get_ray_address_from_environment

        found = get_ray_address_from_environment("auto", None)
    except Exception as e:
        log.debug("finding the Ray cluster for auto: %s", e)
        return None
    return None if found in (None, "", "auto") else str(found)


def unreachable(target: str, seconds: float) -> str:
    """Why nothing takes a TCP connection at `target` (host:port) within `seconds`; '' if one does."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    found: list[Any] = []

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM))
        except OSError as e:
            found.append(e)

    # a name lookup can hang on a dead resolver: bounded by a thread
    t = threading.Thread(target=lookup, daemon=True)
    t.start()
    t.join(seconds)
    if not found:
        return f"the host name {host} did not resolve within {seconds:g} s"
    if isinstance(found[0], OSError):
        return f"the host name {host} does not resolve ({found[0]})"
    try:
        conn = socket.create_connection((host, int(port)), timeout=seconds)
    except OSError as e:
        return f"nothing takes a connection at {target} ({e.strerror or e})"
    with conn:
        if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
            return ""  # TLS first: the plain HTTP/2 greeting below would not be answered
        # Ray's GCS and Ray Client server speak gRPC: an HTTP/2 server answers the client preface
        # with its SETTINGS frame at once. Something that takes the connection and stays silent
        # would keep ray.init waiting for minutes, whatever --timeout says.
        try:
            conn.sendall(H2_PREFACE)
            reply = conn.recv(9)
        except OSError as e:
            return f"{target} takes a connection but does not answer ({e.strerror or e})"
        if len(reply) < 9 or reply[3] != 0x4:
            said = reply[:40].decode("latin-1", "replace").strip() or "nothing"
            return f"{target} takes a connection but does not answer as Ray (it said {said!r})"
    return ""


# the HTTP/2 client connection preface and an empty SETTINGS frame (RFC 9113, 3.4)
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@contextlib.contextmanager
def output_to(path: str) -> Iterator[None]:
    """Everything Ray prints while connecting (its C++ lines on fd 1 and 2, its logger, warnings)
    goes to `path`, not to the notebook."""
    if not path:
        yield
        return
    import ray  # its logger's handlers exist once it is imported

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    with open(path, "a", buffering=1) as f:
        saved: list[int] = []
        with contextlib.suppress(OSError):
            saved = [os.dup(1), os.dup(2)]
            os.dup2(f.fileno(), 1)
            os.dup2(f.fileno(), 2)
        handlers = [
            (h, h.stream)
            for h in logging.getLogger(ray.__name__).handlers
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
        ]
        for h, _ in handlers:
            h.setStream(f)
        try:
            with (
                warnings.catch_warnings(),
                contextlib.redirect_stdout(f),
                contextlib.redirect_stderr(f),
            ):

                def to_file(
                    message: Any,
                    category: Any,
                    filename: str,
                    lineno: int,
                    file: Any = None,
                    line: str | None = None,
                ) -> None:
                    f.write(warnings.formatwarning(message, category, filename, lineno, line))

                warnings.showwarning = to_file
                yield
        finally:
            for h, stream in handlers:
                h.setStream(stream)
            if saved:
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
