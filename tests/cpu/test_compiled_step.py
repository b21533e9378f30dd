"""The compiled one-token forward: bit-equal to the ordinary one, used only where it holds."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_loom
from mlx_loom.cache import KVCache, RotatingKVCache
from mlx_loom.cache.recurrent import RecurrentCache
from mlx_loom.cpu.compiled_step import CompiledStep
from mlx_loom.generation.loop import generate_tokens
from mlx_loom.testing.checkpoints import write_checkpoint


def checkpoint(tmp_path_factory, model_type: str, **overrides):
    claim = mlx_loom.default_host().registry.model_types[model_type]
    path = tmp_path_factory.mktemp(model_type) / "ckpt"
    assert claim.tiny_config is not None and claim.checkpoint_tensors is not None
    config = {**claim.tiny_config, **overrides}
    return write_checkpoint(path, config, claim.checkpoint_tensors(config))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return checkpoint(tmp_path_factory, "llama")


def greedy(lp: mx.array) -> mx.array:
    return mx.argmax(lp, axis=-1)


def decode(model, prompt: list[int], n: int, cache=None) -> tuple[list[int], mx.array]:
    tokens, lps = [], []
    cache = cache if cache is not None else model.make_cache()
    for token, lp in generate_tokens(model, prompt, cache, sampler=greedy, max_tokens=n):
        tokens.append(token)
        lps.append(lp)
    return tokens, mx.stack(lps)


@pytest.fixture
def counted(monkeypatch):
    """How many forwards ran compiled."""
    calls = {"n": 0}
    original = CompiledStep.__call__

    def spy(self, inputs, cache):
        calls["n"] += 1
        return original(self, inputs, cache)

    monkeypatch.setattr(CompiledStep, "__call__", spy)
    return calls


@pytest.fixture
def compiled_on(monkeypatch):
    """The default, also where the environment running the tests turned it off."""
    monkeypatch.delenv("MLX_LOOM_COMPILED_STEP", raising=False)


def test_a_native_llama_decodes_through_the_compiled_step_bit_for_bit(
    llama, counted, monkeypatch, compiled_on
):
    model, _ = mlx_loom.load(llama, compute_dtype="float32", cpu_kernels="cpu-native")
    assert model.compiled_step is not None
    # A prompt near the buffer's 256-slot step: decoding crosses a growth
    # (one more trace) and keeps going on the longer buffer.
    prompt = [(7 * i) % 200 + 1 for i in range(250)]
    tokens, lps = decode(model, prompt, 12)
    assert counted["n"] >= 10
    monkeypatch.setenv("MLX_LOOM_COMPILED_STEP", "0")
    eager, _ = mlx_loom.load(llama, compute_dtype="float32", cpu_kernels="cpu-native")
    assert eager.compiled_step is None
    before = counted["n"]
    eager_tokens, eager_lps = decode(eager, prompt, 12)
    assert counted["n"] == before
    assert tokens == eager_tokens
    assert mx.array_equal(lps, eager_lps)


def test_a_trimmed_cache_continues_compiled_bit_for_bit(llama, compiled_on):
    model, _ = mlx_loom.load(llama, compute_dtype="float32", cpu_kernels="cpu-native")
    cache = model.make_cache()
    decode(model, [3, 1, 4, 1, 5, 9, 2, 6], 6, cache)
    for c in cache:
        c.trim(5)  # stale slots past the offset stay in the buffer
    compiled = decode(model, [8], 6, cache)
    fresh = model.make_cache()
    prefix = [3, 1, 4, 1, 5, 9, 2, 6]
    step = type(model.compiled_step)
    model.compiled_step = None
    try:
        decode(model, prefix, 6, fresh)
        for c in fresh:
            c.trim(5)
        eager = decode(model, [8], 6, fresh)
    finally:
        model.compiled_step = step(model.module)
    assert compiled[0] == eager[0]
    assert mx.array_equal(compiled[1], eager[1])


def test_it_applies_only_to_one_token_over_the_cache_kinds_it_traces():
    full = KVCache()
    full.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
    one = mx.array([[1]])
    assert CompiledStep.applies(one, [full, full])
    assert not CompiledStep.applies(mx.array([[1, 2]]), [full])  # a verify window / prefill
    assert not CompiledStep.applies(one, None)
    assert not CompiledStep.applies(one, [KVCache()])  # nothing written yet
    rotating = RotatingKVCache(max_size=8)
    rotating.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
    assert CompiledStep.applies(one, [full, rotating])
    rotating.begin_round()
    assert not CompiledStep.applies(one, [full, rotating])  # a speculative round is open
    rotating.commit(0)
    other = KVCache()
    other.update_and_fetch(mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 64)))
    assert not CompiledStep.applies(one, [full, other])  # offsets differ
    assert not CompiledStep.applies(one, [full.to_quantized()])
    assert not CompiledStep.applies(one, [full.to_turboquant()])
    assert not CompiledStep.applies(one, [rotating.to_quantized()])
    recurrent = RecurrentCache()
    recurrent.update(conv_state=mx.zeros((1, 3, 8)), recurrent_state=mx.zeros((1, 2, 4, 4)), n=3)
    assert CompiledStep.applies(one, [full, recurrent])
    padded = RecurrentCache(left_padding=[1])
    padded.update(conv_state=mx.zeros((1, 3, 8)), recurrent_state=mx.zeros((1, 2, 4, 4)), n=3)
    assert not CompiledStep.applies(one, [padded])  # per-row offsets and a padding mask
    assert not CompiledStep.applies(one, [KVCache.merge([full, full])])  # a padded batch


def test_batched_rows_apply_over_a_batch_that_takes_the_token_in_place():
    full = KVCache()
    full.update_and_fetch(mx.zeros((1, 2, 3, 64)), mx.zeros((1, 2, 3, 64)))
    longer = KVCache()
    longer.update_and_fetch(mx.zeros((1, 2, 5, 64)), mx.zeros((1, 2, 5, 64)))
    two = mx.array([[1], [2]])
    batch = KVCache.stack([full, longer])  # left-padded, its buffer exactly full
    assert not CompiledStep.applies(two, [batch])  # the eager step grows the buffer
    batch.update_and_fetch(mx.zeros((2, 2, 1, 64)), mx.zeros((2, 2, 1, 64)))
    assert CompiledStep.applies(two, [batch, batch])
    assert not CompiledStep.applies(two, [batch, full])  # a single row's cache in a batch
    batch.begin_round()
    assert not CompiledStep.applies(two, [batch])  # a speculative round is open
    batch.commit(0)
    recurrent = RecurrentCache.stack([RecurrentCache(), RecurrentCache()])
    recurrent.update(conv_state=mx.zeros((2, 3, 8)), recurrent_state=mx.zeros((2, 2, 4, 4)), n=1)
    assert CompiledStep.applies(two, [batch, recurrent])
    quantized = KVCache.stack([full.to_quantized(), longer.to_quantized()])
    quantized.update_and_fetch(mx.zeros((2, 2, 1, 64)), mx.zeros((2, 2, 1, 64)))
    assert not CompiledStep.applies(two, [quantized])  # its view attends over whole buffers
    empty = RotatingKVCache.stack([RotatingKVCache(max_size=8), RotatingKVCache(max_size=8)])
    assert not CompiledStep.applies(two, [batch, empty])  # nothing written yet
    written = []
    for n in (3, 11):
        window = RotatingKVCache(max_size=8)
        window.update_and_fetch(mx.zeros((1, 2, n, 64)), mx.zeros((1, 2, n, 64)))
        written.append(window)
    windows = RotatingKVCache.stack(written)
    assert CompiledStep.applies(two, [batch, windows])  # each row writes at its own slot
    windows.begin_round()
    assert not CompiledStep.applies(two, [batch, windows])


def _eager_and_compiled(path, prompt, n, counted, make_cache=None):
    """Greedy decode of ``prompt`` eager, then through the compiled step (same model)."""
    model, _ = mlx_loom.load(path, compute_dtype="float32", cpu_kernels="cpu-native")
    step = model.compiled_step
    assert step is not None
    make = make_cache or model.make_cache
    model.compiled_step = None
    eager = decode(model, prompt, n, make())
    model.compiled_step = step
    before = counted["n"]
    compiled = decode(model, prompt, n, make())
    return eager, compiled, counted["n"] - before, step


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("gemma3_text", {}),  # two sliding windows (8 slots) and a global layer
        ("gemma4_text", {}),  # windows, full layers, KV-shared layers, per-layer inputs, MoE
        ("qwen3_next", {}),  # gated delta nets (recurrent) and gated attention
        ("llama", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}),
    ],
    ids=["gemma3", "gemma4", "qwen3_next", "sliding-llama"],
)
@pytest.mark.parametrize("prompt_len", [3, 13])
def test_each_cache_kind_decodes_compiled_bit_for_bit(
    tmp_path_factory, counted, compiled_on, model_type, overrides, prompt_len
):
    # 3: a window grows (its buffer is shorter than the window) and then wraps;
    # 13: the prompt's chunk left more slots than the window, dropped on the
    # first compiled write. Decoding 12 tokens wraps every window.
    path = checkpoint(tmp_path_factory, model_type, **overrides)
    prompt = [(5 * i) % 97 + 2 for i in range(prompt_len)]
    eager, compiled, calls, step = _eager_and_compiled(path, prompt, 12, counted)
    assert calls == 12 and not step.refused
    assert compiled[0] == eager[0]
    assert mx.array_equal(compiled[1], eager[1])


def test_a_window_wider_than_the_attention_window_runs_eager_and_says_why(
    tmp_path_factory, counted, compiled_on
):
    # Gemma 3 attends over 8 tokens; a 16-slot window needs the eager step's
    # mask once 8 tokens are in, so the trace refuses and the step runs eager.
    path = checkpoint(tmp_path_factory, "gemma3_text")

    def wide():
        return [RotatingKVCache(max_size=16), RotatingKVCache(max_size=16), KVCache()]

    eager, compiled, _, step = _eager_and_compiled(path, [3, 1, 4, 1, 5], 6, counted, wide)
    assert list(step.refused.values()) == [
        "an attention window of 8 tokens over a 16-slot rotating window needs a mask"
    ]
    assert compiled[0] == eager[0]
    assert mx.array_equal(compiled[1], eager[1])


def test_families_on_cpu_ops_are_never_compiled(llama, tmp_path_factory, compiled_on):
    ops_model, _ = mlx_loom.load(llama, compute_dtype="float32", cpu_kernels="cpu-ops")
    assert ops_model.compiled_step is None
    for model_type in ("qwen3_next", "gemma4_text"):
        model, _ = mlx_loom.load(checkpoint(tmp_path_factory, model_type), cpu_kernels="cpu-ops")
        assert model.compiled_step is None
        assert "compiled-step" in model.capabilities


def _stacked(model, prompts):
    """Each prompt prefilled through its own caches, then stacked into one batch."""
    rows = []
    for prompt in prompts:
        cache = model.make_cache()
        mx.eval(model.forward(mx.array([prompt]), cache))
        rows.append(cache)
    return [type(layer[0]).stack(list(layer)) for layer in zip(*rows)]


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("llama", {}),
        ("qwen3_next", {}),  # full batch caches and recurrent state
        ("gemma4_text", {}),  # each row's own window slots, KV-shared layers
        ("gemma3_text", {}),
        ("llama", {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 6}),
    ],
    ids=["llama", "qwen3_next", "gemma4", "gemma3", "sliding-llama"],
)
def test_batched_rows_decode_compiled_bit_for_bit(
    tmp_path_factory, counted, compiled_on, model_type, overrides
):
    """Rows of different lengths (so different left padding and window slots), one of
    them near the 256-slot step, decoded together past every window's wrap: the
    compiled step's logits equal the eager step's bit for bit."""
    path = checkpoint(tmp_path_factory, model_type, **overrides)
    model, _ = mlx_loom.load(path, compute_dtype="float32", cpu_kernels="cpu-native")
    step = model.compiled_step
    prompts = [[(3 * i + 7 * r) % 97 + 2 for i in range(n)] for r, n in enumerate([250, 4, 9])]
    eager_caches, compiled_caches = _stacked(model, prompts), _stacked(model, prompts)
    tokens = mx.array([[5], [6], [7]])
    for _ in range(12):
        model.compiled_step = None
        eager = model.forward(tokens, eager_caches)
        model.compiled_step = step
        compiled = model.forward(tokens, compiled_caches)
        assert mx.array_equal(eager, compiled)
        tokens = mx.argmax(eager[:, -1:, :], axis=-1)
    # A stacked full buffer is exactly full: the first step grows it (eager,
    # 250 + 256 slots); every other step ran compiled.
    full = any(type(c).__name__ == "BatchKVCache" for c in compiled_caches)
    assert counted["n"] == (11 if full else 12) and not step.refused


def test_a_batch_decodes_compiled_with_each_rows_solo_tokens(llama, counted, compiled_on):
    from mlx_loom.generation.batch import batch_generate_tokens

    model, _ = mlx_loom.load(llama, compute_dtype="float32", cpu_kernels="cpu-native")
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    rows = batch_generate_tokens(model, prompts, max_tokens=5)
    assert counted["n"] > 0
    alone = [decode(model, p, 5)[0] for p in prompts]
    assert [tokens for tokens, _ in rows] == alone


def test_loom_explain_says_whether_the_decode_step_is_compiled(
    llama, tmp_path_factory, capsys, monkeypatch, compiled_on
):
    from mlx_loom.cli.main import main

    assert main(["explain", str(llama)]) == 0
    assert "decode step            compiled where one token" in capsys.readouterr().out
    assert main(["explain", str(checkpoint(tmp_path_factory, "gemma4_text"))]) == 0
    assert "rotating windows and recurrent state" in capsys.readouterr().out
    monkeypatch.setenv("MLX_LOOM_COMPILED_STEP", "0")
    assert main(["explain", str(llama)]) == 0
    assert "eager (MLX_LOOM_COMPILED_STEP=0 turns it off)" in capsys.readouterr().out
    assert main(["explain", str(llama), "--cpu-kernels", "cpu-ops"]) == 0
    assert "eager (compiled only on the native CPU kernel sets)" in capsys.readouterr().out


def test_why_a_model_runs_eager_is_named(monkeypatch):
    from mlx_loom.cpu.compiled_step import not_compiled_because

    caps = frozenset({"generate", "compiled-step"})
    monkeypatch.setenv("MLX_LOOM_COMPILED_STEP", "0")
    assert "MLX_LOOM_COMPILED_STEP=0" in not_compiled_because("cpu-native", caps)
    monkeypatch.delenv("MLX_LOOM_COMPILED_STEP")
    assert not_compiled_because("cpu-native", caps) is None
    assert not_compiled_because("cpu-native-int8-act", caps) is None
    assert "native CPU kernel sets" in not_compiled_because("cpu-ops", caps)
    assert "native CPU kernel sets" in not_compiled_because(None, caps)
    assert "does not declare" in not_compiled_because("cpu-native", frozenset({"generate"}))
    # a split model's pipeline stages call async_eval mid-forward: never traced
    assert "split" in not_compiled_because("cpu-native", caps, split=True)


def test_the_compiled_step_attends_only_over_the_filled_slots(llama, compiled_on, tmp_path):
    import re

    model, _ = mlx_loom.load(llama, compute_dtype="float32", cpu_kernels="cpu-native")
    cache = model.make_cache()
    mx.eval(model(mx.array([[1, 2, 3]]), cache))
    out = model(mx.array([[4]]), cache)  # compiled: the buffer is 256 slots, 4 filled
    path = tmp_path / "step.dot"
    mx.export_to_dot(str(path), out)
    names = re.findall(r'label ="([A-Za-z_]+)', path.read_text())
    assert "LoomAttention" in names
    # no mask over the buffer is built: the kernel takes the filled length
    assert "LessEqual" not in names and "Select" not in names


def test_native_attention_lengths_read_only_the_first_keys():
    from mlx_loom.cpu import native

    nat = native.module()
    q = mx.random.normal((2, 4, 1, 16), key=mx.random.key(1))
    k = mx.random.normal((2, 2, 10, 16), key=mx.random.key(2))
    v = mx.random.normal((2, 2, 10, 16), key=mx.random.key(3))
    lengths = mx.array([7, 3], dtype=mx.int32)
    got = nat.attention(q, k, v, 0.25, False, None, lengths)
    for b, n in enumerate((7, 3)):
        alone = nat.attention(q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], 0.25)
        assert mx.array_equal(got[b : b + 1], alone)
    # past the buffer: clamped to it
    assert mx.array_equal(
        nat.attention(q, k, v, 0.25, False, None, mx.array([99], dtype=mx.int32)),
        nat.attention(q, k, v, 0.25),
    )
    with pytest.raises(ValueError, match="lengths"):
        nat.attention(q, k, v, 0.25, False, None, mx.array([1, 2, 3], dtype=mx.int32))


def test_bf16_experts_compile_on_the_native_sets(tmp_path_factory, compiled_on):
    # bf16 dense experts run the native gathered products, which read nothing on
    # the host, so the MoE step compiles (it used to refuse) and equals eager.
    path = checkpoint(tmp_path_factory, "gemma4_text")
    model, _ = mlx_loom.load(path, compute_dtype="bfloat16", cpu_kernels="cpu-native")
    step = model.compiled_step
    assert step is not None
    compiled = decode(model, [3, 1, 4, 1, 5], 4)
    assert not step.refused
    model.compiled_step = None
    eager = decode(model, [3, 1, 4, 1, 5], 4)
    assert compiled[0] == eager[0]
    assert mx.array_equal(compiled[1], eager[1])


def test_a_kernel_that_reads_the_host_runs_eager_and_says_why(
    tmp_path_factory, compiled_on, monkeypatch
):
    # A kernel that reads an array on the host (a plugin's, say) cannot run in a
    # trace: MLX refuses, and that layout runs eager with the reason recorded.
    from mlx_loom.cpu.experts import NativeSwitchGLU

    native = NativeSwitchGLU.__call__

    def reads_the_host(self, x, indices):
        int(indices.max().item())  # fine eagerly; refused inside a trace
        return native(self, x, indices)

    monkeypatch.setattr(NativeSwitchGLU, "__call__", reads_the_host)
    path = checkpoint(tmp_path_factory, "gemma4_text")
    model, _ = mlx_loom.load(path, cpu_kernels="cpu-native")
    step = model.compiled_step
    assert step is not None
    compiled = decode(model, [3, 1, 4, 1, 5], 4)
    assert [why for why in step.refused.values() if "reads an array on the host" in why]
    model.compiled_step = None
    eager = decode(model, [3, 1, 4, 1, 5], 4)
    assert compiled[0] == eager[0]
    assert mx.array_equal(compiled[1], eager[1])
