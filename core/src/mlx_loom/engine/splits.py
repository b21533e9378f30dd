"""Where a prompt's prefill chunks end, and where the prefix store keeps checkpoints.

Prefill arithmetic depends on the chunk it runs in: on the CPU backend a
39-token chunk and chunks of 20 and 19 give log-probabilities ~1e-6 apart
(the products take another path past 32 rows). So a cache restored at
position ``p`` answers exactly as a request that never saw a cache only if
both prefilled ``[0, p)`` in the same chunks, and both end a chunk at ``p``.
The engine therefore ends chunks at positions that depend on the prompt's
tokens alone — never on what happened to be cached:

* every multiple of the prefill step (counted from the prompt's start);
* every **turn boundary**: the position just after an end-of-turn token (one
  of the request's ``eos`` ids, which is how chat templates close a message:
  ``<|im_end|>``, ``<turn|>``, ``<end_of_turn>``), so the prefix of an
  edited or follow-up conversation ends on a boundary both share;
* the end of the prompt (all but its last token).

Checkpoints are taken at turn boundaries, at the prompt's end, and every
``checkpoint_chunks`` multiples of the step. A checkpoint at ``p`` serves a
later prompt only where that prompt's own chunks end at ``p`` as well
(:func:`ends_chunk`).
"""

from __future__ import annotations

from collections.abc import Sequence


def chunk_end(prompt: Sequence[int], start: int, step: int, last: int, eos: frozenset[int]) -> int:
    """Where the chunk beginning at prompt position ``start`` ends (exclusive).

    ``last`` is where prefill stops (``len(prompt) - 1``). Cost: the chunk's
    length (the scan for an end-of-turn token stops at the first).
    """
    end = min(last, (start // step + 1) * step)
    if eos:
        for i in range(start, end - 1):
            if prompt[i] in eos:
                return i + 1
    return end


def ends_chunk(prompt: Sequence[int], p: int, step: int, eos: frozenset[int]) -> bool:
    """Whether a prefill of ``prompt`` ends a chunk at position ``p``."""
    return p == len(prompt) - 1 or p % step == 0 or (p > 0 and prompt[p - 1] in eos)


def takes_checkpoint(
    prompt: Sequence[int], p: int, step: int, eos: frozenset[int], every: int
) -> bool:
    """Whether the engine keeps a checkpoint after prefilling ``prompt[:p]``."""
    if p == len(prompt) - 1 or (p > 0 and prompt[p - 1] in eos):
        return True
    return every > 0 and p % (step * every) == 0
