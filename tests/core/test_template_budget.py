"""Specification of the chat-template budget: time and size bounds, each a typed error.

Each hostile case here is sized so that, if its guard regressed, the test
would fail on a wrong result or a missing error rather than exhaust the
machine: budgets are small (1,000 characters) and the attempted sizes
moderate. The exact reproducers from the issue (10 GB, minutes of CPU) run in
bounded child processes in ``tests/hostile``.
"""

from __future__ import annotations

import json
import time

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlx_loom.errors import RequestError, TemplateBudgetExceeded, TokenizerError
from mlx_loom.text import TemplateBudget, Tokenizer
from mlx_loom.text import chat_template as ct
from mlx_loom.text.template_budget import (
    CREATED_FACTOR,
    DEFAULT_MAX_OUTPUT_CHARS,
    DEFAULT_TIMEOUT_S,
    ENV_MAX_OUTPUT,
    ENV_TIMEOUT,
    MAX_FIELD_WIDTH,
    MAX_INT_BITS,
    MAX_TEMPLATE_CHARS,
)

SMALL = TemplateBudget(timeout_s=5.0, max_output_chars=1000)
HI = [{"role": "user", "content": "hi"}]
SHARED = (  # 2**30 leaves in 60 list objects
    "{% set ns = namespace(a=['x'], b=['x']) %}{% for i in range(30) %}"
    "{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}{% endfor %}"
)


def render(source: str, budget: TemplateBudget = SMALL, **variables) -> str:
    return ct.ChatTemplate(source, origin="test").render(
        HI, add_generation_prompt=False, budget=budget, **variables
    )


def refused(source: str, *needles: str, budget: TemplateBudget = SMALL) -> TemplateBudgetExceeded:
    start = time.monotonic()
    with pytest.raises(TemplateBudgetExceeded) as info:
        render(source, budget)
    assert time.monotonic() - start < 3.0, "the refusal took too long"
    err = info.value
    assert err.fix and "(template from test)" in err.message
    for needle in needles:
        assert needle in err.message, err.message
    return err


# --- the budget itself -----------------------------------------------------------


def test_defaults_are_one_second_and_two_mebi_characters():
    budget = TemplateBudget()
    assert (budget.timeout_s, budget.max_output_chars) == (DEFAULT_TIMEOUT_S, 2 * 1024 * 1024)
    assert budget.max_created_chars == CREATED_FACTOR * DEFAULT_MAX_OUTPUT_CHARS


def test_the_environment_overrides_the_defaults():
    budget = TemplateBudget.from_env({ENV_TIMEOUT: "2.5", ENV_MAX_OUTPUT: "4096"})
    assert (budget.timeout_s, budget.max_output_chars) == (2.5, 4096)


def test_an_unparsable_environment_value_is_a_request_error_naming_the_variable():
    with pytest.raises(RequestError, match=f"{ENV_TIMEOUT}='soon' is not a number"):
        TemplateBudget.from_env({ENV_TIMEOUT: "soon"})


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "5000"])
def test_an_out_of_range_timeout_is_refused_by_name(value):
    with pytest.raises(RequestError, match=ENV_TIMEOUT) as info:
        TemplateBudget.from_env({ENV_TIMEOUT: value})
    assert info.value.fix


def test_replaced_keeps_fields_that_are_not_given():
    budget = TemplateBudget(timeout_s=3.0).replaced(
        {"timeout_s": None, "max_output_chars": 77}, names={}
    )
    assert (budget.timeout_s, budget.max_output_chars) == (3.0, 77)


def test_a_bad_flag_value_names_the_flag():
    with pytest.raises(RequestError, match="--template-max-output=0 is invalid"):
        TemplateBudget().replaced(
            {"max_output_chars": 0}, names={"max_output_chars": "--template-max-output"}
        )


# --- operations that grow data are sized before they run ----------------------------


def test_string_repetition_past_the_budget_is_refused_before_it_is_built():
    refused("{{ 'ab' * 100000 }}", "string made by repetition would be 200000")


def test_list_repetition_past_the_budget_is_refused():
    refused("{{ ([1, 2] * 100000)|length }}", "list made by repetition")


def test_repetition_within_the_budget_renders():
    assert render("{{ 'ab' * 3 }}") == "ababab"


