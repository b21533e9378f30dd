"""JSON as the server writes it: strict, with no ``NaN`` or ``Infinity`` ever on the wire.

Python's ``json`` writes non-finite floats as bare ``NaN``, ``Infinity`` and
``-Infinity``, which are not JSON: strict parsers (JavaScript's
``JSON.parse``, Go, serde) reject the whole body. Request values are bounded
so the engine's numbers stay finite (see ``SamplingParams``), and this module
makes the answer strict whatever reaches it:

* a log-probability of ``-inf`` (a token the model gives no chance, e.g. a
  vocabulary entry it masks) is reported as :data:`LOGPROB_FLOOR`, the value
  OpenAI's API itself reports for such tokens; a ``NaN`` log-probability too;
* any other non-finite number in an answer is written as ``null`` (and logged:
  it is a bug to fix, not a case to rely on).
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

log = logging.getLogger("mlx_loom.serve")

#: What a log-probability that is not a finite number is reported as.
LOGPROB_FLOOR = -9999.0


def logprob(value: float) -> float:
    """``value`` as a JSON-safe log-probability: finite as is, else :data:`LOGPROB_FLOOR`."""
    return value if math.isfinite(value) else LOGPROB_FLOOR


def dumps(value: Any) -> str:
    """``json.dumps`` that never writes ``NaN``/``Infinity`` (they become ``null``)."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        log.warning("an answer held a non-finite number; it is sent as null")
        return json.dumps(_finite(value), allow_nan=False)


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by ``None`` (iteratively: no recursion)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if not isinstance(value, (dict, list, tuple)):
        return value
    root: list[Any] = [value]
    stack: list[tuple[Any, Any, Any]] = [(root, 0, value)]  # (parent, key, item)
    while stack:
        parent, key, item = stack.pop()
        if isinstance(item, float):
            parent[key] = item if math.isfinite(item) else None
        elif isinstance(item, dict):
            copy = dict(item)
            parent[key] = copy
            stack.extend((copy, k, v) for k, v in copy.items())
        elif isinstance(item, (list, tuple)):
            copy_list = list(item)
            parent[key] = copy_list
            stack.extend((copy_list, i, v) for i, v in enumerate(copy_list))
    return root[0]
