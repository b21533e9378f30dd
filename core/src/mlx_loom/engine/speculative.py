"""Speculative decoding inside the engine: draft, verify in one forward, keep per row.

A speculative row's decode step is the plain step grown to a window
(:class:`SpeculativeGroup`):

1. a drafter proposes up to ``k`` tokens after the row's current token ``y``
   — a draft model (:class:`ModelDrafter`, its own caches, rolled back like
   the target's), the model's own multi-token-prediction head
   (:class:`~mlx_loom.engine.mtp.MtpDrafter`, fed the hidden states of the
   verify forward) or prompt lookup (:func:`ngram_draft`: the tokens that
   followed the latest earlier occurrence of the sequence's last n-gram);
   a row with a grammar keeps only the drafts' legal prefix
   (:mod:`mlx_loom.engine.constraints`);
2. the target verifies ``[y, d1 .. dk]`` in one forward inside a speculative
   round of every cache (:func:`begin_rounds`);
3. each position gets the row's logits processors over its own token
   history (the row's :class:`~mlx_loom.engine.next_token.TokenPicker`, as in
   plain decoding) and its grammar mask at that position, then the accept rule picks how many drafts to keep and
   the next token: for greedy rows the longest prefix equal to the target's argmax;
   for sampled rows the standard accept/reject rule (accept ``d`` with
   probability ``min(1, p(d)/q(d))``; on a rejection sample the residual
   ``max(0, p - q)``), so the output is distributed as the target's;
4. the caches keep exactly the fed tokens that were accepted
   (:func:`keep_rounds`: a recurrent state replays the kept prefix, a
   sliding window writes the kept tokens as one-token decoding would, a full
   KV cache trims), so the state equals plain decoding's.

Verification uses the decode arithmetic: on the CPU backend a window's
logits equal step-by-step decode logits bit for bit for every family (the
caches attend in decode order; see :mod:`mlx_loom.cache.window_round`), and
the backend's :class:`~mlx_loom.host.VerifyPolicy` cuts a window before any
point where the attention kernel changes arithmetic — by KV length, and by
query length and GQA factor for each of the model's attention geometries —
and refuses a model that never allows a window of 2. So greedy speculative
output equals greedy output token for token.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import mlx.core as mx

from mlx_loom.cache.protocol import SpeculativeRounds
from mlx_loom.engine.caches import layout, quantization_pending, stackable
from mlx_loom.engine.constraints import mask_logits
from mlx_loom.engine.group import DecodeGroup, Left, StepResult
from mlx_loom.engine.mtp import MtpDrafter, draft_sampler
from mlx_loom.engine.next_token import host_float, host_floats, host_int, host_ints, log_probs
from mlx_loom.engine.row import Row
from mlx_loom.errors import CacheNotTrimmable
from mlx_loom.engine.sampling import Sampler, logprobs_top_k
from mlx_loom.host import VERIFY_POLICIES
from mlx_loom.nn.attention_geometry import attention_geometries

if TYPE_CHECKING:
    from mlx_loom.model import Model

# --- rolling caches back -------------------------------------------------------------


def check_rollback(caches: Sequence[Any], *, owner: str) -> None:
    """Refuse, before any work, caches that can neither open a round nor trim."""
    for c in caches:
        if isinstance(c, SpeculativeRounds) or c.is_trimmable():
            continue
        raise CacheNotTrimmable(
            f"Speculative decoding needs every cache of the {owner} to roll rejected drafts "
            f"back; a {type(c).__name__} can neither open a speculative round nor trim.",
            fix="Generate without a draft for this model, or give the cache kind "
            "begin_round()/commit(keep).",
        )


def begin_rounds(caches: Sequence[Any]) -> None:
    """Open a speculative round on every cache that rolls back by rounds."""
    for c in caches:
        if isinstance(c, SpeculativeRounds):
            c.begin_round()


def keep_rounds(caches: Sequence[Any], fed: int, keep: int) -> None:
    """Keep the first ``keep`` of the ``fed`` tokens the round put in ``caches``."""
    for c in caches:
        if isinstance(c, SpeculativeRounds):
            c.commit(keep)
        elif fed > keep:
            c.trim(fed - keep)


# --- drafting ----------------------------------------------------------------------------


def ngram_draft(tokens: Sequence[int], k: int, *, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: up to ``k`` tokens that followed the latest earlier match of the tail.

    Tries the sequence's last ``max_n`` tokens first, then shorter tails down
    to ``min_n``; the most recent earlier occurrence wins (recent text is the
    likeliest to repeat). No match: no drafts (the step is a plain decode).
    """
    L = len(tokens)
    if k < 1:
        return []
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        tail = list(tokens[L - n :])
        first = tail[0]
        for i in range(L - n - 1, -1, -1):
            if tokens[i] == first and list(tokens[i : i + n]) == tail:
                return list(tokens[i + n : i + n + k])
    return []


