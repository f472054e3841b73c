"""Bounds on untrusted input (issue 14): capped decompression on every path, the per-file declared-output
limit, regular files only, no SIGBUS when a file shrinks, captures that cannot make us allocate before they
are checked, corrupt HDF5 metadata, and strict header parsing."""

from __future__ import annotations

import json
import os
import signal
import struct
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from kvcodec.errors import KvcCodecError, KvcError, KvcFormatError, KvcInputError
from kvcodec.format import KvcReader, encode_kvc_bytes, lossless_pipeline, write_kvc
from kvcodec.codecs.lossless import fp16_pipeline
from kvcodec.core.kvcache import load_capture, load_h5, load_safetensors, save_h5, save_safetensors
from kvcodec.limits import MAX_DECODED_ENV, MAX_RATIO_ENV
from kvcodec.decode.cpu import fused as fastdecode
from formatutil import assert_same_cache, synthetic_cache  # noqa: E402

from kvcodec.testing.surgery import assemble, crc, header_obj, split, with_header  # noqa: E402

FIELDS = struct.Struct("<IBBHIIIIQQII")


class _Alarm:
    """Fail (instead of hanging the suite) if the body blocks for more than ``s`` seconds."""

    def __init__(self, s: int = 10) -> None:
        self.s = s

    def __enter__(self) -> None:
        def boom(*_):
            raise AssertionError(f"blocked for {self.s} s")

        self.old = signal.signal(signal.SIGALRM, boom)
        signal.alarm(self.s)

    def __exit__(self, *exc) -> None:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, self.old)


def _replace_payload(data: bytes, j: int, payload: bytes) -> bytes:
    """``data`` with chunk j's payload replaced (record re-laid out, CRCs fixed); j must be the last chunk."""
    parts = split(data)
    idx = bytearray(parts["index"])
    f = list(FIELDS.unpack_from(idx, 48 * j))
    off, length = f[8], f[9]
    body = bytearray(parts["data"])
    rec = bytearray(body[off : off + length])
    plen = struct.unpack_from("<Q", rec, 8)[0]
    rec = rec[: len(rec) - plen] + payload
    struct.pack_into("<Q", rec, 8, len(payload))
    assert off + length + (-(off + length)) % 64 == len(body), "only the last chunk can change length here"
    body = body[:off] + rec
    f[9], f[10] = len(rec), crc(bytes(rec))
    FIELDS.pack_into(idx, 48 * j, *f)
    return assemble(parts, index=bytes(idx), data=bytes(body) + bytes((-len(body)) % 64))


# -- decompression caps --------------------------------------------------------
@pytest.mark.parametrize("shuffle", [True, False])
def test_zstd_bomb_is_capped_on_the_fused_and_generic_paths(shuffle):
    """A chunk whose zstd frame expands far beyond its declared size must not allocate the expansion."""
    c = synthetic_cache(torch.float32, T=64)
    data = encode_kvc_bytes(c, lossless_pipeline("float32", shuffle=shuffle))
    with KvcReader(data) as r:
        j = r.num_chunks - 1
        e = r.entries[j]
        declared = e.heads * e.tokens * 8 * 4
    cobj = zstandard.ZstdCompressor(level=3).compressobj()  # 256 MiB of zeros, content size in the frame
    bomb = b"".join(cobj.compress(bytes(1 << 20)) for _ in range(256)) + cobj.flush()
    assert len(bomb) < 100_000
    bad = _replace_payload(data, j, bomb)
    tracemalloc.start()
    try:
        with KvcReader(bad) as r:
            with pytest.raises(KvcFormatError, match="zstd"):
                r.read_chunk(j)
            # the fused lossless decoder alone (before the generic path) must not expand it either
            from kvcodec.format.container import parse_chunk
            from kvcodec.core.stage import chunk_context
            from kvcodec.core.stage import ArraySpec

            pipe = r.header.pipelines[e.pipeline]
            payload, sides, sizes = parse_chunk(r.read_chunk_record(j), len(pipe.stages), len(pipe.byte_stages), j)
            ctx = chunk_context(e.layer, e.kind, e.token_start, e.token_end, e.head_start, e.head_end, None, {}, j)
            with pytest.raises(KvcFormatError, match="zstd"):
                fastdecode.decode(pipe, payload, sides, sizes, ArraySpec((e.heads, e.tokens, 8), "float32"), ctx)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * declared + (8 << 20), f"peak {peak} bytes for a {declared}-byte chunk"


