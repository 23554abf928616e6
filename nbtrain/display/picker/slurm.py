"""The picker's Slurm page: the job's nodes, GPUs and engines per node, partition, account, time
limit and extra sbatch lines, one field per option the Slurm launcher declares
(`nbtrain.cluster.launch.slurm.OPTIONS`). What is left empty is not passed (Slurm's or nbtrain's
default applies)."""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.display.picker.fields import OptionFields
from nbtrain.display.picker.settings import PickerSettings

log = logging.getLogger(__name__)


class SlurmPage:
    """The Slurm page's fields, filled from `s`; each is an attribute by its option's name."""

    def __init__(self, s: PickerSettings, style: dict[str, str]) -> None:
        import ipywidgets as w

        self.form = OptionFields("slurm", s, style)
        self.box = w.VBox(self.fields())

    def fields(self) -> list[Any]:
        """The page's fields in the form's order (each change re-validates the page)."""
        return self.form.fields()

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
        """What the nodes' interfaces belong to on this page: the partition (its nodes)."""
        return (self.form.partition.value.strip(),)
