"""Layers model families share if they want: gated MLPs, routed experts, RoPE kinds, loading.

Nothing here is required: a family may write its own modules. What lives here
is solved once, one way, so three families do not carry three versions.

* :mod:`.activations` — ``swiglu``/``geglu`` and the logit ``softcap``, compiled as
  mlx-lm compiles them;
* :mod:`.mlp` — :class:`GatedMLP` (Hugging Face module names);
* :mod:`.projections` — :func:`project`, several projections of one
  activation (one node on the native CPU kernels);
* :mod:`.heads` — :func:`split_heads` / :func:`merge_heads`, attention's head
  layout (one reshape, no transpose, for a decode step's one token);
* :mod:`.experts` — stacked expert projections, :class:`SwitchGLU`, and the
  per-backend expert kernels (one bf16-on-CPU strategy, measured);
* :mod:`.norm` — :func:`rms_norm`, ``mx.fast.rms_norm`` that a native
  forward runs natively;
* :mod:`.rope` — every RoPE kind the families read, validated and built;
* :mod:`.attention_geometry` — what an attention layer declares about its
  shape, for the backends' kernel rules (speculative verify windows);
* :mod:`.loading` — the strict loader: config manifest vs. safetensors
  headers before any graph exists, lazy weights, no evaluation.

Linear layers stay standard ``mlx.nn`` modules, so quantization (and any
later per-backend linear kernel) applies to them unchanged.
"""

from .activations import Activation, gelu_approx_mul, geglu, softcap, swiglu
from .attention_geometry import AttentionGeometry, attention_geometries
from .experts import (
    QuantizedSwitchLinear,
    SwitchGLU,
    SwitchLinear,
    expert_kernels,
    gather_switch_glu,
    grouped_switch_glu,
    mix_experts,
    switch_glu,
)
from .heads import merge_heads, split_heads
from .loading import (
    Entry,
    Manifest,
    Matrix,
    Tensor,
    dense_tensors,
    expected_tensors,
    graph_checkpoint_tensors,
    graph_manifest,
    load_checkpoint,
)
from .mlp import GatedMLP
from .norm import rms_norm
from .projections import project
from .rope import (
    ROPE_KINDS,
    DynamicScaling,
    LinearScaling,
    Llama3Scaling,
    LongRopeScaling,
    ProportionalScaling,
    RopeScaling,
    YarnScaling,
    make_rope,
    parse_rope_scaling,
)

__all__ = [
    "ROPE_KINDS",
    "Activation",
    "AttentionGeometry",
    "DynamicScaling",
    "Entry",
    "GatedMLP",
    "LinearScaling",
    "Llama3Scaling",
    "LongRopeScaling",
    "Manifest",
    "Matrix",
    "ProportionalScaling",
    "QuantizedSwitchLinear",
    "RopeScaling",
    "SwitchGLU",
    "SwitchLinear",
    "Tensor",
    "YarnScaling",
    "attention_geometries",
    "dense_tensors",
    "expected_tensors",
    "expert_kernels",
    "merge_heads",
    "split_heads",
    "gather_switch_glu",
    "gelu_approx_mul",
    "geglu",
    "graph_checkpoint_tensors",
    "graph_manifest",
    "grouped_switch_glu",
    "load_checkpoint",
    "make_rope",
    "mix_experts",
    "parse_rope_scaling",
    "project",
    "rms_norm",
    "softcap",
    "swiglu",
    "switch_glu",
]
