"""Hostile chat templates: each bounded in time and memory, a typed error through every door.

The reproducers from the issue — ``{{ 'a' * 10**10 }}`` (tried to allocate
10 GB), ``{% set e = 10**8 %}{{ (7**e) % 10 }}`` (ran for minutes) and
``{{ 'a ' * 50000000 }}`` (100 MB that aborted the tokenizer) — and the classes
around them. Every case runs in a child process with a time and memory
bound, so a regression fails its test instead of taking the suite down.
"""

from __future__ import annotations

import pytest

from .bounded import run_bounded
from .conftest import FAMILIES, variant

TIMEOUT_S = 45.0  # the child's bound; a healthy case ends in about a second
MEMORY_MB = 1536

SHARED = (  # 2**40 leaves in 80 list objects
    "{% set ns = namespace(a=['x'], b=['x']) %}{% for i in range(40) %}"
    "{% set ns.a = [ns.a, ns.a] %}{% set ns.b = [ns.b, ns.b] %}{% endfor %}"
)

#: name -> (template, error class, words the message must hold)
CASES = {
    "repetition_10_gb": ("{{ 'a' * 10**10 }}", "TemplateBudgetExceeded", "made by repetition"),
    "power_for_minutes": (
        "{% set e = 10**8 %}{{ (7**e) % 10 }}",
        "TemplateBudgetExceeded",
        "integer of about",
    ),
    "output_that_aborts_the_tokenizer": (
        "{{ 'a ' * 50000000 }}",
        "TemplateBudgetExceeded",
        "made by repetition",
    ),
    "nested_loops_without_output": (
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
        "TemplateBudgetExceeded",
        "time budget",
    ),
    "huge_range": ("{% for i in range(10**10) %}{% endfor %}", "TokenizerError", "Range too big"),
    "macro_recursion": (
        "{% macro f(n) %}{{ f(n + 1) ~ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "TokenizerError",
        "",
    ),
    "join_blowup": (
        "{{ (['x' * 1000000] * 10000)|join }}",
        "TemplateBudgetExceeded",
        "'join' filter",
    ),
    "format_width": ("{{ '{:>999999999}'.format(1) }}", "TemplateBudgetExceeded", "field"),
    "percent_width": ("{{ '%999999999d' % 1 }}", "TemplateBudgetExceeded", "field"),
    "replace_blowup": (
        "{{ ('x' * 1000000).replace('x', 'y' * 10000) }}",
        "TemplateBudgetExceeded",
        "after replacement",
    ),
    "doubling_concatenation": (
        "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s|length }}",
        "TemplateBudgetExceeded",
        "",
    ),
    "shared_structure_printed": (SHARED + "{{ ns.a }}", "TemplateBudgetExceeded", "printed"),
    "shared_structure_compared": (
        SHARED + "{{ ns.a == ns.b }}",
        "TemplateBudgetExceeded",
        "compared value",
    ),
    "shared_structure_sorted": (
        SHARED + "{{ [ns.a, ns.b]|sort|length }}",
        "TemplateBudgetExceeded",
        "'sort' filter",
    ),
    "accumulating_megabytes": (
        "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}"
        "{% set ns.l = ns.l + ['x' * 1000000] %}{% endfor %}{{ ns.l|length }}",
        "TemplateBudgetExceeded",
        "in all",
    ),
    "big_filter_widths": ("{{ 'a'|center(10**10) }}", "TemplateBudgetExceeded", "field"),
}

API = """
from mlx_loom.text import Tokenizer
tok = Tokenizer.from_dir(ARGS["path"])
tok.apply_chat_template([{"role": "user", "content": "hi"}])
"""


def with_template(src, target, template: str):
    return variant(src, target, files={"chat_template.jinja": template})


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_hostile_template_is_a_typed_error_within_its_bounds(case, family_dirs, tmp_path):
    template, error, needle = CASES[case]
    path = with_template(family_dirs["llama"], tmp_path / "m", template)
    outcome = run_bounded(API, args={"path": str(path)}, timeout_s=TIMEOUT_S, memory_mb=MEMORY_MB)
    outcome.expect_error(error, needle)
    assert outcome.seconds < 20, outcome.describe()
    assert outcome.peak_rss_mb < 1024, outcome.describe()


# --- every door, every family: the first reproducer ---------------------------------------

BOMB = CASES["repetition_10_gb"][0]


@pytest.fixture
def hostile_dirs(family_dirs, tmp_path) -> dict[str, str]:
    return {name: str(with_template(family_dirs[name], tmp_path / name, BOMB)) for name in FAMILIES}


