"""Building a model: the core evaluates the weights, checks them, and types a factory's faults."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_loom.errors import ImplementationFailed, WeightsError
from mlx_loom.host import PluginHost, resolve_model
from mlx_loom.loader import build_model

from .toyfamily import ToyPlugin, build_toy, write_toy_checkpoint


def toy_host(**plugin) -> PluginHost:
    return PluginHost(plugins=[("toy", ToyPlugin(**plugin))], entry_points=False)


def build(path, *, lazy: bool = False, **plugin):
    host = toy_host(**plugin)
    return build_model(resolve_model(path, host=host), lazy=lazy)


def poisoned(tmp_path, value: float, *, dtype=mx.float32, vocab: int = 32):
    path = write_toy_checkpoint(tmp_path / "ckpt", vocab=vocab)
    weights = mx.load(str(path / "model.safetensors"))
    head = weights["head.weight"].astype(dtype)
    weights = {"embed.weight": weights["embed.weight"].astype(dtype), "head.weight": head}
    weights["head.weight"] = head.at[3, 5].add(value) if value else head
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, value, dtype):
    with pytest.raises(WeightsError, match=r"NaN or Inf values in 'head.weight'"):
        build(poisoned(tmp_path, value, dtype=dtype))


def test_a_large_finite_fp16_tensor_whose_sum_overflows_is_accepted(tmp_path):
    path = write_toy_checkpoint(tmp_path / "ckpt", vocab=4096)
    big = mx.full((4096, 8), 60000.0, dtype=mx.float16)  # finite; its fp16 sum is +inf
    mx.save_safetensors(str(path / "model.safetensors"), {"embed.weight": big, "head.weight": big})
    model = build(path)
    assert model.module.head.weight.dtype == mx.float16


def test_lazy_building_defers_reading_the_weights(tmp_path):
    path = poisoned(tmp_path, 0.0, vocab=8192)  # 2 x 8192 x 8 float32 = 512 KiB
    weight_bytes = 2 * 8192 * 8 * 4
    before = mx.get_active_memory()
    lazy = build(path, lazy=True)
    deferred = mx.get_active_memory() - before
    eager = build(path)
    loaded = mx.get_active_memory() - before - deferred
    assert deferred < weight_bytes / 2 <= weight_bytes <= loaded
    assert mx.array_equal(lazy.module.head.weight, eager.module.head.weight).item()


def test_lazy_building_does_not_check_finiteness(tmp_path):
    model = build(poisoned(tmp_path, float("nan")), lazy=True)
    assert mx.isnan(model.module.head.weight).any().item()


def test_a_factory_that_raises_is_a_typed_error_naming_implementation_and_plugin(tmp_path):
    def broken(ctx):
        raise RuntimeError("weights table corrupt")

    with pytest.raises(ImplementationFailed) as err:
        build(write_toy_checkpoint(tmp_path / "c"), factory=broken)
    assert "Implementation 'toy.lm.v1' (toy (in-process)) failed to build" in err.value.message
    assert "RuntimeError: weights table corrupt" in err.value.message
    assert isinstance(err.value.__cause__, RuntimeError)


def test_a_factory_that_exits_is_a_typed_error_not_an_exit(tmp_path):
    def exits(ctx):
        raise SystemExit(3)

    with pytest.raises(ImplementationFailed, match="SystemExit"):
        build(write_toy_checkpoint(tmp_path / "c"), factory=exits)


def test_a_factory_returning_a_non_model_is_a_typed_error(tmp_path):
    with pytest.raises(ImplementationFailed, match="built a dict, not an mlx.nn.Module"):
        build(write_toy_checkpoint(tmp_path / "c"), factory=lambda ctx: {"not": "a model"})


def test_a_typed_error_from_a_factory_passes_through_unchanged(tmp_path):
    def strict(ctx):
        raise WeightsError("tensor 'head.weight' is missing", fix="re-convert")

    with pytest.raises(WeightsError, match="'head.weight' is missing"):
        build(write_toy_checkpoint(tmp_path / "c"), factory=strict)


def test_a_users_ctrl_c_in_a_factory_still_stops_the_program(tmp_path):
    def interrupted(ctx):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build(write_toy_checkpoint(tmp_path / "c"), factory=interrupted)


def test_a_good_factory_builds_an_evaluated_model(tmp_path):
    model = build(write_toy_checkpoint(tmp_path / "c"), factory=build_toy)
    assert model.implementation.id == "toy.lm.v1"
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 32)


@pytest.mark.parametrize("shape", [(), (7,), (4, 6), (3, 4, 5), (2, 0, 3)])
def test_the_finiteness_screen_sees_every_element_of_any_shape(shape):
    from mlx_loom.artifacts.finite import screen as _screen

    clean = mx.ones(shape, dtype=mx.bfloat16)
    assert mx.isfinite(_screen(clean)).item()
    size = clean.size
    for flat in {0, size // 2, size - 1} if size else set():
        poisoned = clean.reshape(-1).at[flat].add(float("nan")).reshape(shape)
        assert not mx.isfinite(_screen(poisoned)).item(), (shape, flat)
