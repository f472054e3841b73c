"""A minimal `.kvc` v1 reader written only from spec/kvc-v1.md.

It deliberately imports nothing from kvcodec: struct + google_crc32c +
zstandard + numpy. It supports the built-in stages (raw, shuffle, zstd) and
checks every CRC and the layout rules it relies on. Returns plain numpy data.
"""

from __future__ import annotations

import hashlib
import json
import struct

import google_crc32c
import numpy as np
import zstandard

ELEM = {1: "uint8", 2: "int8", 3: "uint16", 4: "int16", 5: "uint32", 6: "int32",
        7: "uint64", 8: "int64", 9: "float16", 10: "float32", 11: "float64"}


class SpecError(Exception):
    pass


def _crc(b: bytes) -> int:
    return google_crc32c.value(bytes(b))


def _align(n: int) -> int:
    return (n + 63) // 64 * 64


def _unshuffle(data: bytes, e: int) -> bytes:
    m = len(data) // e
    out = bytearray(len(data))
    for b in range(e):
        out[b : m * e : e] = data[b * m : (b + 1) * m]
    out[m * e :] = data[m * e :]
    return bytes(out)


def _unzstd(data: bytes, size: int) -> bytes:
    with zstandard.ZstdDecompressor(max_window_size=1 << 23).stream_reader(data, read_across_frames=True) as r:
        out = r.read(size + 1)
        while len(out) <= size:
            more = r.read(size + 1 - len(out))
            if not more:
                break
            out += more
    if len(out) != size:
        raise SpecError("zstd size mismatch")
    return out


def read(data: bytes) -> dict:
    if data[:8] != b"\x89KVC\r\n\x1a\n":
        raise SpecError("magic")
    major, minor, hlen, req, opt = struct.unpack_from("<HHIQQ", data, 8)
    if major != 1 or req != 0:
        raise SpecError("version/features")
    if _crc(data[: 32 + hlen]) != struct.unpack_from("<I", data, 32 + hlen)[0]:
        raise SpecError("header crc")
    hdr = json.loads(data[32 : 32 + hlen].decode("utf-8"))
    dstart = _align(36 + hlen)
    size = len(data)
    ioff, count, icrc, fcrc = struct.unpack_from("<QQII", data, size - 32)
    if data[size - 8 :] != b"\x89KVCEND\n" or _crc(data[size - 32 : size - 12]) != fcrc:
        raise SpecError("footer")
    if ioff + 48 * count != size - 32 or _crc(data[ioff : ioff + 48 * count]) != icrc:
        raise SpecError("index")

    def blob(i: int) -> np.ndarray:
        b = hdr["blobs"][i]
        raw = data[dstart + b["offset"] : dstart + b["offset"] + b["length"]]
        if _crc(raw) != b["crc32c"]:
            raise SpecError("blob crc")
        return np.frombuffer(raw, dtype=np.dtype(b["dtype"]).newbyteorder("<")).reshape(b["shape"])

    t = hdr["tensors"]
    L, H, T, dims, dtype = t["layers"], t["kv_heads"], t["tokens"], t["head_dims"], t["dtype"]
    pdtype = "float32" if dtype == "bfloat16" else dtype
    out = np.zeros((L, 2, H, T, max(dims)), dtype=pdtype)
    seen = np.zeros((L, 2, H, T), dtype=np.int8)
    for j in range(count):
        layer, kind, _r1, pid, t0, t1, h0, h1, off, length, crc, _r2 = struct.unpack_from("<IBBHIIIIQQII", data, ioff + 48 * j)
        rec = data[dstart + off : dstart + off + length]
        if _crc(rec) != crc:
            raise SpecError(f"chunk {j} crc")
        ns, nz, nside, _res, plen = struct.unpack_from("<BBHIQ", rec, 0)
        pos = 16
        sizes = list(struct.unpack_from(f"<{nz}Q", rec, pos))
        pos += 8 * nz
        for _ in range(nside):  # built-in stages have no side data; skip over any
            _si, nlen, code, ndim = struct.unpack_from("<BBBB", rec, pos)
            pos += 4 + nlen
            shape = struct.unpack_from(f"<{ndim}I", rec, pos)
            pos += 4 * ndim + int(np.prod(shape)) * np.dtype(ELEM[code]).itemsize
        payload = bytes(rec[pos : pos + plen])
        if pos + plen != length:
            raise SpecError("record length")
        stages = hdr["pipelines"][pid]
        byte_stages = stages[1:]
        for st, sz in zip(reversed(byte_stages), reversed(sizes)):
            if st["name"] == "zstd":
                payload = _unzstd(payload, sz)
            elif st["name"] == "shuffle":
                payload = _unshuffle(payload, st["config"]["elementsize"])
            else:
                raise SpecError(f"unknown stage {st['name']}")
        first = stages[0]
        if first["name"] != "raw":
            raise SpecError(f"unknown stage {first['name']}")
        shape = (h1 - h0, t1 - t0, dims[layer])
        if first["config"].get("dtype") == "bfloat16":
            arr = (np.frombuffer(payload, "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(payload, np.dtype(dtype).newbyteorder("<"))
        out[layer, kind, h0:h1, t0:t1, : dims[layer]] = arr.reshape(shape)
        seen[layer, kind, h0:h1, t0:t1] += 1
    if not (seen == 1).all():
        raise SpecError("chunks do not tile the tensors")
    ctx = hdr["context"]
    ids = None if ctx["token_ids_blob"] is None else blob(ctx["token_ids_blob"]).astype(np.int64)
    if ids is not None and hashlib.sha256(ids.astype("<i8").tobytes()).hexdigest() != ctx["token_ids_sha256"]:
        raise SpecError("token id hash")
    positions = None if hdr.get("positions") is None else blob(hdr["positions"]["blob"]).astype(np.int64)
    attachments = {}
    for name, a in hdr.get("attachments", {}).items():
        if "blob" in a:
            arr = blob(a["blob"])
            if hashlib.sha256(arr.astype(arr.dtype.newbyteorder("<")).tobytes()).hexdigest() != a["sha256"]:
                raise SpecError("attachment hash")
            attachments[name] = arr
    return {"tensors": out, "dtype": dtype, "token_ids": ids, "positions": positions, "model": hdr["model"],
            "attachments": attachments, "meta": hdr.get("meta", {})}
