"""``GET /metrics``: the server's counters in the Prometheus text format.

Two kinds of figures. What the HTTP side sees — requests by endpoint and
status, prompt / generated / cached tokens of finished generations, time to
first token and the time between tokens — is counted as it happens, by the
handler threads. What the engine already keeps — its queue, its rows, the
prefix store's hits, misses and bytes, speculative decoding's drafted and
accepted tokens — is read from its stats at each scrape (the same snapshot
``/health`` shows), so the engine thread does no extra work.

Each server has its own :class:`~prometheus_client.CollectorRegistry`, not
the process-wide one: several servers in one process (tests, embedding)
never share or collide on a metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from ..engine import ServiceStats
from .worker import Piece

#: The ``Content-Type`` of a scrape's answer.
CONTENT_TYPE = CONTENT_TYPE_LATEST

#: The ``endpoint`` label of a path the server does not serve: the label's
#: values stay a fixed set, whatever paths clients ask for.
UNMATCHED = "unmatched"

#: Seconds from a request's arrival to its first token: a short prefill is
#: milliseconds, a long prompt behind a queue tens of seconds.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

#: Seconds between two tokens of one answer.
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class _EngineCollector(Collector):
    """The engine's own figures, read from its stats at each scrape."""

    def __init__(self, stats: Callable[[], ServiceStats], connections: Callable[[], int]) -> None:
        self._stats = stats
        self._connections = connections

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        engine = stats.engine
        gauges = (
            ("loom_queued_requests", "Requests waiting for a free row.", stats.queued),
            ("loom_active_rows", "Requests being prefilled or decoded.", engine.active),
            ("loom_prefilling_rows", "Requests being prefilled.", engine.prefilling),
            ("loom_decoding_rows", "Requests being decoded.", engine.decoding),
            ("loom_prefix_cache_entries", "Prompt prefixes held.", engine.prefix_entries),
            ("loom_prefix_cache_bytes", "Bytes of prompt prefixes held.", engine.prefix_bytes),
            (
                "loom_prefix_cache_disk_bytes",
                "Bytes of prompt prefixes on disk.",
                engine.prefix_disk_bytes,
            ),
            ("loom_open_connections", "HTTP connections open.", self._connections()),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = (
            ("loom_prefix_cache_hits", "Prompts that reused a stored prefix.", engine.prefix_hits),
            ("loom_prefix_cache_misses", "Prompts that found no prefix.", engine.prefix_misses),
            (
                "loom_prefix_cache_disk_hits",
                "Prefixes read back from disk.",
                engine.prefix_disk_hits,
            ),
            (
                "loom_spec_draft_tokens",
                "Draft tokens proposed by speculative decoding.",
                engine.draft_tokens,
            ),
            (
                "loom_spec_accepted_tokens",
                "Draft tokens the target model accepted.",
                engine.accepted_drafts,
            ),
            ("loom_engine_steps", "Engine steps run.", engine.steps),
        )
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)


@dataclass
class Timing:
    """One generation's clock: when its request arrived and when its last token came."""

    started: float
    last: float | None = None


class ServerMetrics:
    """The figures of one server, and their exposition (:meth:`render`)."""

    def __init__(self, stats: Callable[[], ServiceStats], connections: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "loom_requests",
            "HTTP requests answered, by endpoint and status.",
            ("endpoint", "status"),
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "loom_prompt_tokens", "Prompt tokens of finished generations.", registry=self.registry
        )
        self.cached_tokens = Counter(
            "loom_cached_prompt_tokens",
            "Prompt tokens of finished generations served from the prefix store.",
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "loom_generation_tokens",
            "Tokens generated by finished generations.",
            registry=self.registry,
        )
        self.ttft = Histogram(
            "loom_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first token.",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.per_token = Histogram(
            "loom_time_per_output_token_seconds",
            "Seconds between two tokens of one answer.",
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_EngineCollector(stats, connections))

    def request(self, endpoint: str, status: int) -> None:
        """Count one answered request."""
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def piece(self, timing: Timing, piece: Piece) -> None:
        """Time one token of a generation; count its tokens once it is the last."""
        now = time.monotonic()
        if timing.last is None:
            self.ttft.observe(now - timing.started)
        else:
            self.per_token.observe(now - timing.last)
        timing.last = now
        if piece.finish_reason is not None:
            self.prompt_tokens.inc(piece.prompt_tokens)
            self.cached_tokens.inc(piece.cached_tokens)
            self.generation_tokens.inc(piece.generation_tokens)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
