"""Soak fuzz of the `.kvc` reader: structure-aware mutations with every checksum recomputed.

    python kvcodec/testing/fuzz.py [--n 100000] [--workers 2] [--seed 1] [--tokens 24] [--json OUT]
    python kvcodec/testing/fuzz.py --repro I [--seed 1]      # re-run mutation I in-process, with a traceback

Seed files are real caches of the embedded SmolLM2-135M (the first ``--tokens``
tokens of the GPL-3 text) written by kvcodec's own writer: every preset
(lossless, fp16, near-lossless, balanced, small), a bfloat16 lossless file,
an H2O-pruned file (per-head positions), chunked files (tokens and heads),
an embedded-calibration file and a file storing only the token-id hash.
They are built once by a child process (the model never enters the workers)
into ``--seeds DIR`` (default: a temp dir).

Each mutation (deterministic in ``--seed`` and its index) picks a seed file
and one of the operators below; CRC32Cs of the header, index, footer, blobs
and chunk records are recomputed afterwards, so the mutation reaches the
parsers and decoders instead of stopping at a checksum:

* header JSON: a value replaced by a hostile one (64.0, true, 2**64, -1,
  "\\ud800", 1e308, nested junk ...), a key deleted / duplicated / added, raw
  text bytes changed; preamble fields (versions, feature bits);
* index and footer fields set to edge values; chunk records re-laid out
  (offsets, lengths, alignment follow the new sizes);
* chunk records: head / stage sizes / side-array heads and elements (NaN,
  inf, huge, negative, dims, dtype codes, names), payload bytes, rANS stream
  fields (contexts, alphabet, counts, frequencies, states), zstd bombs and
  frames that lie about their content size, records spliced in from another
  seed (another pipeline);
* blobs (token ids, positions, calibration attachments) with their header CRC;
* for control, a few plain byte flips (CRC left wrong), truncations and
  extensions.

Every mutated file is opened, fully verified (every blob, attachment and
chunk decoded) and one random layer is read as tensors, in a pool of worker
processes (a segfault kills only its worker: it is counted as a crash and the
worker restarts after that mutation). Reported: outcomes, exceptions that are
not ``KvcError`` (must be 0), crashes (0), runs over 10 s of CPU time (0; a
run blocked without using CPU is caught by the ``HANG_S`` wall-clock watchdog
and counted as a crash; runs over 10 s of wall time are listed too, since on a
shared machine wall time measures the neighbours) and the workers' peak RSS
(must stay <= 512 MB).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

SLOW_S = 10.0  # a run over this is reported
HANG_S = 120.0  # a worker silent for this long is killed (counted as a crash and as slow)
BATCH = 100

_PRE = struct.Struct("<8sHHIQQ")
_IDX = struct.Struct("<IBBHIIIIQQII")
_IDX_BITS = [32, 8, 8, 16, 32, 32, 32, 32, 64, 64, 32, 32]
_HEAD = struct.Struct("<BBHIQ")
_ZEROS = bytes(64)
_SIDE = struct.Struct("<BBBB")
INTERESTING = [0, 1, 2, 3, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 4095, 4096, 4097, 65535, 65536,
               2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
HOSTILE_JSON: list[Any] = [None, True, False, 0, 1, -1, 64.0, 1.5, 1e308, -1e308, 2**31, 2**32, 2**63, 2**64, 10**30,
                           "", "x", "\ud800", "float16", "bfloat16", "int64", "zstd", "rans", "pca.basis", [], [1], [64.0],
                           [True], {}, {"blob": 0}, {"a": [None, {"b": 1}]}, [[[[[[[]]]]]]], list(range(40))]


# --------------------------------------------------------------------------- seeds
def make_seeds(out: Path, tokens: int, lm: Any = None) -> None:
    """Write the seed files (needs the embedded model: ``lm``, else loaded here -- the benchmark runs this in a
    child process so the model never enters the fuzzing processes)."""
    import numpy as np
    import torch

    from kvcodec.models.capture import capture, tokenize
    from kvcodec.format import write_kvc
    from kvcodec.plan.presets import get_plan
    from kvcodec.models.load import load_model
    from kvcodec.prune import apply_prune
    from kvcodec.texts import load_text

    out.mkdir(parents=True, exist_ok=True)
    lm = lm or load_model("smollm2")
    ids = tokenize(lm.tokenizer, load_text("gpl3"))[:tokens]
    cache = capture(lm, token_ids=ids)

    def put(name: str, c: Any, preset: str, **kw: Any) -> None:
        plan = get_plan(preset, c, lm=lm, **kw.pop("plan", {}))
        write_kvc(c, out / f"{name}.kvc", plan,
                  meta=c.meta, **kw)
        print(f"seed {name}: {(out / f'{name}.kvc').stat().st_size} bytes", file=sys.stderr)

    for preset in ("lossless", "fp16", "near-lossless", "balanced", "small"):
        put(preset, cache, preset)
    put("bf16-lossless", cache.to(torch.bfloat16), "lossless")
    put("lossless-chunked", cache, "lossless", chunk_tokens=8, chunk_heads=2)
    put("balanced-chunked", cache, "balanced", chunk_tokens=10, chunk_heads=1)
    put("balanced-embedded", cache, "balanced", plan={"calibration": "embedded"})
    put("lossless-idhash", cache, "lossless", store_token_ids=False)
    pruned = apply_prune(cache, "h2o:0.5", lm=lm)
    put("balanced-pruned", pruned, "balanced")
    put("lossless-pruned", pruned, "lossless")
    np.save(out / "ids.npy", np.asarray(ids, np.int64), allow_pickle=False)


# --------------------------------------------------------------------------- file surgery
def crc(b: bytes | bytearray) -> int:
    import google_crc32c

    return google_crc32c.value(bytes(b))


class Parts:
    """A valid `.kvc` split into editable pieces; :meth:`build` re-lays it out with every CRC recomputed."""

    def __init__(self, data: bytes) -> None:
        magic, self.major, self.minor, hlen, self.req, self.opt = _PRE.unpack_from(data, 0)
        self.header = json.loads(data[32 : 32 + hlen])
        dstart = (36 + hlen + 63) // 64 * 64
        ioff, count = struct.unpack_from("<QQ", data, len(data) - 32)
        self.index = [list(_IDX.unpack_from(data, ioff + 48 * j)) for j in range(count)]
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
        head = _PRE.pack(b"\x89KVC\r\n\x1a\n", self.major, self.minor, len(hb), self.req, self.opt) + hb
        first = head + crc(head).to_bytes(4, "little")
        pieces: list[bytes | bytearray] = [first, bytes((-len(first)) % 64)]
        pos = len(first) + len(pieces[1])
        for raw in self.blobs + self.records:
            pad = (-len(raw)) % 64
            pieces += (raw, _ZEROS[:pad])
            pos += len(raw) + pad
        idx = b"".join(_IDX.pack(*[v % (1 << bits) for v, bits in zip(e, _IDX_BITS)]) for e in self.index)
        f = struct.pack("<QQI", pos, len(self.index), crc(idx))
        pieces += (idx, f, crc(f).to_bytes(4, "little"), b"\x89KVCEND\n")
        return b"".join(pieces)


def _paths(obj: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:64]):
            out += _paths(v, prefix + (i,))
    return out


def _side_arrays(rec: bytes | bytearray) -> list[tuple[int, int, int, int, int]]:
    """(head offset, element offset, element bytes, dtype code, ndim) of each side array of a record."""
    try:
        ns, nz, nside, _, plen = _HEAD.unpack_from(rec, 0)
        pos = 16 + 8 * nz
        out = []
        sizes = {1: 1, 2: 1, 3: 2, 4: 2, 5: 4, 6: 4, 7: 8, 8: 8, 9: 2, 10: 4, 11: 8}
        for _ in range(nside):
            si, nlen, code, ndim = _SIDE.unpack_from(rec, pos)
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


def _payload_at(rec: bytes | bytearray) -> int:
    try:
        _, nz, _, _, plen = _HEAD.unpack_from(rec, 0)
        return len(rec) - plen
    except struct.error:
        return len(rec)


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
        e[f] = rng.choice(INTERESTING + [e[f] + 1, max(0, e[f] - 1)]) % (1 << _IDX_BITS[f])
    return "index"


def _mut_record(rng: random.Random, p: Parts, donor: Parts) -> str:
    j = rng.randrange(len(p.records))
    rec = p.record(j)
    r = rng.random()
    if r < 0.15:  # head and stage sizes
        field = rng.randrange(5)
        vals = list(_HEAD.unpack_from(rec, 0))
        vals[field] = rng.choice(INTERESTING) % (1 << [8, 8, 16, 32, 64][field])
        _HEAD.pack_into(rec, 0, *vals)
        return "record.head"
    if r < 0.3:
        nz = rec[1]
        if nz:
            k = rng.randrange(nz)
            cur = struct.unpack_from("<Q", rec, 16 + 8 * k)[0]
            struct.pack_into("<Q", rec, 16 + 8 * k, rng.choice(INTERESTING + [cur + 1, cur - 1, cur * 2, cur * 1000]) % 2**64)
            return "record.sizes"
    sides = _side_arrays(rec)
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
    pay = _payload_at(rec)
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


# --------------------------------------------------------------------------- running one file
def consume(data: bytes, resolver: Any, rng: random.Random, chunks: list[int] | None = None) -> str:
    """What a consumer does with a file: open (the whole structure is validated), then verify everything
    (``chunks`` None: every padding byte, blob, attachment and chunk decoded, and one layer read as tensors)
    or read the blobs and decode the given chunks."""
    from kvcodec.errors import KvcError, KvcFormatError
    from kvcodec.format import KvcReader

    try:
        with KvcReader(data, attachment_resolver=resolver) as r:
            if chunks is None:
                r.verify(strict=True, backend="cpu")
                r.read_layer(rng.randrange(r.num_layers), backend="cpu")
            else:
                _ = (r.token_ids, r.positions, r.attachments)  # each property parses and checks its blob
                for a, b in r._gaps():  # padding bytes, as verify() checks them
                    if any(bytes(r._src.read(a, b - a))):
                        raise KvcFormatError(f"non-zero padding in bytes [{a}, {b})")
                for j in chunks:
                    if j < r.num_chunks:
                        r.read_chunk(j, backend="cpu")
        return "ok"
    except KvcError as exc:
        return "kvc:" + type(exc).__name__


def _load_seeds(d: Path) -> list[tuple[str, bytes]]:
    return [(p.stem, p.read_bytes()) for p in sorted(d.glob("*.kvc"))]


def _resolver(seeds: list[tuple[str, bytes]]) -> dict[str, Any]:
    """name -> array of the external calibration attachments the seeds reference (resolved once, as a mapping)."""
    from kvcodec.format import KvcReader
    from kvcodec.calibration.store import default_resolver as attachment_resolver

    out: dict[str, Any] = {}
    for _, data in seeds:
        with KvcReader(data) as r:
            for name, a in r.header.attachments.items():
                if a.blob is None and a.sha256 not in out:
                    arr = attachment_resolver(name, a)
                    if arr is not None:
                        out[a.sha256] = arr
    return out


def _peak_rss_kb() -> int:
    """This process's peak RSS (kB): VmHWM, the high-water mark of its own address space. Not ru_maxrss:
    Linux carries that across fork + exec, so a worker spawned by a big parent (pytest with the model
    loaded) would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _worker(conn: Any, seeds_dir: str, seed: int) -> None:

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    seeds = _load_seeds(Path(seeds_dir))
    parsed = [Parts(d) for _, d in seeds]
    resolver = _resolver(seeds)
    conn.send(("ready", _peak_rss_kb()))
    while True:
        task = conn.recv()
        if task is None:
            return
        lo, hi = task
        for i in range(lo, hi):
            name, op, data, chunks = mutate(i, seed, seeds, parsed)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                out = consume(data, resolver, random.Random(i), chunks)
                detail = ""
            except Exception as exc:  # noqa: BLE001 - the point: anything that is not a KvcError
                out = "other:" + type(exc).__name__
                detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:300]
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            conn.send((i, name, op, out, dt, cpu, detail, _peak_rss_kb()))


