"""Per-tenant bounds of the directory tier: bytes over all of a tenant's partitions, and how many partitions.

Why: the tier caps each partition (``objects/<ns>``, one per tenant and namespace tag) separately, and a KDN
client's physical keys name any namespace tag it likes, so one tenant could spread entries over unlimited
partitions, each with its own cap, and fill the disk under every other tenant. The Store now tells the tier
whose put it is (:meth:`~kvcodec.store.tiers.base.Tier.put_for`, the tenant key's id), and the tier bounds:

* a tenant's bytes over all its partitions by ``tenant_bytes``: past it, the tenant's own least-recently-used
  entries (any of its partitions) are evicted down to ``low_water * tenant_bytes``. Eviction, not refusal,
  because that is what the per-partition cap already does: a cache tenant that keeps writing keeps its newest
  entries, and the entry just written is never evicted. Another tenant's entries are never read or touched.
* how many partitions a tenant owns by ``tenant_namespaces``: each costs directories, a lock and counters
  whatever its bytes, so a put that would make one more is refused (:class:`~kvcodec.errors.KvcQuotaError`, one line).

A partition's owner is recorded in ``objects/<ns>/.owner`` (the id, written once, atomically), so the bounds
hold across restarts; a partition written before owners were recorded is claimed by the first put into it.
Puts with no owner (a tier used directly) are bounded by the per-partition cap only.

A tier with neither ``max_bytes`` nor ``tenant_bytes`` bounds no tenant's bytes, but still each tenant's
partitions (each costs the process memory, whatever its bytes). :meth:`TenantQuota.share` gives such a tier's
tenants a byte bound of their own: the KDN service calls it with its number of tenants, so that no tenant of a
service over an uncapped directory can fill the disk under the others.

Atomicity: a put accounts its bytes under the quota's lock after its write, and any put that finds its
tenant over the quota evicts, one eviction per tenant at a time, measuring the tenant's files afresh. So a
tenant is over its quota by at most the entries being written at that moment (its concurrent puts, each at
most ``tenant_bytes``; the KDN runs store calls in a bounded thread pool), and under it again once they
return.
"""

from __future__ import annotations

import os
import re
import secrets
import threading
from typing import Iterator, Protocol

from kvcodec.errors import KvcInputError, KvcQuotaError, KvcStoreError
from kvcodec.store.options import parse_number
from kvcodec.store.tiers.base import TierCounters
from kvcodec.store.tiers.localfs import evict_oldest, open_dir, open_regular, why

OWNER_FILE = ".owner"
DEFAULT_TENANT_NAMESPACES = 1024
_OWNER = re.compile(r"[0-9a-f]{16}")


def namespaces_option(text: str) -> int:
    """``tenant_namespaces=N`` of a store URL: a whole number > 0, else one :class:`KvcInputError` line."""
    try:
        return int(parse_number(text, "tenant_namespaces", positive=True, integer=True))
    except ValueError as e:
        raise KvcInputError(f"directory store option {e}") from None


class _Tier(Protocol):
    """What a quota uses of its :class:`~kvcodec.store.tiers.directory.DirectoryTier` (not imported: a cycle)."""

    root: str
    objects: str
    low_water: float
    counters: TierCounters
    _lock: threading.Lock
    _approx: dict[str, int]

    def _partitions(self) -> list[str]: ...

    def _partition_files(self, part: str) -> Iterator[tuple[str, os.stat_result]]: ...


