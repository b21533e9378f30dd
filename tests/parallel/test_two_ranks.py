"""Two local ranks (``mlx.launch --backend ring -n 2``): every family, both modes, every door.

One launch runs every case (``ranks.py``); the tests below read what each
rank saw. The reference is a single-process run of the same checkpoint on
the same rank, so "equal" means equal to what one process produces.

Logits: pipeline parallel is bit-identical to one process (every layer runs
whole on one rank; the vocabulary split gathers whole dot products). Tensor
parallel differs only where partial products are summed across ranks: each
``all_sum`` adds two partial dot products where one process accumulates one,
a different association of the same terms. Both orders are within
``(K - 1) * eps * sum|x_i w_i|`` of the exact sum (K terms, fp32 eps 2^-24),
so they differ by at most twice that per projection, and the few
projections per layer keep the logits within a small multiple of it. At
these sizes (K <= 128) the measured largest difference is ~1e-6
(``TENSOR_LOGIT_TOLERANCE`` leaves room for 4-bit weights, whose partial
products are larger), far below the gap between the top two logits the
greedy comparisons depend on.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import pytest

from mlx_loom.cli.main import main

from .support import free_ports, run_ranks

#: One launch of two ranks runs every case: ~140 s on a loaded 2-core machine.
pytestmark = pytest.mark.slow

MODES = ("tensor", "pipeline")
API_MODELS = ("llama", "qwen3_next", "qwen3_5", "gemma4_text", "gemma4", "qwen3_moe", "gpt_oss")
QUANTIZED = ("llama-q4", "qwen3_next-q4", "gemma4_text-q4", "qwen3_moe-q4")
DOOR_MODELS = ("llama", "qwen3_next", "qwen3_5", "gemma4_text")
PROMPT = [1, 17, 42, 99, 3, 250, 7, 64]  # token ids every tiny vocabulary holds
TENSOR_LOGIT_TOLERANCE = 1e-4
GENERATE = ["--no-chat-template", "-m", "5", "-p", "-"]
GENERATE_INPUT = "a prompt only rank 0 reads"
CHAT = ["-m", "3", "--no-history"]
#: /save would write a file on every rank's machine: refused in a split chat (a
#: note), so it must not change the turns; the single-process run saves to /dev/null.
CHAT_INPUT = "hello\n/save /dev/null\n/reset\nonce more\n"
SERVE_PROMPTS = [[5, 6, 7, 8]]
#: Sent at once: each request joins and leaves the engine's batch at its own step.
SERVE_BURST = [([5, 6, 7, 8], 4), ([9, 10, 11], 6), ([5, 6, 7, 8, 12, 13], 2)]


#: The API runs every model type in both modes (the gemma4 wrapper, whose graph is
#: gemma4_text's, only tensor: its wrapper names reach the slice reader there); the
#: quantized checkpoints, which differ in how weights are sliced, tensor parallel
#: and one pipeline run.
API = [
    *[(n, m) for n in API_MODELS for m in MODES if (n, m) != ("gemma4", "pipeline")],
    *[(n, "tensor") for n in QUANTIZED],
    ("gemma4_text-q4", "pipeline"),
    ("llama-odd-vocab", "tensor"),
]
#: Each door with each family; every door sees both modes across the families
#: (the door logic does not depend on the mode; the model's does, above).
DOORS = {
    "generate": [
        ("llama", "tensor"),
        ("qwen3_next", "pipeline"),
        ("qwen3_5", "tensor"),
        ("gemma4_text", "pipeline"),
    ],
    "chat": [
        ("llama", "pipeline"),
        ("qwen3_next", "tensor"),
        ("qwen3_5", "pipeline"),
        ("gemma4_text", "tensor"),
    ],
    "serve": [
        ("llama", "tensor"),
        ("qwen3_next", "tensor"),
        ("qwen3_5", "pipeline"),
        ("gemma4_text", "pipeline"),
    ],
}


def _cases(checkpoints) -> list[dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    for name, mode in API:
        cases.append(
            {
                "id": f"api/{name}/{mode}",
                "kind": "api",
                "model": str(checkpoints[name]),
                "mode": mode,
                "prompt": PROMPT,
                "max_tokens": 4,
            }
        )
    for name, mode in DOORS["generate"]:
        cases.append(
            {
                "id": f"generate/{name}/{mode}",
                "kind": "generate",
                "argv": [
                    "generate",
                    "--model",
                    str(checkpoints[name]),
                    "--parallel",
                    mode,
                    *GENERATE,
                ],
                "stdin": GENERATE_INPUT,
            }
        )
    for name, mode in DOORS["chat"]:
        cases.append(
            {
                "id": f"chat/{name}/{mode}",
                "kind": "chat",
                "argv": ["chat", "--model", str(checkpoints[name]), "--parallel", mode, *CHAT],
                "stdin": CHAT_INPUT,
            }
        )
    for name, mode in DOORS["serve"]:
        port = free_ports(1)
        model = str(checkpoints[name])
        cases.append(
            {
                "id": f"serve/{name}/{mode}",
                "kind": "serve",
                "argv": ["serve", "--model", model, "--parallel", mode, "--port", str(port)],
                "port": port,
                "model": model,
                "prompts": SERVE_PROMPTS,
                "burst": SERVE_BURST,
                "max_tokens": 4,
            }
        )
    return cases


@pytest.fixture(scope="module")
def ranks(checkpoints, tmp_path_factory) -> list[dict[str, Any]]:
    return run_ranks(_cases(checkpoints), tmp_path_factory.mktemp("ranks"), timeout=600)


def result(ranks, case: str, rank: int = 0) -> dict[str, Any]:
    found = ranks[rank][case]
    assert "error" not in found, f"rank {rank} failed {case}:\n{found['error']}"
    return found


# --- the Python API ---------------------------------------------------------------

PIPELINE = [n for n, m in API if m == "pipeline"]
TENSOR = [n for n, m in API if m == "tensor"]


@pytest.mark.parametrize(("name", "mode"), API)
def test_greedy_tokens_equal_the_single_process_run(ranks, name, mode):
    for rank in (0, 1):
        r = result(ranks, f"api/{name}/{mode}", rank)
        assert r["tokens"] == r["ref_tokens"], f"rank {rank}"


@pytest.mark.parametrize(("name", "mode"), API)
def test_a_batch_of_rows_equals_the_single_process_batch(ranks, name, mode):
    r = result(ranks, f"api/{name}/{mode}")
    assert r["batch"] == r["ref_batch"]


@pytest.mark.parametrize("name", PIPELINE)
def test_pipeline_logits_are_bit_identical_to_one_process(ranks, name):
    for rank in (0, 1):
        assert result(ranks, f"api/{name}/pipeline", rank)["logits_equal"]


@pytest.mark.parametrize("name", TENSOR)
def test_tensor_logits_differ_only_by_the_all_sum_order(ranks, name):
    diff = result(ranks, f"api/{name}/tensor")["max_abs_diff"]
    assert diff < TENSOR_LOGIT_TOLERANCE


@pytest.mark.parametrize(("name", "mode"), API)
def test_sampling_stays_in_lock_step_across_ranks(ranks, name, mode):
    zero, one = result(ranks, f"api/{name}/{mode}", 0), result(ranks, f"api/{name}/{mode}", 1)
    assert zero["sampled"] == one["sampled"]
    assert zero["unseeded"] == one["unseeded"]


@pytest.mark.parametrize("name", PIPELINE)
def test_seeded_sampling_in_pipeline_equals_one_process(ranks, name):
    r = result(ranks, f"api/{name}/pipeline")
    assert r["sampled"] == r["ref_sampled"]


@pytest.mark.parametrize(("name", "mode"), API)
def test_each_rank_holds_about_half_the_weights(ranks, name, mode):
    for rank in (0, 1):
        r = result(ranks, f"api/{name}/{mode}", rank)
        share = r["weight_bytes"] / r["ref_weight_bytes"]
        # Norms, routers and (Gemma 4) per-layer projections stay whole on every
        # rank; pipeline stages follow layer boundaries, and Gemma 4's tiny
        # config keeps its KV donors with the layers that share them.
        assert share < (0.8 if mode == "pipeline" else 0.62), f"rank {rank}: {share:.2f}"
    total = sum(result(ranks, f"api/{name}/{mode}", k)["weight_bytes"] for k in (0, 1))
    assert total >= result(ranks, f"api/{name}/{mode}")["ref_weight_bytes"]


@pytest.mark.parametrize("name", TENSOR)
def test_tensor_ranks_read_their_slices_from_the_files(ranks, name):
    for rank in (0, 1):
        r = result(ranks, f"api/{name}/tensor", rank)
        assert r["sliced_bytes_read"] > 0.3 * r["ref_weight_bytes"]
        if name.startswith("llama") or name in QUANTIZED:
            # Checkpoints in the graph's own layout (Hugging Face Llama, MLX-converted
            # ones): every split tensor is read as a slice, none whole.
            assert r["sliced_whole"] == [], r["sliced_whole"]


@pytest.mark.parametrize("name", [n for n in PIPELINE if n in API_MODELS])
def test_pipeline_ranks_run_contiguous_layer_ranges_with_their_own_caches(ranks, name):
    zero, one = result(ranks, f"api/{name}/pipeline", 0), result(ranks, f"api/{name}/pipeline", 1)
    assert zero["layers"][0] == 0 and zero["layers"][1] == one["layers"][0]
    assert zero["caches"] + one["caches"] == zero["ref_caches"]
    assert "parallel='pipeline' rank 1/2" in one["repr"]


# --- loom generate / chat / serve --------------------------------------------------


def _single_process(argv: list[str], stdin: str, monkeypatch) -> str:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert main(argv) == 0, err.getvalue()
    return out.getvalue()


@pytest.mark.parametrize(("name", "mode"), DOORS["generate"])
def test_loom_generate_prints_on_rank_0_what_one_process_prints(
    ranks, checkpoints, monkeypatch, name, mode
):
    zero = result(ranks, f"generate/{name}/{mode}", 0)
    one = result(ranks, f"generate/{name}/{mode}", 1)
    assert zero["code"] == one["code"] == 0, zero["stderr"]
    argv = ["generate", "--model", str(checkpoints[name]), *GENERATE]
    assert zero["stdout"] == _single_process(argv, GENERATE_INPUT, monkeypatch)
    assert f"Parallel: {mode} across 2 ranks; peak memory per rank:" in zero["stderr"]
    assert one["stdout"] == one["stderr"] == ""


@pytest.mark.parametrize(("name", "mode"), DOORS["chat"])
def test_loom_chat_follows_rank_0s_input_turn_by_turn(ranks, checkpoints, monkeypatch, name, mode):
    zero, one = result(ranks, f"chat/{name}/{mode}", 0), result(ranks, f"chat/{name}/{mode}", 1)
    assert zero["code"] == one["code"] == 0, zero["stderr"]
    argv = ["chat", "--model", str(checkpoints[name]), *CHAT]
    assert zero["stdout"] == _single_process(argv, CHAT_INPUT, monkeypatch)
    assert "(conversation reset)" in zero["stderr"]
    assert "(/save and /load are not available in a split chat)" in zero["stderr"]
    assert one["stdout"] == one["stderr"] == ""


@pytest.mark.parametrize(("name", "mode"), DOORS["serve"])
def test_loom_serve_answers_like_one_process_and_survives_a_dropped_stream(ranks, name, mode):
    zero, one = result(ranks, f"serve/{name}/{mode}", 0), result(ranks, f"serve/{name}/{mode}", 1)
    assert "client_error" not in zero, zero["client_error"]
    assert zero["code"] == one["code"] == 0, zero["stderr"]
    for replies in (zero["before"], zero["after"]):
        assert [status for status, _ in replies] == [200] * len(SERVE_PROMPTS)
        assert [body["choices"][0]["text"] for _, body in replies] == zero["expected"]
    assert zero["dropped_after"] == 2
    assert "serving" in zero["stderr"] and one["stderr"] == ""


@pytest.mark.parametrize(("name", "mode"), DOORS["serve"])
def test_loom_serve_batches_concurrent_requests_in_step_across_ranks(ranks, name, mode):
    zero = result(ranks, f"serve/{name}/{mode}", 0)
    assert "client_error" not in zero, zero["client_error"]
    assert [status for status, _ in zero["burst"]] == [200] * len(SERVE_BURST)
    texts = [body["choices"][0]["text"] for _, body in zero["burst"]]
    assert texts == zero["expected_burst"]
    assert zero["peak_decoding"] >= 2  # they did share a decode batch
