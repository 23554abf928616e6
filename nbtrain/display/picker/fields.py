"""The picker's fields made from the options a launcher declares (`nbtrain.cluster.options.Option`,
in each launcher's `OPTIONS`): one widget per option with a picker label, by its kind
(`OptionFields`), and the whole page of a launcher that has no page of its own (`OptionsPage`).

The Slurm, SSH and Ray pages take their option fields from here, so an option a launcher adds shows
on its page without a change to the picker.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any

from nbtrain.display.picker.settings import (
    PickerSettings,
    int_text,
    number_text,
    parse_int,
    parse_number,
    setting,
)

log = logging.getLogger(__name__)


def option_widget(opt: Any, value: Any, style: dict[str, str]) -> Any:
    """The field for a declared option (`nbtrain.cluster.options.Option`), showing `value`: a
    dropdown for a choice, a checkbox for a switch, a number box for a count with a default, a text
    area for extra arguments, else a text field (numbers as text: an empty one is "not given")."""
    import ipywidgets as w

    common = {"description": opt.label, "description_tooltip": opt.help, "style": style}
    if opt.kind == "choice":
        shown = value if value in opt.choices else (opt.default or opt.choices[0])
        return w.Dropdown(options=list(opt.choices), value=shown, **common)
    if opt.kind == "switch":
        return w.Checkbox(value=bool(value), indent=False, **common)
    if opt.kind == "count" and opt.default is not None:
        return w.IntText(value=int(opt.default if value is None else value), **common)
    text = {"count": int_text, "count0": int_text, "amount": number_text}.get(opt.kind, str)
    shown = "" if value is None else text(value)
    if opt.kind == "args":
        return w.Textarea(value=shown, placeholder=opt.placeholder, rows=2, **common)
    return w.Text(value=shown, placeholder=opt.placeholder, **common)


def widget_value(opt: Any, widget: Any) -> Any:
    """What a field made by `option_widget` holds, as the settings keep it."""
    value = widget.value
    if opt.kind in ("choice", "switch") or not isinstance(value, str):
        return value
    if opt.kind in ("count", "count0"):
        return parse_int(value)
    if opt.kind == "amount":
        return parse_number(value)
    return value.strip()


class OptionFields:
    """A page's fields made from the options its launcher declares with a picker label (those in
    `skip` are the page's own): one widget each, an attribute of this object by the option's name."""

    def __init__(
        self, launcher: str, s: PickerSettings, style: dict[str, str], skip: tuple[str, ...] = ()
    ) -> None:
        from nbtrain.cluster import launch

        self.launcher = launcher
        self.options = [o for o in launch.declared()[launcher] if o.label and o.name not in skip]
        self.widgets = {
            o.name: option_widget(o, setting(s, launcher, o.name), style) for o in self.options
        }

    def __getattr__(self, name: str) -> Any:
        widgets = self.__dict__.get("widgets", {})
        if name in widgets:
            return widgets[name]
        raise AttributeError(name)

    def fields(self) -> list[Any]:
        """The widgets, in the order the launcher declares its options."""
        return list(self.widgets.values())

    def values(self) -> dict[str, Any]:
        """The `PickerSettings` fields as the widgets show them now; options with no field of their
        own go under `options` (launcher -> option -> value)."""
        own = {f.name for f in fields(PickerSettings)}
        out: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for o in self.options:
            value = widget_value(o, self.widgets[o.name])
            if o.name in own:
                out[o.name] = value
            else:
                extra[o.name] = value
        if extra:
            out["options"] = {self.launcher: extra}
        return out


class OptionsPage:
    """The page of a launcher with no page of its own (its module names a `LABEL`): one field per
    option it declares with a label."""

    def __init__(self, launcher: str, s: PickerSettings, style: dict[str, str]) -> None:
        import ipywidgets as w

        self.form = OptionFields(launcher, s, style)
        self.box = w.VBox(self.form.fields())

    def fields(self) -> list[Any]:
        return self.form.fields()

    def values(self) -> dict[str, Any]:
        return self.form.values()

    def nodes_key(self) -> tuple[str, ...]:
        """What the nodes' interfaces belong to: this page's settings."""
        return tuple(str(w.value) for w in self.form.fields())
