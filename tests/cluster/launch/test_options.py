"""A launcher's options are declared once, in its module (`OPTIONS`), and the magic's flags and help
groups, the checks of `LaunchOptions`, the picker's fields and the docs table are made from them.

The throwaway launcher here is registered for one test (a module and one registry line, as a real
one is): its one option shows in `%nbtrain start --help`, is checked by `nbtrain.start`'s settings,
gets a field on a picker page of its own, and a row in the options table. Nothing is started.
"""

from __future__ import annotations

import sys
import types

import pytest

from nbtrain.cluster import options
from nbtrain.cluster.launch import LaunchOptions, declared, flags, launcher_module
from nbtrain.cluster.options import Option
from nbtrain.errors import ConfigError

NAME = "toy"


@pytest.fixture
def toy(monkeypatch):
    """A launcher `toy` with one option, --colour (a choice), registered for this test only."""
    module = types.ModuleType(f"nbtrain.cluster.launch.{NAME}")
    module.SUMMARY = "engines in toy land"
    module.LABEL = "Toy land"
    module.HINT = "give --colour"
    module.OPTIONS = (
        Option(
            "colour",
            "which toy land",
            kind="choice",
            choices=("RED", "GREEN"),
            default="RED",
            label="Colour",
        ),
    )

    def validate(lo):
        lo.colour = lo.colour  # a validate may settle its settings: only declared names exist

    module.validate = validate
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(options.LAUNCHERS, NAME, NAME)
    return module


def test_a_new_launchers_option_is_checked(toy):
    assert launcher_module(NAME) is toy and declared()[NAME] == toy.OPTIONS
    assert flags()["colour"][1] == [NAME]
    assert LaunchOptions(launcher=NAME).colour == "RED"
    assert LaunchOptions(launcher=NAME, colour="green").colour == "GREEN"
    with pytest.raises(ConfigError, match=r"--colour 'blue': choose one of RED, GREEN"):
        LaunchOptions(launcher=NAME, colour="blue")
    # another launcher's setting is named, with this launcher's hint
    with pytest.raises(
        ConfigError,
        match="--placement is a setting of --launcher ray, not of --launcher toy; with --launcher toy, give --colour",
    ):
        LaunchOptions(launcher=NAME, placement="SPREAD")
    with pytest.raises(
        ConfigError, match="--colour is a setting of --launcher toy, not of --launcher ray"
    ):
        LaunchOptions(launcher="ray", colour="GREEN")
    lo = LaunchOptions(launcher=NAME)
    with pytest.raises(AttributeError, match="no launcher declares a setting 'color'"):
        lo.color = "RED"  # a typo is an error, not a new attribute
    # the Python API takes it as a keyword, as the magic passes it
    from nbtrain.cluster.launch import parse_launch

    assert parse_launch(NAME, {"colour": "GREEN"}) == LaunchOptions(launcher=NAME, colour="GREEN")


def test_a_new_launchers_option_is_a_flag_with_help(toy, ip, monkeypatch):
    from nbtrain.magics.cluster import parser

    start = parser()._subcommand("start")
    text = " ".join(start.format_help().split())
    assert "toy (--launcher toy):" in text and "--colour {RED,GREEN}" in text
    assert "which toy land" in text and "toy: engines in toy land" in text
    # the magic hands it to nbtrain.start by its Python name; a wrong value fails as the API does
    calls: list[dict] = []
    monkeypatch.setattr("nbtrain.cluster.api.start", lambda **k: calls.append(k))
    monkeypatch.setattr("nbtrain.magics.cluster.NbtrainMagics._print_ready", lambda *a: None)
    ip.run_line_magic("nbtrain", "start --launcher toy --colour green")
    assert calls[0]["launcher"] == NAME and calls[0]["colour"] == "green"
    assert "placement" not in calls[0]  # only what was given
    # with no --launcher, a launcher's option would be ignored: refused, naming the flag
    with pytest.raises(ConfigError, match="--colour: multi-node settings, but no --launcher"):
        ip.run_line_magic("nbtrain", "start --colour green")


def test_a_new_launchers_option_is_a_picker_field(toy, tmp_path, monkeypatch):
    monkeypatch.setenv("NBTRAIN_HOME", str(tmp_path))
    import nbtrain.display.picker as pk

    p = pk.ClusterPicker(remember=False)
    assert (toy.LABEL, NAME) in list(p.launcher.options)
    page = p.pages[NAME]
    (field,) = page.fields()
    assert field.description == "Colour" and list(field.options) == ["RED", "GREEN"]
    p.launcher.value = NAME
    assert page.box.layout.display == "" and p._slurm_box.layout.display == "none"
    field.value = "GREEN"
    s = p.settings()
    assert s.options == {NAME: {"colour": "GREEN"}}
    assert pk.validate(s) == {}
    name, kw = pk.api_call(s)
    assert (name, kw["launcher"], kw["colour"]) == ("start", NAME, "GREEN")
    # remembered and restored like the other pages' settings
    pk.save_settings(s, tmp_path / "picker.json")
    again = pk.load_settings(tmp_path / "picker.json")
    assert again.options == {NAME: {"colour": "GREEN"}}
    assert pk.ClusterPicker(again, remember=False).pages[NAME].fields()[0].value == "GREEN"


def test_a_new_launchers_option_is_in_the_docs_table(toy):
    from nbtrain.cluster.launch import options_doc

    row = next(r for r in options_doc.table().splitlines() if "`colour=`" in r)
    assert row.startswith(
        "| `--colour COLOUR` (RED, GREEN) | `colour=` | toy | `RED` | which toy land |"
    )


def test_every_declared_option_is_a_flag_and_a_row():
    # the real launchers: each option (but -n, the command's own, and Python-only ones) is a flag of
    # %nbtrain start under its declared name, and a row of the docs table
    from nbtrain.cluster.launch import options_doc
    from nbtrain.magics.cluster import parser

    start = parser()._subcommand("start")
    dests = {a.dest for a in start._actions}
    table = options_doc.table()
    for name, (opt, _) in flags().items():
        assert f"`{name}=`" in table
        if opt.cli is not None:
            assert opt.cli in start._option_string_actions, opt.cli
            assert name in dests or opt.cli == "-n", name
