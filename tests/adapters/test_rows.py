"""Several adapters on one model, chosen per batch row (``AdapterSet``).

Rows with different adapters — LoRA, DoRA, and none — run in one forward and
each equals, bit for bit, the same row run alone on a model loaded with only
its adapter (or with none). Prefill-sized batches run on the oracle path
(MLX's own operations), where a batch row equals its solo run for the base
model too; the native CPU kernels keep that promise up to 32 rows (their
matrix-vector regime: decode), which the last test holds them to.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.adapters import AdaptedLayer, AdapterSet
from mlx_loom.errors import AdapterError, CapabilityRefused

from . import adapterkit as kit

#: Keys that leave routed experts alone, so the adapters mix in any batch.
DENSE_KEYS = {
    "llama": None,
    "qwen3_next": ["self_attn.q_proj", "linear_attn.out_proj", "mlp.gate"],
    "qwen3_5": ["self_attn.v_proj", "linear_attn.in_proj_qkv", "mlp.down_proj"],
    "gemma4_text": ["self_attn.q_proj", "mlp.down_proj", "router.proj"],
    "gemma4": ["self_attn.o_proj", "mlp.up_proj", "per_layer_input_gate"],
    "gpt_oss": ["self_attn.q_proj", "self_attn.o_proj", "mlp.router"],
}


def _pair(base, tmp_path, model_type):
    path = base(model_type)
    keys = DENSE_KEYS[model_type]
    lora = kit.write_adapter(path, tmp_path / "lora", num_layers=2, keys=keys, seed=1)
    dora_keys = ["self_attn.q_proj", "self_attn.o_proj"]
    dora = kit.write_adapter(
        path, tmp_path / "dora", fine_tune_type="dora", num_layers=3, keys=dora_keys, seed=2
    )
    return path, {"lora": lora, "dora": dora}


def _load(path, adapter=None, **path_options):
    options = path_options or kit.ORACLE_PATH
    return mlx_loom.load(path, adapter_path=adapter, **options)[0]


def _solo(path, adapter, **path_options):
    return _load(path, adapter, **path_options)


def _prompts(n: int, length: int) -> mx.array:
    return mx.concatenate([kit.prompt(length, seed=10 + i) for i in range(n)])


@pytest.mark.parametrize("model_type", kit.FAMILIES)
def test_each_row_equals_its_solo_run(base, tmp_path, model_type):
    path, adapters = _pair(base, tmp_path, model_type)
    model = _load(path)
    AdapterSet(model, adapters)
    names = ["lora", None, "dora", "lora"]
    x = _prompts(len(names), 9)
    batch = model(x, adapters=names)
    for i, name in enumerate(names):
        solo = _solo(path, adapters.get(name))
        assert mx.array_equal(batch[i : i + 1], solo(x[i : i + 1])), (i, name)


def test_rows_keep_their_adapters_through_batched_cached_decode(base, tmp_path):
    from mlx_loom.cache import BatchKVCache

    path, adapters = _pair(base, tmp_path, "llama")
    model = _load(path)
    AdapterSet(model, adapters)
    names = ["dora", "lora", None]
    x = _prompts(3, 8)
    caches = [BatchKVCache([0, 0, 0]) for _ in model.make_cache()]
    got = [model(x, cache=caches, adapters=names)]
    for _ in range(4):
        nxt = mx.argmax(got[-1][:, -1, :], axis=-1)[:, None]
        got.append(model(nxt, cache=caches, adapters=names))
    for i, name in enumerate(names):
        solo = _solo(path, adapters.get(name))
        want = kit.greedy_logits(solo, x[i : i + 1], solo.make_cache(), steps=4)
        for step, (batch, alone) in enumerate(zip(got, want, strict=True)):
            assert mx.array_equal(batch[i : i + 1], alone), (name, step)


def test_a_forward_without_choices_is_the_base_model(base, tmp_path):
    path, adapters = _pair(base, tmp_path, "qwen3_5")
    model = _load(path)
    AdapterSet(model, adapters)
    x = _prompts(2, 6)
    plain = _solo(path, None)
    assert mx.array_equal(model(x), plain(x))
    assert mx.array_equal(model(x, adapters=[None, None]), plain(x))


@pytest.mark.parametrize("model_type", ["qwen3_next", "gemma4_text"])
def test_expert_adapters_mix_even_where_the_expert_block_sorts_tokens(base, tmp_path, model_type):
    path = base(model_type)
    one = kit.write_adapter(path, tmp_path / "one", num_layers=-1, seed=1)
    two = kit.write_adapter(path, tmp_path / "two", num_layers=-1, seed=2)
    model = _load(path)
    adapters = AdapterSet(model, {"one": one, "two": two})
    assert any(".switch_" in m for m in adapters.adapters[0].modules)
    assert {adapters.batch_key(n) for n in ("one", "two", None)} == {None}
    names, solos = ["one", None, "two", "one"], [one, None, two, one]
    # 4 rows x 24 tokens x top-2: the core's expert block sorts the pairs by expert.
    x = _prompts(len(names), 24)
    batch = model(x, adapters=names)
    for i, adapter in enumerate(solos):
        assert mx.array_equal(batch[i : i + 1], _solo(path, adapter)(x[i : i + 1])), i


def test_an_expert_projection_outside_a_core_block_refuses_sorted_mixed_rows():
    from mlx_loom.adapters.layers import AdaptedExpertLinear, Factors, RowSelection
    from mlx_loom.nn import SwitchLinear

    base = SwitchLinear(8, 4, 3)
    factors = [
        Factors(mx.ones((3, 2, 8)), mx.ones((3, 4, 2)), 1.0),
        Factors(mx.ones((3, 2, 8)), mx.ones((3, 4, 2)), 2.0),
    ]
    selection = RowSelection()
    layer = AdaptedExpertLinear(base, factors, selection)
    x, indices = mx.ones((4, 1, 8)), mx.array([0, 0, 1, 2])
    with selection.rows([0, 1]), pytest.raises(AdapterError, match="regrouped by expert"):
        layer.gather(x, indices, True)
    with selection.rows([1, 1]):  # one adapter for every row: applied, nothing to split
        assert layer.gather(x, indices, True).shape == (4, 1, 4)


def test_dense_only_adapters_batch_with_everything(base, tmp_path):
    path, adapters = _pair(base, tmp_path, "gemma4_text")
    model = _load(path)
    registered = AdapterSet(model, adapters)
    assert {registered.batch_key(n) for n in (None, "lora", "dora")} == {None}


def test_an_unknown_adapter_name_in_a_forward_is_refused(base, tmp_path):
    path, adapters = _pair(base, tmp_path, "llama")
    model = _load(path)
    AdapterSet(model, adapters)
    with pytest.raises(AdapterError, match="no adapter named 'sql'"):
        model(_prompts(1, 4), adapters=["sql"])


def test_one_choice_per_row_is_required(base, tmp_path):
    path, adapters = _pair(base, tmp_path, "llama")
    model = _load(path)
    AdapterSet(model, adapters)
    with pytest.raises(AdapterError, match="2 row"):
        mx.eval(model(_prompts(2, 4), adapters=["lora"]))


def test_a_model_without_a_set_refuses_named_adapters(base):
    model = _load(base("llama"))
    with pytest.raises(AdapterError, match="no adapter set"):
        model(_prompts(1, 4), adapters=["lora"])


def test_a_set_with_one_unfit_adapter_changes_nothing(base, tmp_path):
    path, adapters = _pair(base, tmp_path, "llama")
    alien = kit.write_adapter(base("qwen3_next"), tmp_path / "alien")
    model = _load(path)
    with pytest.raises(AdapterError, match="does not fit"):
        AdapterSet(model, {**adapters, "alien": alien})
    assert not any(isinstance(m, AdaptedLayer) for _, m in model.module.named_modules())
    assert model.adapter_set is None


def test_a_full_fine_tune_cannot_be_chosen_per_row(base, tmp_path):
    path = base("llama")
    model = _load(path)
    full = kit.write_full_finetune(path, tmp_path / "full")
    with pytest.raises(AdapterError, match="full fine-tune"):
        AdapterSet(model, {"full": full})


@pytest.mark.parametrize("name", ["", "a:b", " pad", "x" * 65, "tab\there"])
def test_unusable_names_are_refused(base, tmp_path, name):
    path, adapters = _pair(base, tmp_path, "llama")
    model = _load(path)
    with pytest.raises(AdapterError, match="not usable"):
        AdapterSet(model, {name: adapters["lora"]})


def test_a_model_already_running_an_adapter_refuses_a_set(base, tmp_path):
    path, adapters = _pair(base, tmp_path, "llama")
    model = _load(path, adapters["lora"])
    with pytest.raises(AdapterError, match="already runs an adapter"):
        AdapterSet(model, adapters)


def test_a_family_without_the_capability_refuses_a_set(tmp_path):
    from mlx_loom.host import PluginHost
    from mlx_loom.loader import build_model

    from ..core.toyfamily import ToyPlugin, write_toy_checkpoint

    host = PluginHost(plugins=[("toy", ToyPlugin())], entry_points=False)
    model = build_model(mlx_loom.resolve_model(write_toy_checkpoint(tmp_path / "t"), host=host))
    with pytest.raises(CapabilityRefused, match="'adapters'"):
        AdapterSet(model, {"a": tmp_path / "a"})


def test_on_the_native_cpu_kernels_decode_sized_rows_equal_their_solo_runs(base, tmp_path):
    path, adapters = _pair(base, tmp_path, "qwen3_next")
    model = _load(path, compute_dtype="float32", cpu_kernels="cpu-native")
    AdapterSet(model, adapters)
    names = ["lora", None, "dora", "lora", None]
    x = _prompts(len(names), 1)  # five rows of one token: the matrix-vector regime
    batch = model(x, adapters=names)
    for i, name in enumerate(names):
        solo = _solo(path, adapters.get(name), compute_dtype="float32", cpu_kernels="cpu-native")
        assert mx.array_equal(batch[i : i + 1], solo(x[i : i + 1])), (i, name)
