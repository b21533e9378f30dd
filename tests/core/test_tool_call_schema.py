"""Arguments are coerced to the types the tool's schema declares, only when they read as one."""

from __future__ import annotations

import pytest

from mlx_loom.text.tool_calls import coerce_arguments, tool_schemas

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "ratio": {"type": "number"},
        "metric": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "integer"}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "maybe": {"type": ["integer", "null"]},
        "either": {"anyOf": [{"type": "boolean"}, {"type": "integer"}]},
        "level": {"enum": [1, 2, 3]},
    },
}


@pytest.mark.parametrize(
    ("name", "raw", "expected"),
    [
        ("days", "3", 3),
        ("days", "3.0", 3),
        ("days", 4.0, 4),
        ("ratio", "0.25", 0.25),
        ("ratio", "2", 2),
        ("metric", "True", True),
        ("metric", "false", False),
        ("tags", "[1, 2]", [1, 2]),
        ("tags", ["1", 2], [1, 2]),
        ("where", '{"lat": "48.8"}', {"lat": 48.8}),
        ("where", "{'lat': 1.5}", {"lat": 1.5}),
        ("maybe", "null", None),
        ("maybe", "7", 7),
        ("either", "true", True),
        ("either", "12", 12),
        ("level", "2", 2),
        ("city", 75001, "75001"),
    ],
)
def test_a_value_is_converted_to_its_declared_type(name, raw, expected):
    out = coerce_arguments({name: raw}, SCHEMA)[name]
    assert out == expected and type(out) is type(expected)


@pytest.mark.parametrize(
    ("name", "raw"),
    [
        ("days", "three"),
        ("days", "3.5"),
        ("ratio", "nan"),
        ("metric", "yes"),
        ("tags", "[1, 2"),
        ("where", "__import__('os')"),
    ],
)
def test_a_value_that_does_not_read_as_its_type_is_left_as_written(name, raw):
    assert coerce_arguments({name: raw}, SCHEMA) == {name: raw}


def test_a_value_that_already_has_a_declared_type_is_not_touched():
    args = {"city": "3", "days": 3, "maybe": None, "either": False}
    assert coerce_arguments(args, SCHEMA) == args


def test_arguments_the_schema_does_not_mention_are_kept_as_they_are():
    assert coerce_arguments({"extra": "5"}, SCHEMA) == {"extra": "5"}


def test_no_schema_leaves_arguments_unchanged():
    assert coerce_arguments({"days": "3"}, None) == {"days": "3"}


def test_a_self_nesting_schema_is_followed_only_to_a_bounded_depth():
    node: dict = {"type": "object", "properties": {}}
    node["properties"]["child"] = node  # a cycle: client schemas are untrusted
    value: dict = {}
    for _ in range(100):
        value = {"child": value}
    assert coerce_arguments(value, node) == value


def test_tool_schemas_maps_function_names_to_their_parameters():
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": SCHEMA}},
        {"type": "function", "function": {"name": "g"}},
        {"type": "other"},
    ]
    assert tool_schemas(tools) == {"f": SCHEMA, "g": {}}