def test_zstd_trailing_frames_and_short_output():
    c = synthetic_cache(torch.float32, T=8)
    data = encode_kvc_bytes(c, lossless_pipeline("float32", shuffle=False))
    with KvcReader(data) as r:
        j = r.num_chunks - 1
        good = bytes(r.read_chunk_record(j))
        plen = struct.unpack_from("<Q", good, 8)[0]
        frame = good[len(good) - plen :]
        n = r.entries[j].heads * r.entries[j].tokens * 8 * 4
    empty = zstandard.ZstdCompressor().compress(b"")
    with KvcReader(_replace_payload(data, j, frame + empty)) as r:  # a trailing empty frame is fine
        assert np.array_equal(r.read_chunk(j), c.values[1].numpy())
    for junk in (frame + b"\0", frame + zstandard.ZstdCompressor().compress(b"x"),
                 zstandard.ZstdCompressor().compress(bytes(n - 1)),
                 zstandard.ZstdCompressor(write_content_size=False).compress(bytes(n + 1))):
        with KvcReader(_replace_payload(data, j, junk)) as r:
            with pytest.raises(KvcFormatError, match="zstd"):
                r.read_chunk(j)


# -- per-file declared-output limit ------------------------------------------------
def test_declared_output_limit(monkeypatch):
    c = synthetic_cache(torch.float32, T=16)
    data = encode_kvc_bytes(c, lossless_pipeline("float32"))
    total = c.num_elements * 4
    with KvcReader(data, max_decoded_bytes=total) as r:
        assert_same_cache(r.read_cache(), c)
    with pytest.raises(KvcFormatError, match=MAX_DECODED_ENV):
        KvcReader(data, max_decoded_bytes=total - 1)
    monkeypatch.setenv(MAX_DECODED_ENV, str(total - 1))
    with pytest.raises(KvcFormatError, match="over the limit"):
        KvcReader(data)
    for bad in ("12k", "-5", "0", "1e9", "١٢٣"):
        monkeypatch.setenv(MAX_DECODED_ENV, bad)
        with pytest.raises(KvcInputError, match=MAX_DECODED_ENV):
            KvcReader(data)
    monkeypatch.delenv(MAX_DECODED_ENV)
    with pytest.raises(KvcInputError):
        KvcReader(data, max_decoded_bytes=True)


