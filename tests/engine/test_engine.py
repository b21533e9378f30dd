"""The engine: rows join and leave a running batch, each equal to its solo run, for every
family and cache kind; long prompts do not freeze running streams; cancellation is immediate."""

from __future__ import annotations

import math

import pytest

from mlx_loom.cpu import native
from mlx_loom.engine import Engine, EngineSettings
from mlx_loom.errors import RequestError
from mlx_loom.generation import SamplingParams

from .conftest import alone, assert_same_run, drive, ids, request

#: checkpoint, extra request options (cache kinds: full, window, recurrent, KV-shared,
#: quantized full, quantized window, bounded by max_kv_size).
KINDS = {
    "llama/full": ("llama", {}),
    "llama/window": ("llama-sliding", {}),
    "llama/max_kv_size": ("llama", {"max_kv_size": 9}),
    "llama/kv4": ("llama-hd32", {"kv_bits": 4, "kv_group_size": 32}),
    "llama/kv8-late": ("llama-hd32", {"kv_bits": 8, "kv_group_size": 32, "quantized_kv_start": 12}),
    "qwen3_next/recurrent": ("qwen3_next", {}),
    "qwen3_5/recurrent": ("qwen3_5", {}),
    "gemma4_text/kv-shared": ("gemma4_text", {}),
    "gemma4/kv-shared": ("gemma4", {}),
    "gemma4_text/kv8": ("gemma4_text", {"kv_bits": 8, "kv_group_size": 32}),
}


def mixed_requests(model, options):
    """Five requests with their own prompts, budgets and sampling (greedy, seeded,
    penalised, biased)."""
    eos = 0
    return {
        "a": request(model, prompt=ids(11, 1), max_tokens=20, **options),
        "b": request(model, prompt=ids(5, 2), max_tokens=8, **options),
        "c": request(
            model,
            prompt=ids(17, 3),
            max_tokens=12,
            params=SamplingParams(temperature=0.8, top_p=0.9, seed=3),
            **options,
        ),
        "d": request(
            model,
            prompt=ids(7, 4),
            max_tokens=10,
            params=SamplingParams(
                repetition_penalty=1.3, presence_penalty=0.2, logit_bias={eos: -5.0, 9: 2.0}
            ),
            **options,
        ),
        "e": request(model, prompt=ids(3, 5), max_tokens=30, **options),
    }


