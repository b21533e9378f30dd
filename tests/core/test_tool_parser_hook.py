"""A plugin registers a tool-call format through loom_tool_parsers; the host checks it."""

from __future__ import annotations

import pytest

from mlx_loom.errors import RegistrationError
from mlx_loom.host import PluginHost, hookimpl
from mlx_loom.plugin import ToolCall, ToolParser
from mlx_loom.text.tool_calls import BUILTIN_TOOL_PARSERS

ANGLE = ToolParser(
    name="angle",
    start="<<call ",
    end=">>",
    parse=lambda text: [ToolCall(text.strip(), {})],
    template_markers=(("<<call ",),),
)


class ParserPlugin:
    def __init__(self, *parsers: ToolParser) -> None:
        self.parsers = list(parsers)

    @hookimpl
    def loom_plugin_api_version(self):
        return "1.1"

    @hookimpl
    def loom_tool_parsers(self):
        return self.parsers


def host(*plugins) -> PluginHost:
    return PluginHost(plugins=list(plugins), entry_points=False)


def test_a_registered_parser_joins_the_builtins_with_its_provider():
    h = host(("angle", ParserPlugin(ANGLE)))
    parsers = h.registry.tool_parsers
    assert set(parsers) == {"angle"} | {p.name for p in BUILTIN_TOOL_PARSERS}
    assert parsers["angle"].provider.plugin == "angle"
    assert h.record("angle").registers["tool_parsers"] == ("angle",)


def test_registered_parsers_come_before_the_builtins():
    assert list(host(("angle", ParserPlugin(ANGLE))).registry.tool_parsers)[0] == "angle"


def test_a_parser_taking_a_builtin_name_quarantines_its_plugin():
    clash = ToolParser(name="json_tools", start="<x>", end="</x>", parse=lambda t: [])
    record = host(("clash", ParserPlugin(clash))).record("clash")
    assert record.status == "quarantined"
    assert "'json_tools' is built into the core" in record.reason


class LateParser:
    """A plugin whose parser is malformed: building it in the hook raises there."""

    @hookimpl
    def loom_plugin_api_version(self):
        return "1.1"

    @hookimpl
    def loom_tool_parsers(self):
        return [ToolParser(name="empty", start="", end="", parse=lambda t: [])]


def test_a_malformed_parser_is_refused_where_it_is_made_and_quarantines_its_plugin():
    with pytest.raises(RegistrationError, match="start must be"):
        ToolParser(name="empty", start="", end="", parse=lambda t: [])
    record = host(("late", LateParser())).record("late")
    assert record.status == "quarantined" and "start must be" in record.reason


@pytest.mark.parametrize(
    "fields",
    [
        {"name": "has space"},
        {"end": None},
        {"parse": "not callable"},
        {"template_markers": ("not", "groups")},
        {"template_markers": ((),)},
    ],
)
def test_every_field_of_a_parser_is_checked(fields):
    base = dict(name="ok", start="<", end=">", parse=lambda t: [])
    with pytest.raises(RegistrationError, match="ToolParser"):
        ToolParser(**{**base, **fields})


def test_two_plugins_registering_one_name_are_both_quarantined_naming_each_other():
    h = host(("a", ParserPlugin(ANGLE)), ("b", ParserPlugin(ANGLE)))
    for name, other in (("a", "b"), ("b", "a")):
        record = h.record(name)
        assert record.status == "quarantined"
        assert "tool parser 'angle'" in record.reason and other in record.reason
    assert "angle" not in h.registry.tool_parsers


def test_a_composed_registry_keeps_the_plugin_parsers_and_adds_more():
    other = ToolParser(name="other", start="<o>", end="</o>", parse=lambda t: [])
    registry = host(("angle", ParserPlugin(ANGLE))).registry.with_(tool_parsers=[other])
    assert {"angle", "other"} <= set(registry.tool_parsers)


def test_each_family_declares_a_registered_default_format():
    from mlx_loom import default_host

    registry = default_host().registry
    defaults = {name: claim.tool_parser for name, claim in registry.model_types.items()}
    assert defaults["llama"] == "minicpm5"
    assert defaults["qwen3_next"] == "json_tools"
    assert defaults["qwen3_5"] == "qwen3_coder"
    assert defaults["gemma4"] == defaults["gemma4_text"] == "gemma4"
    assert set(defaults.values()) <= set(registry.tool_parsers)
