"""The CPU compute path as a user, a host and ``loom explain`` see it."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import mlx_loom
from mlx_loom.cli.main import main
from mlx_loom.cpu import apply_cpu_path, cpu_kernel_sets, native, resolve_cpu_path
from mlx_loom.cpu.layers import NativeEmbedding, NativeLinear, NativeQuantizedLinear
from mlx_loom.errors import KernelUnavailable, RequestError
from mlx_loom.testing.checkpoints import write_checkpoint


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    claim = mlx_loom.default_host().registry.model_types["llama"]
    return write_checkpoint(
        tmp_path_factory.mktemp("llama") / "ckpt",
        claim.tiny_config,
        claim.checkpoint_tensors(claim.tiny_config),
    )


@pytest.fixture
def no_avx2(monkeypatch):
    """This machine as one whose CPU lacks AVX2 and FMA."""
    reason = native.unavailable_reason({"avx2": False, "fma": False, "f16c": True})
    monkeypatch.setattr(native, "unavailable_reason", lambda features=None: reason)
    return reason


# --- resolution ------------------------------------------------------------


def test_the_cpu_defaults_are_float32_on_the_native_kernels():
    path = resolve_cpu_path("cpu")
    assert (path.compute_dtype, path.kernel_set) == ("float32", "cpu-native")
    assert "no fast half-precision" in path.compute_dtype_reason
    assert path.kernel_set_reason == "the CPU default: the native kernels run here"
    assert path.threads == native.threads()


def test_other_backends_default_to_the_checkpoint_dtype_and_no_cpu_kernel_set():
    path = resolve_cpu_path("metal")
    assert (path.compute_dtype, path.kernel_set) == ("checkpoint", None)


def test_a_cpu_kernel_set_asked_for_on_another_backend_is_refused():
    with pytest.raises(KernelUnavailable, match="'metal' backend"):
        resolve_cpu_path("metal", cpu_kernels="cpu-native")


def test_a_run_chooses_both_and_is_told_so():
    path = resolve_cpu_path("cpu", compute_dtype="checkpoint", cpu_kernels="cpu-ops")
    assert (path.compute_dtype, path.kernel_set) == ("checkpoint", "cpu-ops")
    assert path.compute_dtype_reason == path.kernel_set_reason == "asked for by this run"


def test_a_host_pin_wins_and_a_contradicting_run_is_refused():
    path = resolve_cpu_path("cpu", host_cpu_kernels="cpu-ops", host_compute_dtype="bfloat16")
    assert (path.compute_dtype, path.kernel_set) == ("bfloat16", "cpu-ops")
    assert path.kernel_set_reason == "pinned by the host"
    with pytest.raises(KernelUnavailable, match="host pins 'cpu-ops'") as err:
        resolve_cpu_path("cpu", cpu_kernels="cpu-native", host_cpu_kernels="cpu-ops")
    assert "cpu-ops" in err.value.fix


@pytest.mark.parametrize("kwargs", [{"compute_dtype": "fp8"}, {"cpu_kernels": "cpu-blas"}])
def test_unknown_names_are_request_errors_listing_the_choices(kwargs):
    with pytest.raises(RequestError, match="choose from|registered:"):
        resolve_cpu_path("cpu", **kwargs)


def test_without_avx2_the_default_is_the_ops_set_and_says_why(no_avx2):
    path = resolve_cpu_path("cpu")
    assert path.kernel_set == "cpu-ops"
    assert "lacks AVX2, FMA" in path.kernel_set_reason


def test_without_avx2_asking_for_the_native_set_is_refused_with_a_fix(no_avx2):
    with pytest.raises(KernelUnavailable, match="lacks AVX2, FMA") as err:
        resolve_cpu_path("cpu", cpu_kernels="cpu-native")
    assert "cpu-ops" in err.value.fix


def test_the_kernel_sets_are_registered_by_the_core():
    assert set(cpu_kernel_sets()) == {"cpu-ops", "cpu-native", "cpu-native-int8-act"}
    native_kernels = [
        "matmul",
        "rms_norm",
        "rope",
        "attention",
        "swiglu",
        "geglu",
        "softcap",
        "log_softmax",
        "experts",
        "expert_mix",
        "family",
    ]
    names = {
        "cpu-ops": ["matmul"],
        "cpu-native": native_kernels,
        "cpu-native-int8-act": native_kernels,
    }
    for name, kernel_set in cpu_kernel_sets().items():
        assert list(kernel_set.kernels) == names[name]
        assert all(kernel_set.kernels.values()), name  # each says what it runs


# --- applying it -----------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.proj = nn.Linear(64, 64)
        self.head = nn.QuantizedLinear(64, 32, bias=False, group_size=32, bits=4)
        self.norm = nn.RMSNorm(64)
        self.gain = mx.ones((64,))
        self.set_dtype(mx.bfloat16)

    def __call__(self, ids):
        return self.head(self.norm(self.proj(self.embed(ids))) * self.gain)


def test_native_float32_keeps_matrices_as_stored_and_converts_the_rest():
    model = Tiny()
    apply_cpu_path(model, resolve_cpu_path("cpu", compute_dtype="float32"))
    assert type(model.embed) is NativeEmbedding and type(model.proj) is NativeLinear
    assert type(model.head) is NativeQuantizedLinear
    assert model.proj.weight.dtype == model.embed.weight.dtype == mx.bfloat16
    assert model.head.scales.dtype == mx.bfloat16
    assert model.proj.bias.dtype == model.norm.weight.dtype == model.gain.dtype == mx.float32
    assert model(mx.array([[1, 2, 3]])).dtype == mx.float32


def test_ops_float32_converts_every_floating_parameter():
    model = Tiny()
    apply_cpu_path(model, resolve_cpu_path("cpu", compute_dtype="float32", cpu_kernels="cpu-ops"))
    assert type(model.proj) is nn.Linear
    assert model.proj.weight.dtype == model.head.scales.dtype == mx.float32
    assert model.head.weight.dtype == mx.uint32


def test_checkpoint_on_ops_changes_nothing():
    model = Tiny()
    before = {k: v.dtype for k, v in tree_flatten(model.parameters())}
    path = resolve_cpu_path("cpu", compute_dtype="checkpoint", cpu_kernels="cpu-ops")
    apply_cpu_path(model, path)
    assert type(model.proj) is nn.Linear
    assert {k: v.dtype for k, v in tree_flatten(model.parameters())} == before
    assert before["proj.weight"] == mx.bfloat16


def test_subclasses_of_the_matrix_layers_are_left_alone():
    class Scaled(nn.Linear):
        def __call__(self, x):
            return 2 * super().__call__(x)

    model = nn.Module()
    model.layer = Scaled(8, 8)
    apply_cpu_path(model, resolve_cpu_path("cpu"))
    assert type(model.layer) is Scaled


# --- the doors -------------------------------------------------------------


def test_load_records_the_path_on_the_model(llama):
    model, _ = mlx_loom.load(llama, compute_dtype="checkpoint", cpu_kernels="cpu-ops")
    assert (model.cpu_path.compute_dtype, model.cpu_path.kernel_set) == ("checkpoint", "cpu-ops")
    assert "cpu_kernels='cpu-ops'" in repr(model)


def test_a_host_registry_pin_reaches_load(llama):
    registry = mlx_loom.default_host().registry.with_(cpu_kernels="cpu-ops")
    model, _ = mlx_loom.load(llama, registry=registry)
    assert model.cpu_path.kernel_set == "cpu-ops"
    assert model.cpu_path.kernel_set_reason == "pinned by the host"
    with pytest.raises(KernelUnavailable):
        mlx_loom.load(llama, registry=registry, cpu_kernels="cpu-native")


def test_registry_pins_are_validated():
    with pytest.raises(RequestError):
        mlx_loom.default_host().registry.with_(compute_dtype="float64")


def test_loom_explain_shows_which_cpu_path_runs(llama, capsys):
    assert main(["explain", str(llama)]) == 0
    out = capsys.readouterr().out
    assert "compute dtype          float32  (the CPU default" in out
    assert "cpu kernels            cpu-native, " in out
    assert f"threads, 4-bit products on {native.cpu_isa()}: matmul, rms_norm, rope, attention, swiglu, geglu, softcap, log_softmax, experts, expert_mix, family  (" in out
    assert "prefill chunk          512 tokens  (the native CPU kernels" in out
    assert main(["explain", str(llama), "--cpu-kernels", "cpu-ops", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    cpu = payload["cpu"]
    assert cpu["kernel_set"] == "cpu-ops" and cpu["compute_dtype"] == "float32"
    assert payload["prefill_step_size"] == 2048  # mlx-lm's, on MLX's operations


def test_loom_explain_refuses_the_native_set_where_it_cannot_run(llama, capsys, no_avx2):
    assert main(["explain", str(llama), "--cpu-kernels", "cpu-native"]) == 3
    err = capsys.readouterr().err
    assert "lacks AVX2" in err and "fix:" in err
