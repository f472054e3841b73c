"""Redis tier (redis-py): one Redis string per entry holding the checksummed envelope.

URL: ``redis://[[user]:password@]host:port/db`` or ``rediss://...`` (TLS), or
``unix:///path/sock?db=N``.  Extra query options understood here:

* ``timeout`` (seconds, default 2): socket connect and I/O timeout;
* ``prefix`` (default ``kvc:``): prefix of Redis key names;
* ``ttl`` (seconds, default none): expiry set on every put;
* ``retry_interval`` (seconds, default 1): after a failure, calls within this
  interval fail fast without touching the network;
* ``max_bytes`` (size, default ``1G``, kvc serve's ``--max-body``, like every
  remote tier): the largest entry read or written.  A read asks the value's
  length first, in the same round trip (a server-side script: ``STRLEN``, then
  ``GET`` only if it fits), so an oversized value is a counted miss that never
  crosses the network; a value over 1 MiB comes back as its first 64 KiB, and
  the rest is read only if that head names the asked key and the value's
  length, and the reader's Store accepts its seal (``Tier._check_head``); a server that refuses scripts gets the same
  in separate calls.

Other query options are passed to ``redis.Redis.from_url`` unchanged, and checked when the store opens: one its
connection class does not take (a typo, or ``ssl_cert_reqs`` on ``redis://``) is refused there, not at the first call.

Availability: a connection failure or timeout marks the tier *down* and logs
one warning for the outage (logger ``kvcodec.store``).  While down, reads
are misses and ``put``/``delete`` raise :class:`KvcStoreError` (the store
reports it; local tiers keep their copy).  After ``retry_interval`` the next
call tries again; the first success logs "reachable again" and clears the state.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from kvcodec.errors import KvcFormatError, KvcInputError, KvcStoreError
from kvcodec.store.keys import StoreKey
from kvcodec.store.options import parse_number, redact
from kvcodec.store.outage import OutageGuard
from kvcodec.store.tiers.probe import PROBE_BATCH, PROBE_READ, head_names_key
from kvcodec.store.tiers.base import (
    HeadCheck,
    DEFAULT_MAX_ENTRY,
    FIXED_SIZE,
    HEAD_FIRST,
    HEAD_READ,
    Entry,
    EntryInfo,
    Tier,
    parse_fixed,
    parse_header,
)

T = TypeVar("T")
_OWN_OPTS = ("timeout", "prefix", "ttl", "retry_interval", "max_bytes")
# one round trip, nothing oversized sent: the length when over ARGV[1]; {length, first ARGV[3] bytes} when
# over ARGV[2] (read head first); else the value (nil when absent)
_GET_CAPPED = """
local n = redis.call('STRLEN', KEYS[1])
if n > tonumber(ARGV[1]) then return n end
if n > tonumber(ARGV[2]) then return {n, redis.call('GETRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)} end
return redis.call('GET', KEYS[1])
"""


def _check_client_options(pool: Any, url: str) -> None:
    """The options redis-py was handed, checked when the store opens: redis-py passes an option it does not parse
    on to its connection class, so a typo (``max_byts=1G``) or an option of another scheme (``ssl_cert_reqs`` on
    ``redis://``) opened the store and then escaped from its first call as a TypeError, and ``socket_timeout=-1``
    as a ValueError."""
    import inspect

    known: set[str] = set()
    for c in pool.connection_class.__mro__:  # the keywords of each __init__ up to the first without **kwargs
        init = c.__dict__.get("__init__")
        if init is None:
            continue
        params = inspect.signature(init).parameters.values()
        known |= {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
        if not any(p.kind == p.VAR_KEYWORD for p in params):
            break
    kwargs = pool.connection_kwargs
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise KvcInputError(f"unknown redis URL options {unknown} in {redact(url)!r} (kvcodec's: {', '.join(_OWN_OPTS)})")
    for k in ("socket_timeout", "socket_connect_timeout"):
        v = kwargs.get(k)
        if v is not None and not 0 < float(v) < float("inf"):
            raise KvcInputError(f"redis URL option {k} must be a positive number of seconds in {redact(url)!r}")


class RedisTier(Tier):
    kind = "redis"
    schemes = ("redis", "rediss", "unix")
    remote = True
    checks_heads = True
    guard: OutageGuard

    def __init__(self, url: str, *, name: str | None = None, client: Any = None) -> None:
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:  # pragma: no cover
            raise KvcStoreError("the redis tier needs redis-py: pip install 'kvcodec[store]'") from None
        self._redis_mod = redis
        from kvcodec.store.options import url_port

        try:
            p = urlsplit(url)
        except ValueError as e:
            raise KvcInputError(f"bad redis URL {ascii(url.split('@')[-1])}: {e}") from None
        url_port(p, "redis")
        if p.scheme not in ("redis", "rediss", "unix"):
            raise KvcInputError(f"not a redis URL: {redact(url)!r}")
        if p.scheme != "unix" and not re.fullmatch(r"/?|/[0-9]{1,5}", p.path):  # redis-py took /abc as database 0
            raise KvcInputError(f"a redis URL's path is its database number (/0), got {ascii(p.path[:40])}")
        if p.scheme == "unix" and p.path.strip("/") == "":  # opened, then every call failed as an outage
            raise KvcInputError("a unix:// redis URL names its socket's path: unix:///run/redis.sock")
        q = dict(parse_qsl(p.query, keep_blank_values=True))
        try:
            timeout = parse_number(q.pop("timeout", "2"), "timeout", positive=True)
            ttl = q.pop("ttl", None)
            self.ttl = None if ttl in (None, "", "0") else int(parse_number(ttl, "ttl", positive=True, integer=True))
            self.retry_interval = parse_number(q.pop("retry_interval", "1"), "retry_interval")
        except ValueError as e:
            raise KvcInputError(f"bad redis URL option in {redact(url)!r}: {e}") from None
        from kvcodec.store.options import parse_size

        self.max_entry = parse_size(q.pop("max_bytes", DEFAULT_MAX_ENTRY))
        if self.max_entry <= 0:
            raise KvcInputError(f"redis max_bytes must be positive in {redact(url)!r}")
        self._scripts = True  # False once the server refused EVAL
        self.prefix = q.pop("prefix", "kvc:")
        if any(c in self.prefix for c in "*?[]\\"):
            raise KvcInputError(f"redis key prefix {self.prefix!r} must not contain glob characters")
        clean = urlunsplit((p.scheme, p.netloc, p.path, urlencode(q), p.fragment))
        if p.scheme == "unix":  # urlunsplit writes unix:/path (no netloc), which redis-py refused: unix:// never opened
            clean = "unix://" + clean[len("unix:"):]
        super().__init__(name or "redis", redact(url))
        if client is not None:
            self.r = client
        else:
            try:
                self.r = redis.Redis.from_url(
                    clean, socket_timeout=timeout, socket_connect_timeout=timeout,
                    retry=Retry(NoBackoff(), 1), health_check_interval=0)
            except ValueError as e:
                raise KvcInputError(f"bad redis URL {redact(url)!r}: {e}") from None
            _check_client_options(self.r.connection_pool, url)
        self._errors: tuple[type[BaseException], ...] = (
            redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self.guard = OutageGuard(f"redis {self.url}", self.retry_interval, writes_to="redis")

    # -- transport ------------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` through the tier's guard: transport failures are outages, other Redis errors plain failures."""
        self.guard.check(what)
        try:
            out = fn()
        except self._errors as e:
            raise self.guard.failed(f"{type(e).__name__}: {e}", what) from None
        except self._redis_mod.exceptions.RedisError as e:
            raise KvcStoreError(f"{self.guard.what}: {what} failed: {type(e).__name__}: {e}") from None
        self.guard.ok()
        return out

    def ping(self) -> bool:
        try:
            return bool(self._call("ping", self.r.ping))
        except KvcStoreError:
            return False

    # -- key names -------------------------------------------------------------------
    def rkey(self, key: StoreKey) -> str:
        return self.prefix + key.to_str()

    # -- interface -------------------------------------------------------------------
    def _get_capped(self, name: str) -> bytes | int | list[Any] | None:
        """Size before read: the value of ``name``; its length (an int) when over ``max_bytes``; ``[length,
        head]`` when over :data:`HEAD_FIRST` (the caller checks the head, then reads the rest); None: absent."""
        if self._scripts:
            try:
                return self.r.eval(_GET_CAPPED, 1, name, self.max_entry, HEAD_FIRST, HEAD_READ)
            except self._redis_mod.exceptions.ResponseError as e:
                if not any(w in str(e).lower() for w in ("unknown command", "disabled", "noscript", "not allowed")):
                    raise
                self._scripts = False  # scripting off on this server: two round trips from now on
        n = int(self.r.strlen(name))
        if n > self.max_entry:
            return n
        if n > HEAD_FIRST:
            return [n, self.r.getrange(name, 0, HEAD_READ - 1)]
        return self.r.get(name)

    def get_entry(self, key: StoreKey, head_ok: HeadCheck | None = None) -> Entry | None:
        name = self.rkey(key)
        what = f"redis {name}"
        try:
            buf = self._call("get", lambda: self._get_capped(name))
            if isinstance(buf, list):  # large: the head is checked before the payload is read
                size = int(buf[0])

                def more(n: int, at: int = len(buf[1])) -> bytes:
                    return bytes(self._call("get", lambda: self.r.getrange(name, at, at + n - 1)))

                head = self._check_head(bytes(buf[1]), size, key, what, more, head_ok)
                if head is None:
                    return None
                start = len(head)
                buf = head + self._call("get", lambda: self.r.getrange(name, start, size - 1))
        except KvcStoreError:
            self.counters.add(errors=1, misses=1)
            return None
        if isinstance(buf, int):
            self._too_large(buf, self.max_entry, what)
            return None
        return self._entry_or_drop(buf, key, what, lambda: self._call("delete", lambda: self.r.delete(name)))

    def put(self, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None,
            created: float | None = None) -> None:
        env = self._capped_envelope(key, data, meta, created, self.max_entry, self.guard.what)
        try:
            self._call("put", lambda: self.r.set(self.rkey(key), env, ex=self.ttl))
        except KvcStoreError:
            self.counters.add(put_errors=1)
            raise
        self.counters.add(puts=1)

    def _probe(self, keys: list[StoreKey]) -> list[bool]:
        """One pipelined round: each value's length and first :data:`PROBE_READ` bytes, judged as get would judge
        its head (:mod:`~kvcodec.store.tiers.probe`). A value of another type is a miss, not the round's failure."""
        def run() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for k in keys:
                pipe.strlen(self.rkey(k))
                pipe.getrange(self.rkey(k), 0, PROBE_READ - 1)
            return pipe.execute(raise_on_error=False)

        got = self._call("contains", run)
        out = []
        for j, k in enumerate(keys):
            size, head = got[2 * j], got[2 * j + 1]
            if isinstance(size, Exception) or isinstance(head, Exception):  # WRONGTYPE: a hash planted at the name
                out.append(False)
                continue
            name = self.rkey(k)

            def more(at: int, n: int, name: str = name) -> bytes:
                return bytes(self._call("contains", lambda: self.r.getrange(name, at, at + n - 1)))

            out.append(head_names_key(bytes(head), int(size), k, self.max_entry, f"redis {name}", more))
        return out

    def contains(self, key: StoreKey) -> bool:
        """Whether get would find ``key``'s entry, as far as its head tells (was: the name exists, so a truncated
        or damaged value was present until the first get)."""
        try:
            return self._probe([key])[0]
        except KvcStoreError:
            self.counters.add(errors=1)
            return False

    def contains_many(self, keys: Iterable[StoreKey]) -> list[bool]:
        keys = list(keys)
        out: list[bool] = []
        for i in range(0, len(keys), PROBE_BATCH):
            part = keys[i:i + PROBE_BATCH]
            try:
                out.extend(self._probe(part))
            except KvcStoreError:
                self.counters.add(errors=1)
                out.extend(self._contains_after_failure(part))
        return out

    def _contains_after_failure(self, keys: list[StoreKey]) -> list[bool]:
        """What ``contains_many`` answers when its pipelined round failed: all misses (the server is down)."""
        return [False] * len(keys)

    def delete(self, key: StoreKey) -> bool:
        return bool(self._call("delete", lambda: self.r.delete(self.rkey(key))))

    def _scan(self) -> list[bytes]:
        return list(self.r.scan_iter(match=self.prefix + "kvc1:*", count=1000))

    def ls(self, with_meta: bool = False) -> Iterator[EntryInfo]:
        return self.ls_judged(with_meta, lambda info: None)

    def ls_judged(self, with_meta: bool, mine: Callable[[EntryInfo], bool | None]) -> Iterator[EntryInfo]:
        """Entries grouped by partition (a key's namespace, in its name): a partition's first header is read
        alone, and none of the rest once ``mine`` says it is another tenant's (Tier.ls_judged: a tenant's
        listing read every other tenant's headers)."""
        names = self._call("scan", self._scan)
        plen = len(self.prefix)
        parts: dict[str, list[tuple[bytes, StoreKey]]] = {}
        for n in names or []:
            try:
                k = StoreKey.from_str(n.decode()[plen:])
            except (KvcInputError, UnicodeDecodeError):
                continue
            parts.setdefault(k.namespace, []).append((n, k))
        for group in parts.values():
            for batch in (group[:1], group[1:]):
                for info in self._infos(batch, with_meta):
                    if mine(info) is False:
                        break
                    yield info
                else:
                    continue
                break

    def _infos(self, group: list[tuple[bytes, StoreKey]], with_meta: bool) -> list[EntryInfo]:
        """The listing rows of ``group`` (name, key): their heads read in one pipeline."""
        if not group:
            return []

        def heads() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for n, _ in group:
                pipe.getrange(n, 0, FIXED_SIZE + 4095)
            return pipe.execute()

        out = []
        for (n, k), h in zip(group, self._call("ls", heads)):
            if not h:
                continue  # deleted meanwhile
            try:
                hl, dl, _ = parse_fixed(h)
                meta = None
                if with_meta:
                    hb = h[FIXED_SIZE:FIXED_SIZE + hl]
                    if len(hb) < hl:
                        hb = self._call("ls", lambda: self.r.getrange(n, FIXED_SIZE, FIXED_SIZE + hl - 1))
                    meta = parse_header(hb).get("meta")
            except KvcFormatError:
                continue
            out.append(EntryInfo(k, dl, self.name, meta, None))
        return out

    def usage(self) -> tuple[int, int]:
        names = self._call("scan", self._scan)
        if not names:
            return 0, 0

        def lens() -> list[Any]:
            pipe = self.r.pipeline(transaction=False)
            for n in names:
                pipe.strlen(n)
            return pipe.execute()

        ls = self._call("stats", lens)
        return sum(1 for x in ls if x), sum(int(x) for x in ls)

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        d["ttl"] = self.ttl
        return d

    def close(self) -> None:
        try:
            self.r.close()
        except Exception:  # pragma: no cover
            pass
