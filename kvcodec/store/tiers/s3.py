"""S3-compatible object-store tier (boto3): one object per entry holding the checksummed envelope.

URL: ``s3://bucket[/prefix]?endpoint_url=http://127.0.0.1:9000&region=us-east-1``.
Credentials come from boto3's usual chain (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, instance roles), never from the
URL.  Query options:

* ``endpoint_url``: the S3-protocol server, ``http(s)://host[:port]`` (omit for AWS itself);
* ``region`` (default ``us-east-1``); ``timeout`` (seconds, default 10);
* ``multipart`` (size, default ``8M``): envelopes at least this large are
  uploaded in parts of ``part_size`` (default ``8M``, S3's minimum is 5 MiB);
  ``multipart=0``: every envelope is (a last part may be of any size);
* ``conditional`` (default 1): writes carry ``If-None-Match: *``, so when many
  engines store the same prefix at once the first complete upload wins and
  the others are no-ops (keys are content addresses: equal keys, equal
  content).  A server that rejects conditional writes (HTTP 501) is
  remembered and written unconditionally;
* ``retry_interval`` (seconds, default 1): fail fast while the server is down;
* ``max_bytes`` (size, default ``1G``, kvc serve's ``--max-body``): the largest entry
  read or written.  A read checks the object's ``Content-Length`` (the GET's
  response metadata, before its body is read) and reads at most that much, so
  an oversized object is a counted miss whose body is never read; of an object
  over 1 MiB the first 64 KiB are read first, and the rest only if that head
  names the asked key and the object's length, and the reader's Store accepts its
  seal (``Tier._check_head``).

Guarantees: an object becomes visible whole or not at all (single PUT, or
multipart completion), so readers never see a partial entry; every read
checks the envelope's CRC32C and the key inside it; a damaged object is a
miss and is deleted; namespaces are part of the object name and of the
key digest; an unreachable server makes reads misses and writes reported
failures.  ``range_entry(key)`` reads the payload by ``Range`` GETs pinned to the
object's ETag (``If-Match``), so a replaced object is detected mid-read.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping
from urllib.parse import parse_qsl, urlsplit

from kvcodec.errors import KvcFormatError, KvcInputError, KvcStoreError
from kvcodec.lru import BoundedLRU
from kvcodec.store.keys import StoreKey
from kvcodec.store.outage import OutageGuard
from kvcodec.store.ranged import RangeReader
from kvcodec.store.tiers.probe import PROBE_READ, head_names_key
from kvcodec.store.tiers.base import (
    HeadCheck,
    DEFAULT_MAX_ENTRY,
    HEAD_FIRST,
    HEAD_READ,
    FIXED_SIZE,
    Entry,
    EntryInfo,
    Tier,
    log,
    parse_fixed,
    parse_header,
)

MIN_PART = 5 << 20
REFUSED_MEMO = 4096  # refused objects an S3 tier remembers by ETag (S3Tier._refused)


class S3Tier(Tier):
    kind = "s3"
    schemes = ("s3",)
    supports_ranges = True
    checks_heads = True
    remote = True
    guard: OutageGuard

    def __init__(self, url: str, *, name: str | None = None) -> None:
        try:
            import boto3
            import botocore.config
            import botocore.exceptions as bex
        except ImportError:  # pragma: no cover
            raise KvcStoreError("the s3 tier needs boto3: pip install 'kvcodec[store]'") from None
        from kvcodec.store.options import parse_flag, parse_number, parse_size, url_port

        p = urlsplit(url)
        if p.scheme.lower() != "s3" or not p.netloc:
            raise KvcInputError(f"not an s3://bucket[/prefix] URL: {url!r}")
        if "@" in p.netloc:
            raise KvcInputError("put S3 credentials in the environment (AWS_ACCESS_KEY_ID ...), not in the URL")
        self.bucket = p.netloc
        prefix = p.path.lstrip("/")
        self.prefix = prefix + "/" if prefix and not prefix.endswith("/") else prefix
        q = dict(parse_qsl(p.query))
        try:
            endpoint = q.pop("endpoint_url", None)
            region = q.pop("region", "us-east-1")
            timeout = parse_number(q.pop("timeout", "10"), "timeout", positive=True)
            self.multipart = parse_size(q.pop("multipart", "8M"))
            self.part_size = parse_size(q.pop("part_size", "8M"))
            self.conditional = parse_flag(q.pop("conditional", "1"))
            retry = parse_number(q.pop("retry_interval", "1"), "retry_interval")
            self.max_entry = parse_size(q.pop("max_bytes", DEFAULT_MAX_ENTRY))
        except ValueError as e:
            raise KvcInputError(f"bad s3 URL option: {e}") from None
        if q:
            raise KvcInputError(f"unknown s3 options {sorted(q)}")
        if endpoint is not None:  # boto3 took ftp://x or http://h:0 and then failed every call, a miss each
            try:
                ep = urlsplit(endpoint)
            except ValueError as e:
                raise KvcInputError(f"bad s3 endpoint_url {ascii(endpoint[:80])}: {e}") from None
            if ep.scheme.lower() not in ("http", "https") or not ep.hostname or "@" in ep.netloc:
                raise KvcInputError(f"s3 endpoint_url must be http(s)://host[:port], got {ascii(endpoint[:80])}")
            url_port(ep, "s3 endpoint")
        if self.max_entry <= 0:
            raise KvcInputError("s3 max_bytes must be positive")
        if self.part_size < MIN_PART:
            raise KvcInputError(f"s3 part_size must be at least 5M (S3's minimum part), got {self.part_size}")
        super().__init__(name or "s3", f"s3://{self.bucket}/{self.prefix}" + (f"?endpoint_url={endpoint}" if endpoint else ""))
        cfg = botocore.config.Config(connect_timeout=timeout, read_timeout=timeout, retries={"max_attempts": 1},
                                     region_name=region, s3={"addressing_style": "path"})
        self.s3 = boto3.session.Session().client("s3", endpoint_url=endpoint, config=cfg)
        self._bex = bex
        self._transport = (bex.EndpointConnectionError, bex.ConnectionClosedError, bex.ConnectTimeoutError,
                           bex.ReadTimeoutError, bex.ProxyConnectionError, OSError)
        self.guard = OutageGuard(f"s3 {self.url}", retry)
        # name -> (ETag, by_seal) of an object this tier refused from its head (too large, another key's envelope,
        # malformed; by_seal: a forgery under the asked key that the reader's seal check refused): the next read of
        # that name asks for it If-None-Match, so an unchanged planted value costs the server a 304, not another
        # ranged read (moto reads a whole object to serve a range of it), and any new version is read and judged
        # afresh. A seal's verdict is used only by readers that check seals: a name is an HMAC under the reader's
        # key, so every such reader of one name holds that key and reaches the same verdict. Bounded; forgetting
        # one only costs a read.
        self._refused: BoundedLRU[tuple[str, bool]] = BoundedLRU(REFUSED_MEMO, max_bytes=REFUSED_MEMO * 128)

    # -- plumbing ---------------------------------------------------------------------
    def name_of(self, key: StoreKey) -> str:
        return self.prefix + key.to_str()

    def _call(self, op: str, fn: Any, **kw: Any) -> Any:
        """``fn(**kw)``; ``None`` for a missing object; transport failures mark the tier down."""
        self.guard.check(op)
        try:
            out = fn(**kw)
        except self._bex.ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            self.guard.ok()
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                return None
            err = KvcStoreError(f"s3 {self.url}: {op} failed: {code or status}: "
                                f"{e.response.get('Error', {}).get('Message', '')}".rstrip(": "))
            err.s3_code, err.s3_status = code, status  # callers classify on these, never on the message text
            raise err from None
        except self._transport as e:
            raise self.guard.failed(f"{type(e).__name__}: {e}") from None
        except self._bex.BotoCoreError as e:
            raise KvcStoreError(f"s3 {self.url}: {op} failed: {type(e).__name__}: {e}") from None
        self.guard.ok()
        return out

    def _read_body(self, resp: dict[str, Any], op: str, limit: int | None = None, exact: bool = False) -> bytes:
        """The response's body (at most ``limit`` bytes, more is an error); ``exact``: its next ``limit`` bytes."""
        try:
            if limit is None:
                return resp["Body"].read()
            if exact:
                return resp["Body"].read(limit)
            body = resp["Body"].read(limit + 1)
            if len(body) > limit:
                raise KvcStoreError(f"s3 {self.url}: {op}: body longer than its {limit:,} bytes")
            return body
        except self._transport as e:
            raise self.guard.failed(f"{type(e).__name__}: {e}") from None
        except self._bex.BotoCoreError as e:
            raise KvcStoreError(f"s3 {self.url}: {op} body failed: {e}") from None

    # -- Tier interface -----------------------------------------------------------------
    def get_entry(self, key: StoreKey, head_ok: HeadCheck | None = None) -> Entry | None:
        """The entry, read by one GET of its first :data:`HEAD_FIRST` bytes (``Range``) and, for a larger object
        whose head passes :meth:`Tier._check_head`, one more for the rest pinned to the first's ETag.

        Why ranged: a streamed GET of a planted 32 MiB value makes the server send it all even when the reader
        stops after the head (the connection is dropped, not drained); ranged, the server sends at most
        ``HEAD_FIRST``. The object's size comes from the first response's ``Content-Range``, before any body."""
        name = self.name_of(key)
        what = f"s3 {self.bucket}/{name}"
        memo = self._refused.get(name)  # the ETag of the version of this object this tier last refused, and how
        known = memo[0] if memo is not None and (not memo[1] or head_ok is not None) else None
        cond = {"IfNoneMatch": known} if known else {}
        try:
            resp = self._call("get", self.s3.get_object, Bucket=self.bucket, Key=name, Range=f"bytes=0-{HEAD_FIRST - 1}",
                              **cond)
            if resp is None:
                buf = None
            else:
                size, avail = _sizes(resp)
                etag = resp.get("ETag")

                def refused(by_seal: bool = False) -> None:
                    if isinstance(etag, str) and etag:
                        self._refused.put(name, (etag, by_seal))

                if size < 0 or size > self.max_entry:
                    resp["Body"].close()  # the size is known from the response head: the body is never read
                    self._too_large(size, self.max_entry, what)
                    refused()
                    return None
                cur = _Cursor(self, name, resp, avail)
                if size > HEAD_FIRST:  # large: its head is checked before the payload is read
                    head = self._check_head(cur.read(HEAD_READ), size, key, what, cur.read, head_ok, refused)
                    if head is None:
                        resp["Body"].close()
                        return None
                    buf = head + cur.read(size - len(head))
                else:
                    buf = cur.read(size)
                if len(buf) != size:
                    raise KvcStoreError(f"{what}: read {len(buf):,} of its {size:,} bytes")
        except KvcStoreError as e:
            if known and getattr(e, "s3_status", None) == 304:  # the version refused before: a miss, nothing read
                self.counters.add(misses=1)
                return None
            if getattr(e, "s3_code", None) == "InvalidRange" or getattr(e, "s3_status", None) == 416:
                buf = b""  # an empty object: no envelope at all, dropped as corrupt below
            else:
                if self.guard.up:
                    log.warning("store: %s", e)
                self.counters.add(errors=1, misses=1)
                return None
        return self._entry_or_drop(buf, key, what,
                                   lambda: self._call("delete", self.s3.delete_object, Bucket=self.bucket, Key=name))

    def put(self, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None,
            created: float | None = None) -> None:
        env = self._capped_envelope(key, data, meta, created, self.max_entry, f"s3 {self.url}")
        try:
            if len(env) >= self.multipart:
                self._put_multipart(self.name_of(key), env)
            else:
                self._put_single(self.name_of(key), env)
        except KvcStoreError:
            self.counters.add(put_errors=1)
            raise
        self.counters.add(puts=1)

    def _conditional(self, op: str, fn: Any, **kw: Any) -> None:
        """Run a write with If-None-Match: * when enabled; 412 (someone else stored it first) is success."""
        if self.conditional:
            try:
                self._call(op, fn, IfNoneMatch="*", **kw)
                return
            except KvcStoreError as e:
                # The server's answer, not the message: a transport failure's message holds the URL, whose
                # HMAC-derived object name may well contain "412" (an outage once read as success that way).
                code, status = getattr(e, "s3_code", None), getattr(e, "s3_status", None)
                if code in ("PreconditionFailed", "ConditionalRequestConflict") or status == 412:
                    return
                if code == "NotImplemented" or status == 501:
                    log.warning("store: %s does not support conditional writes; writing unconditionally", self.url)
                    self.conditional = False
                else:
                    raise
        self._call(op, fn, **kw)

    def _put_single(self, name: str, env: bytes) -> None:
        self._conditional("put", self.s3.put_object, Bucket=self.bucket, Key=name, Body=env,
                          ContentType="application/octet-stream")

    def _put_multipart(self, name: str, env: bytes) -> None:
        up = self._call("put", self.s3.create_multipart_upload, Bucket=self.bucket, Key=name,
                        ContentType="application/octet-stream")
        uid = up["UploadId"]
        try:
            parts = []
            for i, off in enumerate(range(0, len(env), self.part_size), start=1):
                r = self._call("put part", self.s3.upload_part, Bucket=self.bucket, Key=name, UploadId=uid,
                               PartNumber=i, Body=env[off:off + self.part_size])
                parts.append({"PartNumber": i, "ETag": r["ETag"]})
            self._conditional("put", self.s3.complete_multipart_upload, Bucket=self.bucket, Key=name,
                              UploadId=uid, MultipartUpload={"Parts": parts})
        except BaseException:
            try:  # nothing became visible; free the parts
                self._call("abort", self.s3.abort_multipart_upload, Bucket=self.bucket, Key=name, UploadId=uid)
            except KvcStoreError:
                pass
            raise

    def contains(self, key: StoreKey) -> bool:
        """Whether get would find ``key``'s entry, as far as its head tells: one ranged GET of its first
        :data:`PROBE_READ` bytes (:mod:`~kvcodec.store.tiers.probe`). Was a HEAD: a truncated or damaged object
        was present until the first get."""
        name = self.name_of(key)
        try:
            resp = self._call("contains", self.s3.get_object, Bucket=self.bucket, Key=name,
                              Range=f"bytes=0-{PROBE_READ - 1}")
            if resp is None:
                return False
            try:
                size, avail = _sizes(resp)
                cur = _Cursor(self, name, resp, avail)
                head = cur.read(min(avail, size)) if 0 < size <= self.max_entry else b""
                return head_names_key(head, size, key, self.max_entry, f"s3 {self.bucket}/{name}",
                                      lambda at, n: cur.read(n))  # forward only: at is where cur stands
            finally:
                resp["Body"].close()
        except KvcStoreError as e:
            if not (getattr(e, "s3_code", None) == "InvalidRange" or getattr(e, "s3_status", None) == 416):
                self.counters.add(errors=1)  # (416: an empty object, no envelope: a miss)
            return False

    def delete(self, key: StoreKey) -> bool:
        name = self.name_of(key)
        if self._call("head", self.s3.head_object, Bucket=self.bucket, Key=name) is None:
            return False
        self._call("delete", self.s3.delete_object, Bucket=self.bucket, Key=name)
        return True

    def _names(self) -> list[tuple[str, int]]:
        out: list[tuple[str, int]] = []
        token = None
        while True:
            kw: dict[str, Any] = {"Bucket": self.bucket, "Prefix": self.prefix + "kvc1:"}
            if token:
                kw["ContinuationToken"] = token
            resp = self._call("list", self.s3.list_objects_v2, **kw)
            if resp is None:
                raise KvcStoreError(f"s3 {self.url}: no such bucket")
            out += [(o["Key"], int(o["Size"])) for o in resp.get("Contents", [])]
            if not resp.get("IsTruncated"):
                return out
            token = resp.get("NextContinuationToken")

    def ls(self, with_meta: bool = False) -> Iterator[EntryInfo]:
        return self.ls_judged(with_meta, lambda info: None)

    def ls_judged(self, with_meta: bool, mine: Callable[[EntryInfo], bool | None]) -> Iterator[EntryInfo]:
        """Objects are read one by one; none more of a partition (a key's namespace, in its name) once ``mine``
        says it is another tenant's (Tier.ls_judged: a tenant's listing read every other tenant's heads)."""
        plen = len(self.prefix)
        others: set[str] = set()
        for name, size in self._names():
            try:
                k = StoreKey.from_str(name[plen:])
            except KvcInputError:
                continue
            if k.namespace in others:
                continue
            resp = self._call("ls", self.s3.get_object, Bucket=self.bucket, Key=name,
                              Range=f"bytes=0-{FIXED_SIZE + 4095}")
            if resp is None:
                continue  # deleted meanwhile
            head = self._read_body(resp, "ls")
            try:
                hl, dl, _ = parse_fixed(head)
                meta = None
                if with_meta:
                    hb = head[FIXED_SIZE:FIXED_SIZE + hl]
                    if len(hb) < hl:
                        r2 = self._call("ls", self.s3.get_object, Bucket=self.bucket, Key=name,
                                        Range=f"bytes={FIXED_SIZE}-{FIXED_SIZE + hl - 1}")
                        hb = self._read_body(r2, "ls") if r2 is not None else b""
                    meta = parse_header(hb).get("meta")
            except KvcFormatError:
                continue
            if FIXED_SIZE + hl + dl != size:
                continue
            info = EntryInfo(k, dl, self.name, meta, None)
            if mine(info) is False:
                others.add(k.namespace)
                continue
            yield info

    def usage(self) -> tuple[int, int]:
        names = self._names()
        return len(names), sum(s for _, s in names)

    def range_entry(self, key: StoreKey) -> "tuple[S3RangeReader, dict[str, Any]] | None":
        """``(range reader over the payload, meta)``; ``None`` if absent or holding another key."""
        name = self.name_of(key)
        head = self._call("head", self.s3.head_object, Bucket=self.bucket, Key=name)
        if head is None:
            return None
        rr = S3RangeReader(self, name, int(head["ContentLength"]), head["ETag"])
        hl, dl, _ = parse_fixed(rr.read(0, FIXED_SIZE), rr.name)
        h = parse_header(rr.read(FIXED_SIZE, hl), rr.name)
        if h["key"] != key.to_str():
            return None
        if FIXED_SIZE + hl + dl != rr.size:
            raise KvcFormatError(f"{rr.name}: object is {rr.size} bytes, envelope says {FIXED_SIZE + hl + dl}")
        return (S3RangeReader(self, name, int(head["ContentLength"]), head["ETag"], base=FIXED_SIZE + hl, length=dl),
                h.get("meta", {}))

    def close(self) -> None:
        try:
            self.s3.close()
        except Exception:  # pragma: no cover
            pass


