"""The picker's SSH page: the hosts and their engines, extra ssh arguments, and Check hosts (log in
and list the hosts' interfaces; nothing starts)."""

from __future__ import annotations

from typing import Any

from nbtrain.display.picker.settings import PickerSettings


class SshPage:
    """The SSH page's fields, filled from `s`, and its Check hosts button."""

    def __init__(self, s: PickerSettings, style: dict[str, str]) -> None:
        import ipywidgets as w

        self.hosts = w.Text(
            value=s.hosts,
            placeholder="node1:2,node2:2",
            description="Hosts:engines",
            style=style,
        )
        self.ssh_args = w.Text(
            value=s.ssh_args,
            placeholder="e.g. -F ~/.ssh/cluster",
            description="ssh arguments",
            style=style,
        )
        self.check_button = w.Button(
            description="Check hosts",
            icon="search",
            tooltip="log in to the hosts over SSH and list their network interfaces",
        )
        self.box = w.VBox([self.hosts, self.ssh_args, self.check_button])

    def values(self) -> dict[str, Any]:
        """The page's `PickerSettings` fields as the widgets show them now."""
        return {"hosts": self.hosts.value.strip(), "ssh_args": self.ssh_args.value.strip()}

    def nodes_key(self) -> tuple[str, ...]:
        """What the nodes' interfaces belong to on this page: the hosts."""
        return (self.hosts.value.strip(),)
