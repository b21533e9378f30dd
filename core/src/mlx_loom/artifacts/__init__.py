"""Artifacts: from a model reference to a validated directory, config and lazy weights.

The path a model takes::

    model_dir = resolve_model_ref("org/name")        # local dir or hub cache snapshot
    config = read_config(model_dir)                  # ArtifactConfig (model_type, quantization ...)
    manifest = read_manifest(model_dir)              # headers only: name -> TensorInfo
    check_weights(manifest, family_expected_tensors) # every mismatch in one WeightsError
    weights = load_weights(model_dir)                # lazy mx.arrays, headers validated first
    apply_quantization(model, config.quantization, weights)
    model.load_weights(list(weights.items()))

Families do the last four steps through :func:`mlx_loom.nn.load_checkpoint`
(the strict loader), with ``config.view()`` mapping wrapper layouts.
"""

from mlx_loom.artifacts.config import (
    CONFIG_FILE,
    TEXT_LAYOUT,
    ArtifactConfig,
    ConfigView,
    TextLayout,
    read_config,
    validate_family_config,
)
from mlx_loom.artifacts.fields import FieldError
from mlx_loom.artifacts.fingerprint import artifact_fingerprint, config_fingerprint
from mlx_loom.artifacts.quantization import (
    MODE_PACKING,
    QUANT_MODES,
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
    QuantizationConfig,
    QuantSpec,
    apply_quantization,
    parse_quantization,
)
from mlx_loom.artifacts.reference import (
    ALLOW_PATTERNS,
    SHORT_NAMES,
    hub_cache_dir,
    hub_command,
    hub_offline,
    parse_repo_ref,
    resolve_model_ref,
)
from mlx_loom.artifacts.safetensors_header import (
    MAX_HEADER_BYTES,
    SAFETENSORS_DTYPES,
    SafetensorsHeader,
    TensorInfo,
    read_safetensors_header,
)
from mlx_loom.artifacts.weights import (
    INDEX_FILE,
    ExpectedTensor,
    check_weights,
    list_weight_files,
    load_weights,
    read_manifest,
    tensor_signature,
)

__all__ = [
    "ALLOW_PATTERNS",
    "CONFIG_FILE",
    "INDEX_FILE",
    "MAX_HEADER_BYTES",
    "SAFETENSORS_DTYPES",
    "SHORT_NAMES",
    "MODE_PACKING",
    "QUANT_MODES",
    "SUPPORTED_BITS",
    "SUPPORTED_GROUP_SIZES",
    "TEXT_LAYOUT",
    "ArtifactConfig",
    "ConfigView",
    "ExpectedTensor",
    "FieldError",
    "QuantSpec",
    "QuantizationConfig",
    "SafetensorsHeader",
    "TensorInfo",
    "TextLayout",
    "apply_quantization",
    "artifact_fingerprint",
    "check_weights",
    "config_fingerprint",
    "hub_cache_dir",
    "hub_command",
    "hub_offline",
    "list_weight_files",
    "load_weights",
    "parse_quantization",
    "parse_repo_ref",
    "read_config",
    "read_manifest",
    "read_safetensors_header",
    "resolve_model_ref",
    "tensor_signature",
    "validate_family_config",
]
