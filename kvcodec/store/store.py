"""The tiered store: ``Store.open(url)``, then ``put`` / ``get`` / ``ls`` / ``rm`` / ``stats`` / ``gc``.

URL grammar (comma-separated tier list, searched in order, an in-process LRU
always in front)::

    mem://[?max_bytes=256M]             only the in-process LRU (sets its size)
    /abs/dir | rel/dir | file:///abs/dir[?max_bytes=10G&fsync=0]
    redis://[:password@]host:port/db[?timeout=2&prefix=kvc:&ttl=S&retry_interval=1]
    rediss://...                        Redis over TLS
    unix:///path/redis.sock[?db=N&...]  Redis over a unix socket
    http(s)://host/base/[?timeout=30&connect_timeout=5&deadline=300&max_bytes=1G]
                                        read-only published directory store
    kvc+http(s)://[:TOKEN@]host:port    a shared ``kvc serve`` (token also from $KVC_TOKEN)
    redis+cluster://[:password@]host:port[?...]   a Redis Cluster (any node; the rest is discovered)
    s3://bucket/prefix?endpoint_url=...  an S3-compatible object store (boto3)

e.g. ``"/var/cache/kvc,redis://127.0.0.1:6379/0"``.  Each part opens the tier
its scheme names in :mod:`kvcodec.store.tiers.registry` (a part without a
scheme is a directory); the Store asks of a tier only what its declared
capabilities (``supports_writes`` / ``_deletes`` / ``_listing`` / ``_ranges``,
``persistent``) allow.

Isolation: a Store acts for one tenant, the holder of a :class:`TenantKey`
(``key=``; default :meth:`TenantKey.default`: ``$KVC_STORE_KEY``,
``$KVC_STORE_KEY_FILE`` or the per-user key file).  Tiers see only physical
keys (HMAC of the logical key) and sealed metadata; every entry read from a
persistent tier is authenticated before it is returned, back-filled or
range-read, and ``ls``/``stats``/``gc`` cover only the caller's entries.
spec/store-keys.md §8-§10 has the scheme and the threat model.

``get`` searches tiers in order and back-fills the faster tiers in front of
the one that hit.  ``put`` writes through to every writable tier and returns
a :class:`PutResult` naming what happened in each one; it raises
:class:`KvcStoreError` only when no persistent tier took the entry (an
entry is never silently kept only in RAM when the user asked for storage).
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, cast

from kvcodec.errors import KvcError, KvcFormatError, KvcInputError, KvcQuotaError, KvcStoreError
from kvcodec.store.keys import DEFAULT_CHUNK, StoreKey, check_id, prefix_keys
from kvcodec.store.options import DEFAULT_MEMORY_BYTES, TierDefaults, parse_size, redact
from kvcodec.store.ranged import BytesRangeReader, RangeReader
from kvcodec.store.tenant import AuthRangeReader, NamespaceKeys, Seal, TenantKey
from kvcodec.store.tiers.base import (
    Entry,
    EntryInfo,
    HeadCheck,
    HeadChecking,
    MemoryTier,
    Tier,
    as_bytes,
    check_meta,
)
from kvcodec.store.tiers.registry import open_tier

log = logging.getLogger("kvcodec.store")


def _redact(url: str) -> str:
    return redact(url) if "@" in url and "://" in url else url


@dataclass
class PutResult:
    """Outcome of ``Store.put`` per tier: ``"ok"``, ``"skipped: ..."`` or ``"error: ..."``."""

    key: StoreKey
    tiers: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no tier reported an error."""
        return not self.failed

    @property
    def failed(self) -> dict[str, str]:
        return {k: v for k, v in self.tiers.items() if v.startswith("error")}

    @property
    def stored_in(self) -> list[str]:
        return [k for k, v in self.tiers.items() if v == "ok"]

    def __bool__(self) -> bool:
        return self.ok