def test_a_tiny_file_declaring_terabytes_is_refused_before_allocation():
    """Consistent header + index claiming 2**31-1 tokens per tensor: refused by the limit, nothing allocated."""
    c = synthetic_cache(torch.float32, T=4)
    f = encode_kvc_bytes(c, lossless_pipeline("float32"), store_token_ids=False)
    parts = split(f)
    idx = bytearray(parts["index"])
    for j in range(parts["count"]):
        fields = list(FIELDS.unpack_from(idx, 48 * j))
        fields[5] = 2**20
        FIELDS.pack_into(idx, 48 * j, *fields)
    obj = header_obj(f)
    obj["tensors"]["tokens"] = obj["context"]["tokens"] = 2**20
    bad = assemble(split(f), header=json.dumps(obj).encode(), index=bytes(idx))
    tracemalloc.start()
    try:
        with pytest.raises(KvcFormatError, match="over the limit"):
            KvcReader(bad, max_decoded_bytes=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20


# -- declared output relative to the file's size (issue 35) ---------------------------------------
def test_a_valid_tiny_file_declaring_a_huge_decode_is_refused_by_its_ratio(monkeypatch):
    """A sound file of zeros: ~9 KB declaring 65.5 MB. Every absolute limit lets it through; the ratio to its
    own size refuses it at open, before anything is decoded or allocated."""
    from kvcodec.testing.attacks import amplification_entry

    _, data = amplification_entry(7, 500)
    declared = 2 * 16 * 8 * 500 * 128 * 4
    assert len(data) < 16 << 10 and declared / len(data) > 5000
    tracemalloc.start()
    try:
        with pytest.raises(KvcFormatError, match=r"x its size\), over the limit of 256x") as e:
            KvcReader(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20 and "\n" not in str(e.value) and MAX_RATIO_ENV in str(e.value)
    with KvcReader(data, max_decoded_ratio=0) as r:  # 0: no ratio limit (the absolute one still holds)
        assert r.declared_bytes == declared
    ratio = declared / len(data)
    with KvcReader(data, max_decoded_ratio=ratio):
        pass
    with pytest.raises(KvcFormatError, match="over the limit"):
        KvcReader(data, max_decoded_ratio=ratio * 0.999)
    monkeypatch.setenv(MAX_RATIO_ENV, "0")
    with KvcReader(data):
        pass
    for bad in ("-1", "inf", "nan", "x", "١"):
        monkeypatch.setenv(MAX_RATIO_ENV, bad)
        with pytest.raises(KvcInputError, match=MAX_RATIO_ENV):
            KvcReader(data)
    monkeypatch.delenv(MAX_RATIO_ENV)
    for bad in (-1.0, float("inf"), float("nan"), True, "3"):
        with pytest.raises(KvcInputError):
            KvcReader(data, max_decoded_ratio=bad)


def test_kvc_verify_of_an_amplifying_file_is_one_line_and_nonzero(tmp_path, capsys):
    from cliutil import run_kvc
    from kvcodec.testing.attacks import amplification_entry

    p = tmp_path / "amp.kvc"
    p.write_bytes(amplification_entry(7, 500)[1])
    code, out, err = run_kvc(["verify", str(p)], capsys)
    assert code == 3 and "its size" in err and len(err.strip().splitlines()) == 1
    code, out, err = run_kvc(["verify", "--max-decoded-ratio", "0", str(p)], capsys)
    assert code == 0 and out.startswith("OK"), err


@pytest.mark.parametrize("preset", ["lossless", "fp16", "raw"])
def test_reading_holds_one_chunk_at_a_time(preset):
    """The stated memory bound (spec/kvc-v1.md §9): verify and read_chunk allocate at most ~3x the largest
    chunk's decoded size, whatever the file's total; max_chunk_bytes bounds that chunk at open."""
    from kvcodec.api import encode
    from kvcodec.testing.attacks import costly_entry

    _, data = costly_entry(3, 64)  # 16 layers x K/V: 32 chunks of 256 KiB each
    data = encode(KvcReader(data).read_cache("cpu"), preset=preset, verify="off").data
    with KvcReader(data) as r:
        chunk = max(e.heads * e.tokens * r.header.head_dims[e.layer] * 4 for e in r.entries)
        assert r.declared_bytes >= 16 * chunk
        r.read_chunk(0, "cpu")  # imports and first-call set-up are not the file's
        tracemalloc.start()
        try:
            assert r.verify(backend="cpu") == []
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert peak < 3 * chunk + (1 << 20), f"{peak} bytes for chunks of {chunk}"
    with pytest.raises(KvcFormatError, match="write smaller chunks"):
        KvcReader(data, max_chunk_bytes=chunk - 1)
    with KvcReader(data, max_chunk_bytes=chunk):
        pass


# -- what gets opened ---------------------------------------------------------
@pytest.mark.parametrize("loader", [KvcReader, load_h5, load_safetensors, load_capture])
def test_non_regular_files_are_refused_without_blocking(tmp_path, loader):
    fifo = tmp_path / "in.fifo"
    os.mkfifo(fifo)
    with _Alarm(10):
        for p, what in ((fifo, "FIFO"), (Path("/dev/zero"), "device"), (tmp_path, "directory")):
            with pytest.raises(KvcInputError, match=what):
                loader(p)
    with pytest.raises(KvcInputError, match="no such file"):
        loader(tmp_path / "missing.kvc")


def test_a_file_shrinking_under_the_reader_is_an_error_not_sigbus(tmp_path):
    c = synthetic_cache(torch.float32, T=256)
    p = tmp_path / "x.kvc"
    write_kvc(c, p, lossless_pipeline("float32"), chunk_tokens=32)
    with KvcReader(p) as r:
        first = r.read_chunk(0)
        with open(p, "r+b") as f:
            f.truncate(r.header.data_start + r.entries[r.num_chunks // 2].offset)
        assert np.array_equal(r.read_chunk(0), first)  # what is still there reads fine
        with pytest.raises(KvcFormatError, match="shrank"):
            r.verify(strict=True)
    with pytest.raises(KvcFormatError):
        KvcReader(p)



def _write_with_holes(path: Path, data: bytes, block: int = 1 << 16) -> None:
    """``data`` written as `cp --sparse=always` would: every all-zero block a hole."""
    with open(path, "wb") as f:
        for at in range(0, len(data), block):
            piece = data[at : at + block]
            if piece.count(0) == len(piece):
                f.seek(len(piece), os.SEEK_CUR)
            else:
                f.write(piece)
        f.truncate(len(data))


def test_a_sparse_kvc_is_refused_before_anything_is_read(tmp_path):
    """A .kvc that is mostly holes (here an 8 MiB stored attachment of zeros left unallocated) opened like any
    file: the declared-output ratio was taken against its 8 MiB size although a few kilobytes are on disk, and
    its stored attachments and chunk records are read whole, so a hole of terabytes made the reader allocate
    terabytes. Refused at open, by the path source and the store's file range reader alike, with the rule
    captures already had (kvcodec.limits.check_not_sparse); the same bytes without holes read as before."""
    import kvcodec
    from kvcodec.store.ranged import FileRangeReader

    c = synthetic_cache(torch.float32, T=8)
    data = encode_kvc_bytes(c, lossless_pipeline("float32"), attachments={"pad": np.zeros(8 << 20, np.uint8)})
    sparse, dense = tmp_path / "sparse.kvc", tmp_path / "dense.kvc"
    _write_with_holes(sparse, data)
    dense.write_bytes(data)
    if os.stat(sparse).st_blocks * 512 * 64 >= len(data):
        pytest.skip("this file system does not keep holes")
    for open_it in (lambda p: kvcodec.open(p), lambda p: KvcReader(FileRangeReader(p))):
        with pytest.raises(KvcFormatError, match="sparse file"):
            open_it(sparse)
        with open_it(dense) as r:
            assert r.verify() == []
    # few blocks without a hole (a compressing file system, ZFS before its commit) is not a sparse file
    from types import SimpleNamespace

    from kvcodec.limits import check_not_sparse

    few = SimpleNamespace(st_size=len(data), st_blocks=8)
    for path, refused in ((dense, False), (sparse, True)):
        fd = os.open(path, os.O_RDONLY)
        try:
            if refused:
                with pytest.raises(KvcFormatError, match="sparse file"):
                    check_not_sparse(few, str(path), "a .kvc file", fd)  # type: ignore[arg-type]
            else:
                check_not_sparse(few, str(path), "a .kvc file", fd)  # type: ignore[arg-type]
        finally:
            os.close(fd)


# -- captures ------------------------------------------------------------------
def _sparse_h5(path: Path, T: int, layers_T: int | None = None) -> None:
    c = synthetic_cache(torch.float32, T=4)
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "kvcodec-capture"
        f.attrs["format_version"] = 1
        f.attrs["fingerprint"] = json.dumps(c.fingerprint.to_json())
        f.attrs["meta"] = "{}"
        f.attrs["dtype"] = "float32"
        f.create_dataset("token_ids", shape=(T,), dtype="i4", chunks=True)
        g = f.create_group("layers")
        for i in range(2):
            gg = g.create_group(str(i))
            for kind in ("key", "value"):
                gg.create_dataset(kind, shape=(2, layers_T or T, 8), dtype="f4", chunks=True)


def test_sparse_hdf5_capture_is_refused_before_allocating(tmp_path):
    p = tmp_path / "sparse.h5"
    _sparse_h5(p, T=25_000_000)  # 3.2 GB declared, a few KB on disk
    assert p.stat().st_size < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(KvcFormatError, match="sparse"):
            load_h5(p)
        _sparse_h5(p, T=16, layers_T=20_000_000)  # inconsistent shapes: refused from metadata alone
        with pytest.raises(KvcFormatError, match=r"layer 0 key has shape \(2, 20000000, 8\), expected \(2, 16, 8\)"):
            load_h5(p)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_capture_limit_and_sparse_safetensors(tmp_path, monkeypatch):
    c = synthetic_cache(torch.float32, T=64)
    p = tmp_path / "c.safetensors"
    save_safetensors(c, p)
    assert_same_cache(load_safetensors(p), c)
    with pytest.raises(KvcFormatError, match="over the limit"):
        load_safetensors(p, max_decoded_bytes=1000)
    h = tmp_path / "c.h5"
    save_h5(c, h)
    monkeypatch.setenv(MAX_DECODED_ENV, "1000")
    with pytest.raises(KvcFormatError, match="over the limit"):
        load_h5(h)
    monkeypatch.delenv(MAX_DECODED_ENV)
    # a safetensors capture of 2**24 tokens, consistent, but a sparse file: refused before reading it
    big = tmp_path / "big.safetensors"
    T = 1 << 24
    hdr: dict = {"__metadata__": {"format": "kvcodec-capture", "fingerprint": json.dumps(c.fingerprint.to_json()), "meta": "{}"}}
    off = 0
    for name, shape, dt, size in [("token_ids", [T], "I32", 4)] + [
            (f"layers.{i}.{k}", [2, T, 8], "F32", 4) for i in range(2) for k in ("key", "value")]:
        n = int(np.prod(shape)) * size
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(hdr).encode()
    hb += b" " * ((-len(hb)) % 8)
    with open(big, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        f.truncate(8 + len(hb) + off)
    tracemalloc.start()
    try:
        with pytest.raises(KvcFormatError, match="sparse"):
            load_safetensors(big)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


def test_corrupt_hdf5_metadata_is_a_format_error(tmp_path):
    """Byte changes all over a real capture's HDF5 metadata: a KvcError or the same cache, nothing else."""
    c = synthetic_cache(torch.float16, T=8)
    good = tmp_path / "good.h5"
    save_h5(c, good)
    data = good.read_bytes()
    rng = np.random.default_rng(0)
    bad = tmp_path / "bad.h5"
    outcomes = {"rejected": 0, "same": 0}
    # HDF5 metadata sits in the first ~2 KB (superblock, root group, attributes) and after the data
    positions = rng.integers(0, min(len(data), 2048), 60).tolist() + rng.integers(0, len(data), 20).tolist()
    for pos in positions:
        b = bytearray(data)
        b[pos] ^= 0xFF if pos % 2 else 0x01
        bad.write_bytes(bytes(b))
        try:
            back = load_h5(bad)
        except KvcError as exc:
            assert "\n" not in str(exc)
            outcomes["rejected"] += 1
        else:
            outcomes["same"] += 1  # some bytes (unused fields, padding, data) do not matter or change values only
            assert back.fingerprint == c.fingerprint
    assert outcomes["rejected"] > 8, outcomes  # and no crash: libhdf5 runs in the sandbox process


# -- strict header ------------------------------------------------------------------
@pytest.fixture(scope="module")
def small_file() -> bytes:
    c = synthetic_cache(torch.float16, T=8)
    return encode_kvc_bytes(c, lossless_pipeline("float16"), chunk_tokens=3, meta={"a": 1})


def _with(small_file: bytes, edit) -> bytes:
    obj = header_obj(small_file)
    edit(obj)
    return with_header(small_file, obj)


@pytest.mark.parametrize("edit, match", [
    (lambda o: o["tensors"].__setitem__("tokens", 8.0), "tokens"),
    (lambda o: o["tensors"].__setitem__("layers", 2.0), "shapes"),
    (lambda o: o["tensors"].__setitem__("head_dims", [8.0, 8]), "shapes"),
    (lambda o: o["model"].__setitem__("head_dims", [8.0, 8]), "head_dims"),
    (lambda o: o["model"].__setitem__("num_layers", 2.0), "num_layers"),
    (lambda o: o["model"].__setitem__("num_kv_heads", True), "num_kv_heads"),
    (lambda o: o["model"].__setitem__("version", True), "version"),
    (lambda o: o["model"].__setitem__("version", 1.0), "version"),
    (lambda o: o["model"].__setitem__("version", 99), "version 99"),
    (lambda o: o["model"].pop("version"), "version"),
    (lambda o: o["model"].__setitem__("dtype", 3), "dtype"),
    (lambda o: o["context"].__setitem__("tokens", True), "context.tokens"),
    (lambda o: o["blobs"][0].__setitem__("length", 32.0), "length"),
    (lambda o: o["chunking"].__setitem__("tokens", 3.0), "chunking"),
    (lambda o: o.__setitem__("writer", ["kvcodec"]), "writer"),
    (lambda o: o["pipelines"][0][0].__setitem__("version", True), "version"),
    (lambda o: o["pipelines"][0][2]["config"].__setitem__("level", 3.0), "level"),
    (lambda o: o["meta"].__setitem__("s", "\ud800"), "surrogate"),
    (lambda o: o.__setitem__("writer", "kvc \udfff"), "surrogate"),
    (lambda o: o["meta"].__setitem__("\ud83d", 1), "surrogate"),
])
def test_strict_header_fields(small_file, edit, match):
    with pytest.raises(KvcFormatError, match=match):
        KvcReader(_with(small_file, edit))


def test_header_rules_that_still_accept(small_file):
    ok = _with(small_file, lambda o: (o["meta"].__setitem__("emoji", "\ud83d\ude00"), o.__setitem__("future", {"x": 1})))
    with KvcReader(ok) as r:
        assert r.header.meta["emoji"] == "\U0001f600" and r.verify() == []
    parts = split(small_file)
    for text in (b'{"a":1e400}', b'{"a":-1e999}'):
        with pytest.raises(KvcFormatError, match="overflows"):
            KvcReader(assemble(parts, header=text))



@pytest.mark.parametrize("meta", [
    {"prune": {"kept_fraction": 10**400}},  # describe(): float(kept_fraction) raised OverflowError
    {"prune": {"context_tokens": -(10**400)}},
    {"edits": [{"op": "append", "params": {}, "parent_sha256": "0" * 64, "parent_token_ids_sha256": "0" * 64,
                "promise": {"preset": "lossless", "kl": 10**400, "basis": "b"}}]},  # kvc info: the edit log's check
    {"x": 2**1024},  # just past a double's range
])
def test_an_integer_past_a_doubles_range_is_refused_like_1e400(small_file, meta, tmp_path, capsys):
    """A JSON integer literal overflowing a double is a number that overflows a double (spec section 4), as 1e400
    is: it escaped as OverflowError from describe() and `kvc info` when meta held one (found by field-by-field
    header surgery with the CRCs recomputed)."""
    from kvcodec.cli.main import main

    bad = _with(small_file, lambda o: o.__setitem__("meta", meta))
    with pytest.raises(KvcFormatError, match="overflows a double"):
        KvcReader(bad)
    path = tmp_path / "big.kvc"
    path.write_bytes(bad)
    with pytest.raises(SystemExit) as exc:
        main(["info", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == KvcFormatError.exit_code and len(err) == 1 and "overflows a double" in err[0]
    fine = _with(small_file, lambda o: o.__setitem__("meta", {"x": int(1.7e308), "y": -(2**64)}))
    with KvcReader(fine) as r:
        assert r.header.meta["y"] == -(2**64) and r.describe()["meta"]["x"] == int(1.7e308)


# -- encode-side range checks ---------------------------------------------------------
def test_fp16_cast_refuses_overflow_and_keeps_nonfinite_exact():
    c = synthetic_cache(torch.float32, T=8)
    c.keys[1][1, 3, 2] = 70000.0
    with pytest.raises(KvcCodecError, match="overflows float16"):
        encode_kvc_bytes(c, fp16_pipeline())
    c.keys[1][1, 3, 2] = 65504.0  # the largest float16: fine
    c.values[0][0, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")])
    back = KvcReader(encode_kvc_bytes(c, fp16_pipeline())).read_cache()
    assert back.keys[1][1, 3, 2] == 65504.0
    assert torch.isposinf(back.values[0][0, 0, 0]) and torch.isneginf(back.values[0][0, 0, 1]) and torch.isnan(back.values[0][0, 0, 2])


def test_writer_reads_back_before_the_rename(tmp_path, monkeypatch):
    """A decoder that disagrees with the encoder is caught by the read-back: nothing appears at dest."""
    import kvcodec.decode.cpu.fused as fd

    c = synthetic_cache(torch.float32, T=16)
    real = fd.decode

    def wrong(*a, **k):
        out = real(*a, **k).copy()
        out.reshape(-1)[0] += 1
        return out

    monkeypatch.setattr(fd, "decode", wrong)
    dest = tmp_path / "x.kvc"
    with pytest.raises(KvcCodecError, match="does not read back"):
        write_kvc(c, dest, lossless_pipeline("float32"))
    assert not dest.exists() and not list(tmp_path.iterdir())
    with pytest.raises(KvcCodecError, match="does not read back"):
        encode_kvc_bytes(c, lossless_pipeline("float32"))
    write_kvc(c, dest, lossless_pipeline("float32"), verify="off")  # the check is what caught it
    assert dest.exists()


def _near_definition(out, want) -> bool:
    """The read-back's bound in plain numpy float64: what the writer's numba pass must equal."""
    from kvcodec.format.readback import LOSSY_BOUND

    if out.shape != want.shape:
        return False
    x, o = want.ravel().astype(np.float64), out.ravel().astype(np.float64)
    fin = np.isfinite(x)
    if not np.array_equal(o[~fin], x[~fin], equal_nan=True) or not np.isfinite(o[fin]).all():
        return False
    d = o[fin] - x[fin]
    return float(d @ d) <= LOSSY_BOUND * float(x[fin] @ x[fin])


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_read_back_bound_equals_its_definition(dtype):
    from kvcodec.format.readback import _near

    rng = np.random.default_rng(7)
    want = rng.standard_normal((2, 33, 16)).astype(dtype)
    cases = {"exact": want.copy(), "small error": (want + 0.3 * rng.standard_normal(want.shape)).astype(dtype),
             "past the bound": (want * -0.5).astype(dtype), "zeroed (at the bound's edge, inside)": np.zeros_like(want)}
    w_nonfin = want.copy()
    w_nonfin[0, 3, 2], w_nonfin[1, 7, 0], w_nonfin[1, 8, 1] = np.inf, -np.inf, np.nan
    for name, out in list(cases.items()):
        assert _near(out, want) == _near_definition(out, want), name
        o = out.copy()
        o[0, 3, 2], o[1, 7, 0], o[1, 8, 1] = np.inf, -np.inf, np.nan  # kept exactly where the input is not finite
        assert _near(o, w_nonfin) == _near_definition(o, w_nonfin) and _near(o, w_nonfin) == _near(out, want), name
    bad = want.copy()
    bad[1, 2, 3] = np.nan  # non-finite where the input is finite
    assert not _near(bad, want) and not _near_definition(bad, want)
    o = want.copy()
    o[0, 3, 2], o[1, 7, 0], o[1, 8, 1] = -np.inf, -np.inf, np.nan  # a flipped infinity
    assert not _near(o, w_nonfin) and not _near_definition(o, w_nonfin)
    assert not _near(want[:, :32], want)
    assert _near(cases["exact"], want) and not _near(cases["past the bound"], want)
    if dtype is np.float32:  # float32 squares overflow here; float64 sums do not
        big = (want * np.float32(1e25)).astype(np.float32)
        assert _near(big * np.float32(1.01), big) and not _near(big * np.float32(-1), big)


# -- never write what cannot be read: extreme-valued real caches -------------------------------
EXTREMES = ["scale:1e-30", "scale:1e-6", "scale:1e3", "scale:1e5", "scale:3e7", "scale:1e30", "const:0", "const:1.5",
            "const:-7e4", "subnormal", "inf", "nan", "sink-outlier:1e6", "outlier:1e9"]


def _extreme(cache, kind: str, layer: int):
    import copy

    c = copy.deepcopy(cache)
    name, _, arg = kind.partition(":")
    for t in c.keys + c.values:
        if name == "scale":
            t.mul_(float(arg))
        elif name == "const":
            t.fill_(float(arg))
        elif name == "subnormal":
            t.mul_(1e-40)
    tgt = c.keys[layer]
    if name == "inf":
        tgt[1, 5, 3] = float("inf")
    elif name == "nan":
        tgt[0, 9, 1] = float("nan")
    elif name == "sink-outlier":
        tgt[2, 1, 7] = float(arg)  # token 1: a kept sink token
    elif name == "outlier":
        c.values[layer][0, 20, 0] = float(arg)
    return c


@pytest.mark.model
@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])  # no shrinking: each example encodes a real cache
@given(data=st.data())
def test_the_writer_never_produces_a_file_its_reader_rejects(real_cache, data):
    """Real-shaped caches with extreme values, every preset, chunked or not: either a one-line KvcError at
    encode, or a file that reads back (independently of the writer's own check) exactly as policy says."""
    from kvcodec.plan.presets import get_plan

    kind = data.draw(st.sampled_from(EXTREMES), label="values")
    preset = data.draw(st.sampled_from(["lossless", "fp16", "near-lossless", "balanced", "small"]), label="preset")
    chunk = data.draw(st.sampled_from([None, 8]), label="chunk_tokens")
    c = _extreme(real_cache(32), kind, data.draw(st.integers(0, 29), label="layer"))
    finite = all(torch.isfinite(t).all() for t in c.keys + c.values)
    amax = max(float(t.abs().max()) for t in c.keys + c.values) if finite else float("inf")
    try:
        plan = get_plan(preset, c)
        blob = encode_kvc_bytes(c, plan.pipelines, attachments=plan.attachments or None, chunk_tokens=chunk, preset=preset)
    except (KvcCodecError, KvcInputError) as exc:
        assert "\n" not in str(exc)
        # policy: lossless stores anything; fp16 refuses only finite values beyond its range;
        # lossy presets refuse only non-finite caches or ranges their float16 side data cannot carry
        assert preset != "lossless", exc
        assert preset != "fp16" or (finite and amax > 65504), exc
        assert preset in ("lossless", "fp16") or not finite or amax > 1e6, exc
        return
    with KvcReader(blob) as r:
        assert r.verify() == []
        back = r.read_cache()
    if preset == "lossless":
        assert_same_cache(back, c)
    elif preset == "fp16":
        for a, b in zip(c.keys + c.values, back.keys + back.values):
            assert torch.equal(a.half().float().isnan(), b.isnan()) and torch.equal(a.half().float().nan_to_num(), b.nan_to_num())
    else:  # lossy: finite input, finite output (fidelity on out-of-distribution values is the codec's business)
        assert finite
        assert all(torch.isfinite(b).all() for b in back.keys + back.values)


@pytest.mark.model
def test_writer_read_back_catches_a_lossy_decoder_that_drifts_or_breaks(monkeypatch, small_cache):
    """Lossy files are read back once with the fast decoder: the first chunk of each stage structure must equal
    the reference decode bit for bit (a drift of 1e-3 is caught), every other chunk must stay near its input
    (a chunk decoded to garbage is caught); a faithful decoder passes."""
    import kvcodec.decode.cpu.fused as fd
    from kvcodec.plan.pipelines import transform_plan

    c = small_cache  # a head_dim the fused decoder takes (a real SmolLM2 cache)
    plan = transform_plan(c, 0.05, basis="hadamard", sink=4)
    encode_kvc_bytes(c, plan)
    real = fd.decode
    calls: list[int] = []

    def drift(*a, **k):
        out = real(*a, **k).copy()
        out.reshape(-1)[-1] += 1e-3
        return out

    def garbage_later(*a, **k):
        out = real(*a, **k).copy()
        calls.append(1)
        if len(calls) == 3:  # not a first chunk of its structure: only the bound can catch it
            out *= -3.0
        return out

    for bad in (drift, garbage_later):
        monkeypatch.setattr(fd, "decode", bad)
        with pytest.raises(KvcCodecError, match="does not read back"):
            encode_kvc_bytes(c, plan)
    assert len(calls) >= 3