@pytest.mark.parametrize("kind", list(KINDS))
def test_rows_joining_and_leaving_mid_decode_equal_their_solo_runs(kind, loaded):
    name, options = KINDS[kind]
    model, _ = loaded(name)
    reqs = mixed_requests(model, options)
    widest = []
    # Prefill chunk boundaries matter once KV is quantized (later chunks attend over
    # quantized keys), so the solo runs use the same chunk size.
    settings = EngineSettings(prefill_step_size=4)
    engine = Engine(model, settings)
    runs = drive(
        engine,
        {
            0: [("a", reqs["a"])],
            3: [("b", reqs["b"])],
            5: [("c", reqs["c"]), ("d", reqs["d"])],
            7: [("e", reqs["e"])],
            14: [("remove", "e")],
        },
        on_step=lambda step, events: widest.append(engine.stats().decoding),
    )
    assert max(widest) >= 4, f"{kind}: the rows never decoded together"
    for row in "abcd":
        assert runs[row].done.outcome == "finished"
        assert_same_run(runs[row], alone(model, reqs[row], settings), f"{kind} row {row}")
    cancelled = runs["e"]
    assert cancelled.done.outcome == "cancelled" and 0 < len(cancelled.tokens) < 30
    solo_e = alone(model, reqs["e"], settings)
    assert cancelled.tokens == solo_e.tokens[: len(cancelled.tokens)]


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("llama", {}),
        ("qwen3_next", {}),
        ("gemma4_text", {}),
        ("llama-hd32", {"kv_codec": "turboquant"}),
        ("gemma4_text", {"kv_bits": 8, "kv_group_size": 32}),
    ],
    ids=["llama", "qwen3_next", "gemma4_text", "llama/turboquant", "gemma4_text/kv8"],
)
def test_rows_leaving_a_batch_park_and_joining_rows_take_their_places(
    name, options, loaded, monkeypatch
):
    """A row that leaves stays in the batch caches while at least half the rows are
    live, for at most park_steps steps; a row joining later takes a parked row's
    place in the buffers, in place, unless it is longer than the batch's rows
    (then the batch compacts and the row joins by a copy); every row still equals
    its solo run."""
    from mlx_loom.engine.group import DecodeGroup

    model, _ = loaded(name)
    reqs = {
        "a": request(model, prompt=ids(9, 1), max_tokens=4, **options),
        "b": request(model, prompt=ids(8, 2), max_tokens=7, **options),
        "c": request(model, prompt=ids(9, 3), max_tokens=64, **options),
        "d": request(model, prompt=ids(7, 4), max_tokens=60, **options),
        "e": request(model, prompt=ids(8, 5), max_tokens=6, **options),
        "f": request(model, prompt=ids(70, 6), max_tokens=5, **options),
    }
    engine = Engine(model)
    shapes: list[tuple[int, int]] = []
    placed: list[bool] = []
    into_parked = DecodeGroup._into_parked

    def spy(self, others):
        placed.append(into_parked(self, others))
        return placed[-1]

    monkeypatch.setattr(DecodeGroup, "_into_parked", spy)

    def look(step, events):
        shapes.extend((g.width, len(g.rows)) for g in engine._groups if g.stacked)

    runs = drive(
        engine,
        {0: [(k, reqs[k]) for k in "abcd"], 16: [("e", reqs["e"])], 20: [("f", reqs["f"])]},
        on_step=look,
    )
    assert (4, 3) in shapes and (4, 2) in shapes, f"{name}: leaving rows never parked: {shapes}"
    after_a_and_b = shapes.index((4, 2))
    assert (4, 3) in shapes[after_a_and_b:], f"{name}: e took no parked place: {shapes}"
    # The first absorb stacks the four rows; e takes a parked place; f, 70 tokens
    # long, does not fit the rows' 30-odd slots and joins by a copy.
    assert placed[-2:] == [True, False], placed
    assert all(2 * live >= width for width, live in shapes)
    # Rows parked for park_steps steps with none joining are compacted away.
    assert (2, 2) in shapes, f"{name}: parked rows outlived park_steps: {shapes}"
    run = longest = 0
    for width, live in shapes:
        run = run + 1 if width != live else 0
        longest = max(longest, run)
    assert longest <= DecodeGroup.park_steps + 1, shapes
    for row in "abcdef":
        assert runs[row].done.outcome == "finished"
        assert_same_run(runs[row], alone(model, reqs[row]), f"{name} row {row}")


def test_a_long_prompt_arriving_during_decode_does_not_freeze_the_running_stream(loaded):
    model, _ = loaded("llama")
    step = 16
    short = request(model, prompt=ids(6, 7), max_tokens=40)
    long = request(model, prompt=ids(200, 8), max_tokens=4)
    engine = Engine(model, EngineSettings(prefill_step_size=step))
    seen: list[tuple[int, set[int]]] = []
    runs = drive(
        engine,
        {0: [("short", short)], 4: [("long", long)]},
        on_step=lambda k, events: seen.append((k, {e.uid for e in events if hasattr(e, "token")})),
    )
    short_uid, long_uid = runs["short"].done.uid, runs["long"].done.uid
    first_long = next(k for k, uids in seen if long_uid in uids)
    # The long prompt is prefilled one chunk per step ...
    assert first_long - 4 >= math.ceil(199 / step)
    # ... and the running stream got a token on every one of those steps.
    for k, uids in seen:
        if 4 <= k <= first_long and len(runs["short"].tokens) > k - 1:
            assert short_uid in uids, f"the running stream stalled at step {k}"
    settings = EngineSettings(prefill_step_size=step)
    assert_same_run(runs["short"], alone(model, short, settings), "short")
    assert_same_run(runs["long"], alone(model, long, settings), "long")


def test_a_removed_row_leaves_at_once(loaded):
    model, _ = loaded("llama")
    engine = Engine(model)
    a, b = (
        request(model, prompt=ids(5, 1), max_tokens=50),
        request(model, prompt=ids(8, 2), max_tokens=50),
    )
    ua, ub = engine.insert([a, b])
    for _ in range(6):
        engine.step()
    assert engine.stats().decoding == 2
    (done,) = engine.remove([ub])
    assert done.outcome == "cancelled" and engine.stats().decoding == 1
    assert all(e.uid == ua for e in engine.step())
    assert engine.stats().cancelled == 1


