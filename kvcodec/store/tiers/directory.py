"""Local directory tier: crash-safe, checksummed, per-partition size caps, multi-process safe.

Layout 2 (spec/store-keys.md §7)::

    <root>/kvstore.json                         marker {"format": "kvcodec-store", "layout": 2}
    <root>/objects/<ns>/<d[:2]>/<d>.kve         one envelope per entry (ns = key namespace,
                                                d = key digest); the Store passes physical
                                                keys, so ns is a tenant's opaque tag
    <root>/objects/<ns>/<d[:2]>/.<d>.<pid>.<rand>.tmp   in-flight writes
    <root>/quarantine/<d>.kve.<time>.<rand>.bad          damaged entries moved aside

Writes: temp file in the target directory, write, ``fsync``, ``os.replace``
onto the final name, ``fsync`` the directory.  Readers see the old complete
file, the new complete file, or nothing; a writer killed at any moment leaves
at most a temp file, which ``gc()`` removes once older than a grace period.

Reads open the file once and verify the envelope (size, crc32c, key) on the
bytes of that open file.  A *damaged* entry (bad size, checksum, header) is
a miss and is moved to ``quarantine/``.  An intact entry that holds another
key is a plain miss and is left alone: a read never moves an entry it does
not own.

Size cap: ``max_bytes`` caps each partition (``<ns>``) separately, so one
tenant's writes can only evict that tenant's own least-recently-used entries
(a read bumps mtime).  A put larger than the cap is refused with
:class:`KvcStoreError` -- the tier never writes an entry only to evict it
(or everything else) at once.  Eviction never removes the entry just written.
A tenant's bytes over all its partitions, and how many it owns, are bounded too
(``tenant_bytes``, default ``max_bytes``; ``tenant_namespaces``): :mod:`~kvcodec.store.tiers.quota`.

A layout-1 store (flat ``objects/<d[:2]>/``, namespace-label keys) is
upgraded on open by renaming its ``objects/`` to ``objects.layout1.<time>``:
its entries cannot be authenticated, so they are kept aside, never served.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
import time
from typing import Any, BinaryIO, Callable, Iterator, Mapping
from urllib.parse import parse_qsl, unquote, urlsplit

from kvcodec.errors import KvcFormatError, KvcInputError, KvcQuotaError, KvcStoreError, json_loads
from kvcodec.store.keys import StoreKey
from kvcodec.store.options import TierDefaults, parse_flag, parse_size
from kvcodec.store.ranged import FileRangeReader
from kvcodec.store.tiers.quota import DEFAULT_TENANT_NAMESPACES, TenantQuota, namespaces_option
from kvcodec.store.tiers.localfs import (
    check_head, evict_oldest, fsync_dir, open_dir, open_regular, purge_older, remove_stale_tmp, why)
from kvcodec.store.tiers.base import (
    FIXED_SIZE,
    MAX_TIER_META,
    Entry,
    EntryInfo,
    KeyMismatch,
    Tier,
    as_bytes,
    check_meta,
    decode_envelope_parts,
    encode_envelope_parts,
    log,
    parse_fixed,
    parse_header,
)

MARKER = "kvstore.json"
MARKER_CONTENT = {"format": "kvcodec-store", "layout": 2}
_MAX_MARKER = 1 << 16  # a marker is some 40 bytes: a larger one is not read whole
SUFFIX = ".kve"
TMP_SUFFIX = ".tmp"


def _marker_tmp(name: str) -> bool:
    """A marker being written by another process opening the same new store at the same moment."""
    return name.startswith(MARKER + ".") and name.endswith(TMP_SUFFIX)


class DirectoryTier(Tier):
    """``/abs/dir``, ``rel/dir`` or ``file:///abs/dir[?max_bytes=10G&tenant_bytes=40G&tenant_namespaces=1024&fsync=0]``
    (a URL without a scheme is a path)."""

    kind = "directory"
    schemes = ("file",)
    supports_ranges = True

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int | None = None,
                 fsync: bool = True, low_water: float = 0.9, create: bool = True,
                 name: str | None = None, tenant_bytes: int | None = None,
                 tenant_namespaces: int = DEFAULT_TENANT_NAMESPACES) -> None:
        self.root = os.path.abspath(os.fspath(root))
        super().__init__(name or "directory", "file://" + self.root)
        self.max_bytes = None if max_bytes is None else int(max_bytes)
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise KvcInputError("directory tier max_bytes must be positive")
        if not 0.0 < low_water <= 1.0:
            raise KvcInputError("low_water must be in (0, 1]")
        self.fsync = bool(fsync)
        self.low_water = float(low_water)
        self.objects = os.path.join(self.root, "objects")
        self.quarantine = os.path.join(self.root, "quarantine")
        self._lock = threading.Lock()  # guards _approx and _part_locks only: held for no I/O
        self._part_locks: dict[str, threading.Lock] = {}  # one eviction at a time per partition
        self._init_root(create)
        self._approx: dict[str, int] = {}  # partition -> bytes (measured by a scan, then tracked)
        tb = self.max_bytes if tenant_bytes is None else int(tenant_bytes)  # default: one partition's cap
        if (tb is not None and tb <= 0) or int(tenant_namespaces) <= 0:
            raise KvcInputError("directory tier tenant_bytes and tenant_namespaces must be positive")
        # always a quota: with no bytes bound it still bounds each tenant's partitions (see share_tenants)
        self.quota = TenantQuota(self, tb, int(tenant_namespaces))

    @classmethod
    def from_url(cls, url: str, defaults: TierDefaults) -> "DirectoryTier":
        """A path or ``file://`` URL; ``max_bytes``/``fsync`` not in the URL come from ``defaults``."""
        opts: dict[str, str] = {}
        if url.lower().startswith("file://"):
            p = urlsplit(url)
            if p.netloc not in ("", "localhost"):
                raise KvcInputError(f"file URL with a remote host is not supported: {url!r}")
            path = unquote(p.path)
            opts = dict(parse_qsl(p.query))
        else:
            # a plain path takes the same ?options (kvc store ... --store st?max_bytes=1G made a directory called
            # "st?max_bytes=1G", uncapped, and `st?bogus=1` was accepted)
            path, sep, query = url.partition("?")
            path = os.path.expanduser(path)
            if sep:
                opts = dict(parse_qsl(query, keep_blank_values=True))
        mb = opts.pop("max_bytes", None)
        max_bytes = parse_size(mb) if mb is not None else (
            parse_size(defaults.max_bytes) if defaults.max_bytes is not None else None)
        tb, tn = opts.pop("tenant_bytes", None), opts.pop("tenant_namespaces", None)
        fs = opts.pop("fsync", None)
        fsync = parse_flag(fs) if fs is not None else (True if defaults.fsync is None else defaults.fsync)
        if opts:
            raise KvcInputError(f"unknown directory store options {sorted(opts)}")
        if not path:
            raise KvcInputError("empty directory path in store URL")
        return cls(path, max_bytes=max_bytes, fsync=fsync, tenant_bytes=None if tb is None else parse_size(tb),
                   tenant_namespaces=DEFAULT_TENANT_NAMESPACES if tn is None else namespaces_option(tn))

    # -- setup ------------------------------------------------------------------
    def _init_root(self, create: bool) -> None:
        marker = os.path.join(self.root, MARKER)
        if os.path.isfile(marker):
            try:
                with open(marker, encoding="utf-8") as f:
                    m = json_loads(f.read(_MAX_MARKER + 1))
            except (OSError, ValueError) as e:
                raise KvcStoreError(f"{self.root}: unreadable store marker {MARKER}: {str(e)[:200]}") from None
            if not isinstance(m, dict) or m.get("format") != MARKER_CONTENT["format"]:
                raise KvcStoreError(f"{self.root}: {MARKER} is not a kvcodec store marker")
            if m.get("layout") == 1 and create:
                self._upgrade_layout1(marker)
            elif m.get("layout") != MARKER_CONTENT["layout"]:
                raise KvcStoreError(f"{self.root}: unsupported store layout {m.get('layout')!r}")
        else:
            if not create:
                raise KvcStoreError(f"{self.root}: not a kvcodec store (no {MARKER})")
            if os.path.exists(self.root):
                if not os.path.isdir(self.root):
                    raise KvcStoreError(f"{self.root}: exists and is not a directory")
                if any(n != MARKER and not n.startswith(".") and not _marker_tmp(n) for n in os.listdir(self.root)) \
                        and not os.path.isdir(self.objects):
                    raise KvcStoreError(
                        f"{self.root}: directory is not empty and not a kvcodec store; "
                        "refusing to use it (gc would delete foreign files)")
            try:
                os.makedirs(self.root, exist_ok=True)
                self._atomic_write_small(marker, json.dumps(MARKER_CONTENT).encode() + b"\n")
            except OSError as e:
                raise KvcStoreError(f"{self.root}: cannot create store: {e.strerror or e}") from None
        for d in (self.objects, self.quarantine):
            try:
                os.makedirs(d, exist_ok=True)
            except OSError as e:
                raise KvcStoreError(f"{d}: cannot create: {e.strerror or e}") from None

    def _upgrade_layout1(self, marker: str) -> None:
        """Move a layout-1 ``objects/`` aside (its entries cannot be authenticated) and mark layout 2."""
        try:
            dest = f"{self.objects}.layout1.{int(time.time())}.{secrets.token_hex(3)}"
            try:
                os.replace(self.objects, dest)
                log.warning("store %s: layout-1 entries (no tenant keys) moved to %s; they are not served",
                            self.root, dest)
            except FileNotFoundError:  # none, or another process upgraded it just now
                pass
            self._atomic_write_small(marker, json.dumps(MARKER_CONTENT).encode() + b"\n")
        except OSError as e:
            raise KvcStoreError(f"{self.root}: cannot upgrade store layout: {e.strerror or e}") from None

    def _atomic_write_small(self, path: str, data: bytes) -> None:
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if self.fsync:
            fsync_dir(os.path.dirname(path))

    # -- paths ------------------------------------------------------------------
    def path_for(self, key: StoreKey) -> str:
        d = key.digest
        return os.path.join(self.objects, key.namespace, d[:2], d + SUFFIX)

    def _shard_fd(self, key: StoreKey, create: bool = False) -> int:
        """A descriptor of ``objects/<ns>/<d[:2]>``, opened level by level without following a symlink.

        Why: a symlink planted at a partition or shard directory (``objects/<ns>``, ``objects/<ns>/ab``) made
        puts write, and deletes unlink, outside the store, where ``ls``, ``gc`` and eviction (which never follow
        one) could not see them. Entries are then named relative to this descriptor, so a swap after the check
        changes nothing. Raises ``OSError`` (:func:`_why` says which)."""
        fd = open_dir(self.objects, None, create)
        try:
            for name in (key.namespace, key.digest[:2]):
                nfd = open_dir(name, fd, create)
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def _partitions(self) -> list[str]:
        try:
            with os.scandir(self.objects) as it:
                return [de.path for de in it if de.is_dir(follow_symlinks=False) and not de.name.startswith(".")]
        except FileNotFoundError:
            return []

    def _entry_files(self, partition: str | None = None) -> Iterator[tuple[str, os.stat_result]]:
        """Entry files of one partition (namespace), or of all; never through a symlink planted at a partition's
        name (evict(partition) unlinked the files of the directory it pointed to, outside the store)."""
        parts = self._partitions()
        if partition is not None:
            parts = [p for p in parts if os.path.basename(p) == partition]
        for part in parts:
            yield from self._partition_files(part)

    def _partition_files(self, part: str) -> Iterator[tuple[str, os.stat_result]]:
        try:
            subs = os.scandir(part)
        except (FileNotFoundError, NotADirectoryError):
            return
        with subs:
            for sub in subs:
                if not sub.is_dir(follow_symlinks=False) or len(sub.name) != 2:
                    continue
                try:
                    it = os.scandir(sub.path)
                except FileNotFoundError:
                    continue
                with it:
                    for de in it:
                        if de.name.endswith(SUFFIX) and not de.name.startswith("."):
                            try:
                                yield de.path, de.stat(follow_symlinks=False)
                            except FileNotFoundError:
                                continue

    # -- reads ------------------------------------------------------------------
    def _quarantine(self, path: str, st: os.stat_result | None, why: str) -> None:
        self.counters.add(corrupt=1)
        log.warning("store %s: corrupt entry %s (%s); moved to quarantine", self.root, path, why)
        try:
            cur = os.stat(path)
            if st is not None and (cur.st_ino, cur.st_dev) != (st.st_ino, st.st_dev):
                return  # replaced by a writer meanwhile: leave the new file alone
            qfd = open_dir(self.quarantine, None, True)  # never through a symlink planted at quarantine/
            try:
                os.replace(path, f"{os.path.basename(path)}.{int(time.time())}.{secrets.token_hex(3)}.bad",
                           dst_dir_fd=qfd)
            finally:
                os.close(qfd)
        except FileNotFoundError:
            pass
        except OSError as e:  # pragma: no cover - read-only store etc.
            log.warning("store %s: cannot quarantine %s: %s", self.root, path, e)

    def _open_entry(self, key: StoreKey) -> BinaryIO:
        """The entry file of ``key``, opened through :meth:`_shard_fd` (``OSError`` when absent or foreign)."""
        dfd = self._shard_fd(key)
        try:
            return open_regular(key.digest + SUFFIX, dfd)
        finally:
            os.close(dfd)

    def _read_file(self, path: str, key: StoreKey | None = None) -> tuple[bytes, bytes, int, os.stat_result] | None:
        """``(prefix, data, file_size, stat)`` read from one open file (no whole-file copy); ``key``: the file
        is that key's, opened without following a symlink at any level (else ``path``, found by a scan)."""
        try:
            with (self._open_entry(key) if key is not None else open_regular(path)) as f:
                st = os.fstat(f.fileno())
                fixed = f.read(FIXED_SIZE)
                try:
                    hl, dl, _ = parse_fixed(fixed, path)
                except KvcFormatError:
                    return fixed, b"", st.st_size, st  # decode reports the damage
                if FIXED_SIZE + hl + dl != st.st_size:
                    return fixed, b"", st.st_size, st
                prefix = fixed + f.read(hl)
                data = f.read(dl)
                return prefix, data, st.st_size, st
        except (FileNotFoundError, IsADirectoryError):
            return None
        except OSError as e:
            self.counters.add(errors=1)
            raise KvcStoreError(f"{path}: read failed: {why(e)}") from None

    def get_entry(self, key: StoreKey) -> Entry | None:
        path = self.path_for(key)
        try:
            r = self._read_file(path, key)
        except KvcStoreError as e:
            log.warning("store %s: %s", self.root, e)
            self.counters.add(misses=1)
            return None
        if r is None:
            self.counters.add(misses=1)
            return None
        prefix, data, size, st = r
        try:
            e = decode_envelope_parts(prefix, data, key, what=path, total=size)
        except KeyMismatch as err:  # intact, but not the entry asked for: never touch it
            log.warning("store %s: %s; treated as a miss", self.root, err)
            self.counters.add(misses=1)
            return None
        except KvcFormatError as err:
            self._quarantine(path, st, str(err))
            self.counters.add(misses=1)
            return None
        try:
            os.utime(path, None)  # last-used time for LRU eviction
        except OSError:
            pass
        self.counters.add(hits=1)
        return e

    def contains(self, key: StoreKey) -> bool:
        """Whether ``key``'s file is there as an entry of ``key``: a regular file whose envelope head (fixed
        part, header) is sound, names ``key`` and announces the file's size.

        Why not just "a file is there" (what this answered until the adversarial sweep): a truncated entry or
        one with a damaged head was reported present while every get missed, so ``longest_prefix`` chose it
        over an intact shorter prefix and ``PUT If-None-Match: *`` refused to replace it; such a file is now
        quarantined here as a get would. Why not the payload's checksum too: that reads the whole entry, and
        a ``/v1/contains`` of 4,096 keys would read 4,096 entries; damage inside a payload is found by the
        first get, which quarantines it, and contains says False from then on."""
        path = self.path_for(key)
        try:
            with self._open_entry(key) as f:
                st = os.fstat(f.fileno())
                try:
                    k = check_head(f, st.st_size, path)
                except KvcFormatError as err:
                    self._quarantine(path, st, str(err))
                    return False
        except (FileNotFoundError, IsADirectoryError):
            return False
        except OSError as e:
            self.counters.add(errors=1)
            log.warning("store %s: %s: read failed: %s", self.root, path, why(e))
            return False
        return k == key  # else intact, another key's: a miss, never moved (as get_entry)

    def range_entry(self, key: StoreKey) -> tuple[FileRangeReader, dict[str, Any]] | None:
        """``(reader over the payload, header meta)`` of ``key`` without reading the payload.

        No whole-entry checksum check: the Store verifies the seal in the meta
        and every block it reads.  ``None`` when absent or holding another key.
        """
        path = self.path_for(key)
        try:
            dfd = self._shard_fd(key)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise KvcStoreError(f"{path}: read failed: {why(e)}") from None
        try:
            with open_regular(key.digest + SUFFIX, dfd) as f:
                fixed = f.read(FIXED_SIZE)
                hl, dl, _ = parse_fixed(fixed, path)
                hb = f.read(hl)
                if len(hb) != hl:
                    raise KvcFormatError(f"{path}: truncated header")
                h = parse_header(hb, path)
            if h["key"] != key.to_str():
                return None
            # opened again, in the same directory: still a regular file, never a symlink or FIFO swapped in
            return (FileRangeReader(path, base=FIXED_SIZE + hl, length=dl, follow_symlinks=False, dir_fd=dfd),
                    h.get("meta", {}))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise KvcStoreError(f"{path}: read failed: {why(e)}") from None
        finally:
            os.close(dfd)

    # -- writes -----------------------------------------------------------------
    def put(self, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None,
            created: float | None = None) -> None:
        self.put_for(None, key, data, meta, created)

    def put_for(self, owner: str | None, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None,
                created: float | None = None) -> None:
        """``put``, bounded by ``owner``'s quota over all its partitions too (:mod:`~kvcodec.store.tiers.quota`)."""
        quota, who = (self.quota, owner) if owner is not None else (None, "")
        data = as_bytes(data)
        meta = check_meta(meta, MAX_TIER_META)
        prefix, payload = encode_envelope_parts(key, data, meta, created)
        size = len(prefix) + len(payload)
        if self.max_bytes is not None and size > self.max_bytes:
            self.counters.add(put_errors=1)
            raise KvcQuotaError(f"{self.root}: entry of {size:,} bytes is larger than the tier's cap of "
                                f"{self.max_bytes:,} bytes; not stored (raise max_bytes)")
        if quota is not None:
            quota.before_put(who, key.namespace, size)
        path, name = self.path_for(key), key.digest + SUFFIX
        tmp = f".{key.digest}.{os.getpid()}.{secrets.token_hex(6)}{TMP_SUFFIX}"
        try:
            dfd = self._shard_fd(key, create=True)
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644, dir_fd=dfd)
                try:
                    with os.fdopen(fd, "wb", buffering=0) as f:
                        for part in (prefix, payload):
                            mv = memoryview(part)
                            while mv:
                                n = f.write(mv)
                                mv = mv[n:]
                        if self.fsync:
                            os.fsync(f.fileno())
                    os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                except BaseException:
                    try:
                        os.unlink(tmp, dir_fd=dfd)
                    except OSError:
                        pass
                    raise
                if self.fsync:
                    os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            self.counters.add(put_errors=1)
            raise KvcStoreError(f"{self.root}: cannot write entry {key.digest[:16]}: {why(e)}") from None
        self.counters.add(puts=1)
        if self.max_bytes is not None:
            ns = key.namespace
            with self._lock:
                known = ns in self._approx
                self._approx[ns] = self._approx.get(ns, 0) + size
                over = not known or self._approx[ns] > self.max_bytes
            if over:
                self.evict(ns, keep=path)
        if quota is not None and quota.account(who, size):
            quota.evict(who, keep=path)

    def evict(self, partition: str, keep: str | None = None) -> int:
        """Delete partition ``partition``'s least-recently-used entries until under ``low_water * max_bytes``.

        ``keep``: a path never evicted (the entry just written).  Other
        partitions are never touched.
        """
        if self.max_bytes is None:
            return 0
        with self._lock:  # the scan holds its partition's lock, never the tier's (one tenant's 100,000-file
            lock = self._part_locks.setdefault(partition, threading.Lock())  # scan stalled every other's put)
        with lock:
            files = list(self._entry_files(partition))
            total = sum(st.st_size for _, st in files)
            target = int(self.max_bytes * self.low_water)
            n = 0
            if total > self.max_bytes:
                total, _, n = evict_oldest(files, total, target, keep)
            with self._lock:
                self._approx[partition] = total
        if n:
            self.counters.add(evictions=n)
        return n

    def delete(self, key: StoreKey) -> bool:
        try:
            dfd = self._shard_fd(key)
            try:
                os.unlink(key.digest + SUFFIX, dir_fd=dfd)
            finally:
                os.close(dfd)
            return True
        except (FileNotFoundError, IsADirectoryError):  # a directory planted at the name is no entry: a miss
            return False
        except OSError as e:
            raise KvcStoreError(f"{self.root}: cannot delete {key.digest[:16]}: {why(e)}") from None

    # -- listing / maintenance ------------------------------------------------------------
    def _read_info(self, path: str, st: os.stat_result, with_meta: bool) -> EntryInfo | None:
        try:
            with open_regular(path) as f:
                hl, dl, _ = parse_fixed(f.read(FIXED_SIZE), path)
                if FIXED_SIZE + hl + dl != st.st_size:
                    return None
                h = parse_header(f.read(hl), path)
            k = StoreKey.from_str(h["key"])
        except (OSError, KvcFormatError, KvcInputError):
            return None
        if path != self.path_for(k):
            return None
        return EntryInfo(k, dl, self.name, h.get("meta") if with_meta else None, st.st_mtime)

    def ls(self, with_meta: bool = False) -> Iterator[EntryInfo]:
        return self.ls_judged(with_meta, lambda info: None)

    def ls_judged(self, with_meta: bool, mine: Callable[[EntryInfo], bool | None]) -> Iterator[EntryInfo]:
        for part in self._partitions():
            for path, st in self._partition_files(part):
                info = self._read_info(path, st, with_meta)
                if info is None:
                    continue
                if mine(info) is False:  # another tenant's partition: none of its other entries is read
                    break
                yield info

    def usage(self) -> tuple[int, int]:
        n = b = 0
        for _, st in self._entry_files():
            n += 1
            b += st.st_size
        return n, b

    def gc(self, grace_s: float = 3600.0, verify: bool = True) -> dict[str, int]:
        """Tier hygiene: temp files older than ``grace_s``, old quarantine, (``verify``) damaged files.

        Returns counts: ``tmp_removed``, ``corrupt_removed`` (moved to
        quarantine), ``quarantine_purged`` (quarantined files older than the
        grace period, deleted), ``checked``.  A temp file younger than the
        grace period may belong to a live writer and is kept.  Only files no
        one can read are touched (bad checksum, size or header, or a file at
        a name its header does not give); intact entries of any partition are
        never moved, and ``gc`` evicts nothing (puts enforce each partition's cap).
        """
        now = time.time()
        out = {"tmp_removed": 0, "corrupt_removed": 0, "checked": 0}
        out["tmp_removed"] = remove_stale_tmp(self.root, self.objects, _marker_tmp, grace_s, now)
        try:
            out["quarantine_purged"] = purge_older(self.quarantine, grace_s, now)
        except OSError as e:
            log.warning("store %s: gc: quarantine not purged: %s", self.root, why(e))
            out["quarantine_purged"] = 0
        if verify:
            for path, _st in list(self._entry_files()):
                try:
                    r = self._read_file(path)
                except KvcStoreError as e:  # e.g. a symlink planted at an entry name: report, go on
                    log.warning("store %s: gc: %s", self.root, e)
                    out["unreadable"] = out.get("unreadable", 0) + 1
                    continue
                if r is None:
                    continue
                prefix, data, size, st2 = r
                out["checked"] += 1
                try:
                    e = decode_envelope_parts(prefix, data, None, what=path, total=size)
                    if self.path_for(e.key) != path:
                        raise KvcFormatError(f"{path}: holds key {e.key.to_str()}, which lives elsewhere")
                except KvcFormatError as err:
                    self._quarantine(path, st2, str(err))
                    out["corrupt_removed"] += 1
        return out

    def share_tenants(self, tenants: int) -> int | None:
        """Without ``tenant_bytes`` or ``max_bytes``, each of ``tenants`` may hold its share of the disk space
        free now (:meth:`TenantQuota.share`); the share set, or None."""
        try:
            free = shutil.disk_usage(self.root).free
        except OSError as e:
            raise KvcStoreError(f"{self.root}: cannot read the disk's free space: {why(e)}") from None
        return self.quota.share(tenants, free)

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        d["root"] = self.root
        d["max_bytes"] = self.max_bytes
        d.update(self.quota.stats())
        try:
            d["quarantined"] = len(os.listdir(self.quarantine))
        except OSError:
            d["quarantined"] = None
        return d
