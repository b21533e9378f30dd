"""Request values a remote client chooses: each costs linear work and gets a typed 400.

Before these bounds, a tool list with one duplicate name took minutes of CPU
to refuse (a ``names.count`` per name), and integers and floats that Python
holds exactly but the engine cannot (``penalty_context_size: 10**18``,
``temperature: 1e308``, ``logit_bias: 1e39``) were a 500 or a body holding
bare ``NaN``/``-Infinity``, which strict JSON parsers reject.
"""

from __future__ import annotations

import pytest

from .bounded import run_bounded
from .test_server_prompts import SERVER_IN_CHILD

#: The request body limit of ``loom serve`` (``MAX_BODY_BYTES``).
BODY_LIMIT = 8 * 1024 * 1024


@pytest.mark.slow
def test_preparing_the_largest_tool_list_the_body_limit_admits_is_linear(family_dirs):
    # ~150,000 tools fill the 8 MiB body; one duplicate name makes the check
    # find it. Quadratic, this took about 6 minutes of CPU; linear, seconds.
    code = (
        SERVER_IN_CHILD
        + """
n = ARGS["limit"] // 56
tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(n)]
tools.append({"type": "function", "function": {"name": "f7"}})
body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools}
size = len(json.dumps(body))
assert ARGS["limit"] * 0.9 < size <= ARGS["limit"], size
RESULT = {"reply": post("/v1/chat/completions", body), "size": size}
server.stop()
"""
    )
    outcome = run_bounded(
        code,
        args={"path": str(family_dirs["llama"]), "limit": BODY_LIMIT},
        timeout_s=120,
        memory_mb=3072,
    )
    result = outcome.expect_ok()
    reply = result["reply"]
    assert reply["status"] == 400, reply
    error = reply["body"]["error"]
    assert error["code"] == "invalid_parameter" and error["param"] == "tools"
    assert "'f7'" in error["message"]
    # A generous bound for a shared, loaded machine: linear work is ~10 s here.
    assert reply["seconds"] < 60, reply["seconds"]
