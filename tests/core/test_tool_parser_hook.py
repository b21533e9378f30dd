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
        return "1.0"

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
    assert "invalid tool parser" in record.reason and "json_tools" in record.reason


def test_a_parser_without_a_start_marker_quarantines_its_plugin():
    empty = ToolParser(name="empty", start="", end="", parse=lambda t: [])
    record = host(("empty", ParserPlugin(empty))).record("empty")
    assert record.status == "quarantined" and "empty start marker" in record.reason


def test_two_plugins_registering_one_name_is_an_error_naming_both():
    h = host(("a", ParserPlugin(ANGLE)), ("b", ParserPlugin(ANGLE)))
    with pytest.raises(RegistrationError, match="registered twice"):
        h.registry  # noqa: B018 - the registry is built lazily, and refuses here


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
