"""The conformance kit itself: checkpoints, tokenizer, host isolation, and that each check
passes a conforming plugin and catches the fault it is named for."""

from __future__ import annotations

import json
import time

import mlx.core as mx
import pytest

from mlx_loom.artifacts import read_manifest
from mlx_loom.plugin import BATCH, GENERATE, PLUGIN_API_VERSION, PROMPT_CACHE, hookimpl
from mlx_loom.testing import run_conformance, write_checkpoint, write_tokenizer
from mlx_loom.text import Tokenizer

from .conformance_variants import (
    NAME,
    LyingTrimKVCache,
    NoMergeKVCache,
    Variant,
    forgets_a_tensor,
    lenient_loader,
    noisy_logits,
    render_and_import,
    with_caches,
)

TENSORS = {
    "model.embed_tokens.weight": ((256, 32), "float32"),
    "model.layers.0.input_layernorm.weight": ((32,), "bfloat16"),
    "lm_head.weight": ((256, 32), "F16"),
}


@pytest.fixture(scope="module")
def kitlm(tmp_path_factory):
    return render_and_import(tmp_path_factory.mktemp("kit"))


@pytest.fixture(scope="module")
def conforming_report(kitlm, tmp_path_factory):
    return run_conformance(NAME, plugin=kitlm, workdir=tmp_path_factory.mktemp("ok"))


def statuses(report, check):
    return {r.name: r.status for r in report.results if r.name.split("[")[0] == check}


# --- checkpoints and tokenizer ---------------------------------------------------


def test_checkpoint_holds_exactly_the_declared_tensors_shapes_and_dtypes(tmp_path):
    path = write_checkpoint(tmp_path / "m", {"model_type": "x", "vocab_size": 256}, TENSORS)
    manifest = read_manifest(path)
    assert {k: (v.shape, v.dtype) for k, v in manifest.items()} == {
        "model.embed_tokens.weight": ((256, 32), "F32"),
        "model.layers.0.input_layernorm.weight": ((32,), "BF16"),
        "lm_head.weight": ((256, 32), "F16"),
    }
    assert json.loads((path / "config.json").read_text()) == {"model_type": "x", "vocab_size": 256}


def test_checkpoint_weights_are_small_and_norm_gains_are_near_one(tmp_path):
    path = write_checkpoint(tmp_path / "m", {"vocab_size": 256}, TENSORS, tokenizer=False)
    w = mx.load(str(path / "model.safetensors"))
    assert 0.01 < mx.std(w["model.embed_tokens.weight"]).item() < 0.03
    gain = w["model.layers.0.input_layernorm.weight"].astype(mx.float32)
    assert abs(mx.mean(gain).item() - 1.0) < 0.02


def test_checkpoint_is_reproducible_from_its_seed(tmp_path):
    a = write_checkpoint(tmp_path / "a", {"vocab_size": 256}, TENSORS, seed=3, tokenizer=False)
    b = write_checkpoint(tmp_path / "b", {"vocab_size": 256}, TENSORS, seed=3, tokenizer=False)
    c = write_checkpoint(tmp_path / "c", {"vocab_size": 256}, TENSORS, seed=4, tokenizer=False)
    wa, wb, wc = (mx.load(str(p / "model.safetensors")) for p in (a, b, c))
    assert all(mx.array_equal(wa[k], wb[k]).item() for k in wa)
    assert not mx.array_equal(wa["lm_head.weight"], wc["lm_head.weight"]).item()


def test_checkpoint_with_tokenizer_is_written_in_under_a_second(tmp_path):
    start = time.perf_counter()
    write_checkpoint(tmp_path / "m", {"vocab_size": 256}, TENSORS)
    assert time.perf_counter() - start < 1.0


def test_tokenizer_fits_the_config_vocab_and_round_trips_text(tmp_path):
    write_tokenizer(tmp_path, vocab_size=128)
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode("the model reads a token")
    assert tok.vocab_size <= 128 and max(ids) < 128
    assert tok.decode(ids) == "the model reads a token"