# --------------------------------------------------------------------------- the pool
class _Slot:
    def __init__(self, ctx: Any, seeds_dir: str, seed: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, seeds_dir, seed), daemon=True)
        self.proc.start()
        child.close()
        self.task: tuple[int, int] | None = None
        self.next = 0
        self.since = time.monotonic()
        self.ready = False
        self.rss = 0


def run(seeds_dir: Path, n: int, workers: int, seed: int, progress: bool = True, checkpoint: Path | None = None) -> dict[str, Any]:
    """Run mutations 0..n-1 over the seeds in ``seeds_dir``; the summary dict (also written to
    ``checkpoint`` every 30 s while running, with ``"complete": false``)."""
    ctx = mp.get_context("spawn")
    pending = [(lo, min(n, lo + BATCH)) for lo in range(0, n, BATCH)]
    pending.reverse()
    slots = [_Slot(ctx, str(seeds_dir), seed) for _ in range(min(workers, max(1, len(pending))))]
    outcomes: Counter = Counter()
    by_op: dict[str, Counter] = {}
    by_seed: Counter = Counter()
    foreign: list[dict[str, Any]] = []
    crashes: list[dict[str, Any]] = []
    slow: list[dict[str, Any]] = []
    jumps: list[dict[str, Any]] = []
    slow_wall: list[dict[str, Any]] = []
    peak_kb = base_kb = 0
    done = 0
    t_start = time.monotonic()
    last_print = t_start

    def summary() -> dict[str, Any]:
        return dict(_summary(done, seed, workers, time.monotonic() - t_start, by_seed, outcomes, by_op, foreign, crashes,
                             slow, peak_kb, base_kb), rss_jumps=jumps[:20], over_10s_wall=len(slow_wall),
                    over_10s_wall_examples=slow_wall[:20])

    def assign(s: _Slot) -> None:
        if pending:
            s.task = pending.pop()
            s.next = s.task[0]
            s.since = time.monotonic()
            s.conn.send(s.task)
        else:
            s.task = None

    def restart(s: _Slot, why: str) -> _Slot:
        nonlocal done
        assert s.task is not None
        crashes.append({"mutation": s.next, "why": why})
        outcomes["crash"] += 1
        done += 1
        if s.next + 1 < s.task[1]:
            pending.append((s.next + 1, s.task[1]))
        s.proc.kill()
        s.proc.join()
        return _Slot(ctx, str(seeds_dir), seed)

    while any(s.task is not None or not s.ready for s in slots) or pending:
        ready = wait([s.conn for s in slots], timeout=1.0)
        for i, s in enumerate(slots):
            if s.conn in ready:
                try:
                    msg = s.conn.recv()
                except (EOFError, OSError):
                    s.proc.join(timeout=5)
                    if s.task is None:
                        raise RuntimeError(f"fuzz worker died while starting (exit code {s.proc.exitcode})") from None
                    slots[i] = restart(s, f"worker died, exit code {s.proc.exitcode}")
                    continue
                if msg[0] == "ready":
                    s.ready = True
                    s.rss = msg[1]
                    base_kb = max(base_kb, msg[1])
                    assign(s)
                    continue
                idx, name, op, out, dt, cpu, detail, rss = msg
                done += 1
                peak_kb = max(peak_kb, rss)
                outcomes[out] += 1
                by_op.setdefault(op, Counter())[out.split(":")[0]] += 1
                by_seed[name] += 1
                if out.startswith("other:"):
                    foreign.append({"mutation": idx, "seed_file": name, "op": op, "error": detail})
                if rss - s.rss > 16 << 10:  # the peak RSS grew by > 16 MB during this one mutation
                    jumps.append({"mutation": idx, "seed_file": name, "op": op, "mb": round((rss - s.rss) / 1024, 1)})
                s.rss = max(s.rss, rss)
                if cpu > SLOW_S:
                    slow.append({"mutation": idx, "seed_file": name, "op": op, "cpu_s": round(cpu, 2), "wall_s": round(dt, 2)})
                if dt > SLOW_S:
                    slow_wall.append({"mutation": idx, "seed_file": name, "op": op, "cpu_s": round(cpu, 2), "wall_s": round(dt, 2)})
                s.next = idx + 1
                s.since = time.monotonic()
                if s.task is not None and s.next >= s.task[1]:
                    assign(s)
            elif s.ready and s.task is not None and time.monotonic() - s.since > HANG_S:
                slow.append({"mutation": s.next, "seconds": HANG_S, "op": "killed (hang)"})
                slots[i] = restart(s, f"no answer for {HANG_S:.0f} s")
        if progress and time.monotonic() - last_print > 30:
            last_print = time.monotonic()
            rate = done / max(1e-9, last_print - t_start)
            print(f"fuzz: {done}/{n} ({rate:.0f}/s) {dict(outcomes)} peak RSS {peak_kb / 1024:.0f} MB", file=sys.stderr, flush=True)
            if checkpoint is not None:
                checkpoint.write_text(json.dumps(dict(summary(), complete=False), indent=1) + "\n")
        if not pending and all(s.task is None for s in slots if s.ready) and all(s.ready for s in slots):
            break
    for s in slots:
        try:
            s.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        s.proc.join(timeout=10)
        if s.proc.is_alive():
            s.proc.kill()
    return dict(summary(), complete=True)