class ModelDrafter:
    """A draft model's proposals for one row, with its own caches rolled back each step."""

    def __init__(self, draft: Model, row: Row) -> None:
        self.model = draft
        self.caches = draft.make_cache()
        check_rollback(self.caches, owner="draft model")
        #: Accepted tokens the draft has not been fed yet.
        self.unseen: list[int] = []
        self._fed = 0
        self._k = 0
        self._proposed: list[int] = []
        self.sampler = draft_sampler(row)

    def prefill(self, tokens: Sequence[int], step: int) -> None:
        for start in range(0, len(tokens), step):
            chunk = mx.array(list(tokens[start : start + step]), mx.uint32)
            self.model.forward(chunk[None], self.caches)
            mx.eval([c.state for c in self.caches])

    def propose(self, y: int, k: int) -> tuple[list[int], mx.array | None]:
        """``k`` draft tokens after ``y``, and (when sampling) their distributions ``[k, V]``."""
        begin_rounds(self.caches)
        feed = [*self.unseen, y]
        self._fed = len(feed) + k - 1
        tokens: list[int] = []
        dists = []
        for _ in range(k):
            logits = self.model.forward(mx.array(feed, mx.uint32)[None], self.caches)[:, -1, :]
            logprobs = log_probs(self.model, logits)
            if self.sampler is None:
                token = host_int(mx.argmax(logprobs, axis=-1))
            else:
                dists.append(mx.softmax(self.sampler.sampling_logits(logprobs), axis=-1)[0])
                token = host_int(self.sampler(logprobs))
            tokens.append(token)
            feed = [token]
        self._k, self._proposed = k, tokens
        return tokens, (mx.stack(dists) if dists else None)

    def settle(self, accepted: int) -> None:
        """Roll the draft back to what the target kept (``accepted`` of its proposals)."""
        k = self._k
        keep = len(self.unseen) + 1 + min(accepted, k - 1)
        keep_rounds(self.caches, self._fed, keep)
        self.unseen = self._proposed[k - 1 : accepted] if accepted == k else []

    def skip(self, y: int) -> None:
        """A step without drafts: the draft sees ``y`` with the next proposal."""
        self.unseen.append(y)


class RowSpeculation:
    """A row's speculative state: its drafter and every token of its sequence."""

    def __init__(self, model: Model, row: Row, prefill_step: int) -> None:
        spec = row.request.speculation
        assert spec is not None
        self.spec = spec
        self.sequence: list[int] = [*row.request.history, *row.request.prompt]
        self.drafter: ModelDrafter | None = None
        #: The MTP head's drafter, fed during prefill (``None`` for other drafters).
        self.mtp: MtpDrafter | None = None
        if spec.draft is not None:
            self.drafter = ModelDrafter(spec.draft, row)
            self.drafter.prefill(self.sequence[:-1], prefill_step)
        elif spec.mtp:
            self.mtp = row.mtp if row.mtp is not None else MtpDrafter(model, row)

    def propose(self, k: int) -> tuple[list[int], mx.array | None]:
        if k < 1:
            return [], None
        if self.mtp is not None:
            return self.mtp.propose(k)
        if self.drafter is not None:
            return self.drafter.propose(self.sequence[-1], k)
        s = self.spec
        return ngram_draft(self.sequence, k, max_n=s.ngram_max, min_n=s.ngram_min), None


# --- the group -------------------------------------------------------------------------------