def test_concatenation_that_doubles_a_string_is_stopped_at_the_budget():
    doubling = (
        "{% set ns = namespace(s='x') %}{% for i in range(40) %}"
        "{% set ns.s = ns.s OP ns.s %}{% endfor %}"
    )
    refused(doubling.replace("OP", "+") + "{{ ns.s }}", "made by concatenation")
    refused(doubling.replace("OP", "~") + "{{ ns.s }}", "would be")


def test_a_huge_power_is_refused_without_computing_it():
    refused("{% set e = 10**8 %}{{ (7**e) % 10 }}", "an integer of about", str(MAX_INT_BITS))


def test_repeated_squaring_is_refused_at_the_integer_bound():
    refused(
        "{% set ns = namespace(x=3) %}{% for i in range(30) %}{% set ns.x = ns.x * ns.x %}"
        "{% endfor %}{{ ns.x > 0 }}",
        "an integer of about",
    )


def test_ordinary_arithmetic_is_unaffected():
    assert render("{{ 2**10 }} {{ 7 * 6 }} {{ 10 % 3 }} {{ 1 + 2 }} {{ 'a' + 'b' }}") == (
        "1024 42 1 3 ab"
    )


@pytest.mark.parametrize(
    "source",
    [
        "{{ '%99999d' % 1 }}",
        "{{ '%*d' % (99999, 1) }}",
        "{{ '%.99999f' % 1.5 }}",
        "{{ '{:>99999}'.format(1) }}",
        "{{ '{:>{w}}'.format(1, w=99999) }}",
        "{{ '{a:>99999}'.format_map({'a': 1}) }}",
        "{{ '%99999s'|format('x') }}",
        "{{ 'a'|center(99999) }}",
        "{{ 'a'.rjust(99999) }}",
        "{{ 'a'.zfill(99999) }}",
    ],
)
def test_a_format_field_wider_than_the_limit_is_refused(source):
    refused(source, f"the limit is {MAX_FIELD_WIDTH}")


def test_narrow_format_fields_render():
    assert render("{{ '%03d|%.2f' % (7, 1.5) }} {{ '{:>4}'.format('x') }}") == "007|1.50    x"


def test_many_format_fields_add_up_to_the_budget():
    refused("{{ ('%100s' * 50) % (('x',) * 50) }}", "formatted string")


def test_a_mapping_value_written_by_many_fields_adds_up_to_the_budget():
    refused("{{ ('%(a)s' * 30) % {'a': 'x' * 100} }}", "formatted string")


def test_percent_fields_take_their_own_values():
    # one big value and one small: sized as written, not as twice the biggest
    assert render("{{ (('%s|%s') % ('x' * 600, 'y'))|length }}") == "602"
    assert render("{{ '%*.*f' % (6, 2, 3.14159) }}") == "  3.14"


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("{{ ('x' * 500).replace('x', 'yyyyy') }}", "string after replacement"),
        ("{{ ('x' * 500)|replace('x', 'yyyyy') }}", "string after replacement"),
        ("{{ ('\\t' * 500).expandtabs(8) }}", "tabs expanded"),
        ("{{ ('a' * 500).translate({97: 'bbbbb'}) }}", "translated string"),
        ("{{ ('a\\n' * 300)|indent(8) }}", "indented string"),
        ("{% set n = 5000 %}{{ [1]|batch(n, 'x')|list|length }}", "'batch' filter"),
        ("{% set n = 5000 %}{{ [1]|slice(n, 'x')|list|length }}", "'slice' filter"),
        ("{{ ('word ' * 150)|wordwrap(2, wrapstring='<br>') }}", "wrapped string"),
        ("{{ (['abcd'] * 300)|join('-') }}", "'join' filter"),
        ("{{ '-'.join(['abcd'] * 300) }}", "call argument"),
    ],
)
def test_filters_and_methods_that_grow_their_input_are_sized_first(source, needle):
    refused(source, needle)


def test_a_join_over_a_generator_is_sized_too():
    refused("{{ '-'.join((['abcd'] * 300)|map('upper')) }}", "would be")


