"""Verification uses the decode arithmetic: a verify window's logits equal one-token steps'.

For every family, past every sliding window, with both CPU kernel sets
(``cpu-native``, the compiled kernels, and ``cpu-ops``, plain MLX ops): the
logits of a window of ``k + 1`` tokens verified in one forward (inside a
speculative round) equal, bit for bit, the logits of feeding the same tokens
one at a time; and after keeping a prefix, the caches continue exactly as
plain decoding's.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.engine.speculative import begin_rounds, keep_rounds
from mlx_loom.host import VERIFY_POLICIES, VerifyPolicies, VerifyPolicy
from mlx_loom.host._verify import metal_policy
from mlx_loom.nn import AttentionGeometry, attention_geometries

from .conftest import SPEC_FAMILIES, SPEC_PROMPT

KERNELS = ["cpu-native", "cpu-ops"]


@pytest.fixture(scope="module")
def kernel_models(spec_models):
    """Each family's target loaded with each CPU kernel set."""
    return {
        (family, kernels): mlx_loom.load(pair[0].model_dir, cpu_kernels=kernels)[0]
        for family, pair in spec_models.items()
        for kernels in KERNELS
    }


def primed(model, decode_steps):
    caches = model.make_cache()
    model(mx.array([SPEC_PROMPT[:-1]]), caches)
    for t in [SPEC_PROMPT[-1], *range(40, 40 + decode_steps)]:
        model(mx.array([[t]]), caches)
    return caches


@pytest.mark.parametrize("family", SPEC_FAMILIES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("width", [2, 5])
@pytest.mark.parametrize("decode_steps", [0, 3])
def test_verify_logits_equal_step_by_step_decode_logits(
    kernel_models, family, kernels, width, decode_steps
):
    model = kernel_models[family, kernels]
    window = [11, 23, 5, 170, 42][:width]
    stepped, verified = primed(model, decode_steps), primed(model, decode_steps)
    want = [model(mx.array([[t]]), stepped)[0, -1] for t in window]
    begin_rounds(verified)
    got = model(mx.array([window]), verified)[0]
    assert all(mx.array_equal(got[j], want[j]).item() for j in range(width))


@pytest.mark.parametrize("family", SPEC_FAMILIES)
@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("keep", [1, 3])
def test_kept_prefix_continues_as_plain_decoding(kernel_models, family, kernels, keep):
    model = kernel_models[family, kernels]
    window = [11, 23, 5, 170]
    plain, spec = primed(model, 2), primed(model, 2)
    for t in window[:keep]:
        model(mx.array([[t]]), plain)
    begin_rounds(spec)
    model(mx.array([window]), spec)
    keep_rounds(spec, len(window), keep)
    for t in (7, 99, 3):
        assert mx.array_equal(model(mx.array([[t]]), spec), model(mx.array([[t]]), plain)).item()


def test_a_verify_window_is_cut_before_an_arithmetic_boundary():
    policy = VerifyPolicy("metal", (1023, 1024, 8192))
    assert policy.window(1000, 5) == 5  # keys 1001..1005
    assert policy.window(1020, 5) == 3  # keys 1021..1023, then the regime changes
    assert policy.window(1023, 5) == 1  # 1024 is a regime of its own
    assert policy.window(1024, 5) == 5
    assert policy.window(8190, 4) == 2


def test_the_cpu_policy_is_registered_and_cuda_is_refused_until_measured():
    from mlx_loom.errors import CapabilityRefused

    assert VERIFY_POLICIES.for_backend("cpu").boundaries == ()
    assert VERIFY_POLICIES.for_backend("cpu").kernel is None
    assert VERIFY_POLICIES.for_backend("metal").kernel is not None  # MLX's dispatch as data
    with pytest.raises(CapabilityRefused, match="not been measured"):
        VERIFY_POLICIES.for_backend("cuda")


def test_each_family_declares_the_geometry_of_every_attention_kind(spec_models):
    windows = {"llama-sliding": {6, None}, "qwen3_next": {None}, "gemma4": {8, None}}
    for family, (model, _) in spec_models.items():
        declared = attention_geometries(model.module)
        assert {g.window for g in declared} == windows[family]
        for m in model.module.modules():
            if isinstance(getattr(m, "geometry", None), AttentionGeometry):
                g = m.geometry
                rows = m.q_proj.weight.shape[0]  # qwen3_next's also carries the gate
                assert rows in (g.query_heads * g.head_dim, 2 * g.query_heads * g.head_dim)


def test_under_metals_rules_a_model_without_a_window_of_2_is_refused(spec_models, monkeypatch):
    """The tiny models' head dims have no Metal vector kernel: decoding runs unfused."""
    from mlx_loom.engine import speculative
    from mlx_loom.errors import CapabilityRefused

    as_if_metal = replace(metal_policy("g"), backend="cpu")
    monkeypatch.setattr(speculative, "VERIFY_POLICIES", VerifyPolicies([as_if_metal]))
    model, _ = spec_models["gemma4"]
    with pytest.raises(CapabilityRefused, match="no verify window of 2 tokens") as err:
        list(mlx_loom.stream_generate(model, None, SPEC_PROMPT, max_tokens=4, draft="ngram"))
    assert "unfused" in str(err.value)


def test_where_kernels_follow_shapes_speculative_rows_verify_alone(spec_models, monkeypatch):
    """A stacked verify would pick the kernel by the batch's lengths, not each row's."""
    from mlx_loom.engine import Engine, Speculation, make_request
    from mlx_loom.engine import speculative

    shaped = VerifyPolicy("cpu", kernel=lambda q_len, kv_len, geometry: "vector")
    monkeypatch.setattr(speculative, "VERIFY_POLICIES", VerifyPolicies([shaped]))
    model, _ = spec_models["llama-sliding"]
    prompts = [SPEC_PROMPT, SPEC_PROMPT[3:]]
    engine = Engine(model)
    uids = engine.insert(
        [make_request(model, None, p, max_tokens=8, speculation=Speculation(None, 3)) for p in prompts]
    )
    got: dict[int, list[int]] = {u: [] for u in uids}
    stacked = set()
    with mx.stream(mx.default_stream(mx.default_device())):
        while engine.has_work:
            for event in engine.step():
                if hasattr(event, "token"):
                    got[event.uid].append(event.token)
            stacked |= {g.stacked for g in engine._groups}
    assert stacked == {False}
    plain = [
        [r.token for r in mlx_loom.stream_generate(model, None, p, max_tokens=8)] for p in prompts
    ]
    assert [got[u] for u in uids] == plain
