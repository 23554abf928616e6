"""The fields more than one picker page shows: where the remote engines reach this machine and
which Python they run (SSH and Slurm), and the nodes' network (every page but Local)."""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.display.picker.settings import AUTO, PickerSettings, parse_int

log = logging.getLogger(__name__)


class RemoteEngines:
    """What SSH hosts and Slurm nodes share: the controller's address here, their Python."""

    def __init__(self, s: PickerSettings, style: dict[str, str]) -> None:
        import ipywidgets as w

        self.ip = w.Text(
            value=s.ip,
            placeholder="auto (routes to the hosts)",
            description="Controller address",
            style=style,
        )
        self.python = w.Text(
            value=s.python,
            placeholder="this kernel's Python path",
            description="Python on hosts",
            style=style,
        )
        self.box = w.VBox([self.ip, self.python])

    def values(self) -> dict[str, Any]:
        """The `PickerSettings` fields as the widgets show them now."""
        return {"ip": self.ip.value.strip(), "python": self.python.value.strip()}


class NodeNetwork:
    """What the remote pages share: the nodes' interface, the rendezvous port, version mismatch."""

    def __init__(self, s: PickerSettings, style: dict[str, str]) -> None:
        import ipywidgets as w

        # filled by the picker: the nodes' interfaces once known (Check hosts, or preflight after
        # a start), until then this machine's (or, for SSH hosts, 'auto' and the saved one)
        self.iface = w.Dropdown(options=[AUTO], value=AUTO, description="Interface", style=style)
        self.iface_info = w.HTML()
        self.port = w.Text(
            value="" if s.port is None else str(s.port),
            placeholder="auto (a free port)",
            description="Rendezvous port",
            style=style,
        )
        # indented by the fields' label width, so the box lines up with the fields above it
        self.allow_mismatch = w.Checkbox(
            value=s.allow_version_mismatch,
            description="Allow version mismatch",
            indent=True,
            style=dict(style),
        )
        self.box = w.VBox([self.iface, self.iface_info, self.port, self.allow_mismatch])

    def values(self) -> dict[str, Any]:
        """The `PickerSettings` fields as the widgets show them now."""
        port: Any = parse_int(self.port.value)
        return {
            "iface": self.iface.value,
            "port": port,
            "allow_version_mismatch": bool(self.allow_mismatch.value),
        }
