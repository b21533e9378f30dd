"""Sampling defaults: what a request that leaves a sampling field out gets.

Two sources, each field overriding the one before: the checkpoint's
``generation_config.json`` (read by :mod:`mlx_loom.artifacts.generation`),
then the server's own flags (``loom serve --temp --top-p --top-k --min-p``).
A request's own value overrides both. Every value is checked by
:class:`~mlx_loom.engine.params.SamplingParams`, field by field, so a
default can never be something a request could not ask for:

* a value from the checkpoint that SamplingParams refuses is dropped with a
  warning naming it (the file is advisory; a model with a nonsense
  recommendation still loads, and decodes as if the file did not say);
* a value the operator gave (a flag, an embedding application's argument)
  is a :class:`~mlx_loom.errors.RequestError` naming the field, at start.

Which doors apply the checkpoint's values is decided by each door and
documented there: ``loom serve`` does (as vLLM does); ``generate()`` and
``loom generate`` do not unless asked (as mlx-lm does not), so they stay
token-for-token comparable with mlx-lm: ``loom generate --generation-config``,
or :func:`generation_defaults` passed on in Python.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

from mlx_loom.artifacts.generation import read_sampling_defaults
from mlx_loom.engine.params import SamplingParams
from mlx_loom.errors import RequestError

log = logging.getLogger("mlx_loom.engine")

#: The sampling fields a default may be given for.
DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def check_defaults(values: Mapping[str, Any], *, source: str) -> dict[str, Any]:
    """``values`` checked field by field; a refused one raises, naming ``source``."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        if value is None:
            continue
        if name not in DEFAULT_FIELDS:
            raise RequestError(
                f"{source}: {name!r} cannot have a server default; the fields that can are "
                f"{', '.join(DEFAULT_FIELDS)}.",
                fix=f"remove {name!r} from the defaults",
                param=name,
            )
        try:
            SamplingParams.parse(**{name: value})
        except RequestError as err:
            raise RequestError(f"{source}: {err.message}", fix=err.fix, param=name) from None
        out[name] = value
    return out


def generation_defaults(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The checkpoint's recommended sampling values that SamplingParams accepts.

    A refused value is dropped with a warning (see the module docstring).
    Pass the result on as options: ``generate(model, tokenizer, prompt,
    **generation_defaults(model.model_dir))``.
    """
    out: dict[str, Any] = {}
    for name, value in read_sampling_defaults(model_dir).items():
        try:
            SamplingParams.parse(**{name: value})
        except RequestError as err:
            log.warning("generation_config.json: %s; ignored", err.message)
            continue
        out[name] = value
    return out