class TenantQuota:
    """The owner of each partition, each owner's bytes (measured by a scan, then tracked) and partitions."""

    def __init__(self, tier: _Tier, max_bytes: int | None, max_namespaces: int) -> None:
        self.tier, self.max_namespaces = tier, int(max_namespaces)
        self.max_bytes = None if max_bytes is None else int(max_bytes)  # None: partitions bounded, bytes not
        self._lock = threading.Lock()  # held for no I/O but the one-time owner scan
        self._owner_of: dict[str, str] | None = None  # partition -> owner id (None: not read from disk yet)
        self._parts: dict[str, set[str]] = {}
        self._bytes: dict[str, int] = {}
        self._evicting: dict[str, threading.Lock] = {}

    def before_put(self, owner: str, partition: str, size: int) -> None:
        """Refuse an entry larger than the quota (the tier never writes one only to evict it, as with its cap),
        then :meth:`claim` ``partition`` for ``owner``."""
        if not isinstance(owner, str) or not _OWNER.fullmatch(owner):
            raise KvcInputError(f"directory tier: an owner is a tenant key id (16 hex digits), got {ascii(owner)[:40]}")
        if self.max_bytes is not None and size > self.max_bytes:
            self.tier.counters.add(put_errors=1)
            raise KvcQuotaError(f"{self.tier.root}: entry of {size:,} bytes is larger than a tenant's quota of "
                                f"{self.max_bytes:,} bytes; not stored (raise tenant_bytes)")
        self.claim(owner, partition)

    def _read_owner(self, part: str) -> str | None:
        try:
            with open_regular(os.path.join(part, OWNER_FILE)) as f:
                text = f.read(64).decode("ascii", "replace").strip()
        except OSError:
            return None
        return text if _OWNER.fullmatch(text) else None

    def _load(self) -> dict[str, str]:
        """partition -> owner, read once from the partitions' owner files (under ``_lock``)."""
        if self._owner_of is None:
            self._owner_of = {}
            for part in self.tier._partitions():
                o = self._read_owner(part)
                if o is not None:
                    name = os.path.basename(part)
                    self._owner_of[name] = o
                    self._parts.setdefault(o, set()).add(name)
        return self._owner_of

    def claim(self, owner: str, partition: str) -> None:
        """Before a put into ``partition``: make it ``owner``'s, or refuse it as one partition too many."""
        with self._lock:
            owners = self._load()
            if partition in owners:  # (another owner's cannot happen through a Store: tags are HMACs of secrets)
                return
            mine = self._parts.setdefault(owner, set())
            if len(mine) >= self.max_namespaces:
                raise KvcQuotaError(f"{self.tier.root}: tenant {owner} already has {len(mine):,} namespaces on this "
                                    f"tier, the most it may (tenant_namespaces={self.max_namespaces}); not stored")
            owners[partition] = owner
            mine.add(partition)
        try:
            self._write_owner(owner, partition)
        except OSError as e:
            with self._lock:
                owners.pop(partition, None)
                mine.discard(partition)
            raise KvcStoreError(f"{self.tier.root}: cannot record the owner of a namespace: {why(e)}") from None

    def _write_owner(self, owner: str, partition: str) -> None:
        fd = open_dir(self.tier.objects, None, True)
        try:
            pfd = open_dir(partition, fd, True)
        finally:
            os.close(fd)
        try:
            tmp = f"{OWNER_FILE}.{os.getpid()}.{secrets.token_hex(6)}.tmp"  # gc removes one a crash left
            wfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=pfd)
            with os.fdopen(wfd, "wb") as f:
                f.write(owner.encode() + b"\n")
            os.replace(tmp, OWNER_FILE, src_dir_fd=pfd, dst_dir_fd=pfd)
        finally:
            os.close(pfd)

    def account(self, owner: str, size: int) -> bool:
        """After a put of ``size`` bytes: whether ``owner`` must be measured (first put) or is over its quota."""
        with self._lock:
            if self.max_bytes is None:
                return False
            known = owner in self._bytes
            self._bytes[owner] = self._bytes.get(owner, 0) + size
            return not known or self._bytes[owner] > self.max_bytes

    def evict(self, owner: str, keep: str | None = None) -> int:
        """Delete ``owner``'s least-recently-used entries, over all its partitions, until under
        ``low_water * max_bytes`` if it is over ``max_bytes``; ``keep`` (the entry just written) never."""
        with self._lock:
            if self.max_bytes is None:
                return 0
            lock = self._evicting.setdefault(owner, threading.Lock())
            limit = self.max_bytes
        with lock:
            with self._lock:
                parts = sorted(self._parts.get(owner, ()))
            files = [(p, path, st) for p in parts
                     for path, st in self.tier._partition_files(os.path.join(self.tier.objects, p))]
            total = sum(st.st_size for _, _, st in files)
            target = int(limit * self.tier.low_water)
            removed: dict[str, int] = {}
            n = 0
            if total > limit:
                total, gone, n = evict_oldest([(path, st) for _, path, st in files], total, target, keep)
                for i in gone:
                    part, _, st = files[i]
                    removed[part] = removed.get(part, 0) + st.st_size
            with self._lock:
                self._bytes[owner] = total
        with self.tier._lock:  # the partitions' tracked bytes, less what this removed from them
            for part, k in removed.items():
                if part in self.tier._approx:
                    self.tier._approx[part] = max(0, self.tier._approx[part] - k)
        if n:
            self.tier.counters.add(evictions=n)
        return n

    def share(self, tenants: int, free_bytes: int) -> int | None:
        """Bound each tenant's bytes to its share of ``free_bytes`` among ``tenants`` where no bound was set.

        Returns the bound set, or None where ``tenant_bytes`` (or ``max_bytes``) already bounds them or one
        tenant cannot starve another. Why a share of the free space: it is what the tenants can fill between
        them, and the store's own eviction then keeps each under its share (a set ``tenant_bytes`` wins)."""
        with self._lock:
            if self.max_bytes is not None or tenants < 2:
                return None
            self.max_bytes = max(1, int(free_bytes) // int(tenants))
            self._bytes.clear()  # measured afresh by each tenant's next put
            return self.max_bytes

    def stats(self) -> dict[str, int | None]:
        with self._lock:
            return {"tenant_bytes": self.max_bytes, "tenant_namespaces": self.max_namespaces,
                    "tenants": len(self._parts)}