def test_slow_filters_refuse_oversized_input():
    budget = TemplateBudget(max_output_chars=10_000_000)
    refused("{{ ('a ' * 200000)|wordwrap(5) }}", "'wordwrap' filter", budget=budget)
    refused("{{ (range(1000)|list * 200)|sort|length }}", "'sort' filter", budget=budget)


# --- no C-level walk over shared structure ----------------------------------------


@pytest.mark.parametrize(
    ("use", "needle"),
    [
        ("{{ ns.a }}", "printed value"),
        ("{{ ns.a == ns.b }}", "compared value"),
        ("{{ ns.a in [ns.b] }}", "compared value"),
        ("{{ ns.a ~ '' }}", "concatenated value"),
        ("{{ ns.a|tojson }}", "'tojson' filter"),
        ("{{ ns.a|string }}", "'string' filter"),
        ("{{ [ns.a, ns.b]|unique|list|length }}", "'unique' filter"),
        ("{{ ns.a is eq ns.b }}", "'eq' test"),
        ("{{ [ns.a].index(ns.b) }}", "call argument"),
        ("{{ '%s' % [ns.a] }}", "formatted value"),
        ("{{ '{}'.format(ns.a) }}", "call argument"),
    ],
)
def test_exponentially_shared_lists_are_refused_before_python_walks_them(use, needle):
    refused(SHARED + use, needle)


def test_tuple_keys_of_shared_structure_are_refused_before_hashing():
    shared_tuple = (
        "{% set ns = namespace(t=('x',)) %}{% for i in range(30) %}"
        "{% set ns.t = (ns.t, ns.t) %}{% endfor %}"
    )
    refused(shared_tuple + "{% set d = {ns.t: 1} %}{{ d|length }}", "dictionary key")
    refused(shared_tuple + "{{ {'k': 1}[ns.t] }}", "dictionary key")


def test_a_namespace_that_contains_itself_is_refused_when_printed():
    refused("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}", "contains itself")


def test_shallow_filters_do_not_measure_their_input():
    # length, first, list ... only touch references: no look, no refusal
    assert render(SHARED + "{{ ns.a|length }} {{ (ns.a|first)|length }}") == "2 2"


# --- time ------------------------------------------------------------------------


def test_nested_loops_with_no_output_stop_at_the_deadline():
    budget = TemplateBudget(timeout_s=0.3, max_output_chars=1000)
    start = time.monotonic()
    refused(
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "time budget of 0.3 s",
        budget=budget,
    )
    assert time.monotonic() - start < 2.0


def test_a_macro_that_recurses_forever_is_a_tokenizer_error():
    with pytest.raises(TokenizerError, match="recursed too deeply"):
        render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}")


def test_range_stays_bounded_by_the_sandbox():
    with pytest.raises(TokenizerError, match="Range too big"):
        render("{{ range(10**9)|list|length }}")


def test_a_huge_raised_message_is_clipped_in_the_error():
    with pytest.raises(TokenizerError) as info:
        render("{{ raise_exception('x' * 900) }}")
    assert len(info.value.message) < 700 and "400 more characters" in info.value.message


def test_lipsum_is_not_available():
    with pytest.raises(TokenizerError, match="'lipsum' is undefined"):
        render("{{ lipsum(10**9) }}")


# --- output and everything built --------------------------------------------------


def test_output_past_the_budget_is_refused_as_it_streams():
    refused("{% for i in range(200) %}{{ 'abcdefghij' }}{% endfor %}", "output passed its budget")


def test_output_exactly_at_the_budget_renders():
    assert len(render("{% for i in range(100) %}{{ 'abcdefghij' }}{% endfor %}")) == 1000


def test_building_more_than_the_created_budget_is_refused():
    refused(
        "{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
        "{% set ns.l = ns.l + ['x' * 900] %}{% endfor %}{{ ns.l|length }}",
        "in all",
    )


# --- compiling ---------------------------------------------------------------------


def test_a_source_past_the_size_limit_is_refused_before_compiling():
    with pytest.raises(TemplateBudgetExceeded, match=str(MAX_TEMPLATE_CHARS)):
        ct.ChatTemplate("x" * (MAX_TEMPLATE_CHARS + 1), origin="big").compile()


