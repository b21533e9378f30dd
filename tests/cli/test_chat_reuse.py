"""``loom chat`` reuses each earlier turn for every family, including caches that cannot trim.

Qwen3-Next's recurrent state and Gemma 4's sliding windows (which wrap once
a prompt is longer than the window) cannot be trimmed back; the prompt cache
steps back to its checkpoint at the last turn boundary instead. Each turn's
prompt must then be served mostly from the cache, not prefilled again.
"""

from __future__ import annotations

import re

import pytest

from .conftest import FAMILIES, family_checkpoint

REUSED = re.compile(r"Prompt: (\d+) tokens(?: \((\d+) reused from cache\))?")
#: A first turn longer than Gemma 4's tiny sliding window, so the window wraps.
TURNS = "".join(
    [
        "Tell me about " + "the quiet river and the old mill by the bridge " * 6 + "\n",
        "and then?\n",
        "and after that?\n",
    ]
)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-reuse")
    return {t: family_checkpoint(root, t) for t in FAMILIES}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_every_turn_after_the_first_reuses_the_conversation_so_far(
    chat, family_dirs, model_type
):
    code, _, err = chat(
        "--model", str(family_dirs[model_type]), "-m", "8", "--temp", "0", "--stats", input=TURNS
    )
    assert code == 0, err
    turns = [(int(p), int(c or 0)) for p, c in REUSED.findall(err)]
    assert len(turns) == 3, err
    assert turns[0][1] == 0
    for (before, _), (prompt, reused) in zip(turns, turns[1:], strict=False):
        # The earlier prompt is checkpointed at its end (the reply after it is
        # prefilled again on caches that cannot trim, to stay exact).
        assert reused >= 0.8 * before, (model_type, turns)
        assert reused < prompt


def test_every_chat_reply_follows_the_json_schema_file(chat, tmp_path):
    import json

    schema = tmp_path / "s.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["n"],
                "additionalProperties": False,
            }
        )
    )
    args = ("--model", "tiny", "-m", "40", "--temp", "1.0", "--seed", "3")
    code, out, err = chat(*args, "--json-schema", str(schema), input="hi\nand again\n")
    assert code == 0, err
    replies = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert len(replies) == 2, out
    assert all(set(r) == {"n"} and 0 <= r["n"] <= 9 for r in replies)
