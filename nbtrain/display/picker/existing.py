"""The picker's existing-cluster page: the IPython profile and cluster id of an ipyparallel
cluster to attach to (`nbtrain.connect`)."""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.display.picker.settings import PickerSettings

log = logging.getLogger(__name__)


class ExistingPage:
    """The existing-cluster page's fields, filled from `s`."""

    def __init__(self, s: PickerSettings, style: dict[str, str]) -> None:
        import ipywidgets as w

        self.profile = w.Text(
            value=s.profile, placeholder="default", description="Profile", style=style
        )
        self.cluster_id = w.Text(
            value=s.cluster_id, placeholder="(newest)", description="Cluster id", style=style
        )
        self.box = w.VBox([self.profile, self.cluster_id])

    def values(self) -> dict[str, Any]:
        """The page's `PickerSettings` fields as the widgets show them now."""
        return {"profile": self.profile.value.strip(), "cluster_id": self.cluster_id.value.strip()}

    def nodes_key(self) -> tuple[str, ...]:
        """What the nodes' interfaces belong to on this page: the profile and cluster id."""
        return (self.profile.value.strip(), self.cluster_id.value.strip())