def test_nesting_too_deep_to_compile_is_a_tokenizer_error():
    with pytest.raises(TokenizerError, match="does not compile"):
        ct.ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", origin="deep").compile()


def test_constants_are_folded_at_compile_time_only_within_the_default_budget():
    # jinja computes constant filter calls while compiling; past the default
    # budget it gives up, and the call runs (and is refused) at render time.
    folded = ct.ChatTemplate("{{ [1]|batch(5000, 'x')|list|length }}", origin="test")
    assert folded.render(HI, add_generation_prompt=False, budget=SMALL) == "1"


def test_a_hostile_constant_is_refused_at_render_not_while_folding():
    template = ct.ChatTemplate("{{ 'a'|center(999999999) }}", origin="test")
    template.compile()  # jinja tried to fold the filter; the guard made it give up
    with pytest.raises(TemplateBudgetExceeded):
        template.render(HI, add_generation_prompt=False, budget=SMALL)


def test_filters_registered_later_are_wrapped_too():
    env = ct._environment()
    env.filters["shout"] = lambda s: s.upper()
    env.filters.update({"twice": lambda s: s * 2})
    assert all(getattr(env.filters[n], "_loom_budgeted", False) for n in ("shout", "twice"))


# --- ordinary templates render exactly as in jinja's stock sandbox -------------------

ORDINARY = [
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}:{{ m.role }}"
    "{% if not loop.last %},{% endif %}{% endfor %}",
    "{% for m in messages if m.role == 'user' %}{{ m.content|trim|upper }}{% else %}none"
    "{% endfor %}",
    "{{ 1 < 2 < 3 }} {{ 3 > 2 > 5 }} {{ 'a' in 'abc' }} {{ 'z' not in ['a'] }} {{ 1 == 1.0 }}",
    "{% set d = {'a': 1, ('k' ~ 1): 2} %}{{ d|dictsort }} {{ d.k1 }}",
    "{{ messages|map(attribute='role')|join(', ') }} {{ messages|length }}",
    "{{ [3, 1, 2]|sort|list }} {{ 'x' ~ 1 ~ none }} {{ '%s-%d' % ('a', 5) }}",
    "{% macro item(m) %}[{{ m.role }}: {{ m.content }}]{% endmacro %}"
    "{% for m in messages %}{{ item(m) }}{% endfor %}",
    "{%- for node in tree recursive %}{{ node.name }}{% if node.kids %}({{ loop(node.kids) }})"
    "{% endif %}{% endfor %}",
    "{{ messages[-1].content|tojson }} {{ {'b': [1, 2]}|tojson }} {{ ('%5.1f' % 3.14159) }}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% endfor %}{{ ns.n }} {{ messages|selectattr('role', 'eq', 'user')|list|length }}",
]


def _stock() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = ct._tojson
    env.globals["namespace"] = ct._TemplateNamespace
    return env


@pytest.mark.parametrize("source", ORDINARY)
def test_ordinary_templates_render_exactly_as_in_the_stock_sandbox(source):
    messages = [
        {"role": "system", "content": " be brief "},
        {"role": "user", "content": "Hi café"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "again"},
    ]
    tree = [{"name": "a", "kids": [{"name": "b", "kids": []}, {"name": "c", "kids": []}]}]
    want = _stock().from_string(source).render(messages=messages, tree=tree)
    got = ct.ChatTemplate(source, origin="test").render(
        messages, add_generation_prompt=False, tree=tree
    )
    assert got == want


# --- the API door -------------------------------------------------------------------


def test_the_tokenizer_takes_a_budget_per_call(tmp_path):
    from mlx_loom.testing.tokenizer import write_tokenizer

    write_tokenizer(tmp_path, 256)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m.content * 50 }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").unlink(missing_ok=True)
    tok = Tokenizer.from_dir(tmp_path)
    messages = [{"role": "user", "content": "0123456789"}]
    assert len(tok.apply_chat_template(messages)) == 500
    with pytest.raises(TemplateBudgetExceeded, match="the limit is 100"):
        tok.apply_chat_template(messages, template_budget=TemplateBudget(max_output_chars=100))
    with pytest.raises(TemplateBudgetExceeded):
        tok.encode_chat(messages, template_budget=TemplateBudget(max_output_chars=100))
