"""The soak fuzzer's mutations: structure-aware operators on a seed ``.kvc`` (header JSON values and types, index
fields, chunk-record heads, side arrays and payloads, blobs), then the file laid out again with every checksum
recomputed (:mod:`kvcodec.testing.surgery`).

Why a module of its own: which mutations exist, and the deterministic choice of one per (seed, index), is the
fuzzer's test design; the runner (:mod:`kvcodec.testing.fuzz`) only hands indices to worker processes and
counts outcomes, and ``--repro I`` replays mutation ``I`` through the same :func:`mutate`.
"""

from __future__ import annotations

import json
import random
import struct
from typing import Any

from kvcodec.testing.surgery import HEAD, IDX_BITS, Parts, crc, payload_at, side_arrays

INTERESTING = [0, 1, 2, 3, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 4095, 4096, 4097, 65535, 65536,
               2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
HOSTILE_JSON: list[Any] = [None, True, False, 0, 1, -1, 64.0, 1.5, 1e308, -1e308, 2**31, 2**32, 2**63, 2**64, 10**30,
                           "", "x", "\ud800", "float16", "bfloat16", "int64", "zstd", "rans", "pca.basis", [], [1], [64.0],
                           [True], {}, {"blob": 0}, {"a": [None, {"b": 1}]}, [[[[[[[]]]]]]], list(range(40))]


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:64]):
            out += _paths(v, prefix + (i,))
    return out


SPECIAL_F16 = [b"\x00\x7c", b"\x00\xfc", b"\x00\x7e", b"\xff\x7b", b"\x00\x00", b"\x00\x80", b"\x01\x00", b"\x00\xbc"]
SPECIAL_F32 = [struct.pack("<f", v) for v in (float("inf"), float("-inf"), float("nan"), 3.4e38, 0.0, -0.0, 1e-45, -1.0, 1e30)]


def _mut_header(rng: random.Random, p: Parts, donor: Parts) -> str:
    p.own_header()
    r = rng.random()
    if r < 0.6:
        paths = [q for q in _paths(p.header) if q]
        path = rng.choice(paths)
        parent = p.header
        for k in path[:-1]:
            parent = parent[k]
        act = rng.random()
        if act < 0.75:
            val = rng.choice(HOSTILE_JSON)
            cur = parent[path[-1]]
            if isinstance(cur, int) and not isinstance(cur, bool) and rng.random() < 0.5:
                val = rng.choice([cur + 1, cur - 1, cur * 2, float(cur), -cur, cur + 2**32, str(cur), bool(cur)])
            parent[path[-1]] = json.loads(json.dumps(val))
        elif act < 0.9 and isinstance(parent, dict):
            del parent[path[-1]]
        elif isinstance(parent, list):
            parent.append(json.loads(json.dumps(rng.choice(HOSTILE_JSON))))
        else:
            parent[rng.choice(["future", "\ud800", "blob", "version", "x" * 200])] = rng.choice(HOSTILE_JSON)
        return "header.value"
    if r < 0.7:  # a whole section from the donor seed (other pipelines, blobs, model ...)
        k = rng.choice([k for k in donor.header if k in p.header] or ["pipelines"])
        p.header[k] = json.loads(json.dumps(donor.header.get(k)))
        return "header.section"
    if r < 0.85:
        text = bytearray(json.dumps(p.header, sort_keys=True, separators=(",", ":")).encode())
        for _ in range(rng.randint(1, 4)):
            at = rng.randrange(len(text))
            choice = rng.random()
            if choice < 0.5:
                text[at] = rng.choice(b'{}[]":,0123456789.-+eEtrufalsn\\ ')
            elif choice < 0.75:
                del text[at]
            else:
                text[at:at] = rng.choice([b'"a":1,', b"\\ud800", b"1e999", b"-0", b"00", b" ", b"\xff", b"\xc0\x80"])
        p.header_bytes = bytes(text)
        return "header.bytes"
    which = rng.randrange(4)
    if which == 0:
        p.major = rng.choice([0, 2, 65535])
    elif which == 1:
        p.minor = rng.choice([1, 7, 65535])
    elif which == 2:
        p.req = 1 << rng.randrange(64)
    else:
        p.opt = rng.getrandbits(64)
    return "preamble"


