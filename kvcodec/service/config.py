"""The limits and options of one KDN service instance (``kvc serve`` flags) and the sizing constants they use.

Why a module of its own: the limits are the service's contract (``spec/kdn-v1.md`` §5) and are read by the
admission layer (:mod:`kvcodec.service.admission`), the routes (:mod:`kvcodec.service.app`), the edit route
(:mod:`kvcodec.service.edit`) and ``kvc serve``'s flag parsing; none of them needs the others to know them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcodec.errors import KvcInputError
from kvcodec.service.checks import MAX_LOOKUP_TOKENS

MAX_JSON_BODY = 16 << 20
MAX_CHUNKED_JSON = 1 << 20  # a JSON body sent without Content-Length: it can only be refused after it is read
TENANT_CACHE = 64 << 20   # each tenant view's in-process LRU (Store.for_key)
SERVICE_BASE = 384 << 20  # the event-loop process without bodies or caches (measured ~150-300 MB; spec §5)
WORKER_BASE = 256 << 20   # a worker with its decoders loaded, before a job's data (measured ~200 MB; spec §5)
THROTTLE_HOLD = 1.0       # seconds at most a throttled tenant's request waits before its 429
MAX_THROTTLED = 1024      # requests held back at once; beyond, the 429 is at once
DRAIN_MAX = 1 << 20        # a throttled request's body larger than this (or of unknown length) is not drained
LINGER = 1.0              # seconds the rest of a refused request's body is drained before its connection closes
REFUSAL_BODY_UNIT = 1 << 20  # a refused request costs its tenant one refusal, plus one per MiB of body it made us read
PEER_KEYS = 1 << 16       # client addresses whose refusals are remembered at once (the oldest is forgotten)
INLINE_JSON = 64 << 10   # JSON bodies up to this size are parsed on the event loop; larger ones by a worker
PROBE_SLICE = 16         # keys of a lookup or key list parsed and probed per store-thread call (KdnService._probe)
# The cost model of the service process (KdnService._run): its event loop and store threads share one interpreter
# lock, so a CPU-second of a tenant's there counts SERVICE_CPU_WEIGHT against its CPU share, plus STORE_TURN_COST
# for the event loop's own work handing each store-thread call over and back (measured ~0.18 ms here: a 600-key
# key list probed in 38 calls cost the service 16 CPU-ms against 9.7 in 2)
CONNECTION_BYTES = 256 << 10  # one open connection at most: a request head (124 KiB, server.MAX_HEAD) held twice
SERVICE_CPU_WEIGHT = 2.0
STORE_TURN_COST = 0.2e-3

__all__ = ["ServiceConfig"]


@dataclass
class ServiceConfig:
    """Limits and options of one service instance (``kvc serve`` flags; defaults in spec/kdn-v1.md §5)."""

    max_body: int = 1 << 30          # bytes of one PUT body
    body_timeout: float = 120.0      # seconds to receive a whole body
    body_idle_timeout: float = 15.0  # longest silence while a body is received (and stall while an answer is sent)
    header_timeout: float = 10.0     # seconds to send a request's head (also: idle keep-alive connections close)
    op_timeout: float = 30.0         # seconds for one store operation
    verify_timeout: float = 300.0    # seconds to check (decode) one put in its worker
    request_timeout: float = 600.0   # deadline of any request: body, queue waits, work and store included
    queue_timeout: float = 60.0      # longest wait for a worker process or store thread
    verify: bool = True              # decode every chunk of a put (False: structure, CRCs, tokens, key only)
    models: list[str] = field(default_factory=list)  # models whose tokenizers serve text lookups
    max_json_body: int = MAX_JSON_BODY
    max_chunked_json: int = MAX_CHUNKED_JSON  # of those, one sent chunked (no Content-Length)
    max_lookup_tokens: int = MAX_LOOKUP_TOKENS
    max_lookup_text: int = 4 << 20   # characters of a text lookup
    max_decoded_bytes: int = 4 << 30  # decoded K/V a put entry may declare
    max_decoded_ratio: float = 256.0  # ... and at most this many times its own size
    max_chunk_decoded: int = 512 << 20  # decoded size of one of its chunks (a worker holds one at a time)
    workers: int = 2                 # worker processes (decode, large JSON, tokenization)
    tenant_workers: int = 1          # of them busy for one tenant at once
    tenant_queue: int = 16           # requests one tenant may have waiting for a worker (more: 429)
    tenant_worker_cpu: float = 0.5   # worker CPU-seconds per second one tenant's jobs may use on average (0: no share)
    tenant_decode_rate: float = 256 << 20  # decoded bytes per second per tenant (0: no quota); burst: max_decoded_bytes
    tenant_ingest_rate: float = 64 << 20  # body bytes per second read for one tenant (0: no limit); burst: one second
    store_threads: int = 16          # threads for store operations
    tenant_store_threads: int = 8    # of them busy for one tenant at once
    max_inflight_body: int = 2 << 30   # body bytes held at once (received; entries being sent), all requests
    tenant_inflight_body: int = 1 << 30  # ... for one tenant
    worker_memory: int = 2 << 30     # memory a worker may allocate beyond its started state (hard: RLIMIT_DATA)
    peer_connections: int = 256      # connections one client address may hold at once (more: 429 at once)
    max_connections: int = 4096      # connections at once, all addresses (more: 503 at once; descriptors permitting)
    log_rate: float = 10.0           # bad-request log lines per second (more are counted, then summarised)
    tenant_refusal_rate: float = 20.0  # refused requests per second a tenant may cause (burst 5x); then 429 at once
    peer_refusal_rate: float = 20.0  # unauthenticated refusals (401, malformed HTTP) per second per client address

    def check(self) -> None:
        """:class:`KvcInputError` naming the first option out of range."""
        pos_int = ("max_body", "max_json_body", "max_chunked_json", "max_lookup_tokens", "max_lookup_text", "max_decoded_bytes",
                   "max_chunk_decoded",
                   "workers", "tenant_workers", "store_threads", "tenant_store_threads", "max_inflight_body",
                   "tenant_inflight_body", "worker_memory", "peer_connections", "max_connections")
        for k in pos_int:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise KvcInputError(f"{k.replace('_', '-')} must be a positive integer, got {v!r}")
        for k in ("body_timeout", "body_idle_timeout", "header_timeout", "op_timeout", "verify_timeout",
                  "request_timeout", "queue_timeout"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or not 0 < v <= 86400:
                raise KvcInputError(f"{k.replace('_', '-')} must be in (0, 86400] seconds, got {v!r}")
        for k in ("max_decoded_ratio", "tenant_decode_rate", "log_rate", "tenant_refusal_rate", "peer_refusal_rate",
                  "tenant_worker_cpu", "tenant_ingest_rate"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise KvcInputError(f"{k.replace('_', '-')} must be a finite number >= 0, got {v!r}")
        if self.tenant_queue < 0:
            raise KvcInputError("tenant-queue must be >= 0")
        if self.worker_memory <= max(self.max_body, self.max_json_body):
            raise KvcInputError(f"worker-memory ({self.worker_memory}) must be larger than max-body and max-json-body: "
                                "a worker holds the body it checks")

    def memory_bound(self, tenants: int) -> int:
        """The service's stated peak memory in bytes (spec/kdn-v1.md §5, "Memory"), every term enforced:
        the event-loop process (code, and each body held from its first byte to its answer, at most
        ``max_inflight_body``, counted twice for the one copy made when a body is complete), each tenant's
        in-process cache, each open connection (``max_connections``, each at most a request head held twice:
        CONNECTION_BYTES), and each worker (code, and at most ``worker_memory`` more: its data limit)."""
        return (SERVICE_BASE + 2 * self.max_inflight_body + tenants * TENANT_CACHE
                + self.max_connections * CONNECTION_BYTES + self.workers * (WORKER_BASE + self.worker_memory))
