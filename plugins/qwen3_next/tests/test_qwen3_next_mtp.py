"""Drafting with the checkpoint's own multi-token-prediction head (``mtp.*``).

The tiny checkpoints carry a random head: its drafts are mostly rejected,
which is what makes "greedy speculative output equals plain greedy output"
a test of the rollback. Other tests force acceptance (a head whose drafts
the target then agrees with) and follow the pairs the head is fed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_loom
from mlx_loom.engine import Speculation
from mlx_loom.engine.request import make_request
from mlx_loom.errors import CapabilityRefused
from mlx_loom.host import resolve_model
from mlx_loom.loader import build_model
from mlx_loom.testing.oracle import oracle_options

PROMPT = [1, 5, 7, 9, 11, 200, 3, 4, 8, 100, 42, 17, 23, 99]


def engine_model(path, **options):
    """The model as ``mlx_loom.load`` builds it (its engine included), without a tokenizer."""
    return build_model(resolve_model(path, **options))


@pytest.fixture(scope="module")
def mtp_models(ckpt_dir):
    cache = {}

    def get(kind):
        if kind not in cache:
            cache[kind] = engine_model(ckpt_dir(kind))
        return cache[kind]

    yield get
    for model in cache.values():
        model.close_engine()


def tokens(model, prompt=PROMPT, n=16, **options):
    out = list(mlx_loom.stream_generate(model, None, prompt, max_tokens=n, **options))
    return [r.token for r in out], sum(r.from_draft for r in out)


# --- loading ------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
def test_a_checkpoint_that_ships_an_mtp_head_loads_it_mapped_like_the_model(ckpt_dir, family):
    from safetensors.numpy import load_file  # the raw checkpoint, as stored

    path = ckpt_dir(f"{family}_mtp-fp32")
    stored = load_file(str(path / "model.safetensors"))
    model = engine_model(path)
    assert model.mtp_refusal() is None
    head = model.module.mtp
    assert np.array_equal(np.array(head.fc.weight), stored["mtp.fc.weight"])
    # Zero-centred gains get their 1.0 back, as the model's own norms do.
    for name in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding"):
        got = np.array(getattr(head, name).weight)
        assert np.allclose(got, stored[f"mtp.{name}.weight"] + 1.0), name
    assert not head.layers[0].is_linear  # the head's layer is full attention


def test_the_head_is_not_part_of_the_models_logits(loaders):
    """With a head loaded, the model's logits stay bit-equal to mlx-lm's (which drops it)."""
    ours, ref = loaders("qwen3_next_mtp-fp32")
    x = mx.array([PROMPT])
    assert mx.array_equal(ours(x), ref(x))
    logits, hidden = ours.forward_hidden(x)
    assert mx.array_equal(logits, ours(x))
    assert hidden.shape == (1, len(PROMPT), ours.config.hidden_size)


def test_the_heads_cache_grows_pair_by_pair_as_it_does_over_all_pairs(loaders):
    """Fed incrementally or at once, the head gives the same next-token logits."""
    model = loaders("qwen3_next_mtp-fp32")[0]
    _, hidden = model.forward_hidden(mx.array([PROMPT]))
    nxt = mx.array([PROMPT[1:] + [3]])
    whole, _ = model.mtp_forward(hidden, nxt, model.make_mtp_cache())
    cache = model.make_mtp_cache()
    model.mtp_forward(hidden[:, :9], nxt[:, :9], cache)
    part, _ = model.mtp_forward(hidden[:, 9:], nxt[:, 9:], cache)
    assert part.shape == whole.shape == (1, model.config.vocab_size)
    assert np.allclose(np.array(part), np.array(whole), atol=1e-5)


def test_a_checkpoint_without_mtp_weights_or_without_the_config_field_has_no_head(
    ckpt_dir, tmp_path, qn
):
    plain = engine_model(ckpt_dir("qwen3_next-fp32"))  # a stray mtp.fc, no config field
    assert "declares no MTP layers" in plain.mtp_refusal()
    assert not hasattr(plain.module, "mtp")
    bare = qn.write_checkpoint(tmp_path / "bare", qn.QWEN3_NEXT_CONFIG, drop=("mtp.fc.weight",))
    assert "no mtp.* tensors" in engine_model(bare).mtp_refusal()


# --- drafting -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5"])
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafting_gives_the_plain_greedy_tokens(mtp_models, family, k):
    model = mtp_models(f"{family}_mtp-fp32")
    before = model.engine.stats().engine.draft_tokens
    got, _ = tokens(model, draft="mtp", num_draft_tokens=k)
    assert got == tokens(model)[0]
    assert model.engine.stats().engine.draft_tokens > before  # the head did draft


def test_batched_mtp_rows_give_each_rows_plain_greedy_tokens(mtp_models):
    model = mtp_models("qwen3_next_mtp-fp32")
    prompts = [PROMPT, PROMPT[3:], [7, 7, 8, 9] * 3]
    want = [tokens(model, p, n=12)[0] for p in prompts]
    spec = Speculation(None, 3, mtp=True)
    handles = [
        model.engine.submit(make_request(model, None, p, max_tokens=12, speculation=spec))
        for p in prompts
    ]
    assert [[e.token for e in h] for h in handles] == want


def test_sampled_mtp_drafting_runs_to_its_budget(mtp_models):
    model = mtp_models("qwen3_5_mtp-fp32")
    got, _ = tokens(model, n=12, draft="mtp", temperature=0.9, seed=7)
    assert len(got) == 12


def test_the_head_is_fed_the_models_hidden_state_and_the_next_token_at_every_position(
    mtp_models, monkeypatch
):
    """Every position the head's cache keeps holds (h_t of the model, token t+1)."""
    model = mtp_models("qwen3_next_mtp-fp32")
    module = model.module
    fed: dict[int, tuple[np.ndarray, int]] = {}
    real = module.mtp_forward

    def spy(hidden, toks, cache):
        start = cache[0].offset
        states = np.array(hidden[0])  # read on the engine thread, which built it
        for i, t in enumerate(toks[0].tolist()):
            fed[start + i] = (states[i], t)  # a later write replaces a trimmed one
        return real(hidden, toks, cache)

    monkeypatch.setattr(module, "mtp_forward", spy)
    got, _ = tokens(model, n=16, draft="mtp", num_draft_tokens=3, prefill_step_size=5)
    sequence = PROMPT + got
    _, hidden = module.forward_hidden(mx.array([sequence[:-1]]))
    checked = len(PROMPT) + 8  # every position fed before the run's last steps
    for t in range(checked):
        h, token = fed[t]
        assert token == sequence[t + 1], t
        assert np.allclose(h, np.array(hidden[0, t]), atol=1e-4), t


