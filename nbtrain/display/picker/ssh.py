"""The picker's SSH page: the hosts and their engines, extra ssh arguments (the fields the SSH
launcher declares, `nbtrain.cluster.launch.ssh.OPTIONS`), and Check hosts (log in and list the hosts'
interfaces; nothing starts)."""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.display.picker.fields import OptionFields
from nbtrain.display.picker.settings import PickerSettings

log = logging.getLogger(__name__)


class SshPage:
    """The SSH page's fields, filled from `s`, and its Check hosts button."""

    def __init__(self, s: PickerSettings, style: dict[str, str]) -> None:
        import ipywidgets as w

        self.form = OptionFields("ssh", s, style)
        self.check_button = w.Button(
            description="Check hosts",
            icon="search",
            tooltip="log in to the hosts over SSH and list their network interfaces",
        )
        self.box = w.VBox([*self.form.fields(), self.check_button])

    def __getattr__(self, name: str) -> Any:
        # the option fields are the page's attributes, by the option's name (page.partition)
        form = self.__dict__.get("form")
        if form is None:
            raise AttributeError(name)
        return getattr(form, name)

    def values(self) -> dict[str, Any]:
        """The page's `PickerSettings` fields as the widgets show them now."""
        return self.form.values()

    def nodes_key(self) -> tuple[str, ...]:
        """What the nodes' interfaces belong to on this page: the hosts."""
        return (self.form.hosts.value.strip(),)
