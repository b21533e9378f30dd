"""The model object users hold.

A plugin's factory returns an ``mlx.nn.Module`` satisfying
:class:`~mlx_loom.causal_lm.CausalLM`.
The core wraps it in :class:`Model`, which remembers how it was resolved
(profile, implementation, kernel backend) so a user — or ``loom explain`` —
can always tell what is running.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np

from .causal_lm import CausalLM, MultiTokenPredictor
from .cpu.compiled_step import CompiledStep, not_compiled_because
from .cpu.ops import forward_kernels
from .errors import AdapterError, CapabilityRefused, RequestError
from .forward_hooks import storing_kv

if TYPE_CHECKING:
    import mlx.nn as nn

    from .artifacts import ArtifactConfig
    from .cpu.path import CpuPath
    from .engine import EngineService
    from .host import Binding, Implementation, Profile
    from .parallel.build import Parallel


def _arrays(module: nn.Module, *, constants_only: bool) -> list[mx.array]:
    """Every array the module tree holds; with ``constants_only``, only the non-parameters.

    Non-parameters are the arrays a graph computes at construction and keeps
    under a private name (``self._freqs = base ** ...``): MLX leaves them out
    of ``parameters()``, so loading the weights never evaluates them.
    """

    def keep(_module: Any, key: str, value: Any) -> bool:
        if isinstance(value, (dict, list)):
            return True
        return isinstance(value, mx.array) and (not constants_only or key.startswith("_"))

    found: list[mx.array] = []

    def collect(tree: Any) -> None:
        if isinstance(tree, mx.array):
            found.append(tree)
        elif isinstance(tree, dict):
            for value in tree.values():
                collect(value)
        elif isinstance(tree, (list, tuple)):
            for value in tree:
                collect(value)

    collect(module.filter_and_map(keep))
    return found


def _compiled_step(
    module: nn.Module, cpu_path: CpuPath | None, capabilities: frozenset[str], *, split: bool
) -> CompiledStep | None:
    """The compiled one-token forward for this model, or ``None``
    (:func:`mlx_loom.cpu.compiled_step.not_compiled_because` says why)."""
    kernel_set = cpu_path.kernel_set if cpu_path is not None else None
    if not_compiled_because(kernel_set, capabilities, split=split) is not None:
        return None
    return CompiledStep(module)


def check_token_ids(inputs: Any, vocab: int | None) -> None:
    """Refuse token ids outside ``0..vocab-1`` with a RequestError naming the first.

    ``inputs`` is an ``mx.array`` or a sequence of ints. The check reads the
    ids back once (a few microseconds for a prompt) and compares their
    minimum and maximum; the first offender is looked up only on failure.
    Without it an id past the table made the embedding gather read past its
    weights (a crash, or silent garbage), and ``-1`` wrapped to the last row.
    """
    if vocab is None:
        return
    ids = np.asarray(inputs)
    if ids.size == 0:
        return
    if ids.dtype.kind not in "iu":
        raise RequestError(
            f"Token ids must be integers; got an array of {ids.dtype}.",
            fix="Pass token ids as an integer array (mx.int32 or mx.uint32).",
        )
    if int(ids.min()) >= 0 and int(ids.max()) < vocab:
        return
    flat = ids.reshape(-1).astype(np.int64)
    bad = int(flat[(flat < 0) | (flat >= vocab)][0])
    raise RequestError(
        f"Token id {bad} is outside the vocabulary (size {vocab}): valid ids are "
        f"0..{vocab - 1}.",
        fix="Encode the text with this model's tokenizer; ids must be in 0..vocab_size-1.",
    )


class Model:
    """A built model: the plugin's graph plus the resolution that produced it.

    Construction evaluates every array the graph computed while it was built
    (RoPE frequency tables and the like). Why: an MLX graph is bound to the
    streams of the thread that built it, and generation runs on the model's
    engine thread, not the loading thread; a constant left lazy would fail
    there with "There is no Stream(cpu, 0) in current thread" (every Gemma 4
    request did, through ``loom serve``).
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        binding: Binding,
        config: ArtifactConfig,
        model_dir: Path,
        profile_reason: str = "",
        cpu_path: CpuPath | None = None,
        parallel: Parallel | None = None,
        artifact_fingerprint: str | None = None,
        weights_identity: str | None = None,
    ) -> None:
        if not isinstance(module, CausalLM):
            raise TypeError(
                f"Implementation {binding.implementation.id!r} built a "
                f"{type(module).__name__}, which lacks __call__(inputs, cache) or make_cache()."
            )
        self.module = module
        self.binding = binding
        self.config = config
        self.model_dir = model_dir
        self.profile_reason = profile_reason
        #: The compute dtype and CPU kernel set it runs with (``None`` when
        #: built outside :func:`mlx_loom.load`).
        self.cpu_path = cpu_path
        #: How this rank's part of a split model was cut (``None``: one process).
        self.parallel = parallel
        #: The tensor manifest's fingerprint and the weight files' identity
        #: (:func:`mlx_loom.artifacts.fingerprint.weights_identity`, taken at
        #: load): what a saved prompt cache is bound to (``None`` when built
        #: outside :func:`mlx_loom.load`).
        self.artifact_fingerprint = artifact_fingerprint
        self.weights_identity = weights_identity
        #: The adapter applied on top of the family's graph, if any
        #: (:class:`mlx_loom.adapters.AppliedAdapter`).
        self.adapter: Any = None
        #: Adapters chosen per batch row, if registered
        #: (:class:`mlx_loom.adapters.AdapterSet`).
        self.adapter_set: Any = None
        #: The dtype attention caches store keys/values in (``load(kv_dtype=)``;
        #: ``None``: the compute dtype they are computed in).
        self.kv_dtype: mx.Dtype | None = None
        mx.eval(_arrays(module, constants_only=True))
        #: The compiled one-token forward, where the family allows it and the
        #: model runs on the native CPU kernels (``None`` otherwise).
        self.compiled_step = _compiled_step(
            module, cpu_path, self.capabilities, split=parallel is not None
        )
        self._engine_lock = threading.Lock()
        self._engine: Any = None

    @property
    def engine(self) -> EngineService:
        """The continuous-batching engine every generation on this model goes through.

        Started on first use; see :mod:`mlx_loom.engine.service` for the
        thread-safety contract it provides.
        """
        with self._engine_lock:
            if self._engine is None or not self._engine.alive:
                # The engine sits above the model in the layers (it drives a model);
                # a model starts its own on first use, so it is imported here.
                from .engine import EngineService, lockstep_service

                if self.parallel is not None:
                    # Split across ranks: rank 0 decides each turn.
                    self._engine = lockstep_service.LockstepService(self)
                else:
                    self._engine = EngineService(self)
            return self._engine

    @property
    def started_engine(self) -> EngineService | None:
        """The engine if one was started and is not closed (``None``: none runs)."""
        with self._engine_lock:
            engine = self._engine
        return engine if engine is not None and engine.alive else None

    def close_engine(self, timeout: float = 10.0) -> None:
        """Stop this model's engine, if one runs (a pool unloading the model).

        The next use of :attr:`engine` starts a new one.
        """
        with self._engine_lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.close(timeout)

    def materialize(self) -> None:
        """Evaluate every array of the graph, weights included, on the calling thread.

        Needed only for a model built with ``lazy=True``, and only on the
        thread that loaded it: its weights are lazy graphs bound to that
        thread's streams, and the engine thread cannot evaluate them.
        """
        mx.eval(_arrays(self.module, constants_only=False))

    def native_kernels(self) -> AbstractContextManager[None]:
        """The context in which graph code for this model picks up its native CPU
        kernels (:mod:`mlx_loom.forward_hooks`): every forward runs in it, and the
        engine builds its log-probabilities from the logits in it."""
        return forward_kernels(self.cpu_path.kernel_set if self.cpu_path is not None else None)

    def __call__(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        *,
        adapters: Sequence[str | None] | None = None,
    ) -> mx.array:
        """Logits for ``inputs``; ``adapters`` names each row's adapter from
        :attr:`adapter_set` (``None`` for a row: the base model).

        Token ids outside the vocabulary are refused (:func:`check_token_ids`):
        an embedding gather past its table reads whatever memory follows it.
        """
        check_token_ids(inputs, self.vocab_size)
        return self.forward(inputs, cache, adapters=adapters)

    def forward(
        self,
        inputs: mx.array,
        cache: list[Any] | None = None,
        *,
        adapters: Sequence[str | None] | None = None,
    ) -> mx.array:
        """:meth:`__call__` without the token-id check, for the engine.

        Why a second door: the engine checks every prompt once, when it takes
        the request (:meth:`mlx_loom.engine.Engine.insert`), and feeds back
        only tokens it sampled from the model's own logits; checking its
        inputs here would read back each step's tokens before the next step
        is queued, undoing the overlap of compute and bookkeeping.
        """
        with self.native_kernels(), storing_kv(self.kv_dtype):
            step = self.compiled_step
            if (
                step is not None
                and self.adapter_set is None
                and (adapters is None or not any(adapters))
                and step.applies(inputs, cache)
            ):
                return step(inputs, cache)  # type: ignore[arg-type]
            if adapters is None:
                return self.module(inputs, cache=cache)
            if self.adapter_set is None:
                if any(name is not None for name in adapters):
                    raise AdapterError(
                        f"a forward asked for adapters {sorted({n for n in adapters if n})}, "
                        "but this model has no adapter set",
                        fix="register the adapters first (mlx_loom.adapters.AdapterSet)",
                    )
                return self.module(inputs, cache=cache)
            with self.adapter_set.rows(adapters):
                return self.module(inputs, cache=cache)

    def make_cache(self) -> list[Any]:
        return self.module.make_cache()

    # --- multi-token prediction: drafting with the model's own head ---

    def mtp_refusal(self) -> str | None:
        """Why this model cannot draft with an MTP head (``None``: it can)."""
        module = self.module
        if not isinstance(module, MultiTokenPredictor):
            return f"the {self.model_type} family's graph has no multi-token-prediction head"
        return module.mtp_refusal()

    def forward_hidden(self, inputs: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array]:
        """:meth:`forward`'s logits and the hidden states the MTP head reads
        (an eager forward: the compiled step returns logits only)."""
        assert isinstance(self.module, MultiTokenPredictor)
        with self.native_kernels():
            return self.module.forward_hidden(inputs, cache)

    def mtp_forward(
        self, hidden: mx.array, tokens: mx.array, cache: list[Any]
    ) -> tuple[mx.array, mx.array]:
        """The MTP head's last logits and hidden states (see :class:`MultiTokenPredictor`)."""
        assert isinstance(self.module, MultiTokenPredictor)
        with self.native_kernels():
            return self.module.mtp_forward(hidden, tokens, cache)

    def make_mtp_cache(self) -> list[Any]:
        assert isinstance(self.module, MultiTokenPredictor)
        return self.module.make_mtp_cache()

    @property
    def profile(self) -> Profile:
        return self.binding.profile

    @property
    def implementation(self) -> Implementation:
        return self.binding.implementation

    @property
    def backend(self) -> str:
        return self.binding.backend

    @property
    def capabilities(self) -> frozenset[str]:
        return self.binding.implementation.capabilities & self.binding.profile.capabilities

    @property
    def vocab_size(self) -> int | None:
        value = self.config.text_config().get("vocab_size")
        return int(value) if isinstance(value, int) else None

    @property
    def context_length(self) -> int | None:
        """The longest sequence the config says the model was trained for, if it says."""
        value = self.config.text_config().get("max_position_embeddings")
        return int(value) if isinstance(value, int) and value > 0 else None

    @property
    def model_type(self) -> str:
        return self.config.model_type

    def require(self, capability: str, *, asked: str) -> None:
        """Refuse a request method the resolved profile does not support."""
        if capability not in self.capabilities:
            raise CapabilityRefused(
                f"{asked} needs capability {capability!r}, which profile {self.profile.id!r} "
                f"(implementation {self.implementation.id!r}) does not provide "
                f"(it provides: {', '.join(sorted(self.capabilities)) or 'none'}).",
                fix=f"Drop {asked} from the request, or use a model whose plugin supports it.",
            )

    def __repr__(self) -> str:
        split = ""
        if self.parallel is not None:
            split = (
                f", parallel={self.parallel.mode!r} rank {self.parallel.rank}/{self.parallel.size}"
            )
        return (
            f"Model(model_type={self.model_type!r}, profile={self.profile.id!r}, "
            f"implementation={self.implementation.id!r}, backend={self.backend!r}"
            + (
                f", compute_dtype={self.cpu_path.compute_dtype!r}, "
                f"cpu_kernels={self.cpu_path.kernel_set!r}"
                if self.cpu_path is not None
                else ""
            )
            + (f", kv_dtype={self.kv_dtype}" if self.kv_dtype is not None else "")
            + f"{split})"
        )