class Store:
    """Tiers searched in order behind an in-process LRU, acting for one tenant (``key``)."""

    def __init__(self, tiers: list[Tier], url: str = "", key: TenantKey | None = None) -> None:
        if not tiers or not isinstance(tiers[0], MemoryTier):
            tiers = [MemoryTier(DEFAULT_MEMORY_BYTES)] + list(tiers)
        names: set[str] = set()
        for t in tiers:
            base, i = t.name, 2
            while t.name in names:
                t.name = f"{base}{i}"
                i += 1
            names.add(t.name)
        self.tiers = tiers
        self.url = url
        self.memory: MemoryTier = tiers[0]  # type: ignore[assignment]
        self.hits = 0
        self.misses = 0
        self.put_failures = 0
        self.rejected = 0  # entries that failed authentication (forged, tampered, another tenant's)
        self._lock = threading.Lock()
        if key is None:
            key = TenantKey.ephemeral() if all(not t.persistent for t in tiers) else TenantKey.default()
        if not isinstance(key, TenantKey):
            raise KvcInputError(f"store key must be a TenantKey, got {type(key).__name__}")
        self.key = key

    # -- construction ----------------------------------------------------------
    @classmethod
    def open(cls, url: str | os.PathLike[str], *, memory_bytes: int | str | None = None,
             fsync: bool | None = None, max_bytes: int | str | None = None,
             key: TenantKey | None = None) -> "Store":
        """Open a store from a URL or comma-separated tier list (see module doc).

        Each part opens the tier its scheme names (:mod:`kvcodec.store.tiers.registry`);
        ``memory_bytes`` sizes the front LRU; ``fsync``/``max_bytes`` are
        defaults for directory tiers whose URL does not set them; ``key`` is
        the caller's tenant key (default: :meth:`TenantKey.default`).
        """
        s = os.fspath(url).strip()
        if not s:
            raise KvcInputError("empty store URL")
        defaults = TierDefaults(fsync=fsync, max_bytes=max_bytes)
        if memory_bytes is not None:
            defaults.memory_bytes = parse_size(memory_bytes)
        tiers: list[Tier] = []
        try:
            for part in (p.strip() for p in s.split(",")):
                if not part:
                    raise KvcInputError(f"empty tier in store URL {ascii(s)}")
                t = open_tier(part, defaults)
                if isinstance(t, MemoryTier):  # mem:// sizes the front LRU (a later bare mem:// keeps the size)
                    defaults.memory_bytes = t.max_bytes
                else:
                    tiers.append(t)
            shown = ",".join(_redact(p.strip()) for p in s.split(","))
        except ValueError as e:  # urlsplit / port parsing of an odd URL
            raise KvcInputError(f"bad store URL {ascii(s.split('@')[-1][:200])}: {e}") from None
        return cls([MemoryTier(defaults.memory_bytes)] + tiers, url=shown, key=key)

    def for_key(self, key: TenantKey) -> "Store":
        """The same persistent tiers acting for another tenant, with its own in-process LRU.

        For services that act for many tenants: one Store per tenant key over
        shared tier objects (connections, directory handles).  The LRU is not
        shared, so one tenant's traffic never evicts another's cached entries.
        """
        if not isinstance(key, TenantKey):  # None made Store() fall back to this process's default key: the owner's
            raise KvcInputError(f"for_key needs the tenant's TenantKey, got {type(key).__name__}")
        return Store([MemoryTier(self.memory.max_bytes)] + self.tiers[1:], url=self.url, key=key)

    # -- tenant mapping ----------------------------------------------------------------
    def _ns(self, key: StoreKey) -> NamespaceKeys:
        return self.key.namespace(key.namespace)

    def physical(self, key: StoreKey) -> StoreKey:
        """The key ``key`` has on every tier (HMAC of it under the caller's tenant key)."""
        self._check_key(key)
        return self._ns(key).physical(key)

    def _reject(self, tier: Tier, what: str, err: Exception) -> None:
        tier.counters.add(corrupt=1)
        with self._lock:
            self.rejected += 1
        log.warning("store: %s from %s refused: %s", what, tier.name, err)

    def _unseal(self, tier: Tier, key: StoreKey, phys: StoreKey, e: Entry) -> Seal | None:
        """The verified seal of entry ``e`` read from ``tier``, or None (warned, counted)."""
        try:
            seal = self._ns(key).open(phys, e.meta, f"entry {key}")
            if seal.key != key:
                raise KvcFormatError(f"entry {key}: sealed for {seal.key}")
            if not isinstance(tier, MemoryTier):  # the LRU holds only entries verified on the way in
                seal.check_data(e.data, f"entry {key}")
        except KvcFormatError as err:
            self._reject(tier, f"entry {key}", err)
            return None
        return seal

    def _head_check(self, key: StoreKey, phys: StoreKey) -> HeadCheck:
        """The seal check a tier may run on an envelope's header before reading its payload (Tier._check_head):
        a forgery under our name -- no seal, a seal that does not verify, of another key, or of another length --
        is refused without the payload crossing the network.  The payload's hashes are checked after the read."""
        def check(meta: Mapping[str, Any], size: int) -> None:
            seal = self._ns(key).open(phys, meta, f"entry {key}")
            if seal.key != key:
                raise KvcFormatError(f"entry {key}: sealed for {seal.key}")
            if seal.size != size:
                raise KvcFormatError(f"entry {key}: payload is {size} bytes, sealed size {seal.size}")
        return check

    # -- core ------------------------------------------------------------------------
    def get_entry(self, key: StoreKey) -> Entry | None:
        """Entry (data + meta) from the first tier holding an authentic copy; back-fills faster tiers.

        A copy that fails authentication (another tenant's, forged, tampered)
        is a miss in that tier: it is logged, counted in ``rejected``, left
        where it is, and never copied into another tier.
        """
        phys = self.physical(key)
        for i, t in enumerate(self.tiers):
            # a tier that reads large objects head first checks our seal before their payload (others: get_entry(key))
            e = cast(HeadChecking, t).get_entry(phys, head_ok=self._head_check(key, phys)) if t.checks_heads \
                else t.get_entry(phys)
            if e is None:
                continue
            seal = self._unseal(t, key, phys, e)
            if seal is None:
                continue
            for front in self.tiers[:i]:
                if not front.supports_writes:
                    continue
                if isinstance(front, MemoryTier) and not front.fits(len(e.data)):
                    continue
                try:
                    front.put_for(self.key.id, phys, e.data, e.meta, created=e.created)
                except KvcStoreError as err:
                    log.debug("store: back-fill of %s into %s failed: %s", key, front.name, err)
            with self._lock:
                self.hits += 1
            return Entry(key, e.data, seal.meta, e.created)
        with self._lock:
            self.misses += 1
        return None

    def get(self, key: StoreKey) -> bytes | None:
        """The bytes stored under ``key``, or ``None``."""
        e = self.get_entry(key)
        return None if e is None else e.data

    def get_meta(self, key: StoreKey) -> dict[str, Any] | None:
        e = self.get_entry(key)
        return None if e is None else e.meta

    def put(self, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None) -> PutResult:
        """Seal and write through to every writable tier; see :class:`PutResult`."""
        phys = self.physical(key)
        data = as_bytes(data)
        sealed = self._ns(key).seal(key, data, check_meta(meta))
        res = PutResult(key)
        quota_refused: set[str] = set()
        for t in self.tiers:
            if not t.supports_writes:
                res.tiers[t.name] = "skipped: read-only"
                continue
            if isinstance(t, MemoryTier) and not t.fits(len(data)):
                res.tiers[t.name] = "skipped: larger than the memory tier"
                continue
            try:
                t.put_for(self.key.id, phys, data, sealed)  # the tier may bound each tenant (quota.py)
                res.tiers[t.name] = "ok"
            except KvcStoreError as e:
                res.tiers[t.name] = f"error: {e}"
                if isinstance(e, KvcQuotaError):
                    quota_refused.add(t.name)
        persistent = [t.name for t in self.tiers if t.supports_writes and t.persistent]
        if res.failed:
            with self._lock:
                self.put_failures += 1
        if persistent and not any(res.tiers[n] == "ok" for n in persistent):
            self.memory.delete(phys)
            # every persistent tier refused for the tenant's own bound: a quota refusal (KDN: 507), not an outage
            raise (KvcQuotaError if quota_refused >= set(persistent) else KvcStoreError)(
                f"store put of {key} failed in every persistent tier: "
                + "; ".join(f"{n}: {res.tiers[n]}" for n in persistent))
        return res

    def contains(self, key: StoreKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Iterable[StoreKey]) -> list[bool]:
        """Whether each key has an entry (by name: a later ``get`` still authenticates it)."""
        phys = [self.physical(k) for k in keys]
        found = [False] * len(phys)
        for t in self.tiers:
            todo = [i for i, f in enumerate(found) if not f]
            if not todo:
                break
            for i, ok in zip(todo, t.contains_many([phys[i] for i in todo])):
                if ok:
                    found[i] = True
        return found

    def longest_prefix(self, token_ids: Any, *, model: str, codec: str, namespace: str = "default",
                       chunk: int = DEFAULT_CHUNK, min_tokens: int = 1) -> tuple[StoreKey | None, int]:
        """``(key, n_tokens)`` of the longest cached prefix of ``token_ids``, or ``(None, 0)``.

        Probes every candidate (:func:`keys.prefix_keys`, longest first) in one ``contains_many``
        round trip per tier: a shorter prefix being cached implies nothing about longer ones, so
        this is not a binary search.
        """
        cands = prefix_keys(token_ids, model=model, codec=codec, namespace=namespace, chunk=chunk, min_tokens=min_tokens)
        for k, ok in zip(cands, self.contains_many(cands) if cands else []):
            if ok:
                return k, k.n_tokens
        return None, 0

    def reader(self, key: StoreKey) -> RangeReader | None:
        """A range reader over the payload of ``key`` without loading it whole.

        Uses the first tier that can serve ranges (directory: pread, http:
        Range requests) through :class:`AuthRangeReader`, which verifies the
        seal first and each block before returning its bytes; other tiers
        fall back to a full, verified ``get``.
        """
        phys = self.physical(key)
        for t in self.tiers:
            if isinstance(t, MemoryTier):
                e = t.get_entry(phys)
                if e is not None and self._unseal(t, key, phys, e) is not None:
                    return BytesRangeReader(e.data, name=str(key))
                continue
            if not t.supports_ranges:
                if t.contains(phys):
                    e2 = self.get_entry(key)
                    if e2 is not None:
                        return BytesRangeReader(e2.data, name=str(key))
                continue
            try:
                got = t.range_entry(phys)
            except KvcError as err:
                log.warning("store: %s cannot serve ranges for %s: %s", t.name, key, err)
                continue
            if got is None:
                continue
            inner, sealed = got
            try:
                seal = self._ns(key).open(phys, sealed, f"entry {key}")
                return AuthRangeReader(inner, seal, name=str(key))
            except KvcFormatError as err:
                inner.close()
                self._reject(t, f"entry {key}", err)
        return None

    def rm(self, key: StoreKey) -> bool:
        """Delete ``key`` from every writable tier.  True if any tier held it.

        Only the caller's own entry can be named: another tenant's entry with
        the same logical key has another physical key.  Raises
        :class:`KvcStoreError` if some tier could not be reached (a surviving
        copy would come back through back-fill).
        """
        phys = self.physical(key)
        removed = False
        errors = []
        for t in self.tiers:
            if not t.supports_deletes:
                continue
            try:
                removed = t.delete(phys) or removed
            except KvcStoreError as e:
                errors.append(f"{t.name}: {e}")
        if errors:
            raise KvcStoreError(f"store rm of {key} incomplete: " + "; ".join(errors))
        return removed

    def _scan(self, t: Tier) -> Iterable[tuple[EntryInfo, Seal | None]]:
        """Entries of tier ``t`` in the caller's partitions, with their verified seal (None: fails).

        An entry's partition is the tag of the namespace its header claims;
        entries in other tenants' partitions are skipped unread.
        """
        def logical_of(info: EntryInfo) -> StoreKey | None:
            sealed = info.meta
            try:
                ks = sealed.get("key") if isinstance(sealed, dict) else None
                return StoreKey.from_str(ks) if isinstance(ks, str) else None
            except KvcInputError:
                return None

        def mine(info: EntryInfo) -> bool | None:  # a partition is its owner's: one header tells (Tier.ls_judged)
            logical = logical_of(info)
            return None if logical is None else self._ns(logical).tag == info.key.namespace

        for info in t.ls_judged(True, mine):
            logical = logical_of(info)
            if logical is None:
                continue
            ns = self._ns(logical)
            if info.key.namespace != ns.tag:
                continue  # another tenant's partition: not even its seal is examined
            try:
                yield info, ns.open(info.key, info.meta or {}, f"entry {logical}")
            except KvcFormatError as err:
                log.debug("store: %s: %s", t.name, err)
                yield info, None

    def _own(self, t: Tier) -> Iterable[tuple[EntryInfo, Seal]]:
        """The caller's authentic entries in tier ``t`` (header seal verified)."""
        for info, seal in self._scan(t):
            if seal is not None:
                yield info, seal

    def ls(self, *, with_meta: bool = False, model: str | None = None, codec: str | None = None,
           namespace: str | None = None, failures: list[str] | None = None) -> list[EntryInfo]:
        """The caller's entries in all tiers that support listing, merged by key (``tier`` = comma-joined names).

        A tier that cannot be listed is skipped with a warning; ``failures`` (when given) collects one line
        per such tier, so a caller can tell a partial listing from a complete one (``kvc store ls`` exits
        non-zero)."""
        # a filter no key can carry (a/b, "", 5) listed nothing, as if the store were empty (or, "", everything)
        for what, v in (("model", model), ("codec", codec), ("namespace", namespace)):
            if v is not None:
                check_id(what, v)
        merged: dict[StoreKey, EntryInfo] = {}
        for t in self.tiers:
            if not t.supports_listing:
                continue
            was_up = t.available()
            try:
                for info, seal in self._own(t):
                    k = seal.key
                    if (model and k.model != model) or (codec and k.codec != codec) or \
                            (namespace and k.namespace != namespace):
                        continue
                    if k in merged:
                        merged[k].tier += "," + info.tier
                    else:
                        merged[k] = EntryInfo(k, info.size, info.tier, dict(seal.meta) if with_meta else None,
                                              info.mtime)
            except KvcStoreError as e:  # an outage already warned about is not repeated
                (log.warning if was_up and t.available() else log.info)(
                    "store: cannot list %s: %s", t.name, e)
                if failures is not None:
                    failures.append(f"{t.name}: {e}")
        return sorted(merged.values(), key=lambda i: i.key)

    def stats(self) -> dict[str, Any]:
        """Counters per tier; ``entries``/``bytes`` count only the caller's entries."""
        tiers = []
        for t in self.tiers:
            d = t.stats()
            d.pop("entries", None)
            d.pop("bytes", None)
            if t.supports_listing:
                try:
                    own = [info for info, _ in self._own(t)]
                    d["entries"], d["bytes"] = len(own), sum(i.size for i in own)
                except KvcStoreError as e:
                    d["entries"], d["bytes"], d["error"] = None, None, str(e)
            else:
                d["entries"] = d["bytes"] = None
            tiers.append(d)
        return {"url": self.url, "tenant_key": self.key.id, "key_source": self.key.source,
                "hits": self.hits, "misses": self.misses, "put_failures": self.put_failures,
                "rejected": self.rejected, "tiers": tiers}

    def gc(self, grace_s: float = 3600.0) -> dict[str, Any]:
        """Tier hygiene plus a full check of the caller's own entries.

        Per tier: the tier's own ``gc`` (leftover temp files, files no one can
        read), then every entry in the caller's partitions is read and
        verified against its seal; those that fail (tampered, forged at the
        caller's names) are deleted (``auth_removed``).  Other tenants'
        partitions are never read, moved or deleted.
        """
        if isinstance(grace_s, bool) or not isinstance(grace_s, (int, float)) or not 0 <= grace_s < float("inf"):
            # "x" escaped as TypeError at the first temp file; NaN kept every one for ever
            raise KvcInputError(f"gc's grace period must be a number of seconds >= 0, got {grace_s!r:.40}")
        out: dict[str, Any] = {}
        for t in self.tiers:
            try:
                r = dict(t.gc(grace_s=grace_s))
                if t.supports_listing and t.supports_deletes and t.persistent:
                    r["auth_checked"] = r["auth_removed"] = 0
                    for info, seal in list(self._scan(t)):
                        r["auth_checked"] += 1
                        e = t.get_entry(info.key) if seal is not None else None
                        if seal is not None and e is None:
                            continue  # vanished, or damaged and already quarantined by the tier
                        if seal is None or self._unseal(t, seal.key, info.key, e) is None:
                            t.delete(info.key)
                            r["auth_removed"] += 1
                out[t.name] = r
            except KvcStoreError as e:
                out[t.name] = {"error": str(e)}
        return out

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KvcInputError(f"no tier named {name!r} (have {[t.name for t in self.tiers]})")

    @staticmethod
    def _check_key(key: Any) -> None:
        if not isinstance(key, StoreKey):
            raise KvcInputError(f"store keys are StoreKey objects, got {type(key).__name__} "
                                "(use StoreKey.from_str for strings)")

    def close(self) -> None:
        for t in self.tiers:
            t.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r}, tiers={[t.name for t in self.tiers]})"
