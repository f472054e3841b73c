"""Hostile input: byte flips, fuzzed headers / index entries / chunk records, truncation, memory bounds.

Only KvcFormatError may escape the reader; nothing may decode to a silently
wrong tensor; nothing may allocate what a header merely claims.
"""

from __future__ import annotations

import json
import struct
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcodec.errors import KvcCodecError, KvcFormatError
from kvcodec.format import KvcReader, KvcUnknownCodecError, encode_kvc_bytes, lossless_pipeline, raw_pipeline, verify_kvc

from formatutil import assert_same_cache, synthetic_cache  # noqa: E402,F401

from kvcodec.testing.surgery import assemble, crc, header_obj, split, with_header  # noqa: E402,F401

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
MEM_LIMIT = 24 << 20


@pytest.fixture(scope="module")
def small_file() -> bytes:
    c = synthetic_cache(torch.float16, T=8, n_ctx=12, positions=np.array([0, 1, 2, 4, 6, 8, 10, 11]))
    return encode_kvc_bytes(c, lossless_pipeline("float16"), chunk_tokens=3, chunk_heads=1,
                            attachments={"calib": np.arange(6, dtype=np.float32)}, meta={"a": 1})


def open_and_verify(data: bytes) -> None:
    """Everything a consumer might do; only KvcFormatError may come out."""
    with KvcReader(data) as r:
        r.verify(strict=True)
        r.read_cache()
        for j in range(r.num_chunks):
            r.read_chunk(j)


def only_format_errors(data: bytes) -> str:
    tracemalloc.start()
    try:
        open_and_verify(data)
        return "ok"
    except KvcFormatError:
        return "rejected"
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < MEM_LIMIT, f"peak Python allocation {peak} bytes"


# -- byte flips on a real file ------------------------------------------------
class Flipped:
    """A range source (size + read) serving ``data`` with one byte XORed, without copying the file."""

    def __init__(self, data: bytes, pos: int, mask: int) -> None:
        self.data, self.pos, self.mask, self.size = data, pos, mask, len(data)

    def read(self, offset: int, length: int) -> bytes:
        b = self.data[offset : offset + length]
        if offset <= self.pos < offset + length:
            b = bytearray(b)
            b[self.pos - offset] ^= self.mask
            b = bytes(b)
        return b


