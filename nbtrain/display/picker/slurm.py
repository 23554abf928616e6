"""The picker's Slurm page: the job's nodes, GPUs and engines per node, partition, account, time
limit and extra sbatch lines. What is left empty is not passed (Slurm's or nbtrain's default
applies)."""

from __future__ import annotations

from typing import Any

from nbtrain.display.picker.settings import PickerSettings, int_text, parse_int


class SlurmPage:
    """The Slurm page's fields, filled from `s`."""

    def __init__(self, s: PickerSettings, style: dict[str, str]) -> None:
        import ipywidgets as w

        self.nodes = w.IntText(value=int(s.nodes), description="Nodes", style=style)
        self.gpus_per_node = w.Text(
            value=int_text(s.gpus_per_node),
            placeholder="none (CPU nodes)",
            description="GPUs per node",
            style=style,
        )
        self.engines_per_node = w.Text(
            value=int_text(s.engines_per_node),
            placeholder="one per GPU, else 1",
            description="Engines per node",
            style=style,
        )
        self.partition = w.Text(
            value=s.partition,
            placeholder="the default partition",
            description="Partition",
            style=style,
        )
        self.account = w.Text(
            value=s.account, placeholder="your default account", description="Account", style=style
        )
        self.time = w.Text(
            value=s.time,
            placeholder="the partition's default, e.g. 02:00:00",
            description="Time limit",
            style=style,
        )
        self.slurm_args = w.Textarea(
            value=s.slurm_args,
            placeholder="--qos=high\n--constraint=a100",
            description="Extra sbatch lines",
            rows=2,
            style=style,
        )
        self.box = w.VBox(self.fields())

    def fields(self) -> list[Any]:
        """The page's fields in the form's order (each change re-validates the page)."""
        return [
            self.nodes,
            self.gpus_per_node,
            self.engines_per_node,
            self.partition,
            self.account,
            self.time,
            self.slurm_args,
        ]

    def values(self) -> dict[str, Any]:
        """The page's `PickerSettings` fields as the widgets show them now."""
        return {
            "nodes": int(self.nodes.value),
            "gpus_per_node": parse_int(self.gpus_per_node.value),
            "engines_per_node": parse_int(self.engines_per_node.value),
            "partition": self.partition.value.strip(),
            "account": self.account.value.strip(),
            "time": self.time.value.strip(),
            "slurm_args": self.slurm_args.value.strip(),
        }

    def nodes_key(self) -> tuple[str, ...]:
        """What the nodes' interfaces belong to on this page: the partition (its nodes)."""
        return (self.partition.value.strip(),)