def _sizes(resp: dict[str, Any]) -> tuple[int, int]:
    """(the object's size, the bytes this response carries) of a ranged GET: ``Content-Range: bytes a-b/size``,
    or a server that ignored the range (200, the whole object)."""
    n = int(resp.get("ContentLength", -1))
    cr = resp.get("ContentRange")
    if not cr:
        return n, n
    try:
        return int(str(cr).rsplit("/", 1)[1]), n
    except (IndexError, ValueError):
        return -1, n


class _Cursor:
    """Reads an object forward: the first ranged GET's body, then (past it) a ranged GET pinned to its ETag,
    so the rest can never come from a replaced object."""

    def __init__(self, tier: "S3Tier", name: str, resp: dict[str, Any], avail: int) -> None:
        self.tier, self.name, self.resp, self.avail = tier, name, resp, avail
        self.etag = resp.get("ETag")
        self.pos = 0

    def read(self, n: int) -> bytes:
        out = b""
        take = min(n, self.avail - self.pos)
        if take > 0:
            out = self.tier._read_body(self.resp, "get", take, exact=True)
            self.pos += len(out)
            if len(out) < take:
                raise KvcStoreError(f"s3 {self.tier.bucket}/{self.name}: body ended after {self.pos:,} bytes")
        rest = n - len(out)
        if rest > 0:
            if not self.etag:
                raise KvcStoreError(f"s3 {self.tier.bucket}/{self.name}: no ETag to pin the rest of the object to")
            more = S3RangeReader(self.tier, self.name, self.pos + rest, str(self.etag))._read(self.pos, rest)
            self.pos += len(more)
            out += more
        return out


class S3RangeReader(RangeReader):
    """Ranged GETs of one object version (``If-Match: <etag>``): a replaced object raises, never mixes."""

    def __init__(self, tier: S3Tier, name: str, total: int, etag: str, base: int = 0, length: int | None = None) -> None:
        self.tier, self.key_name, self.etag = tier, name, etag
        self.name = f"s3://{tier.bucket}/{name}"
        self.base = base
        self.size = total - base if length is None else length
        self.requests = 0

    def _read(self, offset: int, length: int) -> bytes:
        first = self.base + offset
        self.requests += 1
        try:
            resp = self.tier._call("range get", self.tier.s3.get_object, Bucket=self.tier.bucket, Key=self.key_name,
                                   Range=f"bytes={first}-{first + length - 1}", IfMatch=self.etag)
        except KvcStoreError as e:
            if getattr(e, "s3_code", None) == "PreconditionFailed" or getattr(e, "s3_status", None) == 412:
                raise KvcStoreError(f"{self.name}: object changed during the read") from None
            raise
        if resp is None:
            raise KvcStoreError(f"{self.name}: object vanished during the read")
        return self.tier._read_body(resp, "range get")
