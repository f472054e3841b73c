"""Byte surgery on valid ``.kvc`` files (spec/kvc-v1.md): split a file into its parts, edit them, and lay it out
again with every CRC32C recomputed, so an edit reaches the parsers and decoders behind the checksums.

Why a module of its own: the soak fuzzer's mutations (:mod:`kvcodec.testing.mutations`) and the hostile-input
tests (tests/format, tests/conformance, tests/store, tests/integrations) edit files the same way, and a
checksum computed two ways would let the two drift apart.  It knows the container's byte layout only (the
preamble, header JSON, 64-byte alignment, the 48-byte index entries, the footer and a chunk record's side
arrays), never the codec.
"""

from __future__ import annotations

import json
import struct

PRE = struct.Struct("<8sHHIQQ")
IDX = struct.Struct("<IBBHIIIIQQII")
IDX_BITS = [32, 8, 8, 16, 32, 32, 32, 32, 64, 64, 32, 32]
HEAD = struct.Struct("<BBHIQ")
ZEROS = bytes(64)
SIDE = struct.Struct("<BBBB")


def crc(b: bytes | bytearray) -> int:
    """CRC32C, the container's checksum."""
    import google_crc32c

    return google_crc32c.value(bytes(b))


class Parts:
    """A valid `.kvc` split into editable pieces; :meth:`build` re-lays it out with every CRC recomputed."""

    def __init__(self, data: bytes) -> None:
        magic, self.major, self.minor, hlen, self.req, self.opt = PRE.unpack_from(data, 0)
        self.header = json.loads(data[32 : 32 + hlen])
        dstart = (36 + hlen + 63) // 64 * 64
        ioff, count = struct.unpack_from("<QQ", data, len(data) - 32)
        self.index = [list(IDX.unpack_from(data, ioff + 48 * j)) for j in range(count)]
        self.blobs = [bytearray(data[dstart + b["offset"] : dstart + b["offset"] + b["length"]]) for b in self.header["blobs"]]
        self.records = [bytearray(data[dstart + e[8] : dstart + e[8] + e[9]]) for e in self.index]
        self.header_bytes: bytes | None = None  # raw header text override
        self.touched: set[int] | None = set()  # chunks whose records changed (None: anything may be affected)
        self._crcs: dict[int, tuple[bytearray, int]] = {id(r): (r, crc(r)) for r in self.records}  # the seed's own
        self.own = True  # header is private to this object (else shared with the seed: must not be written)
        self._hbytes = json.dumps(self.header, sort_keys=True, separators=(",", ":")).encode()

    def copy(self) -> "Parts":
        """Copy-on-write: the header and index are copied, records / blobs shared until an operator replaces one."""
        c = object.__new__(Parts)
        c.__dict__.update(self.__dict__)
        c.own = False
        c.index = [list(e) for e in self.index]
        c.blobs = list(self.blobs)
        c.records = list(self.records)
        c.touched = set()
        return c

    def own_header(self) -> dict:
        """The header, made private to this copy (before an operator edits it)."""
        if not self.own:
            self.header = json.loads(json.dumps(self.header))
            self.own = True
        return self.header

    def record(self, j: int) -> bytearray:
        """Chunk record ``j``, made private to this copy (mutable), and noted as touched."""
        self.records[j] = bytearray(self.records[j])
        if self.touched is not None:
            self.touched.add(j)
        return self.records[j]

    def _crc(self, rec: bytearray) -> int:
        hit = self._crcs.get(id(rec))
        return hit[1] if hit is not None and hit[0] is rec else crc(rec)

    def build(self, fix_crcs: bool = True, relayout: bool = True) -> bytes:
        hdr = self.header
        if relayout and self.own and isinstance(hdr, dict) and isinstance(hdr.get("blobs"), list):
            off = 0
            for b, raw in zip(hdr["blobs"], self.blobs):
                if isinstance(b, dict):
                    b["offset"], b["length"] = off, len(raw)
                    if fix_crcs:
                        b["crc32c"] = crc(raw)
                off = -(-(off + len(raw)) // 64) * 64
        else:
            off = sum(-(-len(raw) // 64) * 64 for raw in self.blobs)
        for e, rec in zip(self.index, self.records):
            if relayout:
                e[8], e[9] = off, len(rec)
            if fix_crcs:
                e[10] = self._crc(rec)
            off = -(-(off + len(rec)) // 64) * 64
        if self.header_bytes is not None:
            hb = self.header_bytes
        elif not self.own:  # untouched header (and blobs unchanged): the seed's bytes
            hb = self._hbytes
        else:
            hb = json.dumps(hdr, sort_keys=True, separators=(",", ":")).encode()
        head = PRE.pack(b"\x89KVC\r\n\x1a\n", self.major, self.minor, len(hb), self.req, self.opt) + hb
        first = head + crc(head).to_bytes(4, "little")
        pieces: list[bytes | bytearray] = [first, bytes((-len(first)) % 64)]
        pos = len(first) + len(pieces[1])
        for raw in self.blobs + self.records:
            pad = (-len(raw)) % 64
            pieces += (raw, ZEROS[:pad])
            pos += len(raw) + pad
        idx = b"".join(IDX.pack(*[v % (1 << bits) for v, bits in zip(e, IDX_BITS)]) for e in self.index)
        f = struct.pack("<QQI", pos, len(self.index), crc(idx))
        pieces += (idx, f, crc(f).to_bytes(4, "little"), b"\x89KVCEND\n")
        return b"".join(pieces)


def side_arrays(rec: bytes | bytearray) -> list[tuple[int, int, int, int, int]]:
    """(head offset, element offset, element bytes, dtype code, ndim) of each side array of a record."""
    try:
        ns, nz, nside, _, plen = HEAD.unpack_from(rec, 0)
        pos = 16 + 8 * nz
        out = []
        sizes = {1: 1, 2: 1, 3: 2, 4: 2, 5: 4, 6: 4, 7: 8, 8: 8, 9: 2, 10: 4, 11: 8}
        for _ in range(nside):
            si, nlen, code, ndim = SIDE.unpack_from(rec, pos)
            shape = struct.unpack_from(f"<{ndim}I", rec, pos + 4 + nlen)
            n = sizes.get(code, 1)
            for d in shape:
                n *= d
            el = pos + 4 + nlen + 4 * ndim
            out.append((pos, el, n, code, ndim))
            pos = el + n
        return out
    except struct.error:
        return []


def payload_at(rec: bytes | bytearray) -> int:
    """Offset of a chunk record's payload (after its head and side arrays)."""
    try:
        _, nz, _, _, plen = HEAD.unpack_from(rec, 0)
        return len(rec) - plen
    except struct.error:
        return len(rec)


# -- the lighter cut: whole sections as bytes (header, data, index), for tests that replace one of them --
def split(data: bytes) -> dict:
    magic, major, minor, hlen, req, opt = PRE.unpack_from(data, 0)
    dstart = (36 + hlen + 63) // 64 * 64
    ioff, count = struct.unpack_from("<QQ", data, len(data) - 32)
    return {"major": major, "minor": minor, "req": req, "opt": opt, "header": data[32 : 32 + hlen],
            "dstart": dstart, "data": data[dstart:ioff], "index": data[ioff : ioff + 48 * count], "count": count}


def assemble(parts: dict, header: bytes | None = None, index: bytes | None = None, data: bytes | None = None,
             keep_data_start: bool = True, **pre) -> bytes:
    """Rebuild a file from split() parts with valid CRCs (header space-padded to keep data_start if it fits)."""
    h = parts["header"] if header is None else header
    if keep_data_start and len(h) <= parts["dstart"] - 36:
        h = h + b" " * (parts["dstart"] - 36 - len(h))
    p = {k: pre.get(k, parts[k]) for k in ("major", "minor", "req", "opt")}
    head = PRE.pack(b"\x89KVC\r\n\x1a\n", p["major"], p["minor"], len(h), p["req"], p["opt"]) + h
    out = bytearray(head + crc(head).to_bytes(4, "little"))
    out += bytes((-len(out)) % 64)
    out += parts["data"] if data is None else data
    out += bytes((-len(out)) % 64)
    idx = parts["index"] if index is None else index
    ioff = len(out)
    out += idx
    f = struct.pack("<QQI", ioff, len(idx) // 48, crc(idx))
    out += f + crc(f).to_bytes(4, "little") + b"\x89KVCEND\n"
    return bytes(out)


def header_obj(data: bytes) -> dict:
    return json.loads(split(data)["header"])


def with_header(data: bytes, obj: dict) -> bytes:
    return assemble(split(data), header=json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())
