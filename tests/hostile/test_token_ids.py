"""Token ids past the vocabulary: refused with a RequestError naming the id and the size.

Before the check, ``model(mx.array([[100000]]))`` made the embedding gather
read past its table (a segfault on the bundled model, garbage elsewhere) and
``-1`` silently wrapped to the last row. Each case runs in a child process:
a regression may crash.
"""

from __future__ import annotations

import pytest

from .bounded import run_bounded

_LOAD = """
import dataclasses
import mlx.core as mx
import mlx_loom
from mlx_loom.engine import Engine, make_request
model, tok = mlx_loom.load(ARGS["path"])
vocab = model.vocab_size
"""


@pytest.mark.parametrize(
    "ids",
    ["mx.array([[100000]])", "mx.array([[1, 2, vocab]])", "mx.array([[3, -1]])",
     "mx.array([[-1]]).astype(mx.uint32)", "mx.array([[2**31 - 1]])"],
)
def test_the_model_call_refuses_ids_outside_the_vocabulary(family_dirs, ids):
    outcome = run_bounded(
        _LOAD + f"model({ids}, cache=model.make_cache())",
        args={"path": str(family_dirs["llama"])},
        timeout_s=60,
    )
    outcome.expect_error("RequestError", "outside the vocabulary (size", "valid ids are 0..")


def test_the_message_names_the_id(family_dirs):
    outcome = run_bounded(
        _LOAD + "model(mx.array([[5, 100000, 7]]))",
        args={"path": str(family_dirs["gemma4_text"])},
        timeout_s=60,
    )
    outcome.expect_error("RequestError", "Token id 100000 is outside")


def test_ids_inside_the_vocabulary_still_run(family_dirs):
    outcome = run_bounded(
        _LOAD + "RESULT = list(model(mx.array([[0, vocab - 1]])).shape)",
        args={"path": str(family_dirs["llama"])},
        timeout_s=60,
    )
    assert outcome.expect_ok()[1] == 2


def test_a_hand_built_engine_request_is_refused_at_insert(family_dirs):
    outcome = run_bounded(
        _LOAD
        + """
request = dataclasses.replace(make_request(model, tok, [1, 2, 3], max_tokens=2),
                              prompt=(1, 100000))
Engine(model).insert([request])
""",
        args={"path": str(family_dirs["llama"])},
        timeout_s=60,
    )
    outcome.expect_error("RequestError", "Token id 100000")
