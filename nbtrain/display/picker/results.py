"""The picker's results view: the status line, the error, the topology and version tables and the
probe's output, and the progress lines a start logs (`Progress`) for the status line."""

from __future__ import annotations

import contextlib
import html
import logging
import threading
from collections.abc import Iterator
from typing import Any

from nbtrain.errors import NbtrainError

log = logging.getLogger(__name__)
#: where a start's progress lines arrive: every module logs under "nbtrain" (its own name below it),
#: so the handler listens on the package's logger, not on this module's
progress_log = logging.getLogger("nbtrain")


def error_text(e: BaseException) -> str:
    """The message a user reads: nbtrain's own message, or the exception's type and message."""
    if isinstance(e, NbtrainError):
        return str(e)
    return f"{type(e).__name__}: {e}"


# -- tables ----------------------------------------------------------------------------------------


def topology_html(cluster: Any) -> str:
    """Rank -> host, local rank, device, address, interface, as an HTML table."""
    head = ("rank", "host", "local rank", "device", "address", "interface")
    rows = [
        (r.rank, r.host, r.local_rank, r.device, r.address, r.interface or "-")
        for r in cluster.ranks
    ]
    out = ['<table class="nbtrain-topology"><thead><tr>']
    out += [f"<th>{h}</th>" for h in head]
    out.append("</tr></thead><tbody>")
    for row in rows:
        out.append("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def versions_html(cluster: Any) -> str:
    """The preflight version table (odd versions highlighted), or '' where the cluster has none.

    Clusters started over SSH or attached with connect ran preflight; local ones did not (one node).
    """
    from nbtrain.cluster.launch import preflight

    result = getattr(cluster, "preflight", None)
    if result is None:
        return ""
    return preflight.format_html(result)


# -- the progress of a start ----------------------------------------------------------------------


class Progress(logging.Handler):
    """The start's progress lines, for the status line next to the elapsed seconds.

    `nbtrain.start` reports each step (the same lines `quiet=False` prints: "slurm job 4711
    pending (Resources)", "rendezvous at ...") on the "nbtrain" logger; this keeps the last one
    logged by the thread that runs the start, so another start or cell in the kernel does not
    show up in this picker. The picker does not pass quiet=False: printing from its worker thread
    would put the lines under whichever cell runs, not in the form.
    """

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.last = ""
        self._thread: int | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self._thread and record.levelno == logging.INFO:
            self.last = record.getMessage().removeprefix("nbtrain: ")

    @contextlib.contextmanager
    def from_this_thread(self) -> Iterator[None]:
        self._thread = threading.get_ident()
        old = progress_log.level
        # INFO must reach the handler; the level goes back afterwards
        if progress_log.getEffectiveLevel() > logging.INFO:
            progress_log.setLevel(logging.INFO)
        progress_log.addHandler(self)
        try:
            yield
        finally:
            progress_log.removeHandler(self)
            progress_log.setLevel(old)


# -- the widgets -----------------------------------------------------------------------------------


class ResultsView:
    """The widgets under the buttons: the status line, the error, the topology and version tables
    and the probe's output. They sit in the form itself (no box of their own), in this order."""

    def __init__(self) -> None:
        import ipywidgets as w

        self.status = w.HTML()
        self.error = w.HTML()
        self.topology = w.HTML()
        self.versions = w.HTML()
        self.probe_out = w.HTML()

    def children(self) -> list[Any]:
        """The widgets in the form's order."""
        return [self.status, self.error, self.topology, self.versions, self.probe_out]

    def show_error(self, text: str) -> None:
        """Show `text` as the error under the form (red, pre-formatted); '' clears it."""
        self.error.value = (
            f'<pre style="color:#842029;white-space:pre-wrap">{html.escape(text)}</pre>'
            if text
            else ""
        )

    def clear_cluster(self) -> None:
        """Empty the topology, versions and probe output (a new start, or the cluster stopped)."""
        self.topology.value = self.versions.value = self.probe_out.value = ""

    def show_cluster(self, cluster: Any) -> None:
        """The started cluster's topology and (where preflight ran) version tables."""
        self.topology.value = topology_html(cluster)
        self.versions.value = versions_html(cluster)
