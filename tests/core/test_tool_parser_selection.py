"""Which tool-call parser a model gets: override, tokenizer config, template, family default."""

from __future__ import annotations

import pytest

from mlx_loom.errors import RegistrationError, ToolParserUnavailable
from mlx_loom.text.reasoning import GEMMA4_CHANNEL, THINK, infer_reasoning
from mlx_loom.text.tool_calls import ToolParser, choose_tool_parser, parser_table

TABLE = parser_table()

#: Fragments of the markers each format's chat templates carry.
TEMPLATES = {
    "json_tools": '{{- "<tool_call>\\n" }}{{ tool_call.name }}</tool_call>',
    "qwen3_coder": "{{ '<tool_call>\\n<function=' + tool_call.name + '>' }}",
    "gemma4": "{{ '<|tool_call>call:' + name }}{{ '<tool_call|>' }}",
    "minicpm5": '<function name="{{ name }}"><param name="{{ key }}">',
    "pythonic": "<|tool_list_start|>{{ tools }}<|tool_list_end|>",
    "mistral": "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]",
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_the_format_is_inferred_from_the_chat_templates_markers(name):
    choice = choose_tool_parser(TABLE, template=TEMPLATES[name])
    assert choice.parser is TABLE[name]
    assert "template" in choice.reason


def test_the_override_beats_the_tokenizer_config_and_the_template():
    choice = choose_tool_parser(
        TABLE, override="pythonic", tokenizer_config="mistral", template=TEMPLATES["gemma4"]
    )
    assert choice.parser is TABLE["pythonic"] and "--tool-call-parser" in choice.reason


def test_the_tokenizer_config_beats_the_template():
    choice = choose_tool_parser(TABLE, tokenizer_config="mistral", template=TEMPLATES["gemma4"])
    assert choice.parser is TABLE["mistral"] and "tool_parser_type" in choice.reason


def test_the_family_default_applies_when_nothing_else_says():
    choice = choose_tool_parser(
        TABLE, template="{{ messages }}", family_default="minicpm5", model_type="llama"
    )
    assert choice.parser is TABLE["minicpm5"] and "'llama'" in choice.reason


def test_no_declaration_and_no_markers_means_no_parser():
    assert choose_tool_parser(TABLE, template="{{ messages }}").parser is None


@pytest.mark.parametrize(
    "where",
    [{"override": "hermes"}, {"tokenizer_config": "hermes"}, {"family_default": "hermes"}],
)
def test_an_unknown_name_is_refused_listing_the_registered_ones(where):
    with pytest.raises(ToolParserUnavailable) as info:
        choose_tool_parser(TABLE, **where)
    assert "'hermes'" in info.value.message
    assert all(name in info.value.message for name in TEMPLATES)
    assert "--tool-call-parser" in info.value.fix


def test_a_plugin_parser_is_tried_before_the_builtins():
    mine = ToolParser(
        name="mine",
        start="<tool_call>",
        end="</tool_call>",
        parse=lambda t: [],
        template_markers=(("<tool_call>", "MINE"),),
    )
    table = parser_table([mine])
    assert choose_tool_parser(table, template="MINE <tool_call> tool_call.name").parser is mine


def test_a_plugin_parser_may_not_take_a_builtin_name():
    clash = ToolParser(name="gemma4", start="<x>", end="</x>", parse=lambda t: [])
    with pytest.raises(RegistrationError, match="built into the core"):
        parser_table([clash])


def test_reasoning_is_inferred_from_the_template_or_the_vocabulary():
    assert infer_reasoning("{{ '<think>' }}...{{ '</think>' }}", lambda t: False) is THINK
    gemma_vocab = {"<|channel>", "<channel|>"}
    assert infer_reasoning("{{ messages }}", gemma_vocab.__contains__) is GEMMA4_CHANNEL
    assert infer_reasoning("{{ messages }}", lambda t: False) is None


def test_a_reply_opens_inside_thinking_when_the_prompt_left_it_open():
    assert THINK.opens_inside("<|im_start|>assistant\n<think>\n")
    assert not THINK.opens_inside("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not THINK.opens_inside("<|im_start|>assistant\n")