def test_drafts_the_target_agrees_with_are_accepted(tmp_path, qn):
    """A head whose final gain is zero drafts token 0 every time; a bias makes the
    target emit token 0 too, so every draft after the first step is accepted."""
    path = qn.write_checkpoint(tmp_path / "agree", qn.QWEN3_NEXT_CONFIG, seed=2, mtp=True)
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors["mtp.norm.weight"] = np.full_like(tensors["mtp.norm.weight"], -1.0)  # gain 0
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "mlx"})
    model = engine_model(path)
    try:
        bias = {"logit_bias": {0: 100.0}}
        got, accepted = tokens(model, n=13, draft="mtp", num_draft_tokens=3, **bias)
        assert got == tokens(model, n=13, **bias)[0] == [0] * 13
        assert accepted == 9  # 1 draftless step, then 3 windows of 3 accepted drafts + 1
    finally:
        model.close_engine()


# --- refusals ---------------------------------------------------------------------------


def test_draft_mtp_is_refused_naming_why_when_the_checkpoint_has_no_head(ckpt_dir):
    model = engine_model(ckpt_dir("qwen3_next-fp32"))
    with pytest.raises(CapabilityRefused, match="declares no MTP layers") as err:
        tokens(model, draft="mtp")
    assert "mtp.* weights" in err.value.fix


def test_checkpoints_with_a_head_still_parity_check_on_the_oracle_path(ckpt_dir):
    """The head is loaded on the oracle's arithmetic too (no kernel path drops it)."""
    model = build_model(resolve_model(ckpt_dir("qwen3_5_mtp-fp32"), **oracle_options()))
    assert model.mtp_refusal() is None
