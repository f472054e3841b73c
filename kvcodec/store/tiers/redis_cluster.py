"""Redis Cluster tier (redis-py's ``RedisCluster``): entries spread over the cluster's masters by hash slot.

URL: ``redis+cluster://[[user]:password@]host:port[?options]`` (``rediss+cluster://``
for TLS).  ``host:port`` is any node; the client discovers the others and
follows ``MOVED`` / ``ASK`` redirections, so slot migrations (resharding)
are invisible to callers.  Options are those of :class:`RedisTier`
(``timeout``, ``prefix``, ``ttl``, ``max_bytes``: a value's size is checked on
its master before it is sent) plus ``nodes``: more
startup nodes, ``host:port`` joined by ``+`` (commas separate store tiers).

Each entry is one Redis string (the checksummed envelope of
:mod:`kvcodec.store.tiers.base`), so a write is atomic on the master that owns
its slot, and a read verifies the checksum and the key exactly as on a
single Redis node.

Node failure: one dead master owns only its slots, so the tier keeps serving
the others: a failure is never turned into a tier-wide outage (no calls are
skipped; warnings are rate-limited).  A read of a
key on a dead master is a miss (counted in ``errors``), a write to it raises
:class:`KvcStoreError` (the store reports it), and ``contains_many`` answers
per key, so a lookup still finds prefixes held by live masters.  Run the
cluster with ``cluster-require-full-coverage no`` so live masters keep
answering while a slot range is uncovered.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvcodec.errors import KvcInputError, KvcStoreError
from kvcodec.store.keys import StoreKey
from kvcodec.store.options import parse_port, redact, url_port
from kvcodec.store.outage import NodeOutageGuard
from kvcodec.store.tiers.redis import RedisTier


_LAZY = object()
WARN_EVERY = 30.0  # seconds between two warnings about unreachable nodes


class RedisClusterTier(RedisTier):
    kind = "redis-cluster"
    schemes = ("redis+cluster", "rediss+cluster")

    def __init__(self, url: str, *, name: str | None = None) -> None:
        try:
            from redis.backoff import NoBackoff
            from redis.cluster import ClusterNode, RedisCluster
            from redis.retry import Retry
        except ImportError:  # pragma: no cover
            raise KvcStoreError("the redis cluster tier needs redis-py: pip install 'kvcodec[store]'") from None
        p = urlsplit(url)
        scheme = p.scheme.lower()
        if scheme not in ("redis+cluster", "rediss+cluster"):
            raise KvcInputError(f"not a redis+cluster URL: {redact(url)!r}")
        if p.path not in ("", "/", "/0"):
            raise KvcInputError("a Redis Cluster has only database 0; drop the path from the URL")
        q = dict(parse_qsl(p.query, keep_blank_values=True))
        startup: list[Any] = []
        for hp in filter(None, q.pop("nodes", "").split("+")):
            host, _, port = hp.rpartition(":")
            if not host:
                raise KvcInputError(f"bad cluster node {ascii(hp[:60])}: use host:port")
            startup.append(ClusterNode(host, parse_port(port, f"cluster node {ascii(hp[:60])}")))
        port0 = url_port(p, "redis+cluster")
        try:
            timeout = float(q.get("timeout", 2.0))
        except ValueError as e:
            raise KvcInputError(f"bad redis URL option in {redact(url)!r}: {e}") from None
        base = scheme.split("+")[0]
        own = {k: q.pop(k) for k in ("timeout", "prefix", "ttl", "retry_interval", "max_bytes") if k in q}
        if q:
            raise KvcInputError(f"unknown redis+cluster options {sorted(q)}")
        kw = dict(host=p.hostname or "127.0.0.1", port=port0 or 6379, startup_nodes=startup or None,
                  username=p.username or None, password=p.password or None, ssl=(base == "rediss"),
                  socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 1),
                  require_full_coverage=False, health_check_interval=0)
        # Connecting discovers the cluster: done on first use, so a cluster that is down when the
        # store opens is an outage of this tier (misses, reported writes), not a failed open.
        self._factory = lambda: RedisCluster(**kw)
        self._client: Any = None
        # RedisTier parses its own options from a redis:// URL; the client is already built.
        inner = urlunsplit((base, p.netloc, "/0", urlencode(own), ""))
        super().__init__(inner, name=name or "redis-cluster", client=_LAZY)
        self.url = redact(url)
        from redis.exceptions import ClusterDownError, ClusterError, RedisClusterException, SlotNotCoveredError

        self._errors = self._errors + (ClusterDownError, ClusterError, SlotNotCoveredError, RedisClusterException)
        # A failing node is not a tier-wide outage: one dead master owns only its slots, so the tier stays
        # available, calls are never skipped, and warnings come at most once per WARN_EVERY seconds.
        self.guard = NodeOutageGuard(f"redis cluster {self.url}", WARN_EVERY,
                                     consequence="its keys are misses and writes to its slots are reported as failed")

    @property
    def r(self) -> Any:
        """The cluster client, connected (and the topology discovered) on first use."""
        if self._client is None:
            self._client = self._factory()
        return self._client

    @r.setter
    def r(self, value: Any) -> None:  # RedisTier.__init__ assigns its client here
        self._client = None if value is _LAZY else value

    def close(self) -> None:
        if self._client is not None:
            super().close()

    def _contains_after_failure(self, keys: list[StoreKey]) -> list[bool]:
        """A node is down: ask per key, so the live masters still answer for their slots."""
        return [self.contains(k) for k in keys]

    def _scan(self) -> list[bytes]:
        return list(self.r.scan_iter(match=self.prefix + "kvc1:*", count=1000, target_nodes=self.r.PRIMARIES))