def test_removing_a_waiting_or_prefilling_request_never_runs_it(loaded):
    model, _ = loaded("llama")
    engine = Engine(model, EngineSettings(prefill_step_size=2, decode_concurrency=1))
    first, second = engine.insert(
        [
            request(model, prompt=ids(9, 1), max_tokens=5),
            request(model, prompt=ids(4, 2), max_tokens=5),
        ]
    )
    engine.step()  # the first is prefilling; the second waits for a free row
    assert engine.stats().prefilling == 1 and engine.stats().waiting == 1
    outcomes = engine.remove([first, second])
    assert [d.outcome for d in outcomes] == ["cancelled", "cancelled"]
    assert not engine.has_work


def test_concurrency_settings_cap_running_and_prefilling_rows(loaded):
    model, _ = loaded("llama")
    reqs = [request(model, prompt=ids(9, i), max_tokens=6) for i in range(5)]
    engine = Engine(
        model, EngineSettings(decode_concurrency=2, prompt_concurrency=1, prefill_step_size=2)
    )
    peaks = {"prefilling": 0, "running": 0}

    def watch(_step, _events):
        stats = engine.stats()
        peaks["prefilling"] = max(peaks["prefilling"], stats.prefilling)
        peaks["running"] = max(peaks["running"], stats.active)

    runs = drive(engine, {0: [(str(i), r) for i, r in enumerate(reqs)]}, on_step=watch)
    assert peaks == {"prefilling": 1, "running": 2}
    for i, r in enumerate(reqs):
        assert_same_run(runs[str(i)], alone(model, r, engine.settings), f"request {i}")