class SpeculativeGroup(DecodeGroup):
    """Speculative rows decoding together: one verify forward of every row's window.

    A lone row decodes through its own caches; rows whose caches share a
    layout are stacked, as plain rows are (:class:`DecodeGroup` does the
    joining and leaving), and each row keeps its own number of tokens per
    step (every batch cache kind commits a count per row). A row equals its
    solo speculative run: rows are computed independently and a row's
    shorter window is padded after its last draft, where causal attention
    never looks back from its real positions.
    """

    #: A verify step commits a count per cache row: rows that leave are taken out at once.
    parks = False

    def __init__(self, model: Model, row: Row, caches: list[Any], prefill_step: int) -> None:
        check_rollback(caches, owner="model")
        super().__init__(model, row, caches)
        self.policy = VERIFY_POLICIES.for_backend()
        #: Every attention layer kind of the model: the policy's kernel rules read them.
        self.geometries = attention_geometries(model.module)
        self.policy.check(self.geometries)
        row.speculation = RowSpeculation(model, row, prefill_step)

    @property
    def key(self) -> Hashable | None:
        if self.stacked:
            return self._key
        if self.policy.kernel is not None:
            # The backend picks attention kernels by shape (Metal): a stacked
            # verify runs every row at the batch's padded KV length and widest
            # window, not at the row's own, so only a lone row's window is the
            # one its policy allowed. Such rows verify alone.
            return None
        row = self.rows[0]
        if not stackable(self.caches) or quantization_pending(self.caches, row.request.kv.bits):
            return None
        return ("speculative", layout(self.caches))

    def absorb(self, others: list[DecodeGroup]) -> None:
        was_stacked = self.stacked
        super().absorb(others)
        if not was_stacked:
            self._key = ("speculative", self._key)

    def step(self) -> StepResult:
        out = StepResult()
        failed: dict[int, BaseException] = {}
        plans = [self._plan(j, row, failed) for j, row in enumerate(self.rows)]
        if failed:
            self._drop(failed, out)
            plans = [p for j, p in enumerate(plans) if j not in failed]
            failed = {}
        rows = self.rows
        if not rows:
            return out
        N = 1 + max(len(drafts) for drafts, _ in plans)
        inputs = []
        for row, (drafts, _) in zip(rows, plans, strict=True):
            window = [row.speculation.sequence[-1], *drafts]
            inputs.append(window + [window[-1]] * (N - len(window)))
        if N > 1:
            begin_rounds(self.caches)
        hidden: mx.array | None = None
        if any(row.speculation.mtp is not None for row in rows):
            # The MTP head reads the hidden states of the positions each row keeps.
            logits, hidden = self.model.forward_hidden(mx.array(inputs, mx.uint32), self.caches)
        else:
            logits = self.model.forward(mx.array(inputs, mx.uint32), self.caches)
        choices: list[tuple[mx.array, list[int], int] | None] = []
        for j, (row, (drafts, q)) in enumerate(zip(rows, plans, strict=True)):
            width = 1 + len(drafts)
            try:
                row_logits = row.picker.process(logits[j, :width], drafts)
                if row.constraint is not None:  # then the grammar's mask at each position
                    row_logits = mask_logits(row_logits, row.constraint.masks_along(drafts))
                logprobs = log_probs(self.model, row_logits)
                choices.append((logprobs, *_choose(row, logprobs, drafts, q)))
            except BaseException as err:  # a user's processor: this row fails alone
                failed[j] = err
                choices.append(None)
        keeps = []
        for j, row in enumerate(rows):
            choice = choices[j]
            if choice is None:
                keeps.append(0)
                continue
            emitted = self._emit(row, *choice, out)
            keeps.append(emitted)
            if row.constraint is not None:
                try:
                    row.constraint.advance(choice[1][:emitted])
                except BaseException as err:  # this row's grammar failed: it alone leaves
                    failed[j] = err
            drafts = plans[j][0]
            row.fed.extend(inputs[j][:emitted])
            row.speculation.sequence.extend(choice[1][:emitted])
            row.picker.note(choice[1][:emitted])
            out.drafted += len(drafts)
            out.accepted += min(choice[2], emitted)
            mtp = row.speculation.mtp
            if mtp is not None and hidden is not None and not row.finished:
                mtp.feed(hidden[j, :emitted], choice[1][:emitted])
            drafter = row.speculation.drafter
            if drafter is not None and not row.finished:
                if drafts:
                    drafter.settle(choice[2])
                else:
                    drafter.skip(inputs[j][0])
        if N > 1:
            self._commit(N, keeps)
        if not self.stacked:
            rows[0].request.kv.apply(self.caches)
        done = {j: failed.get(j) for j, row in enumerate(rows) if row.finished or j in failed}
        if done:
            self._drop(done, out)
        return out

    def _plan(
        self, j: int, row: Row, failed: dict[int, BaseException]
    ) -> tuple[list[int], mx.array | None]:
        """Row ``row``'s drafts for this step (none when its budget or the policy allows none)."""
        st = row.speculation
        budget = row.request.limit - row.produced
        k = min(st.spec.num_draft, budget - 1)
        if k > 0:
            k = self.policy.window(len(st.sequence) - 1, k + 1, self.geometries) - 1
        try:
            drafts, q = st.propose(k)
        except BaseException as err:  # a draft model may raise anything: this row fails
            failed[j] = err
            return [], None
        if row.constraint is not None:  # a draft the grammar rejects ends the run
            n = row.constraint.legal_prefix(drafts)
            drafts, q = drafts[:n], (q[:n] if q is not None and n else None)
        return drafts, q

    def _commit(self, fed: int, keeps: list[int]) -> None:
        for c in self.caches:
            if isinstance(c, SpeculativeRounds):
                c.commit(keeps if self.stacked else keeps[0])
            elif fed > keeps[0]:
                c.trim(fed - keeps[0])  # a lone row's trimmable cache

    def _drop(self, leaving: Mapping[int, BaseException | None], out: StepResult) -> None:
        for j, err in leaving.items():
            row = self.rows[j]
            caches = None if err is not None else self._row_caches(j)
            out.left.append(Left(row, caches, err))
        self._keep([j for j in range(len(self.rows)) if j not in leaving])

    @staticmethod
    def _emit(
        row: Row, logprobs: mx.array, tokens: list[int], accepted: int, out: StepResult
    ) -> int:
        """Hand ``tokens`` to the row until it finishes; how many it took."""
        ids = mx.array(tokens, mx.int32)
        chosen = mx.take_along_axis(logprobs[: len(tokens)], ids[:, None], axis=-1)[:, 0]
        top_k = row.request.params.logprobs
        top = logprobs_top_k(logprobs[: len(tokens)], top_k) if top_k else None
        # Events cross threads: every array they carry is evaluated here.
        vectors = (
            [mx.contiguous(logprobs[j]) for j in range(len(tokens))]
            if row.request.logprobs_vector
            else None
        )
        mx.eval(chosen, *(top or ()), *(vectors or ()))
        values = host_floats(chosen)
        emitted = 0
        for j, token in enumerate(tokens):
            alts: list[tuple[int, float]] = []
            if top is not None:
                alts = list(zip(host_ints(top[0][j]), host_floats(top[1][j]), strict=True))
            vector = vectors[j] if vectors is not None else None
            out.events.append(row.accept(token, values[j], alts, vector, from_draft=j < accepted))
            emitted += 1
            if row.finished:
                break
        return emitted


