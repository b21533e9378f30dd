"""mlx_loom.nn.rope: every RoPE kind equals mlx-lm's, bit for bit, and bad kinds are refused."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.rope_utils import ProportionalRoPE, initialize_rope

from mlx_loom.errors import CapabilityRefused
from mlx_loom.nn import (
    DynamicScaling,
    LinearScaling,
    ProportionalScaling,
    make_rope,
    parse_rope_scaling,
)

HEAD = 32
MAX_POS = 64

KINDS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "longrope": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 16,
        "short_factor": [1.0] * (HEAD // 2),
        "long_factor": [1.0 + i / 8 for i in range(HEAD // 2)],
    },
}


def _x(length: int = 7) -> mx.array:
    return mx.random.normal((1, 2, length, HEAD), key=mx.random.key(0))


def _ours(config, dims=HEAD):
    scaling = parse_rope_scaling(config, dims=dims, max_position_embeddings=MAX_POS)
    return make_rope(dims, base=10000.0, scaling=scaling, max_position_embeddings=MAX_POS)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("offset", [0, 70])  # 70: past max_position_embeddings
def test_every_llama_kind_matches_mlx_lm_bit_for_bit(kind, offset):
    theirs = initialize_rope(
        HEAD, 10000.0, False, scaling_config=KINDS[kind], max_position_embeddings=MAX_POS
    )
    x = _x()
    assert mx.array_equal(_ours(KINDS[kind])(x, offset=offset), theirs(x, offset=offset))


@pytest.mark.parametrize("kind", ["default", "llama3", "yarn"])
def test_partial_rotary_dims_match_mlx_lm(kind):
    dims = HEAD // 4
    theirs = initialize_rope(
        dims, 10000.0, False, scaling_config=KINDS[kind], max_position_embeddings=MAX_POS
    )
    x = _x()
    assert mx.array_equal(_ours(KINDS[kind], dims)(x, offset=3), theirs(x, offset=3))


def test_per_row_offsets_rotate_each_row_at_its_own_position():
    rope = _ours(KINDS["llama3"])
    x = mx.concatenate([_x(), _x()], axis=0)
    both = rope(x, offset=mx.array([0, 5]))
    assert mx.array_equal(both[1:], rope(x[1:], offset=5))


@pytest.mark.parametrize("factor", [0.25, 1.0])
def test_proportional_rope_matches_mlx_lm(factor):
    theirs = ProportionalRoPE(HEAD, int(HEAD * factor), base=1e6, factor=1.0)
    scaling = parse_rope_scaling(
        {"rope_type": "proportional", "partial_rotary_factor": factor},
        dims=HEAD,
        max_position_embeddings=None,
    )
    assert isinstance(scaling, ProportionalScaling)
    ours = make_rope(HEAD, base=1e6, scaling=scaling)
    x = _x()
    assert mx.array_equal(ours(x, offset=9), theirs(x, offset=9))


def test_default_and_mrope_mean_plain_rope():
    for config in ({"rope_type": "default"}, {"type": "mrope", "mrope_section": [2, 1, 1]}):
        assert parse_rope_scaling(config, dims=HEAD, max_position_embeddings=None) is None


def test_type_is_read_before_rope_type_as_mlx_lm_does():
    parsed = parse_rope_scaling(
        {"type": "linear", "rope_type": "dynamic", "factor": 2.0},
        dims=HEAD,
        max_position_embeddings=MAX_POS,
    )
    assert isinstance(parsed, LinearScaling)


def test_a_family_can_narrow_the_kinds_it_implements():
    with pytest.raises(ValueError, match="'mrope' is not supported"):
        parse_rope_scaling(
            {"rope_type": "mrope"}, dims=HEAD, max_position_embeddings=None, kinds=("default",)
        )


def test_unknown_kind_is_refused_naming_it():
    with pytest.raises(ValueError, match="'su' is not supported"):
        parse_rope_scaling({"rope_type": "su"}, dims=HEAD, max_position_embeddings=None)


def test_dynamic_needs_max_position_embeddings():
    with pytest.raises(ValueError, match="needs max_position_embeddings"):
        parse_rope_scaling(
            {"type": "dynamic", "factor": 2.0}, dims=HEAD, max_position_embeddings=None
        )


@pytest.mark.parametrize("factor", [float("inf"), float("nan"), 0.0, -1.0])
def test_factors_must_be_finite_and_positive(factor):
    with pytest.raises(ValueError, match="factor"):
        parse_rope_scaling(
            {"rope_type": "linear", "factor": factor}, dims=HEAD, max_position_embeddings=None
        )


def test_llama3_band_factors_must_differ():
    with pytest.raises(ValueError, match="must differ"):
        parse_rope_scaling(
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0},
            dims=HEAD,
            max_position_embeddings=None,
        )


def test_longrope_factors_must_cover_half_the_rotated_dims():
    with pytest.raises(ValueError, match="long_factor has 3 entries"):
        parse_rope_scaling(
            {
                "rope_type": "longrope",
                "original_max_position_embeddings": 8,
                "long_factor": [1.0] * 3,
            },
            dims=HEAD,
            max_position_embeddings=MAX_POS,
        )


def test_dynamic_ntk_refuses_per_row_offsets():
    rope = make_rope(
        HEAD, base=10000.0, scaling=DynamicScaling(factor=2.0), max_position_embeddings=MAX_POS
    )
    with pytest.raises(CapabilityRefused, match="dynamic"):
        rope(_x(), offset=mx.array([0]))
