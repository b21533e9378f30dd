"""The plugin host: one subsystem from installed plugins to a resolved model.

Everything that turns installed family plugins into a selection lives here,
behind this small public face; the modules inside are private, each about
one idea:

* ``_hookspecs`` — the hooks a plugin implements and the plugin-API version;
* ``_policy`` — which plugins a host lets load;
* ``_discovery`` — entry points, import, hook calls, quarantine;
* ``_registrations`` — model types, implementations, the declarative family;
* ``_registry`` — the immutable snapshot of registrations and ``select()``;
* ``_bounded`` — plugin code under a time limit, every exception caught;
* ``_profiles`` — profiles, their rules, and profile resolution;
* ``_verify`` — per backend, where attention arithmetic changes (verify windows);
* ``_resolution`` — a model reference to a binding, without loading weights;
* ``_advice`` — fixes that depend on how this installation was made.

Building a model from a binding is the layer above (:mod:`mlx_loom.loader`):
the host decides, it does not build.

The kernel record and the field checks registrations pass are leaves below
the host (:mod:`mlx_loom.backends`, :mod:`mlx_loom.field_checks`), re-exported here.

Users import :mod:`mlx_loom`; family authors import :mod:`mlx_loom.plugin`;
an embedding host composes with the names below.
"""

from ..backends import BACKENDS, Backend, Kernel, Provider, active_backend, runnable_backends
from ..capabilities import (
    ADAPTERS,
    BATCH,
    COMPILED_STEP,
    GENERATE,
    KV_QUANTIZATION,
    PROMPT_CACHE,
    SPECULATIVE,
)
from ._discovery import STRICT_ENV, PluginHost, PluginRecord
from ._hookspecs import PLUGIN_API_VERSION, hookimpl
from ._policy import POLICY_ENV, PluginPolicy
from ._profiles import LOOP_CAPABILITIES, Execution, Profile
from ._registrations import Family, Graph
from ._registry import Binding, BuildContext, Implementation, ModelType, Registry
from ._resolution import Resolution, Resolved, default_host, resolve_model
from ._verify import VERIFY_POLICIES, VerifyPolicies, VerifyPolicy

__all__ = [
    "ADAPTERS",
    "BACKENDS",
    "BATCH",
    "GENERATE",
    "KV_QUANTIZATION",
    "LOOP_CAPABILITIES",
    "PLUGIN_API_VERSION",
    "POLICY_ENV",
    "PROMPT_CACHE",
    "SPECULATIVE",
    "COMPILED_STEP",
    "STRICT_ENV",
    "VERIFY_POLICIES",
    "Backend",
    "Binding",
    "BuildContext",
    "Execution",
    "Family",
    "Graph",
    "Implementation",
    "Kernel",
    "ModelType",
    "PluginHost",
    "PluginPolicy",
    "PluginRecord",
    "Profile",
    "Provider",
    "Registry",
    "Resolution",
    "Resolved",
    "VerifyPolicies",
    "VerifyPolicy",
    "active_backend",
    "default_host",
    "hookimpl",
    "resolve_model",
    "runnable_backends",
]
