"""The picker's Ray page: the Ray cluster's address, the ranks (-n, or nodes x engines per node),
each rank's GPUs and CPUs, and how Ray places them (`nbtrain.start(launcher="ray", ...)`). What is
left empty is not passed (nbtrain's default applies: 0 GPUs, 1 CPU per rank)."""

from __future__ import annotations

import logging
from typing import Any

from nbtrain.display.picker.fields import OptionFields
from nbtrain.display.picker.settings import RAY_RANKS, PickerSettings, int_text, parse_int

log = logging.getLogger(__name__)

ADDRESS_HINT = (
    "<small><code>auto</code>: the Ray cluster this machine belongs to; <code>local</code>: a "
    "private one-machine Ray, stopped with the cluster; <code>ray://HEAD:10001</code>: a remote "
    "head's Ray Client port.</small>"
)


class RayPage:
    """The Ray page's fields, filled from `s`."""

    def __init__(self, s: PickerSettings, style: dict[str, str]) -> None:
        import ipywidgets as w

        # the address, each rank's GPUs and CPUs and the placement: the launcher's declared options
        self.form = OptionFields("ray", s, style)
        self.address = self.form.address
        self.gpus_per_rank = self.form.gpus_per_rank
        self.cpus_per_rank = self.form.cpus_per_rank
        self.placement = self.form.placement
        self.address_hint = w.HTML(ADDRESS_HINT)
        self.ranks_by = w.RadioButtons(
            options=[(label, k) for k, label in RAY_RANKS.items()],
            value=s.ray_ranks_by if s.ray_ranks_by in RAY_RANKS else "n",
            description="Ranks as",
            style=style,
        )
        self.n = w.BoundedIntText(
            value=max(1, int(s.ray_n)), min=1, max=4096, description="Ranks (-n)", style=style
        )
        self.nodes = w.Text(
            value=int_text(s.ray_nodes), placeholder="1", description="Nodes", style=style
        )
        self.engines_per_node = w.Text(
            value=int_text(s.ray_engines_per_node),
            placeholder="1",
            description="Engines per node",
            style=style,
        )
        self._by_n = w.VBox([self.n])
        self._by_nodes = w.VBox([self.nodes, self.engines_per_node])
        self.box = w.VBox(
            [
                self.address,
                self.address_hint,
                self.ranks_by,
                self._by_n,
                self._by_nodes,
                *self._rest(),
            ]
        )
        self.ranks_by.observe(self._on_ranks_by, names="value")
        self._on_ranks_by()

    def _on_ranks_by(self, *_: Any) -> None:
        # -n or nodes x engines per node, never both: the other's fields are hidden
        by_nodes = self.ranks_by.value == "nodes"
        self._by_n.layout.display = "none" if by_nodes else ""
        self._by_nodes.layout.display = "" if by_nodes else "none"

    def _rest(self) -> list[Any]:
        # the declared options after the address, in their order (a new one shows here)
        return [f for f in self.form.fields() if f is not self.address]

    def fields(self) -> list[Any]:
        """The page's fields in the form's order (each change re-validates the page)."""
        return [
            self.address,
            self.ranks_by,
            self.n,
            self.nodes,
            self.engines_per_node,
            *self._rest(),
        ]

    def values(self) -> dict[str, Any]:
        """The page's `PickerSettings` fields as the widgets show them now."""
        return {
            **self.form.values(),
            "ray_ranks_by": self.ranks_by.value,
            "ray_n": int(self.n.value),
            "ray_nodes": parse_int(self.nodes.value),
            "ray_engines_per_node": parse_int(self.engines_per_node.value),
        }

    def nodes_key(self) -> tuple[str, ...]:
        """What the nodes' interfaces belong to on this page: the Ray cluster's address."""
        return (self.address.value.strip() or "auto",)