def _summary(done: int, seed: int, workers: int, wall: float, by_seed: Counter, outcomes: Counter, by_op: dict,
             foreign: list, crashes: list, slow: list, peak_kb: int, base_kb: int) -> dict[str, Any]:
    return {
        "mutations": done, "seed": seed, "workers": workers, "wall_s": round(wall, 1),
        "seed_files": dict(sorted(by_seed.items())),
        "outcomes": dict(sorted(outcomes.items())),
        "by_operator": {k: dict(v) for k, v in sorted(by_op.items())},
        "non_kvc_exceptions": len(foreign), "non_kvc_examples": foreign[:20],
        "crashes": len(crashes), "crash_examples": crashes[:20],
        "over_10s": len(slow), "slow_examples": slow[:20],
        "peak_rss_mb": round(peak_kb / 1024, 1), "worker_rss_after_import_mb": round(base_kb / 1024, 1),
    }


def ensure_seeds(seeds_dir: Path, tokens: int) -> None:
    if any(seeds_dir.glob("*.kvc")):
        return
    here = Path(__file__).resolve()
    subprocess.run([sys.executable, str(here), "--make-seeds", str(seeds_dir), "--tokens", str(tokens)], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--seeds", type=Path, default=None, help="seed directory (built if empty)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--make-seeds", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--repro", type=int, default=None, help="re-run one mutation in-process, with its traceback")
    a = ap.parse_args()
    if a.make_seeds is not None:
        make_seeds(a.make_seeds, a.tokens)
        return
    seeds_dir = a.seeds or Path(tempfile.gettempdir()) / f"kvc-fuzz-seeds-{a.tokens}"
    ensure_seeds(seeds_dir, a.tokens)
    if a.repro is not None:
        seeds = _load_seeds(seeds_dir)
        name, op, data, chunks = mutate(a.repro, a.seed, seeds, [Parts(d) for _, d in seeds])
        print(f"mutation {a.repro}: seed file {name}, operator {op}, {len(data)} bytes, chunks {chunks}", file=sys.stderr)
        res = _resolver(seeds)
        consume(data, res, random.Random(a.repro), chunks)  # warm-up (numba, caches)
        t0, c0 = time.perf_counter(), time.process_time()
        out = consume(data, res, random.Random(a.repro), chunks)
        print(f"{out}  ({time.perf_counter() - t0:.2f} s wall, {time.process_time() - c0:.2f} s CPU)")
        return
    res = run(seeds_dir, a.n, a.workers, a.seed, checkpoint=a.json)
    text = json.dumps(res, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    print(text)
    ok = res["non_kvc_exceptions"] == 0 and res["crashes"] == 0 and res["over_10s"] == 0 and res["peak_rss_mb"] <= 512
    print(f"fuzz: {res['mutations']} mutations in {res['wall_s']} s: non-KvcError {res['non_kvc_exceptions']}, "
          f"crashes {res['crashes']}, over 10 s {res['over_10s']}, peak RSS {res['peak_rss_mb']} MB -> "
          f"{'PASS' if ok else 'FAIL'}", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