def _choose(
    row: Row, logprobs: mx.array, drafts: list[int], q: mx.array | None
) -> tuple[list[int], int]:
    """The tokens this step emits (accepted drafts, then one of the target's) and how
    many of them are drafts."""
    picker = row.picker
    if picker.greedy:
        return accept_greedy(logprobs, drafts)
    sampler = picker.sampler
    assert isinstance(sampler, Sampler)
    return accept_sampled(sampler, logprobs, drafts, q)


def accept_greedy(logprobs: mx.array, drafts: list[int]) -> tuple[list[int], int]:
    """Keep the drafts that equal the target's argmax; then the target's own token."""
    k = len(drafts)
    target = host_ints(mx.argmax(logprobs, axis=-1))
    a = 0
    while a < k and drafts[a] == target[a]:
        a += 1
    return [*drafts[:a], target[a]], a


def accept_sampled(
    sampler: Sampler, logprobs: mx.array, drafts: list[int], q: mx.array | None
) -> tuple[list[int], int]:
    """The standard accept/reject rule, so the tokens are distributed as the target's.

    ``logprobs`` ``[k+1, V]`` are the target's (after processors); the target
    distribution ``p`` is what the sampler would draw from (its filters and
    temperature applied). ``q`` ``[k, V]`` is the draft's distribution, or
    ``None`` for deterministic drafts (prompt lookup: ``q`` is one-hot).
    Draft ``j`` is accepted with probability ``min(1, p(d)/q(d))``; the first
    rejection is replaced by a draw from ``max(0, p - q)`` renormalised; if
    every draft is accepted, one more token is drawn from ``p``.
    """
    k = len(drafts)
    if k == 0:
        return [host_int(sampler(logprobs[:1]))], 0
    p = mx.softmax(sampler.sampling_logits(logprobs), axis=-1)
    ids = mx.array(drafts, mx.int32)[:, None]
    p_d = mx.take_along_axis(p[:k], ids, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, ids, axis=-1)[:, 0] if q is not None else mx.ones((k,))
    u = mx.random.uniform(shape=(k,), key=sampler.split_key())
    accept = cast("list[bool]", (u * q_d < p_d).tolist())
    a = 0
    while a < k and accept[a]:
        a += 1
    if a == k:
        final = host_int(sampler(logprobs[k : k + 1]))
        return [*drafts, final], k
    if q is not None:
        residual = mx.maximum(p[a] - q[a], 0.0)
    else:
        residual = mx.where(mx.arange(p.shape[-1]) == drafts[a], 0.0, p[a])
    if host_float(residual.sum()) <= 0.0:  # p == q up to rounding: the target's own draw
        residual = p[a]
    final = host_int(mx.random.categorical(mx.log(residual), key=sampler.split_key()))
    return [*drafts[:a], final], a
