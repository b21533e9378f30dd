"""The KV quantization group size a request gets: one rule for every door.

mlx-lm always defaults to 64, which fails during prefill on a model whose
heads are 32 wide (the bundled model among them): a default that cannot work
is not a default. So ``kv_group_size=None`` (every door's default: the Python
API, ``generate``/``chat``/``serve`` and the HTTP server) means the preferred
size, 64, where it divides every head size the model's config declares, else
32. A size that is given is checked against the heads, never replaced. Both
happen where a request's options are checked, before any forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_loom.cache._buffers import KV_GROUP_SIZES
from mlx_loom.cache.codecs import kv_dtype_name
from mlx_loom.errors import RequestError

if TYPE_CHECKING:
    from mlx_loom.model import Model

__all__ = ["PREFERRED_KV_GROUP_SIZE", "kv_group_size_for", "model_head_dims"]

#: mlx-lm's default, kept wherever the model's heads allow it.
PREFERRED_KV_GROUP_SIZE = 64


def model_head_dims(model: Model) -> set[int]:
    """The attention head sizes ``config.json`` declares (what KV groups must divide).

    Read from ``head_dim`` and ``global_head_dim`` (Gemma 4's full-attention
    layers), else ``hidden_size / num_attention_heads`` — the sizes the
    families' key/value caches hold.
    """
    text = model.config.text_config()
    dims = {v for k in ("head_dim", "global_head_dim") if isinstance(v := text.get(k), int)}
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    if not dims and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
        dims.add(hidden // heads)
    return {d for d in dims if d > 0}


def kv_group_size_for(
    model: Model, kv_group_size: int | None, *, kv_bits: int | None, kv_codec: str | None
) -> int:
    """The group size to quantize ``model``'s KV cache with (see the module docstring).

    Only affine storage groups values; for another codec (or no KV
    quantization) the size is returned unchecked (``None``: the preferred one).
    Raises :class:`RequestError` for a given size that does not divide a head
    size, or when no size divides them, and for any KV quantization of a model
    loaded with ``kv_dtype`` (the two are different storages of one cache).
    """
    kv_dtype = getattr(model, "kv_dtype", None)
    if kv_dtype is not None and (kv_bits is not None or kv_codec is not None):
        raise RequestError(
            f"kv_bits / kv_codec quantize the KV cache, but this model stores it in "
            f"{kv_dtype_name(kv_dtype)} (it was loaded with kv_dtype)",
            fix="drop kv_bits and kv_codec, or load the model without kv_dtype to quantize "
            "its KV cache",
            param="kv_bits" if kv_bits is not None else "kv_codec",
        )
    if kv_group_size is not None and (
        isinstance(kv_group_size, bool) or kv_group_size not in KV_GROUP_SIZES
    ):
        return kv_group_size  # validate_kv_quantization refuses it, naming the sizes
    if kv_codec not in (None, "affine") or kv_bits is None:
        return PREFERRED_KV_GROUP_SIZE if kv_group_size is None else kv_group_size
    dims = model_head_dims(model)
    fits = [s for s in KV_GROUP_SIZES if all(d % s == 0 for d in dims)]
    if kv_group_size is not None:
        bad = sorted(d for d in dims if d % kv_group_size)
        if bad:
            raise RequestError(
                f"kv_group_size={kv_group_size} does not divide this model's head dimension "
                f"({', '.join(map(str, bad))})",
                fix=f"pass kv_group_size={fits[-1]}, or omit it to pick one that fits"
                if fits
                else "drop kv_bits for this model: no KV group size divides its head dimension",
                param="kv_group_size",
            )
        return kv_group_size
    for size in (PREFERRED_KV_GROUP_SIZE, 32):  # 128 only ever fits where 64 does
        if size in fits:
            return size
    raise RequestError(
        f"kv_bits={kv_bits}: this model's head dimension ({', '.join(map(str, sorted(dims)))}) "
        "is not a multiple of any KV quantization group size (32, 64 or 128)",
        fix="drop kv_bits for this model",
        param="kv_bits",
    )
