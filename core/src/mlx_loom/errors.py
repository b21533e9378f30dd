"""Every typed error mlx-loom raises, in one place.

Each error says three things: what was asked for, what was found, and the fix.
The fix is a separate field so the CLI can print it on its own line and
machines can read it from ``--json`` output.

Two families matter to callers:

* :class:`Refusal` — the engine declines to build or run something because
  what the artifact or request needs is not installed, not allowed, or not
  executable on this device. The CLI exits with code 3 for these. A refusal is
  never followed by a silent substitute.
* Everything else under :class:`LoomError` — bad input (config, weights,
  request parameters) or a broken plugin.
"""

from __future__ import annotations


class LoomError(Exception):
    """Base class. ``str(err)`` is the message followed by ``Fix: ...``."""

    def __init__(self, message: str, *, fix: str | None = None) -> None:
        self.message = message
        self.fix = fix
        super().__init__(message if fix is None else f"{message}\nFix: {fix}")

    def to_dict(self) -> dict[str, str | None]:
        return {"error": type(self).__name__, "message": self.message, "fix": self.fix}


# --- bad input: artifacts --------------------------------------------------


class ArtifactError(LoomError):
    """A model artifact (directory, config, weights, tokenizer) is unusable."""


class ModelNotFound(ArtifactError):
    """A model reference resolves to no local directory or cached snapshot."""


class ConfigError(ArtifactError):
    """``config.json`` is missing, not JSON, or has a missing or invalid field."""


class WeightsError(ArtifactError):
    """Tensors are missing, unexpected, mis-shaped or mis-typed for the config."""


class SafetensorsHeaderError(ArtifactError):
    """A ``.safetensors`` file is truncated or its header is malformed or hostile."""


class TokenizerError(ArtifactError):
    """The tokenizer files are missing or unusable, or a chat template fails."""


class TemplateBudgetExceeded(TokenizerError):
    """A chat template ran past its time budget or tried to build too much text."""


class AdapterError(ArtifactError):
    """A LoRA/DoRA adapter is unreadable, or does not fit the model it is applied to."""


# --- bad input: requests ---------------------------------------------------


class RequestError(LoomError, ValueError):
    """A generation request has an invalid parameter (empty prompt, bad top-p ...).

    ``param`` names the request field at fault (``"top_p"``, ``"prompt"``;
    ``None`` when no single field is) and ``code`` says why in a word
    (``"context_length_exceeded"``), so a front end (the server) can answer
    in its own wire format without checking the field again.
    """

    def __init__(
        self,
        message: str,
        *,
        fix: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message, fix=fix)
        self.param = param
        self.code = code


class UsageError(RequestError):
    """A command-line flag has a value the command cannot use (CLI exit code 2)."""


class ConvertError(LoomError):
    """``loom convert`` / ``loom fuse`` was asked something it cannot do as asked."""


class EngineBusy(LoomError):
    """The engine's queue of waiting requests is full; try again shortly."""


class KVBudgetExceeded(EngineBusy):
    """A request's KV caches alone would outgrow the engine's byte budget (``max_kv_bytes``)."""


class EngineStopped(LoomError):
    """The engine was shut down (or stopped) before the request could finish."""


class ModelUnavailable(LoomError):
    """A model of a pool could not be loaded (its own error is the cause); the others serve on.

    ``model`` is the pool's id of the model, ``cause`` the error its load raised.
    """

    def __init__(
        self, message: str, *, fix: str | None = None, model: str, cause: BaseException | None
    ) -> None:
        super().__init__(message, fix=fix)
        self.model = model
        self.cause = cause


# --- plugins ---------------------------------------------------------------


class PluginError(LoomError):
    """A plugin is broken or the host's plugin policy is inconsistent."""


class PolicyError(PluginError):
    """The plugin policy names a plugin that is not installed, or is malformed."""


class PluginApiMismatch(PluginError):
    """A plugin was written for a plugin-API version this core does not speak."""


class RegistrationError(PluginError):
    """A plugin registered something malformed: an empty id, a duplicate id ..."""


class ImplementationFailed(PluginError):
    """An implementation's factory raised, or returned something that is not a model."""


# --- caches ----------------------------------------------------------------


class CacheError(LoomError):
    """A cache operation is invalid for this cache kind or state."""


class CacheNotTrimmable(CacheError):
    """Trim was asked of a cache that cannot be trimmed correctly.

    Trimming a recurrent state, or a rotating window that has already wrapped,
    would silently give wrong tokens; we refuse instead.
    """


# --- refusals (CLI exit code 3) -------------------------------------------


class Refusal(LoomError):
    """The engine will not build or run what was asked, and says why."""


class UnknownModelType(Refusal):
    """No installed and allowed plugin claims the artifact's model type."""


class PluginUnavailable(Refusal):
    """The plugin that claims the artifact is quarantined or blocked by policy."""


class ProfileError(Refusal):
    """A profile is invalid, or profile resolution is ambiguous."""


class ImplementationUnavailable(Refusal):
    """No registered (and allowed) implementation matches the resolved profile."""


class IncompatibleImplementation(Refusal):
    """An implementation exists but cannot serve this config or device."""


class KernelUnavailable(Refusal):
    """A kernel an implementation needs has no registration runnable here."""


class CapabilityRefused(Refusal):
    """A request method (KV quantization, batching, speculation ...) is not supported."""


class ParallelRefused(Refusal):
    """A model cannot run split across the distributed group as asked.

    The group is missing or too small, the implementation declares no plan
    for the mode, or the checkpoint's geometry does not divide across the
    group's size (the message names the field and the sizes that would work).
    """


class ToolParserUnavailable(Refusal):
    """A tool-call parser was asked for by name and none is registered under it,
    or tools were sent to a model for which no tool-call format is known."""


class HubRefused(Refusal):
    """The Hugging Face Hub is needed (an upload) but the host forbids or cannot reach it."""
