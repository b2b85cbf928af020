"""Prometheus metrics of the Router (``GET /metrics``), in a registry of its own per application.

Counters and histograms are updated on the request path through cached label children (one
dictionary lookup each); the per-backend gauges are read from the pool when scraped, so they
cost nothing per request.

Names (``backend`` = ``host:port``, ``role`` = ``prefill``/``decode``, ``endpoint`` = the path):

- ``pd_router_requests_total{endpoint,status}``: client requests by final HTTP status
  (``499`` = the client went away first);
- ``pd_router_errors_total{endpoint,type}``: error answers by OpenAI error type
  (``client_disconnected`` included);
- ``pd_router_backend_requests_total{endpoint,role,backend}``: requests sent to each backend;
- ``pd_router_backend_errors_total{endpoint,role,backend,kind}``: failed backend requests,
  ``kind`` one of ``connect``, ``timeout``, ``disconnect``, ``http_4xx``, ``http_5xx``, ``empty``,
  ``error_event``;
- ``pd_router_retries_total{endpoint}``: attempts repeated on another P/D pair (failover);
- ``pd_router_resumes_total{endpoint,reason}``: streams cut after they started and continued on
  another decoder (:mod:`proxy.strategies.resume`), ``reason`` the failure's ``kind``;
  ``pd_router_resume_replayed_tokens_total{endpoint}``: generated tokens prefilled again for them;
  ``pd_router_resume_seconds{endpoint}``: histogram, from the cut to the resumed leg's first chunk;
- ``pd_router_rebalance_moves_total{from,to,mode}``: streams moved off an overloaded decoder
  (``--rebalance on``, :mod:`proxy.admin.rebalance`), and ``pd_router_rebalance_itl_ms{backend}``: each
  decoder's inter-token latency as the rebalancer measures it (both registered there);
- ``pd_router_path_total{path,reason}``: requests by the path ``--path-policy`` chose (``pd``, ``delta``:
  P prefills and pushes the KV; ``local``: D prefills) and why (:mod:`proxy.planning.path_policy`);
- ``pd_router_auth_refused_total{endpoint,reason}``: calls refused by :mod:`proxy.access.api_keys`,
  ``reason`` one of ``missing``, ``wrong``, ``not_loopback``;
- ``pd_router_time_to_first_byte_seconds{endpoint}`` and
  ``pd_router_request_duration_seconds{endpoint}``: histograms, from the request's arrival to
  the first byte of the answer sent, and to its last byte;
- ``pd_router_backend_in_flight_requests{role,backend}``,
  ``pd_router_backend_in_flight_prompt_tokens{role,backend}`` (prefillers; estimated),
  ``pd_router_backend_healthy{role,backend}`` (1/0), ``pd_router_backend_draining{role,backend}`` (1/0).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.router_config import Backend
from proxy.upstream.pool import BackendPool

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
)


class _PoolCollector(Collector):
    """Per-backend gauges read from the pool at scrape time."""

    def __init__(self, pool: BackendPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["role", "backend"]
        requests = GaugeMetricFamily(
            "pd_router_backend_in_flight_requests", "Requests in flight on each backend", labels=labels
        )
        tokens = GaugeMetricFamily(
            "pd_router_backend_in_flight_prompt_tokens",
            "Estimated prompt tokens in flight on each prefill backend",
            labels=labels,
        )
        healthy = GaugeMetricFamily(
            "pd_router_backend_healthy", "1 if the backend is considered healthy, else 0", labels=labels
        )
        draining = GaugeMetricFamily(
            "pd_router_backend_draining", "1 if the backend was removed and is finishing its requests", labels=labels
        )
        for state in self.pool.all_states():
            values = [state.backend.role, state.backend.address]
            requests.add_metric(values, state.in_flight)
            if state.backend.role == "prefill":
                tokens.add_metric(values, state.in_flight_tokens)
            healthy.add_metric(values, 1 if state.healthy else 0)
            draining.add_metric(values, 1 if state.draining else 0)
        yield requests
        yield tokens
        yield healthy
        yield draining


class RouterMetrics:
    """The Router's metrics; ``render()`` gives the Prometheus text format."""

    def __init__(self, pool: BackendPool) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter(
            "pd_router_requests",
            "Client requests by endpoint and final HTTP status",
            ["endpoint", "status"],
            registry=reg,
        )
        self.errors = Counter(
            "pd_router_errors", "Error answers by endpoint and OpenAI error type", ["endpoint", "type"], registry=reg
        )
        self.backend_requests = Counter(
            "pd_router_backend_requests",
            "Requests sent to each backend",
            ["endpoint", "role", "backend"],
            registry=reg,
        )
        self.backend_errors = Counter(
            "pd_router_backend_errors",
            "Failed backend requests by kind",
            ["endpoint", "role", "backend", "kind"],
            registry=reg,
        )
        self.retries = Counter(
            "pd_router_retries", "Attempts repeated on another P/D pair (failover)", ["endpoint"], registry=reg
        )
        self.resumes = Counter(
            "pd_router_resumes",
            "Streams cut after they started and continued on another decoder, by the failure's kind",
            ["endpoint", "reason"],
            registry=reg,
        )
        self.replayed = Counter(
            "pd_router_resume_replayed_tokens",
            "Generated tokens prefilled again to resume cut streams",
            ["endpoint"],
            registry=reg,
        )
        self.resume_time = Histogram(
            "pd_router_resume_seconds",
            "Seconds from a stream's cut to the first chunk of its resumed leg",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.paths = Counter(
            "pd_router_path",
            "Requests by the prefill path chosen (pd, delta, local) and the policy's reason",
            ["path", "reason"],
            registry=reg,
        )
        self.auth_refusals = Counter(
            "pd_router_auth_refused",
            "Calls refused for a missing or wrong API key / admin token, or a non-loopback admin caller",
            ["endpoint", "reason"],
            registry=reg,
        )
        self.ttfb = Histogram(
            "pd_router_time_to_first_byte_seconds",
            "Seconds from a request's arrival to the first byte of its answer",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.duration = Histogram(
            "pd_router_request_duration_seconds",
            "Seconds from a request's arrival to the last byte of its answer",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        reg.register(_PoolCollector(pool))
        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def request_done(self, endpoint: str, status: int, ttfb: float | None, duration: float) -> None:
        """Count one client request and record its latencies."""
        self._child(self.requests, endpoint, str(status)).inc()
        if ttfb is not None:
            self._child(self.ttfb, endpoint).observe(ttfb)
        self._child(self.duration, endpoint).observe(duration)

    def error(self, endpoint: str, error_type: str) -> None:
        """Count one error answer (or a client that went away) by its type."""
        self._child(self.errors, endpoint, error_type).inc()

    def backend_request(self, endpoint: str, backend: Backend) -> None:
        """Count one request sent to ``backend``."""
        self._child(self.backend_requests, endpoint, backend.role, backend.address).inc()

    def backend_error(self, endpoint: str, backend: Backend, kind: str) -> None:
        """Count one failed request to ``backend``."""
        self._child(self.backend_errors, endpoint, backend.role, backend.address, kind).inc()

    def retry(self, endpoint: str) -> None:
        """Count one failover attempt."""
        self._child(self.retries, endpoint).inc()

    def resumed(self, endpoint: str, reason: str, replayed: int, seconds: float) -> None:
        """Count one stream resumed on another decoder after a ``reason`` failure."""
        self._child(self.resumes, endpoint, reason).inc()
        self._child(self.replayed, endpoint).inc(replayed)
        self._child(self.resume_time, endpoint).observe(seconds)

    def path(self, path: str, reason: str) -> None:
        """Count one request's path choice."""
        self._child(self.paths, path, reason).inc()

    def auth_refused(self, endpoint: str, reason: str) -> None:
        """Count one call refused by :mod:`proxy.access.api_keys`."""
        self._child(self.auth_refusals, endpoint, reason).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