def test_the_api_refuses_for_every_family(hostile_dirs):
    code = """
    import mlx_loom
    from mlx_loom.errors import TemplateBudgetExceeded
    out = {}
    for name, path in ARGS["dirs"].items():
        model, tok = mlx_loom.load(path)
        try:
            ids = tok.encode_chat([{"role": "user", "content": "hi"}])
            out[name] = "rendered"
        except TemplateBudgetExceeded as err:
            out[name] = err.message
    RESULT = out
    """
    result = run_bounded(code, args={"dirs": hostile_dirs}, timeout_s=TIMEOUT_S).expect_ok()
    assert set(result) == set(FAMILIES)
    assert all("made by repetition" in message for message in result.values()), result


CLI = """
import contextlib, io, sys
from mlx_loom.cli.main import main
out = {}
for name, path in ARGS["dirs"].items():
    sys.stdin = io.StringIO("hello\\nagain\\n")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        out[name] = {"code": main([*ARGS["argv"], "--model", path]), "stderr": err.getvalue()}
RESULT = out
"""


def test_loom_generate_exits_1_with_the_error_for_every_family(hostile_dirs):
    args = {"dirs": hostile_dirs, "argv": ["generate", "hello", "-m", "2"]}
    result = run_bounded(CLI, args=args, timeout_s=TIMEOUT_S).expect_ok()
    for name in FAMILIES:
        assert result[name]["code"] == 1, result[name]
        assert "made by repetition" in result[name]["stderr"]
        assert "fix:" in result[name]["stderr"]


def test_loom_chat_reports_each_refused_turn_and_keeps_going_for_every_family(hostile_dirs):
    args = {"dirs": hostile_dirs, "argv": ["chat", "-m", "2"]}
    result = run_bounded(CLI, args=args, timeout_s=TIMEOUT_S).expect_ok()
    for name in FAMILIES:
        # both typed lines were refused, each with its message and fix; the chat then
        # ended normally at the end of its input
        assert result[name]["code"] == 0, result[name]
        assert result[name]["stderr"].count("made by repetition") == 2
        assert result[name]["stderr"].count("fix:") == 2


def test_the_server_answers_400_and_keeps_serving_for_every_family(hostile_dirs):
    code = """
    import http.client, json
    import mlx_loom
    from mlx_loom.serve import make_server
    out = {}
    for name, path in ARGS["dirs"].items():
        model, tok = mlx_loom.load(path)
        server = make_server(model, tok, host="127.0.0.1", port=0)
        server.start_in_background()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                         headers={"Content-Type": "application/json"})
            reply = conn.getresponse()
            error = json.loads(reply.read())["error"]
            conn.request("GET", "/health")
            health = conn.getresponse()
            health.read()
            out[name] = {"status": reply.status, "error": error, "health": health.status}
        finally:
            server.stop()
    RESULT = out
    """
    result = run_bounded(code, args={"dirs": hostile_dirs}, timeout_s=TIMEOUT_S).expect_ok()
    for name in FAMILIES:
        answer = result[name]
        assert answer["status"] == 400 and answer["health"] == 200, answer
        assert answer["error"]["code"] == "template_budget_exceeded"
        assert answer["error"]["param"] == "messages" and answer["error"]["fix"]
        assert "made by repetition" in answer["error"]["message"]


def test_the_server_budget_flag_reaches_the_template(family_dirs, tmp_path):
    # A template that is fine under the default budget and too long under a tiny one.
    path = with_template(family_dirs["llama"], tmp_path / "m", "{{ 'x' * 200 }}")
    code = """
    import contextlib, io, threading, time, http.client, json, socket
    from mlx_loom.cli.main import main
    import mlx_loom.cli.serve_cmd as serve_cmd
    made = {}
    real = serve_cmd.make_server
    def capture(*args, **kwargs):
        made["server"] = real(*args, **kwargs)
        return made["server"]
    serve_cmd.make_server = capture
    thread = threading.Thread(
        target=main,
        args=(["serve", "--model", ARGS["path"], "--port", "0", "--template-max-output", "100"],),
        daemon=True,
    )
    with contextlib.redirect_stderr(io.StringIO()):
        thread.start()
        while "server" not in made:
            time.sleep(0.05)
        server = made["server"]
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        reply = conn.getresponse()
        RESULT = {"status": reply.status, "error": json.loads(reply.read())["error"]}
        server.shutdown()
        thread.join(10)
    """
    result = run_bounded(code, args={"path": str(path)}, timeout_s=TIMEOUT_S).expect_ok()
    assert result["status"] == 400 and "the limit is 100" in result["error"]["message"]


@pytest.mark.parametrize("key", ["template_budget", "budget", "special_tokens", "tokenize", "self"])
def test_chat_template_kwargs_cannot_reach_the_renderers_own_arguments(family_dirs, key):
    import mlx_loom

    from ..server.conftest import serve

    model, tok = mlx_loom.load(family_dirs["llama"])
    for client in serve(model, tok):
        body = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1,
            "chat_template_kwargs": {key: 1},
        }
        reply = client.post("/v1/chat/completions", body)
        assert reply.status == 400, reply.text
        assert reply.error["param"] == "chat_template_kwargs" and key in reply.error["message"]
