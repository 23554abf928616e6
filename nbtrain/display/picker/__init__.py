"""`nbtrain.ClusterPicker()`: start, inspect, probe and stop a cluster from a widget.

In [1]: nbtrain.ClusterPicker()

One module per job: the settings, their validation and the call into the API (`settings`), the
nodes' interfaces (`interfaces`), a module per page (`local`, `ssh`, `slurm`, `ray`, `existing`,
and the fields they share in `shared`), the results view (`results`), and the form that assembles
them and handles its buttons (`widget`). Importing this package does not import ipywidgets; building the
form does.
"""

from __future__ import annotations

from nbtrain.display.picker.interfaces import (
    NodeInterfaces,
    check_node_interfaces,
    interface_choices,
    interfaces_from_reports,
    node_interface_options,
    node_interfaces_html,
)
from nbtrain.display.picker.results import error_text, topology_html, versions_html
from nbtrain.display.picker.settings import (
    AUTO,
    BACKENDS,
    LAUNCHERS,
    PAGES,
    PickerSettings,
    api_call,
    launchers,
    load_settings,
    ray_launch,
    save_settings,
    settings_path,
    slurm_launch,
    start_cluster,
    validate,
    validate_ray,
    validate_slurm,
)
from nbtrain.display.picker.widget import ClusterPicker

__all__ = [
    "AUTO",
    "BACKENDS",
    "LAUNCHERS",
    "PAGES",
    "ClusterPicker",
    "NodeInterfaces",
    "PickerSettings",
    "api_call",
    "check_node_interfaces",
    "error_text",
    "interface_choices",
    "interfaces_from_reports",
    "launchers",
    "load_settings",
    "node_interface_options",
    "node_interfaces_html",
    "ray_launch",
    "save_settings",
    "settings_path",
    "slurm_launch",
    "start_cluster",
    "topology_html",
    "validate",
    "validate_ray",
    "validate_slurm",
    "versions_html",
]
