"""The picker's Local page: engines on this machine (`nbtrain.start(n=...)`)."""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.display.picker.settings import PickerSettings

log = logging.getLogger(__name__)


class LocalPage:
    """The Local page's one field, Engines, filled from `s`."""

    def __init__(self, s: PickerSettings, style: dict[str, str]) -> None:
        import ipywidgets as w

        self.n = w.BoundedIntText(
            value=max(1, int(s.n)), min=1, max=1024, description="Engines", style=style
        )
        self.box = w.VBox([self.n])

    def values(self) -> dict[str, Any]:
        """The page's `PickerSettings` fields as the widgets show them now."""
        return {"n": int(self.n.value)}

    def nodes_key(self) -> tuple[str, ...]:
        """What the nodes' interfaces belong to on this page: nothing (this machine)."""
        return ()