def test_tokenizer_has_a_chat_template_and_an_eos(tmp_path):
    write_tokenizer(tmp_path, vocab_size=256)
    tok = Tokenizer.from_dir(tmp_path)
    ids = tok.encode_chat([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_ids == {tok.token_to_id("<|im_end|>")}


def test_tokenizer_refuses_a_vocab_too_small_for_its_alphabet(tmp_path):
    with pytest.raises(ValueError, match="vocab_size=40 is too small"):
        write_tokenizer(tmp_path, vocab_size=40)


# --- pytest fixtures -----------------------------------------------------------------


def test_loom_host_fixture_holds_only_the_plugins_handed_in(loom_host, kitlm, monkeypatch):
    monkeypatch.setenv("MLX_LOOM_PLUGINS", "")  # the fixture's host ignores the environment
    host = loom_host((NAME, kitlm))
    assert [r.name for r in host.records] == [NAME]
    assert set(host.registry.model_types) == {NAME}


def test_loom_tiny_checkpoint_fixture_writes_what_the_model_type_declares(
    loom_host, loom_tiny_checkpoint, kitlm
):
    host = loom_host((NAME, kitlm))
    path = loom_tiny_checkpoint(NAME, host=host)
    declared = kitlm.checkpoint_tensors(kitlm.TINY_CONFIG)
    assert set(read_manifest(path)) == set(declared)
    assert (path / "tokenizer.json").is_file()


def test_loom_conformance_fixture_runs_the_suite(loom_conformance, kitlm):
    report = loom_conformance(NAME, plugin=kitlm)
    assert report.passed, report.format()


# --- the suite on a conforming plugin ----------------------------------------------


def test_a_conforming_plugin_passes_every_check_that_applies(conforming_report):
    assert conforming_report.passed, conforming_report.format()
    names = [r.name.split("[")[0] for r in conforming_report.results]
    for check in (
        "hooks",
        "registrations",
        "no-collisions",
        "construct",
        "implementations",
        "forward",
        "incremental-decode",
        "greedy-determinism",
        "weight-coverage",
        "cache-trim",
        "prompt-cache-reuse",
        "state-round-trip",
        "batch-rows",
        "batch-equals-single",
    ):
        assert check in names


def test_capability_checks_not_declared_are_skipped_and_say_so(conforming_report):
    spec = conforming_report.result(f"speculative-rounds[{NAME}]")
    assert spec.status == "skip"
    assert spec.line() == f"SKIP speculative-rounds[{NAME}] — (capability not declared)"


def test_report_lines_name_status_check_and_detail(conforming_report):
    line = conforming_report.result(f"forward[{NAME}]").line()
    assert line.startswith(f"PASS forward[{NAME}] — logits [1, 7, 256] float32")
    assert conforming_report.format().splitlines()[-1].startswith(f"plugin {NAME!r} conforms:")


def test_declared_capabilities_are_checked_not_skipped(kitlm, tmp_path):
    caps = frozenset({GENERATE})
    report = run_conformance(
        NAME, plugin=Variant(kitlm, capabilities=caps), workdir=tmp_path, collisions=False
    )
    assert statuses(report, "batch-rows") == {f"batch-rows[{NAME}]": "skip"}
    assert statuses(report, "cache-trim") == {f"cache-trim[{NAME}]": "skip"}
    assert report.passed, report.format()


# --- the suite catches each fault ------------------------------------------------


def run_variant(tmp_path, base, **changes):
    return run_conformance(
        NAME, plugin=Variant(base, **changes), workdir=tmp_path, collisions=False
    )


def test_a_loader_that_ignores_unexpected_tensors_fails_weight_coverage(kitlm, tmp_path):
    report = run_variant(tmp_path, kitlm, factory=lenient_loader)
    result = report.result(f"weight-coverage[{NAME}]")
    assert result.status == "fail"
    assert "loaded without a WeightsError" in result.detail


def test_a_parameter_left_at_its_initial_value_fails_weight_coverage(kitlm, tmp_path):
    report = run_variant(tmp_path, kitlm, factory=forgets_a_tensor)
    result = report.result(f"weight-coverage[{NAME}]")
    assert result.status == "fail"
    assert "not loaded from the checkpoint" in result.detail
    assert "model.norm.weight" in result.detail


def test_batch_declared_without_mergeable_caches_fails_batch_rows(kitlm, tmp_path):
    report = run_variant(tmp_path, kitlm, factory=with_caches(NoMergeKVCache))
    result = report.result(f"batch-rows[{NAME}]")
    assert result.status == "fail" and "has no merge()" in result.detail


def test_a_trim_that_keeps_the_tokens_fails_cache_trim(kitlm, tmp_path):
    report = run_variant(tmp_path, kitlm, factory=with_caches(LyingTrimKVCache))
    result = report.result(f"cache-trim[{NAME}]")
    assert result.status == "fail" and "offsets after trimming" in result.detail


def test_a_nondeterministic_model_fails_greedy_determinism(kitlm, tmp_path):
    report = run_variant(tmp_path, kitlm, factory=noisy_logits)
    assert report.result(f"greedy-determinism[{NAME}]").status == "fail"


def test_a_model_type_without_tiny_config_fails_and_nothing_downstream_is_skipped(kitlm, tmp_path):
    report = run_variant(tmp_path, kitlm, model_type={"tiny_config": None})
    assert "no tiny_config" in report.result("registrations").detail
    assert report.result(f"construct[{NAME}]").status == "fail"
    downstream = [r for r in report.results if r.name.endswith(f"[{NAME}]")]
    assert downstream and all(r.status == "fail" for r in downstream)


def test_declared_kernels_must_be_refused_when_their_backend_is_missing(kitlm, tmp_path):
    report = run_variant(tmp_path, kitlm, kernels=("kitlm.identity",))
    result = report.result(f"kernel-refusal[{NAME}]")
    assert result.status == "pass", result.detail
    assert "refused, not substituted" in result.detail


def test_an_incompatible_plugin_api_is_reported_unavailable(kitlm, tmp_path):
    class OldApi(Variant):
        @hookimpl
        def loom_plugin_api_version(self):
            return "0.9"

    report = run_conformance(NAME, plugin=OldApi(kitlm), workdir=tmp_path, collisions=False)
    assert not report.available and not report.passed
    assert "plugin API 0.9" in report.results[0].detail
    assert PLUGIN_API_VERSION in report.results[0].detail


def test_claiming_a_model_type_another_installed_plugin_claims_is_a_collision(kitlm, tmp_path):
    # minicpm5 (installed with the repository) claims model_type "llama".
    llama = dict(kitlm.TINY_CONFIG, model_type="llama")
    variant = Variant(kitlm, model_type={"name": "llama", "tiny_config": llama})
    report = run_conformance(NAME, plugin=variant, workdir=tmp_path, collisions=True)
    result = report.result("no-collisions")
    assert result.status == "fail" and "'llama'" in result.detail


def test_capability_constants_used_by_the_template_are_the_cores():
    assert {GENERATE, BATCH, PROMPT_CACHE} == {"generate", "batch", "prompt-cache"}


# --- the template's config ------------------------------------------------------------


def test_the_templates_head_dim_is_a_config_field_a_checkpoint_may_set(kitlm, tmp_path):
    # Qwen3 and Gemma configs carry head_dim apart from hidden_size / heads; a
    # family ported from the template reads it as it reads any other field.
    import importlib

    from mlx_loom.host import PluginHost, PluginPolicy
    from mlx_loom.loader import load

    config = importlib.import_module(f"mlx_loom_{NAME}.config")
    schema = config.KitlmConfig  # the template's <Family>Config
    assert "head_dim" in schema.model_fields and "head_dim" in config.FINGERPRINT_FIELDS
    tiny = {**kitlm.TINY_CONFIG}
    assert schema(**tiny).head_dim == tiny["hidden_size"] // tiny["num_attention_heads"]
    wide = {**tiny, "head_dim": 2 * schema(**tiny).head_dim}
    assert schema(**wide).head_dim == wide["head_dim"]
    path = write_checkpoint(tmp_path / "wide", wide, kitlm.checkpoint_tensors(wide))
    host = PluginHost(policy=PluginPolicy(), plugins=[(NAME, kitlm)], entry_points=False)
    model, _ = load(path, host=host)
    q_proj = model.module.model.layers[0].self_attn.q_proj
    heads, hidden = tiny["num_attention_heads"], tiny["hidden_size"]
    assert q_proj.weight.shape == (heads * wide["head_dim"], hidden)
    with pytest.raises(ValueError, match="head_dim"):
        schema(**{**tiny, "head_dim": 7})