def test_stop_strings_and_alternatives_are_each_rows_own(loaded):
    model, tok = loaded("llama")
    free = alone(model, request(model, tok, "the model reads a token", max_tokens=30))
    stop = free.text[len(free.text) // 2 :][:2]
    assert stop.strip(), "need a visible stop string"
    stopped = request(model, tok, "the model reads a token", max_tokens=30, stop=[stop])
    other = request(model, tok, "hello world", max_tokens=12, params=SamplingParams(logprobs=3))
    runs = drive(Engine(model), {0: [("stopped", stopped), ("other", other)]})
    assert runs["stopped"].text == free.text[: free.text.index(stop)]
    assert runs["stopped"].events[-1].finish_reason == "stop"
    assert runs["stopped"].events[-1].stop == stop
    assert all(len(e.top_logprobs) == 3 for e in runs["other"].events)
    assert all(e.top_logprobs == [] for e in runs["stopped"].events)
    assert_same_run(runs["other"], alone(model, other), "other")


def test_a_failing_custom_sampler_fails_its_row_alone(loaded):
    model, _ = loaded("llama")

    def broken(logprobs):
        raise ValueError("sampler exploded")

    good = request(model, prompt=ids(6, 1), max_tokens=8)
    bad = request(model, prompt=ids(6, 2), max_tokens=8, sampler=broken)
    runs = drive(Engine(model), {0: [("good", good)], 2: [("bad", bad)]})
    assert runs["bad"].done.outcome == "failed"
    assert isinstance(runs["bad"].done.error, ValueError)
    assert_same_run(runs["good"], alone(model, good), "good")


def test_generation_stops_at_the_context_with_finish_reason_length(loaded):
    model, _ = loaded("llama")
    context = model.context_length
    near = request(model, prompt=ids(context - 5, 1), max_tokens=50)
    run = alone(model, near)
    assert len(run.tokens) == 5 and run.events[-1].finish_reason == "length"
    with pytest.raises(RequestError, match="leaves no room"):
        request(model, prompt=ids(context, 1), max_tokens=1)


def test_insert_takes_only_requests(loaded):
    model, _ = loaded("llama")
    with pytest.raises(RequestError, match="Request objects"):
        Engine(model).insert([[1, 2, 3]])


def test_a_batch_of_one_runs_through_the_rows_own_caches(loaded):
    """Alone, a row decodes through its single-row caches (the generate_step op graph)."""
    from mlx_loom.cache import KVCache

    model, _ = loaded("llama")
    caches = model.make_cache()
    run = alone(model, request(model, prompt=ids(6, 1), max_tokens=5, cache=caches))
    assert len(run.tokens) == 5
    assert all(type(c) is KVCache for c in caches) and caches[0].offset == 6 + 4
    assert run.done.caches is caches and len(run.done.fed) == 6 + 4


def test_a_request_with_its_own_caches_leaves_a_batch_holding_exactly_its_tokens(loaded):
    """A caller's caches (a PromptCache's) are stacked into the batch and handed back."""
    model, _ = loaded("llama")
    mine = model.make_cache()
    prompt = ids(9, 1)
    engine = Engine(model)
    runs = drive(
        engine,
        {
            0: [("other", request(model, prompt=ids(12, 2), max_tokens=20))],
            2: [("mine", request(model, prompt=prompt, max_tokens=10, cache=mine))],
        },
    )
    held = prompt + runs["mine"].tokens[:-1]  # the last token was never fed
    assert list(runs["mine"].done.fed) == held and runs["mine"].done.caches is mine
    # Continuing from the handed-back caches equals a fresh run over everything.
    more = ids(4, 3)
    continued = alone(model, request(model, prompt=more, history=held, cache=mine, max_tokens=8))
    fresh = alone(model, request(model, prompt=held + more, max_tokens=8))
    assert_same_run(continued, fresh, "continued")


def test_a_model_without_the_batch_capability_still_serves_requests_side_by_side(tmp_path):
    from mlx_loom import load
    from mlx_loom.host import PluginHost
    from mlx_loom.testing.tokenizer import write_tokenizer

    from ..core.toyfamily import ToyPlugin, write_toy_checkpoint

    host = PluginHost(plugins=[("toy", ToyPlugin())], entry_points=False)
    ckpt = write_toy_checkpoint(tmp_path / "toy", vocab=256)
    write_tokenizer(ckpt, 256)
    model, _ = load(ckpt, host=host)
    reqs = [
        request(model, prompt=[1, 2, 3], max_tokens=6),
        request(model, prompt=[4, 5], max_tokens=6),
    ]
    engine = Engine(model)
    groups = []
    runs = drive(
        engine,
        {0: [("a", reqs[0]), ("b", reqs[1])]},
        on_step=lambda *_: groups.append(engine.stats().groups),
    )
    assert max(groups) == 2  # one forward per row: never stacked
    for name, req in zip("ab", reqs, strict=True):
        assert_same_run(runs[name], alone(model, req), name)


class CountingModule:
    """Wraps a graph to count its forwards and record their input shapes."""

    def __init__(self, module):
        self.module, self.shapes = module, []

    def __call__(self, inputs, cache=None):
        self.shapes.append(tuple(inputs.shape))
        return self.module(inputs, cache=cache)

    def make_cache(self):
        return self.module.make_cache()


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "gemma4_text"])
def test_a_burst_past_the_products_row_switch_is_not_stacked_across_it(name, loaded, monkeypatch):
    # On the native sets a product of more than SMALL_ROWS rows runs the
    # blocked GEMM, which sums in another order than the matrix-vector kernel
    # a lone 20-token chunk takes. Three such prompts in one padded forward
    # (60 rows) would change every row's bits (a greedy token on a near tie).
    model, _ = loaded(name)
    switch = model.cpu_path.rows_switch
    assert switch == native.module().SMALL_ROWS
    reqs = [request(model, prompt=ids(n, 40 + i), max_tokens=6) for i, n in enumerate([21, 20, 21])]
    counter = CountingModule(model.module)
    monkeypatch.setattr(model, "module", counter)
    runs = drive(Engine(model), {0: [(str(i), r) for i, r in enumerate(reqs)]})
    prefills = [s for s in counter.shapes if s[1] > 1]
    assert all(rows * width <= switch or rows == 1 for rows, width in prefills), prefills
    assert sorted(prefills) == [(1, 19), (1, 20), (1, 20)]
    monkeypatch.undo()
    for i, r in enumerate(reqs):
        assert_same_run(runs[str(i)], alone(model, r), f"{name} request {i}")


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "gemma4_text"])
def test_a_burst_of_fresh_prompts_is_prefilled_in_one_forward_exactly(name, loaded, monkeypatch):
    model, _ = loaded(name)
    reqs = [request(model, prompt=ids(n, i), max_tokens=6) for i, n in enumerate([9, 8, 9, 7, 120])]
    counter = CountingModule(model.module)
    monkeypatch.setattr(model, "module", counter)
    runs = drive(Engine(model), {0: [(str(i), r) for i, r in enumerate(reqs)]})
    prefills = [s for s in counter.shapes if s[1] > 1]
    # The four similar prompts share one padded forward; the long one goes alone.
    assert sorted(prefills) == [(1, 119), (4, 8)]
    monkeypatch.undo()
    for i, r in enumerate(reqs):
        assert_same_run(runs[str(i)], alone(model, r), f"{name} request {i}")