@pytest.mark.model
def test_every_structural_byte_flip_is_detected(real_cache):
    cache = real_cache(16).to(torch.bfloat16)
    data = encode_kvc_bytes(cache, lossless_pipeline("bfloat16"), chunk_tokens=8, preset="lossless")
    assert 100_000 < len(data) < 400_000
    with KvcReader(data) as r:
        hd, entries = r.header, r.entries
        positions: set[int] = set(range(hd.data_start))  # preamble, header, header CRC, header padding
        positions |= set(range(r.footer.index_offset, len(data)))  # index and footer
        owner = {}
        for j, e in enumerate(entries):  # every chunk record head, sizes field and trailing padding
            at = hd.data_start + e.offset
            positions |= set(range(at, at + 24))  # head + first stage size
            owner.update({p: j for p in range(at, at + e.length)})
            positions |= set(range(at + e.length, hd.data_start + ((e.offset + e.length + 63) // 64) * 64))
        for b in hd.blobs:
            at = hd.data_start + b.offset
            positions |= set(range(at, hd.data_start + ((b.offset + b.length + 63) // 64) * 64))
    stride = set(range(0, len(data), 611))  # a stride over the payloads
    positions |= stride
    outcomes = {"open": 0, "verify": 0}
    for pos in sorted(positions):
        src = Flipped(data, pos, 1 << (pos % 8))
        try:
            r = KvcReader(src)
        except KvcFormatError:
            outcomes["open"] += 1
        else:
            with r:
                try:
                    if pos in owner:  # a flip inside a chunk: reading that chunk must fail
                        r.read_chunk(owner[pos])
                    r.verify(strict=True)
                except KvcFormatError:
                    outcomes["verify"] += 1
                else:  # undetected: must be provably harmless
                    assert_same_cache(r.read_cache(), cache), f"flip at {pos} went undetected and changed the data"
    assert sum(outcomes.values()) == len(positions), outcomes
    assert outcomes["open"] > 5000 and outcomes["verify"] > 100


@pytest.mark.model
def test_reader_never_returns_wrong_data_after_a_payload_flip(real_cache):
    cache = real_cache(16).to(torch.float16)
    data = encode_kvc_bytes(cache, raw_pipeline("float16"))
    with KvcReader(data) as r:
        e = r.entries[7]
        at = r.header.data_start + e.offset + 100
    buf = bytearray(data)
    buf[at] ^= 0x10
    with KvcReader(bytes(buf)) as r:
        with pytest.raises(KvcFormatError, match="chunk 7.*CRC32C"):
            r.read_layer(3)
        k, v = r.read_layer(0)  # other layers still read fine
        assert torch.equal(k, cache.keys[0])


# -- truncation and garbage ---------------------------------------------------
def test_every_truncation_is_rejected(small_file):
    for n in range(len(small_file)):
        with pytest.raises(KvcFormatError):
            open_and_verify(small_file[:n])
    with pytest.raises(KvcFormatError):
        open_and_verify(small_file + b"\0" * 64)


@FUZZ
@given(st.binary(max_size=4096))
def test_random_bytes(b):
    assert only_format_errors(b) == "rejected"
    assert only_format_errors(b"\x89KVC\r\n\x1a\n" + b) == "rejected"


@FUZZ
@given(st.data())
def test_random_splices(small_file, data):
    """Overwrite a random span of a valid file with random bytes."""
    b = bytearray(small_file)
    at = data.draw(st.integers(0, len(b) - 1))
    junk = data.draw(st.binary(min_size=1, max_size=64))
    b[at : at + len(junk)] = junk
    assert only_format_errors(bytes(b)) in ("ok", "rejected")


# -- fuzzed headers with valid CRCs -------------------------------------------
json_leaf = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**32, 2**63, 2**64, "", "raw", "zstd", "float16", "bfloat16", "int64"]),
    st.text(max_size=20),
)
json_val = st.recursive(json_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


@FUZZ
@given(st.data())
def test_fuzzed_header_values(small_file, data):
    obj = header_obj(small_file)
    paths = [p for p in _paths(obj) if p]
    path = data.draw(st.sampled_from(paths))
    action = data.draw(st.sampled_from(["replace", "delete"]))
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    if action == "delete" and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(json_val)
    assert only_format_errors(with_header(small_file, obj)) in ("ok", "rejected")


@FUZZ
@given(st.binary(max_size=300))
def test_fuzzed_header_bytes(small_file, hb):
    assert only_format_errors(assemble(split(small_file), header=hb)) == "rejected"


# -- fuzzed index entries and chunk records with valid CRCs -------------------
INTERESTING = st.sampled_from([0, 1, 2, 3, 7, 8, 63, 64, 255, 2**16 - 1, 2**31 - 1, 2**32 - 1, 2**63, 2**64 - 1])
FIELDS = struct.Struct("<IBBHIIIIQQII")
FIELD_BITS = [32, 8, 8, 16, 32, 32, 32, 32, 64, 64, 32, 32]


@FUZZ
@given(st.data())
def test_fuzzed_index_entries(small_file, data):
    parts = split(small_file)
    idx = bytearray(parts["index"])
    for _ in range(data.draw(st.integers(1, 3))):
        j = data.draw(st.integers(0, parts["count"] - 1))
        fields = list(FIELDS.unpack_from(idx, 48 * j))
        f = data.draw(st.integers(0, len(fields) - 1))
        v = data.draw(st.one_of(INTERESTING, st.integers(0, 2 ** FIELD_BITS[f] - 1)))
        fields[f] = v % (1 << FIELD_BITS[f])
        FIELDS.pack_into(idx, 48 * j, *fields)
    # keep chunk CRCs valid where the entry still points at a record, so deeper checks run
    assert only_format_errors(assemble(parts, index=bytes(idx))) in ("ok", "rejected")


@FUZZ
@given(st.data())
def test_fuzzed_chunk_records_with_fixed_crcs(small_file, data):
    """Mutate bytes inside one chunk record (head, sizes, payload) and recompute its CRC in the index."""
    parts = split(small_file)
    idx = bytearray(parts["index"])
    body = bytearray(parts["data"])
    j = data.draw(st.integers(0, parts["count"] - 1))
    fields = list(FIELDS.unpack_from(idx, 48 * j))
    off, length = fields[8], fields[9]
    for _ in range(data.draw(st.integers(1, 4))):
        at = off + data.draw(st.integers(0, min(length, 64) - 1) if data.draw(st.booleans()) else st.integers(0, length - 1))
        body[at] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):  # a huge declared stage size
        struct.pack_into("<Q", body, off + 16, data.draw(st.sampled_from([2**32, 2**40, 2**63, 10**6])))
    fields[10] = crc(body[off : off + length])
    FIELDS.pack_into(idx, 48 * j, *fields)
    assert only_format_errors(assemble(parts, index=bytes(idx), data=bytes(body))) in ("ok", "rejected")


# -- targeted hostile headers --------------------------------------------------
def test_header_claiming_terabytes_does_not_allocate(small_file):
    obj = header_obj(small_file)
    for tokens in (2**31 - 1, 2**30, 10**8):
        obj2 = json.loads(json.dumps(obj))
        obj2["tensors"]["tokens"] = tokens
        obj2["context"]["tokens"] = tokens
        assert only_format_errors(with_header(small_file, obj2)) == "rejected"
    # a consistent index claiming one enormous chunk per tensor
    c = synthetic_cache(torch.float32, T=4)
    f = encode_kvc_bytes(c, lossless_pipeline("float32"), store_token_ids=False)
    parts = split(f)
    idx = bytearray(parts["index"])
    for j in range(parts["count"]):
        fields = list(FIELDS.unpack_from(idx, 48 * j))
        fields[5] = 2**31 - 1
        FIELDS.pack_into(idx, 48 * j, *fields)
    obj = header_obj(f)
    obj["tensors"]["tokens"] = obj["context"]["tokens"] = 2**31 - 1
    bad = assemble(split(f), header=json.dumps(obj).encode(), index=bytes(idx))
    assert only_format_errors(bad) == "rejected"
    with pytest.raises(KvcFormatError, match="limit"):
        KvcReader(bad)


def test_decompression_is_capped_at_declared_size():
    c = synthetic_cache(torch.float32, T=4)
    f = encode_kvc_bytes(c, lossless_pipeline("float32"))
    with KvcReader(f) as r:
        e = r.entries[0]
    parts = split(f)
    body = bytearray(parts["data"])
    # declare a smaller shuffle input than zstd really produces -> capped, rejected
    struct.pack_into("<QQ", body, e.offset + 16, 100, 100)
    idx = bytearray(parts["index"])
    fields = list(FIELDS.unpack_from(idx, 0))
    fields[10] = crc(body[e.offset : e.offset + e.length])
    FIELDS.pack_into(idx, 0, *fields)
    with KvcReader(assemble(parts, index=bytes(idx), data=bytes(body))) as r:
        with pytest.raises(KvcFormatError, match="zstd"):
            r.read_chunk(0)


def test_header_limits_and_json_rules(small_file):
    parts = split(small_file)
    with pytest.raises(KvcFormatError, match="repeats"):
        KvcReader(assemble(parts, header=b'{"a":1,"a":2}'))
    with pytest.raises(KvcFormatError, match="NaN"):
        KvcReader(assemble(parts, header=b'{"a":NaN}'))
    with pytest.raises(KvcFormatError, match="deeper"):
        KvcReader(assemble(parts, header=b"[" * 100 + b"]" * 100))
    with pytest.raises(KvcFormatError, match="UTF-8"):
        KvcReader(assemble(parts, header=b'{"a":"\xff"}'))
    big = bytearray(small_file)
    struct.pack_into("<I", big, 12, (16 << 20) + 1)
    with pytest.raises(KvcFormatError, match="header length"):
        KvcReader(bytes(big))


def test_versions_and_feature_bits(small_file):
    parts = split(small_file)
    with pytest.raises(KvcFormatError, match="major"):
        KvcReader(assemble(parts, major=2))
    with pytest.raises(KvcFormatError, match=r"unknown feature bits \[2, 5\]"):  # bit 1: the attention bias (4.6)
        KvcReader(assemble(parts, req=0b100100))
    with pytest.raises(KvcFormatError, match="layer_tokens"):  # bit 0 (ragged layers) without its header key
        KvcReader(assemble(parts, req=0b1))
    with KvcReader(assemble(parts, opt=0xFFFF, minor=7)) as r:  # unknown optional bits / newer minor: fine
        assert r.header.version == (1, 7)
        assert r.verify() == []
    obj = header_obj(small_file)
    obj["future_key"] = {"x": [1, 2]}
    obj["tensors"]["future"] = True
    with KvcReader(with_header(small_file, obj)) as r:
        assert r.verify() == []


def test_text_mode_corruption_is_named(small_file):
    with pytest.raises(KvcFormatError, match="text-mode"):
        KvcReader(small_file.replace(b"\r\n", b"\n", 1))
    with pytest.raises(KvcFormatError, match="not a .kvc"):
        KvcReader(b"PK\x03\x04" + small_file[4:])


def test_unknown_codec_is_named(small_file):
    obj = header_obj(small_file)
    obj["pipelines"][0][-1]["name"] = "brotli9000"
    with pytest.raises(KvcUnknownCodecError, match="brotli9000") as ei:
        KvcReader(with_header(small_file, obj))
    assert isinstance(ei.value, KvcFormatError) and isinstance(ei.value, KvcCodecError)
    obj["pipelines"][0][-1] = {"name": "zstd", "version": 99, "config": {}}
    with pytest.raises(KvcFormatError, match="zstd.*99"):
        KvcReader(with_header(small_file, obj))
    obj["pipelines"][0][-1] = {"name": "zstd", "version": 1, "config": {"level": "max"}}
    with pytest.raises(KvcFormatError):
        KvcReader(with_header(small_file, obj))


def test_layout_rules(small_file):
    parts = split(small_file)
    idx = bytearray(parts["index"])
    a, b = bytes(idx[:48]), bytes(idx[48:96])
    swapped = b + a + bytes(idx[96:])
    with pytest.raises(KvcFormatError, match="index entry 0"):
        KvcReader(assemble(parts, index=swapped))
    with pytest.raises(KvcFormatError, match="index ends"):
        KvcReader(assemble(parts, index=bytes(idx[:-48])))
    with pytest.raises(KvcFormatError):  # extra bytes between data and index
        KvcReader(assemble(parts, data=parts["data"] + bytes(64)))
    pad = bytearray(small_file)
    with KvcReader(small_file) as r:
        gap = r._gaps()[0]
    pad[gap[0]] = 7
    assert any("padding" in p for p in verify_kvc(bytes(pad)))
    assert verify_kvc(small_file) == []


# -- the ragged layout (spec section 4.2): lying layer_tokens -------------------------
def ragged_file() -> bytes:
    from formatutil import ragged_cache

    return encode_kvc_bytes(ragged_cache(), lossless_pipeline("float16"), chunk_tokens=3, chunk_heads=1)


@pytest.mark.parametrize("lie, match", [
    ([12, 12], "layer_tokens"),        # not ragged at all, yet bit 0 set
    ([5, 12, 3], "layer_tokens"),      # one count per layer
    ([0, 12], "layer_tokens"),         # a layer with no tokens
    ([13, 12], "layer_tokens"),        # more than the tensors' tokens
    ([5.0, 12], "layer_tokens"),       # not an int
    ("5,12", "layer_tokens"),
    ([4, 12], "index entry|tile"),     # the chunks cover 5 tokens of layer 0
    ([6, 12], "index entry|tile"),
])
def test_lying_layer_tokens_are_one_format_error(lie, match):
    data = ragged_file()
    obj = header_obj(data)
    assert obj["tensors"]["layer_tokens"] == [5, 12] and split(data)["req"] == 1
    obj["tensors"]["layer_tokens"] = lie
    with pytest.raises(KvcFormatError, match=match):
        open_and_verify(with_header(data, obj))


def test_ragged_header_rules():
    data = ragged_file()
    parts = split(data)
    with pytest.raises(KvcFormatError, match="layer_tokens"):  # layer_tokens without feature bit 0
        KvcReader(assemble(parts, req=0))
    obj = header_obj(data)
    del obj["tensors"]["layer_tokens"]
    with pytest.raises(KvcFormatError, match="layer_tokens"):
        KvcReader(with_header(data, obj))
    obj = header_obj(data)
    obj["tensors"]["layer_tokens"] = [12, 5]  # chunks of layer 0 tile 5 tokens: now a tiling error, never a misread
    with pytest.raises(KvcFormatError):
        open_and_verify(with_header(data, obj))
    obj = header_obj(data)
    obj["positions"] = {"blob": 0}  # ragged + positions is not a layout
    with pytest.raises(KvcFormatError, match="positions"):
        KvcReader(with_header(data, obj))
    assert only_format_errors(data) == "ok"
