"""Local directory tier: crash-safe, checksummed, size-capped, multi-process safe.

Layout::

    <root>/kvstore.json                    marker {"format": "kvcodec-store", "layout": 1}
    <root>/objects/<d[:2]>/<d>.kve         one envelope per entry (d = key digest, 64 hex)
    <root>/objects/<d[:2]>/.<d>.<pid>.<rand>.tmp   in-flight writes (same dir => same filesystem)
    <root>/quarantine/<d>.<time>.<rand>.bad        corrupt entries moved aside on read

Writes: temp file in the target directory, write, ``fsync``, ``os.replace``
onto the final name, ``fsync`` the directory.  Readers therefore see either
the old complete file, the new complete file, or nothing -- never a partial
file -- and concurrent writers of one key never interleave bytes (last rename
wins).  A writer killed at any moment leaves at most a temp file, which
``gc()`` removes once older than a grace period.

Reads open the file once and verify the envelope (size, crc32c, key) on the
bytes of that open file.  A damaged entry is a miss: it is moved to
``quarantine/`` (only if the name still points at the damaged inode) and a
warning is logged.

LRU-ish eviction: a read bumps the file's mtime, so mtime is "last used".
When the tier's byte total (envelopes) exceeds ``max_bytes``, the oldest
files by mtime are deleted until the total is below ``low_water * max_bytes``.
The total is measured by a scan at open and after every eviction, and
tracked incrementally in between (other processes' writes are caught at the
next scan); deleting a file another process is reading is safe on POSIX.
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import threading
import time
from typing import Any, Iterator, Mapping

from ..errors import KvcFormatError, KvcInputError, KvcStoreError
from .keys import StoreKey
from .ranged import FileRangeReader
from .tiers import (
    FIXED_SIZE,
    Entry,
    EntryInfo,
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
MARKER_CONTENT = {"format": "kvcodec-store", "layout": 1}
SUFFIX = ".kve"
TMP_SUFFIX = ".tmp"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without dir fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


class DirectoryTier(Tier):
    kind = "directory"

    def __init__(self, root: str | os.PathLike[str], *, max_bytes: int | None = None,
                 fsync: bool = True, low_water: float = 0.9, create: bool = True,
                 name: str | None = None) -> None:
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
        self._lock = threading.Lock()
        self._init_root(create)
        self._approx_bytes: int | None = None
        if self.max_bytes is not None:
            self._approx_bytes = self.usage()[1]

    # -- setup ------------------------------------------------------------------
    def _init_root(self, create: bool) -> None:
        marker = os.path.join(self.root, MARKER)
        if os.path.isfile(marker):
            try:
                with open(marker, encoding="utf-8") as f:
                    m = json.load(f)
            except (OSError, ValueError) as e:
                raise KvcStoreError(f"{self.root}: unreadable store marker {MARKER}: {e}") from None
            if m.get("format") != MARKER_CONTENT["format"]:
                raise KvcStoreError(f"{self.root}: {MARKER} is not a kvcodec store marker")
            if m.get("layout") != MARKER_CONTENT["layout"]:
                raise KvcStoreError(f"{self.root}: unsupported store layout {m.get('layout')!r}")
        else:
            if not create:
                raise KvcStoreError(f"{self.root}: not a kvcodec store (no {MARKER})")
            if os.path.exists(self.root):
                if not os.path.isdir(self.root):
                    raise KvcStoreError(f"{self.root}: exists and is not a directory")
                if any(n != MARKER and not n.startswith(".") for n in os.listdir(self.root)) and \
                        not os.path.isdir(self.objects):
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

    def _atomic_write_small(self, path: str, data: bytes) -> None:
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if self.fsync:
            _fsync_dir(os.path.dirname(path))

    # -- paths ------------------------------------------------------------------
    def path_for(self, key: StoreKey) -> str:
        d = key.digest
        return os.path.join(self.objects, d[:2], d + SUFFIX)

    def _entry_files(self) -> Iterator[tuple[str, os.stat_result]]:
        try:
            subs = os.scandir(self.objects)
        except FileNotFoundError:
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
            dest = os.path.join(self.quarantine,
                                f"{os.path.basename(path)}.{int(time.time())}.{secrets.token_hex(3)}.bad")
            os.replace(path, dest)
        except FileNotFoundError:
            pass
        except OSError as e:  # pragma: no cover - read-only store etc.
            log.warning("store %s: cannot quarantine %s: %s", self.root, path, e)

    def _read_file(self, path: str) -> tuple[bytes, bytes, int, os.stat_result] | None:
        """``(prefix, data, file_size, stat)`` read from one open file (no whole-file copy)."""
        try:
            with open(path, "rb") as f:
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
            raise KvcStoreError(f"{path}: read failed: {e.strerror or e}") from None

    def get_entry(self, key: StoreKey) -> Entry | None:
        path = self.path_for(key)
        try:
            r = self._read_file(path)
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
        return os.path.isfile(self.path_for(key))

    def reader(self, key: StoreKey) -> FileRangeReader | None:
        """A range reader over the payload of ``key`` (no whole-entry checksum check)."""
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                fixed = f.read(FIXED_SIZE)
                hl, dl, _ = parse_fixed(fixed, path)
                h = parse_header(f.read(hl), path)
        except FileNotFoundError:
            return None
        if h["key"] != key.to_str():
            raise KvcFormatError(f"{path}: holds key {h['key']}, expected {key.to_str()}")
        return FileRangeReader(path, base=FIXED_SIZE + hl, length=dl)

    # -- writes -----------------------------------------------------------------
    def put(self, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None,
            created: float | None = None) -> None:
        data = as_bytes(data)
        meta = check_meta(meta)
        prefix, payload = encode_envelope_parts(key, data, meta, created)
        path = self.path_for(key)
        d = os.path.dirname(path)
        tmp = os.path.join(d, f".{key.digest}.{os.getpid()}.{secrets.token_hex(6)}{TMP_SUFFIX}")
        try:
            try:
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
            except FileNotFoundError:
                os.makedirs(d, exist_ok=True)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
            try:
                with os.fdopen(fd, "wb", buffering=0) as f:
                    for part in (prefix, payload):
                        mv = memoryview(part)
                        while mv:
                            n = f.write(mv)
                            mv = mv[n:]
                    if self.fsync:
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
            if self.fsync:
                _fsync_dir(d)
        except OSError as e:
            self.counters.add(put_errors=1)
            msg = e.strerror or str(e)
            if e.errno == errno.ENOSPC:
                msg = "no space left on device"
            raise KvcStoreError(f"{self.root}: cannot write entry {key.digest[:16]}: {msg}") from None
        self.counters.add(puts=1)
        if self.max_bytes is not None:
            with self._lock:
                self._approx_bytes = (self._approx_bytes or 0) + len(prefix) + len(payload)
                over = self._approx_bytes > self.max_bytes
            if over:
                self.evict()

    def evict(self) -> int:
        """Delete least-recently-used entries until under ``low_water * max_bytes``."""
        if self.max_bytes is None:
            return 0
        with self._lock:
            files = list(self._entry_files())
            total = sum(st.st_size for _, st in files)
            target = int(self.max_bytes * self.low_water)
            n = 0
            if total > self.max_bytes:
                files.sort(key=lambda t: t[1].st_mtime)
                for path, st in files:
                    if total <= target:
                        break
                    try:
                        os.unlink(path)
                        n += 1
                    except FileNotFoundError:
                        pass
                    total -= st.st_size
            self._approx_bytes = total
        if n:
            self.counters.add(evictions=n)
        return n

    def delete(self, key: StoreKey) -> bool:
        try:
            os.unlink(self.path_for(key))
            return True
        except FileNotFoundError:
            return False
        except OSError as e:
            raise KvcStoreError(f"{self.root}: cannot delete {key.digest[:16]}: {e.strerror or e}") from None

    # -- listing / maintenance ------------------------------------------------------------
    def _read_info(self, path: str, st: os.stat_result, with_meta: bool) -> EntryInfo | None:
        try:
            with open(path, "rb") as f:
                hl, dl, _ = parse_fixed(f.read(FIXED_SIZE), path)
                if FIXED_SIZE + hl + dl != st.st_size:
                    return None
                h = parse_header(f.read(hl), path)
            k = StoreKey.from_str(h["key"])
        except (OSError, KvcFormatError, KvcInputError):
            return None
        if k.digest + SUFFIX != os.path.basename(path):
            return None
        return EntryInfo(k, dl, self.name, h.get("meta") if with_meta else None, st.st_mtime)

    def ls(self, with_meta: bool = False) -> Iterator[EntryInfo]:
        for path, st in self._entry_files():
            info = self._read_info(path, st, with_meta)
            if info is not None:
                yield info

    def usage(self) -> tuple[int, int]:
        n = b = 0
        for _, st in self._entry_files():
            n += 1
            b += st.st_size
        return n, b

    def gc(self, grace_s: float = 3600.0, verify: bool = True) -> dict[str, int]:
        """Remove temp files older than ``grace_s`` and (``verify``) corrupt entries.

        Returns counts: ``tmp_removed``, ``corrupt_removed`` (moved to
        quarantine), ``quarantine_purged`` (quarantined files older than the
        grace period, deleted), ``checked``, ``evicted``.  A temp file younger than the grace period may belong
        to a live writer and is kept.
        """
        now = time.time()
        out = {"tmp_removed": 0, "corrupt_removed": 0, "checked": 0, "evicted": 0}
        for dirpath, _dirs, names in os.walk(self.root):
            for nm in names:
                if not nm.endswith(TMP_SUFFIX):
                    continue
                p = os.path.join(dirpath, nm)
                try:
                    if now - os.stat(p).st_mtime >= grace_s:
                        os.unlink(p)
                        out["tmp_removed"] += 1
                except FileNotFoundError:
                    pass
        try:
            qnames = os.listdir(self.quarantine)
        except FileNotFoundError:
            qnames = []
        out["quarantine_purged"] = 0
        for nm in qnames:
            p = os.path.join(self.quarantine, nm)
            try:
                if now - os.stat(p).st_mtime >= grace_s:
                    os.unlink(p)
                    out["quarantine_purged"] += 1
            except FileNotFoundError:
                pass
        if verify:
            for path, st in list(self._entry_files()):
                r = self._read_file(path)
                if r is None:
                    continue
                prefix, data, size, st2 = r
                out["checked"] += 1
                want = os.path.basename(path)[: -len(SUFFIX)]
                try:
                    e = decode_envelope_parts(prefix, data, None, what=path, total=size)
                    if e.key.digest != want:
                        raise KvcFormatError(f"{path}: holds digest {e.key.digest}, name says {want}")
                except KvcFormatError as err:
                    self._quarantine(path, st2, str(err))
                    out["corrupt_removed"] += 1
        out["evicted"] = self.evict()
        return out

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        d["root"] = self.root
        d["max_bytes"] = self.max_bytes
        try:
            d["quarantined"] = len(os.listdir(self.quarantine))
        except OSError:
            d["quarantined"] = None
        return d
