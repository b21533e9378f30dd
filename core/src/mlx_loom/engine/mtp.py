"""Drafting with the model's own multi-token-prediction (MTP) head.

Some checkpoints (Qwen3-Next, Qwen3.5) ship a small head trained to predict
token ``t + 2`` from the model's hidden state at ``t`` and the token at
``t + 1`` (:class:`mlx_loom.causal_lm.MultiTokenPredictor`). The head is one
attention layer with its own KV cache, which holds one entry per *pair*
``(h_t, x_{t+1})`` of the row's sequence, always with the model's own hidden
state (never the head's): that is what the head was trained on.

So the drafter keeps the pairs the head has not seen yet. Prefill hands it
the prompt's pairs chunk by chunk (:func:`mlx_loom.engine.prefill.prefill_alone`
runs the model's forward that returns hidden states for such rows); each
verify step hands it the pairs of the positions the row kept (their hidden
states come out of the same verify forward). To propose ``k`` tokens it
feeds the pending pairs (the last one predicts the first draft), then feeds
its own output state with each draft for the next; the ``k - 1`` chained
entries are trimmed straight away, since the next step re-feeds those
positions with the model's hidden states. The model's caches roll back as
for any drafter (:mod:`mlx_loom.engine.speculative`), so greedy output
equals plain greedy decoding whatever the head proposes.

The first decode step after prefill drafts nothing: the hidden state of the
prompt's last token comes out of that step's forward. Prompt tokens reused
from the prefix store (or a caller's cache) were never seen by the head, so
its context starts after them; RoPE is relative, so only that missing
context (not the positions' offset) can lower acceptance.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import mlx.core as mx

from mlx_loom.engine.next_token import host_int, log_probs
from mlx_loom.engine.row import Row
from mlx_loom.engine.sampling import Sampler, make_sampler
from mlx_loom.errors import CacheNotTrimmable

if TYPE_CHECKING:
    from mlx_loom.model import Model


def draft_sampler(row: Row) -> Sampler | None:
    """How a drafter samples for a sampled row (``None``: the row is greedy, drafts are argmax).

    Its own key, derived from the row's seed, so drafting never moves the
    row's own random stream.
    """
    picker = row.picker
    if picker.greedy:
        return None
    seed = picker.sampler.seed if isinstance(picker.sampler, Sampler) else None
    key = mx.random.key(((seed or 0) ^ 0x5DEECE66D) & (2**63 - 1))
    return make_sampler(row.request.params, key=key)


def uses_mtp(row: Row) -> bool:
    """Whether ``row`` drafts with the model's MTP head."""
    spec = row.request.speculation
    return spec is not None and spec.mtp


class MtpDrafter:
    """One row's MTP head: its caches and the pairs it has not been fed yet."""

    def __init__(self, model: Model, row: Row) -> None:
        self.model = model
        self.caches = model.make_mtp_cache()
        for c in self.caches:
            if not c.is_trimmable():
                raise CacheNotTrimmable(
                    f"The MTP head's {type(c).__name__} cannot trim the drafts it chains.",
                    fix="Give the head a trimmable KV cache (make_mtp_cache), or draft with "
                    "'ngram'.",
                )
        self.sampler = draft_sampler(row)
        self._hidden: list[mx.array] = []
        self._tokens: list[int] = []

    def feed(self, hidden: mx.array, tokens: Sequence[int]) -> None:
        """Pairs to feed before the next proposal: hidden states ``[L, D]`` of the
        model and the token that followed each."""
        assert hidden.shape[0] == len(tokens)
        self._hidden.append(hidden)
        self._tokens.extend(tokens)

    def prefill(self, hidden: mx.array, tokens: Sequence[int]) -> None:
        """Feed a prompt chunk's pairs through the head now (its cache grows with the prompt)."""
        self.feed(hidden, tokens)
        hidden_in, tokens_in = self._take()
        self.model.mtp_forward(hidden_in, tokens_in, self.caches)
        mx.eval([c.state for c in self.caches])

    def _take(self) -> tuple[mx.array, mx.array]:
        hidden = mx.concatenate(self._hidden, axis=0)[None]
        tokens = mx.array(self._tokens, mx.uint32)[None]
        self._hidden, self._tokens = [], []
        return hidden, tokens

    def propose(self, k: int) -> tuple[list[int], mx.array | None]:
        """Up to ``k`` drafts and (when sampling) their distributions ``[k, V]``;
        none until a pair is pending (the first step after prefill)."""
        if k < 1 or not self._tokens:
            return [], None
        hidden, tokens = self._take()
        drafts: list[int] = []
        dists = []
        for _ in range(k):
            logits, out = self.model.mtp_forward(hidden, tokens, self.caches)
            if self.sampler is None:  # the argmax of the logits is that of their log-softmax
                token = host_int(mx.argmax(logits, axis=-1))
            else:
                logprobs = log_probs(self.model, logits)
                dists.append(mx.softmax(self.sampler.sampling_logits(logprobs), axis=-1)[0])
                token = host_int(self.sampler(logprobs))
            drafts.append(token)
            hidden, tokens = out[:, -1:, :], mx.array([[token]], mx.uint32)
        if k > 1:  # the chained entries hold the head's states, not the model's
            for c in self.caches:
                c.trim(k - 1)
        return drafts, (mx.stack(dists) if dists else None)
