"""Prometheus metrics of the KDN service (prometheus-client, one registry per service).

Scraped from ``GET /metrics``.  Hit rate is ``kvc_get_total{result="hit"}`` over
all gets (and, for prefix lookups, ``kvc_lookup_hit_tokens_total`` over
``kvc_lookup_tokens_total``); ``kvc_hit_ratio`` exposes the get hit ratio
directly for dashboards that cannot divide.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvc_requests", "HTTP requests by route and status", ["method", "route", "status"],
                                registry=r)
        self.latency = Histogram("kvc_request_seconds", "Request latency (handler time) by route",
                                 ["method", "route"], buckets=_BUCKETS, registry=r)
        self.gets = Counter("kvc_get", "Entry reads by result", ["result"], registry=r)
        self.bytes_served = Counter("kvc_bytes_served", "Payload bytes sent by GET (ranges included)", registry=r)
        self.puts = Counter("kvc_put", "Entry writes by result", ["result"], registry=r)
        self.bytes_stored = Counter("kvc_bytes_stored", "Payload bytes accepted by PUT", registry=r)
        self.lookups = Counter("kvc_lookup", "Prefix lookups by result", ["result"], registry=r)
        self.lookup_tokens = Counter("kvc_lookup_tokens", "Tokens asked for in lookups", registry=r)
        self.lookup_hit_tokens = Counter("kvc_lookup_hit_tokens", "Tokens found cached in lookups", registry=r)
        self.auth_failures = Counter("kvc_auth_failures", "Refused requests by reason", ["reason"], registry=r)
        self.overloads = Counter("kvc_overloaded", "Requests refused for load (429 tenant limit, 503 server)",
                                 ["status"], registry=r)
        self.jobs = Counter("kvc_worker_jobs", "Jobs run by the worker processes, by kind and result",
                            ["op", "result"], registry=r)
        self.queued_jobs = Gauge("kvc_worker_queue", "Requests waiting for a worker process", registry=r)
        self.queued_store = Gauge("kvc_store_queue", "Requests waiting for a store thread", registry=r)
        self.edits_running = Gauge("kvc_edits_running", "Model edits running now (at most one in the service)",
                                   registry=r)
        self.queued_edits = Gauge("kvc_edit_queue", "Edit requests waiting for the service's model slot", registry=r)
        self.inflight_body = Gauge("kvc_inflight_body_bytes", "Body bytes held: from their first byte to their answer",
                                   registry=r)
        self.peer_refused = Gauge("kvc_peer_refused_total", "Connections refused at once: their address held "
                                  "--peer-connections already (no log line each)", registry=r)
        self.throttled = Gauge("kvc_throttled", "Requests held back now before their 429 (tenant over its refusal "
                               "rate)", registry=r)
        self.log_suppressed = Gauge("kvc_bad_request_lines_suppressed", "Bad-request log lines not yet written "
                                    "(rate limit)", registry=r)
        self._hits = 0
        self._total = 0
        self._lock = threading.Lock()
        Gauge("kvc_hit_ratio", "Entry read hit ratio since start", registry=r).set_function(self._ratio)

    def _ratio(self) -> float:
        with self._lock:
            return self._hits / self._total if self._total else 0.0

    def request(self, method: str, route: str, status: int, seconds: float) -> None:
        self.requests.labels(method, route, str(status)).inc()
        self.latency.labels(method, route).observe(seconds)

    def get(self, hit: bool, nbytes: int = 0) -> None:
        self.gets.labels("hit" if hit else "miss").inc()
        if nbytes:
            self.bytes_served.inc(nbytes)
        with self._lock:
            self._total += 1
            self._hits += int(hit)

    def put(self, result: str, nbytes: int = 0) -> None:
        self.puts.labels(result).inc()
        if nbytes:
            self.bytes_stored.inc(nbytes)

    def lookup(self, tokens: int, hit_tokens: int) -> None:
        self.lookups.labels("hit" if hit_tokens else "miss").inc()
        self.lookup_tokens.inc(tokens)
        self.lookup_hit_tokens.inc(hit_tokens)

    def overloaded(self, status: str) -> None:
        self.overloads.labels(status).inc()

    def job(self, op: str, result: str) -> None:
        self.jobs.labels(op, result).inc()

    def queues(self, jobs: int, store: int, body_bytes: int, suppressed: int, peer_refused: int = 0,
               throttled: int = 0, edits_running: int = 0, edits_queued: int = 0) -> None:
        self.edits_running.set(edits_running)
        self.queued_edits.set(edits_queued)
        self.peer_refused.set(peer_refused)
        self.throttled.set(throttled)
        self.queued_jobs.set(jobs)
        self.queued_store.set(store)
        self.inflight_body.set(body_bytes)
        self.log_suppressed.set(suppressed)

    def auth_failure(self, reason: str) -> None:
        self.auth_failures.labels(reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