def _mut_index(rng: random.Random, p: Parts) -> str:
    for _ in range(rng.randint(1, 3)):
        e = rng.choice(p.index)
        f = rng.choice([0, 1, 2, 3, 4, 5, 6, 7, 11] if rng.random() < 0.8 else [8, 9])
        e[f] = rng.choice(INTERESTING + [e[f] + 1, max(0, e[f] - 1)]) % (1 << IDX_BITS[f])
    return "index"


def _mut_record(rng: random.Random, p: Parts, donor: Parts) -> str:
    j = rng.randrange(len(p.records))
    rec = p.record(j)
    r = rng.random()
    if r < 0.15:  # head and stage sizes
        field = rng.randrange(5)
        vals = list(HEAD.unpack_from(rec, 0))
        vals[field] = rng.choice(INTERESTING) % (1 << [8, 8, 16, 32, 64][field])
        HEAD.pack_into(rec, 0, *vals)
        return "record.head"
    if r < 0.3:
        nz = rec[1]
        if nz:
            k = rng.randrange(nz)
            cur = struct.unpack_from("<Q", rec, 16 + 8 * k)[0]
            struct.pack_into("<Q", rec, 16 + 8 * k, rng.choice(INTERESTING + [cur + 1, cur - 1, cur * 2, cur * 1000]) % 2**64)
            return "record.sizes"
    sides = side_arrays(rec)
    if r < 0.55 and sides:
        head, el, n, code, ndim = rng.choice(sides)
        act = rng.random()
        if act < 0.5 and n:
            width = {9: 2, 10: 4}.get(code, 1)
            pool = SPECIAL_F16 if code == 9 else SPECIAL_F32 if code == 10 else [bytes([rng.randrange(256)]) for _ in range(4)]
            for _ in range(rng.randint(1, 8)):
                at = el + rng.randrange(max(1, n // width)) * width
                rec[at : at + width] = rng.choice(pool)[:width].ljust(width, b"\0")
            return "record.side.values"
        if act < 0.8 and ndim:
            nlen = rec[head + 1]
            d = rng.randrange(ndim)
            at = head + 4 + nlen + 4 * d
            cur = struct.unpack_from("<I", rec, at)[0]
            struct.pack_into("<I", rec, at, rng.choice([0, 1, cur + 1, max(0, cur - 1), 2**32 - 1, cur * 2]) % 2**32)
            return "record.side.shape"
        at = head + rng.randrange(4 + rec[head + 1])
        rec[at] = rng.randrange(256)
        return "record.side.head"
    pay = payload_at(rec)
    if r < 0.8 and pay < len(rec):
        stages = p.header["pipelines"][p.index[j][3]] if p.index[j][3] < len(p.header["pipelines"]) else []
        last = stages[-1]["name"] if stages else ""
        if last == "zstd" and rng.random() < 0.5:
            import zstandard

            declared = struct.unpack_from("<Q", rec, 16 + 8 * (rec[1] - 1))[0] if rec[1] else 0
            kind = rng.randrange(3)
            if kind == 0:  # a bomb: far more than declared (built in 1 MiB pieces: the harness stays small)
                cobj = zstandard.ZstdCompressor(level=3).compressobj()
                total, piece = max(declared, 1) * rng.choice([2, 64, 4096]), bytes(1 << 20)
                new = b"".join(cobj.compress(piece[: min(len(piece), total - k)]) for k in range(0, total, len(piece))) + cobj.flush()
            elif kind == 1:  # content size field lying low / high, real output right
                new = zstandard.ZstdCompressor(level=3, write_content_size=False).compress(bytes(declared))
            else:  # valid frame + trailing junk / second frame
                new = bytes(rec[pay:]) + rng.choice([b"\0", zstandard.ZstdCompressor().compress(b"x" * 9), b"\x28\xb5\x2f\xfd"])
            rec[pay:] = new
            struct.pack_into("<Q", rec, 8, len(new))
            return "record.zstd"
        if last == "rans" and rng.random() < 0.6:
            # stream header: u32 contexts, u16 alphabet, then per context 2 x u32 counts + LEB128 freqs ...
            at = pay + rng.choice([0, 1, 4, 5] + list(range(6, min(40, len(rec) - pay))))
            if at < len(rec):
                rec[at] = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rec[at] ^ 1, rec[at] + 1 & 0xFF])
            return "record.rans"
        for _ in range(rng.randint(1, 4)):
            at = pay + rng.randrange(len(rec) - pay)
            rec[at] = rng.randrange(256)
        return "record.payload"
    if r < 0.9:  # a record of another seed / chunk (another pipeline, shape, dtype)
        p.records[j] = bytearray(rng.choice(donor.records))
        return "record.splice"
    at = rng.randrange(len(rec))
    if rng.random() < 0.5:
        del rec[at : at + rng.randint(1, 16)]
    else:
        rec[at:at] = bytes(rng.randint(1, 16))
    return "record.resize"


