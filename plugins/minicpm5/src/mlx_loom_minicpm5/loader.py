"""A Hugging Face Llama checkpoint in, the graph with its weights loaded out — strictly.

The graph uses Hugging Face's tensor names, so :func:`sanitize` only drops
what the checkpoint stores but the graph does not read. :func:`expected_tensors`
writes out, from the config alone, every tensor the graph needs with its shape
and dtype; any difference (a missing layer, a stray tensor, a ``q_proj`` whose
shape contradicts ``num_attention_heads * head_dim``) is one ``WeightsError``
listing all of them, before the model runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from mlx_loom.artifacts import (
    ExpectedTensor,
    QuantizationConfig,
    QuantSpec,
    apply_quantization,
    check_weights,
    load_weights,
    tensor_signature,
)
from mlx_loom.errors import WeightsError
from mlx_loom.registry import BuildContext

from .config import MiniCPM5Config
from .graph import MiniCPM5ForCausalLM

T = TypeVar("T")

#: Dtypes (safetensors codes) a checkpoint may store its floating tensors in.
FLOAT_DTYPES = ("BF16", "F16", "F32")
_DTYPE_PROBE = "model.norm.weight"  # always present, never quantized


def sanitize(weights: Mapping[str, T], cfg: MiniCPM5Config) -> dict[str, T]:
    """Drop tensors Hugging Face may store that the graph does not read."""
    out = {k: v for k, v in weights.items() if not k.endswith("self_attn.rotary_emb.inv_freq")}
    if cfg.tie_word_embeddings:
        # Tied means lm_head *is* embed_tokens; transformers overwrites a stored
        # copy at load, so ignoring it here matches how the checkpoint is meant.
        out.pop("lm_head.weight", None)
    return out


def matrices(cfg: MiniCPM5Config) -> dict[str, tuple[int, int, bool]]:
    """Every quantizable module: path -> (rows, columns, has bias)."""
    D, inter, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    ab, mb = cfg.attention_bias, cfg.mlp_bias
    out = {"model.embed_tokens": (V, D, False)}
    for i in range(cfg.num_hidden_layers):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        out |= {
            f"{attn}.q_proj": (q, D, ab),
            f"{attn}.k_proj": (kv, D, ab),
            f"{attn}.v_proj": (kv, D, ab),
            f"{attn}.o_proj": (D, q, ab),
            f"{mlp}.gate_proj": (inter, D, mb),
            f"{mlp}.up_proj": (inter, D, mb),
            f"{mlp}.down_proj": (D, inter, mb),
        }
    if not cfg.tie_word_embeddings:
        out["lm_head"] = (V, D, False)
    return out


def expected_tensors(
    cfg: MiniCPM5Config,
    dtype: str | None = "BF16",
    quantized: Mapping[str, QuantSpec] | None = None,
) -> dict[str, ExpectedTensor]:
    """The exact tensor manifest for ``cfg``: name -> (shape, safetensors dtype).

    ``quantized`` maps module paths to their MLX affine packing: the weight is
    ``uint32`` with ``bits/32`` of the columns, and ``scales``/``biases`` have
    one column per group, in the checkpoint's float dtype.
    """
    quantized = quantized or {}
    out: dict[str, ExpectedTensor] = {}
    for path, (rows, cols, bias) in matrices(cfg).items():
        spec = quantized.get(path)
        if spec is None:
            out[f"{path}.weight"] = ((rows, cols), dtype)
        else:
            out[f"{path}.weight"] = ((rows, cols * spec.bits // 32), "U32")
            out[f"{path}.scales"] = ((rows, cols // spec.group_size), dtype)
            out[f"{path}.biases"] = ((rows, cols // spec.group_size), dtype)
        if bias:
            out[f"{path}.bias"] = ((rows,), dtype)
    norms = [
        f"model.layers.{i}.{n}"
        for i in range(cfg.num_hidden_layers)
        for n in ("input_layernorm", "post_attention_layernorm")
    ]
    for path in [*norms, "model.norm"]:
        out[f"{path}.weight"] = ((cfg.hidden_size,), dtype)
    return out


def checkpoint_dtype(weights: Mapping[str, object], source: Path) -> str | None:
    """The one float dtype the checkpoint stores (read off the final norm).

    Tensors load in the dtype they are stored in, so a checkpoint mixing float
    dtypes would compute in whichever dtype promotion picks; we refuse it
    instead (``check_weights`` lists every tensor that differs).
    """
    probe = weights.get(_DTYPE_PROBE)
    if probe is None:
        return None  # reported as missing by check_weights
    code = tensor_signature(probe)[1]  # type: ignore[arg-type]
    if code not in FLOAT_DTYPES:
        raise WeightsError(
            f"{source}: {_DTYPE_PROBE} is stored as {code}; float tensors must be one of "
            f"{', '.join(FLOAT_DTYPES)}",
            fix="re-export the checkpoint in bf16, fp16 or fp32",
        )
    return code


def load_model(
    model_dir: Path, cfg: MiniCPM5Config, qconfig: QuantizationConfig | None
) -> MiniCPM5ForCausalLM:
    """Build the graph and load ``model_dir``'s weights into it (lazily: no data read yet)."""
    weights = sanitize(load_weights(model_dir), cfg)
    model = MiniCPM5ForCausalLM(cfg)
    # Swap exactly the modules the checkpoint stores scales for (and check
    # their packing against the config's quantization) before checking names.
    swapped = apply_quantization(model, qconfig, weights)
    specs = {path: qconfig.for_module(path) for path in swapped} if qconfig else {}
    expected = expected_tensors(cfg, checkpoint_dtype(weights, model_dir), specs)
    check_weights(weights, expected, source=model_dir)
    model.load_weights(list(weights.items()))
    return model


def build(ctx: BuildContext) -> MiniCPM5ForCausalLM:
    """The implementation's factory: what :func:`mlx_loom.load` calls."""
    assert isinstance(ctx.family_config, MiniCPM5Config)
    return load_model(ctx.model_dir, ctx.family_config, ctx.config.quantization)