def _mut_blob(rng: random.Random, p: Parts) -> str:
    if not p.blobs:
        return _mut_record(rng, p, p)
    p.own_header()  # the blob's CRC in the header changes
    k = rng.randrange(len(p.blobs))
    p.blobs[k] = b = bytearray(p.blobs[k])
    if not b:
        return "blob.empty"
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(b))
        b[at] = rng.choice([0, 0xFF, 0x7F, 0x80, b[at] ^ 1])
    return "blob"


FULL_EVERY = 50  # every 50th mutated file is decoded completely, whatever the mutation touched


def mutate(i: int, seed: int, seeds: list[tuple[str, bytes]], parsed: list[Parts]) -> tuple[str, str, bytes, list[int] | None]:
    """Mutation ``i`` of run ``seed``: (seed file name, operator, mutated bytes, chunks to decode). Deterministic.

    The chunk list names every chunk the mutation can have changed (its record,
    its index entry, or its pipeline's config; for a raw flip the chunk holding
    the byte) plus two random ones (blobs -- positions, attachments -- feed every
    chunk; a replaced header section may change any); None means all of them
    (truncations, extensions, the footer, and every ``FULL_EVERY``-th mutation).
    """
    rng = random.Random(seed * 1_000_003 + i)
    si = i % len(seeds)
    name, data = seeds[si]
    r = rng.random()
    if r < 0.03:
        b = bytearray(data)
        at = rng.randrange(len(b))
        b[at] ^= 1 << rng.randrange(8)
        p0 = parsed[si]
        dstart = len(data) - 32 - 48 * len(p0.index) - sum(-(-len(x) // 64) * 64 for x in p0.blobs + p0.records)
        hit = [j for j, e in enumerate(p0.index) if dstart + e[8] <= at < dstart + e[8] + e[9]]
        return name, "flip.nocrc", bytes(b), None if i % FULL_EVERY == 0 else hit + [rng.randrange(len(p0.index))]
    if r < 0.05:
        return name, "truncate", data[: rng.randrange(len(data))], None
    if r < 0.06:
        return name, "extend", data + bytes(rng.choice([1, 63, 64, 4096])), None
    base = parsed[si]
    p = base.copy()
    donor = parsed[rng.randrange(len(parsed))]
    relayout = True
    if r < 0.30:
        op = _mut_header(rng, p, donor)
        relayout = rng.random() < 0.7  # else blob offsets / lengths / CRCs keep the mutated values
        pl_old, pl_new = base.header.get("pipelines"), p.header.get("pipelines") if isinstance(p.header, dict) else None
        if p.header_bytes is None and isinstance(pl_new, list) and len(pl_new) == len(pl_old) and op == "header.value":
            changed = {k for k, (a, b) in enumerate(zip(pl_old, pl_new)) if a != b}
            p.touched = {j for j, e in enumerate(p.index) if e[3] in changed}
        else:
            p.touched = set()  # the two random chunks below
    elif r < 0.42:
        op = _mut_index(rng, p)
        relayout = rng.random() < 0.5  # half keep the mutated offsets / lengths
        p.touched = {j for j, (a, b) in enumerate(zip(base.index, p.index)) if a != b}
    elif r < 0.90:
        op = _mut_record(rng, p, donor)
    elif r < 0.97:
        op = _mut_blob(rng, p)
    else:
        op = "footer"
        out = bytearray(p.build())
        at = len(out) - 32
        field = rng.randrange(2)
        struct.pack_into("<Q", out, at + 8 * field, rng.choice(INTERESTING) % 2**64)
        struct.pack_into("<I", out, at + 20, crc(out[at : at + 20]))
        return name, op, bytes(out), None
    try:
        out_b = p.build(relayout=relayout)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, struct.error, UnicodeEncodeError):
        # the mutation made the header unserialisable by this harness: fall back to a text edit
        p.header_bytes = json.dumps(p.header, sort_keys=True, separators=(",", ":"), default=str).encode("utf-8", "surrogatepass")
        out_b = p.build(relayout=False)
    touched = None if p.touched is None or i % FULL_EVERY == 0 else sorted(p.touched | {rng.randrange(len(p.index)) for _ in range(2)})
    return name, op, out_b, touched


