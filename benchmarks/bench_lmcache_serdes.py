"""kvcodec against LMCache's own serdes, side by side on the same real KV chunks (issue 54, item 5).

Run with the LMCache venv (``LMCACHE_SETUP_ONLY=1 bash .ci/lmcache.sh`` builds it; lmcache pinned to 0.5.6):
``.venv-lmcache/bin/python benchmarks/bench_lmcache_serdes.py`` (case ``lmcache_serdes``).

For each model (``--models``; ``smollm2`` is the embedded one, ``gemma3-270m`` one more name) and held-out text
(``kvcodec.texts.HELD_OUT``: nothing was tuned on them): capture the first ``--tokens`` tokens with kvcodec's own
capture (every layer's full KV), cut the cache into LMCache's ``--chunk``-token chunks in its multiprocess layout
``KV_2LTD`` ``[2, layers, tokens, heads*head_dim]`` in ``--dtype`` (as tests/integrations/lmcache cut them, and as
vLLM hands them), then serialize and deserialize every chunk with each method:

* LMCache's multiprocess-mode serdes, built by LMCache's own factory from the ``serde`` dict an L2 adapter config
  carries (``create_serde_processor(SerdeConfig(type, kwargs))``: the real ``AsyncSerdeProcessor`` around the real
  ``Serializer`` / ``Deserializer``) and driven the way LMCache's serde wrapper drives them: ``submit_serialize`` /
  ``submit_deserialize`` on its thread pool, completion read from its event fd, the destination buffer sized by its
  ``estimate_serialized_size``. ``fp8`` (``float8_e4m3fn``), ``turboquant`` (each ``--turboquant-presets``,
  ``head_dim`` set to the model's), and kvcodec's own serde ``kvcodec`` at each ``--presets`` (the path LMCache
  users get: no model in the server, so the lossy presets run at their fixed step, without rate control). A method
  ``PRESET:step0=X`` gives the serde ``"overrides": {"step0": X}`` (a step sweep; any of the preset's overrides,
  ``;``-separated), and ``rope_offset=zero`` its option of that name (the chunk offset search off).
* ``cachegen``: LMCache's non-multiprocess engine serde, built as its remote backend builds it
  (``CreateSerde("cachegen", LMCacheMetadata, LMCacheEngineConfig)``; the model name is the model's HF directory,
  which its ``CacheGenConfig.from_model_name`` reads the layer count from) and called as that backend calls it
  (``serialize(memory_obj) -> BytesBufferMemoryObj``, ``deserialize(buffer) -> MemoryObj``).

A method that cannot run here is recorded with its one-line reason (its own exception); where its serialized size
is fixed by its layout (turboquant's ``estimate_serialized_size`` is exactly what its ``serialize`` writes) the
bytes are still reported, with no quality or timing.

Measured per (model, text, method): the real serialized bytes per chunk (what ``serialize`` returns, which LMCache's
``AsyncSerdeProcessor`` narrows the stored object to; for ``kvcodec`` with ``pad: false``, the frame + `.kvc` its
L2 adapter stores) -> bits per KV element; encode and decode CPU-seconds per chunk (``time.process_time`` of the
whole process, one torch / BLAS / numba thread; the serde's worker thread included); quality on the real model:
the decoded chunks reassembled into one cache, continued on the ``--continuation`` tokens that follow the context
in the text, against the exact cache (the ``--dtype`` chunks as LMCache holds them): mean KL(exact || decoded) and
top-1 agreement (``kvcodec.models.quality``). The row ``bf16 chunks`` gives the cost of the ``--dtype`` cast itself
against the fp32 capture. Beside them, the rate at which the CPU engine produces KV: the capture's (a prefill's)
CPU-seconds -> MB of fp16 KV per CPU-second, in the same process, against encode / decode MB/s per core.

Per model the summary pools the texts (mean KL over every continuation token; total bytes) and gives, for each
kvcodec preset whose KL is at most fp8's (and top-1 at least fp8's), the ratio of fp8's bytes to its bytes.
``--report-from RESULT.json`` prints the tables of a saved run.
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import time
from pathlib import Path
from typing import Any

import harness  # noqa: E402

harness.pin_threads(sys.argv[1:])  # before numpy and torch load: their pools size themselves at import

import numpy as np  # noqa: E402

DTYPES = ("bfloat16", "float16")


class CannotRun(RuntimeError):
    """A serde task that failed inside LMCache's processor; the message is the serde's own exception, one line."""


def _reason(e: BaseException) -> str:
    return (str(e) if isinstance(e, CannotRun) else f"{type(e).__name__}: {e}").splitlines()[0]


# ------------------------------------------------------------------------------------------------ LMCache objects


def _kv_obj(t):
    """A KV_2LTD chunk as LMCache's ``TensorMemoryObj`` (a flat byte buffer viewed as the chunk)."""
    import torch
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    raw = t.contiguous().view(torch.uint8).reshape(-1).clone()
    meta = MemoryObjMetadata(shape=t.shape, dtype=t.dtype, address=0, phy_size=raw.numel(), ref_count=1,
                             fmt=MemoryFormat.KV_2LTD, shapes=[t.shape], dtypes=[t.dtype])
    return TensorMemoryObj(raw, meta, None)


def _byte_obj(n: int, data=None):
    """A serialized-object buffer of ``n`` bytes, as the serde wrapper reserves one (the estimate); ``data`` copied in."""
    import torch
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    raw = torch.zeros(n, dtype=torch.uint8)
    if data is not None:
        raw[:data.numel()].copy_(data)
    shape = torch.Size([n])
    meta = MemoryObjMetadata(shape=shape, dtype=torch.uint8, address=0, phy_size=n, ref_count=1,
                             fmt=MemoryFormat.BINARY_BUFFER, shapes=[shape], dtypes=[torch.uint8])
    return TensorMemoryObj(raw, meta, None)


def _wait(proc, fd: int, query, tid: int) -> bool:
    """Block on the processor's event fd (as LMCache's serde wrapper polls it) until task ``tid`` completes."""
    from lmcache.v1.platform import consume_fd

    while True:
        r = query(tid)
        if r is not None:
            return bool(r)
        select.select([fd], [], [], 1.0)
        consume_fd(fd)


class MPSerde:
    """One LMCache multiprocess-mode serde, built by LMCache's factory from an adapter's ``serde`` dict."""

    kind = "mp"

    def __init__(self, name: str, kwargs: dict[str, Any]) -> None:
        from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

        self.name, self.kwargs = name, dict(kwargs)
        self.proc = create_serde_processor(SerdeConfig(kwargs["type"], {k: v for k, v in kwargs.items() if k != "type"}))

    def estimate(self, t) -> int:
        from lmcache.v1.distributed.api import MemoryLayoutDesc

        return int(self.proc.estimate_serialized_size(MemoryLayoutDesc(shapes=[t.shape], dtypes=[t.dtype])))

    def encode(self, t, key):
        """(serialized bytes as a uint8 tensor, encode CPU-s)."""
        src, dst = _kv_obj(t), _byte_obj(self.estimate(t))
        c0 = time.process_time()
        tid = self.proc.submit_serialize([src], [dst], [key])
        ok = _wait(self.proc, self.proc.get_serialize_event_fd(), self.proc.query_serialize_result, tid)
        cpu = time.process_time() - c0
        if not ok:
            raise CannotRun(self._why(src, dst, key))
        return dst.tensor.clone(), cpu  # narrowed by the processor to what serialize returned (set_used_size)

    def decode(self, data, like, key):
        """(the decoded chunk, decode CPU-s): the stored bytes in a buffer of the estimate's size, as a load gets them."""
        import torch

        src = _byte_obj(self.estimate(like), data)
        out = torch.full_like(like, float("nan"))
        dst = _kv_obj(out)
        c0 = time.process_time()
        tid = self.proc.submit_deserialize([src], [dst], [key])
        ok = _wait(self.proc, self.proc.get_deserialize_event_fd(), self.proc.query_deserialize_result, tid)
        cpu = time.process_time() - c0
        if not ok:
            raise CannotRun(f"{self.name}: deserialize failed")
        return dst.tensor.clone(), cpu

    def _why(self, src, dst, key) -> str:
        """The failed task's own exception, one line (LMCache's processor only logs it): the same call, again."""
        try:
            self.proc._serializer.serialize(src, dst, key)
        except Exception as e:  # noqa: BLE001 - the reason is the point
            return f"{type(e).__name__}: {e}".splitlines()[0]
        return f"{self.name}: serialize failed"

    def close(self) -> None:
        self.proc.close()


class CacheGen:
    """LMCache's CacheGen serde (non-multiprocess engine), built as its remote backend builds it."""

    kind = "engine"

    def __init__(self, model_dir: str, layers: int, heads: int, head_dim: int, chunk: int, dtype) -> None:
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.naive_serde import CreateSerde

        self.name = "cachegen"
        self.kwargs = {"remote_serde": "cachegen", "chunk_size": chunk, "model_name": model_dir}
        meta = LMCacheMetadata(model_name=model_dir, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=dtype, kv_shape=(layers, 2, chunk, heads, head_dim), chunk_size=chunk)
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=chunk, remote_serde="cachegen")
        self.ser, self.de = CreateSerde("cachegen", meta, cfg)

    def encode(self, t, key):
        import torch

        src = _kv_obj(t)
        c0 = time.process_time()
        buf = self.ser.serialize(src)
        cpu = time.process_time() - c0
        return torch.frombuffer(bytearray(buf.byte_array), dtype=torch.uint8), cpu

    def decode(self, data, like, key):
        from lmcache.v1.memory_management import BytesBufferMemoryObj

        buf = BytesBufferMemoryObj(data.numpy().tobytes())
        c0 = time.process_time()
        obj = self.de.deserialize(buf)
        cpu = time.process_time() - c0
        return obj.tensor.reshape(like.shape).clone(), cpu

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------------ the cache


def cut_chunks(cache, chunk: int, dtype) -> list:
    """The cache as LMCache KV_2LTD chunks ``[2, L, chunk, H*D]`` (tests/integrations/lmcache/lmc.py's cut)."""
    import torch

    h, d = cache.keys[0].shape[0], cache.keys[0].shape[-1]
    out = []
    for c in range(cache.keys[0].shape[1] // chunk):
        s = slice(c * chunk, (c + 1) * chunk)
        k = torch.stack([x[:, s].transpose(0, 1).reshape(chunk, h * d) for x in cache.keys])
        v = torch.stack([x[:, s].transpose(0, 1).reshape(chunk, h * d) for x in cache.values])
        out.append(torch.stack([k, v]).to(dtype).contiguous())
    return out


def join_chunks(chunks: list, like, fp32: bool = True):
    """Chunks back into one KVCache of ``like``'s tokens and model (fp32 unless not ``fp32``)."""
    import torch

    from kvcodec.core.kvcache import KVCache

    h, d = like.keys[0].shape[0], like.keys[0].shape[-1]
    L = len(like.keys)
    ks = [torch.cat([c[0, i].reshape(c.shape[2], h, d).transpose(0, 1) for c in chunks], 1).contiguous()
          for i in range(L)]
    vs = [torch.cat([c[1, i].reshape(c.shape[2], h, d).transpose(0, 1) for c in chunks], 1).contiguous()
          for i in range(L)]
    if fp32:
        ks, vs = [k.float() for k in ks], [v.float() for v in vs]
    return KVCache(ks, vs, like.token_ids, like.fingerprint)


def _rope_offset(data) -> int:
    """The chunk offset a kvcodec serde object records (0: none recorded)."""
    import kvcodec
    from kvcodec.integrations.lmcache.chunks import unframe

    with kvcodec.open(unframe(data.numpy().tobytes())) as r:
        meta = r.header.meta if isinstance(r.header.meta, dict) else {}
    return int(meta.get("rope_offset", 0))


def _obj_key(model_name: str, text: str, i: int):
    import hashlib

    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=hashlib.sha256(f"{text}/{i}".encode()).digest()[:16], model_name=model_name, kv_rank=0)


# ------------------------------------------------------------------------------------------------ measuring


SERDE_KEYS = ("rope_offset",)  # serde options a method may set beside the preset's overrides


def parse_method(m: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """``preset`` or ``preset:key=value;key=value`` (values as JSON, or a bare word) -> (preset, the serde's
    ``overrides``, other serde options: ``rope_offset=zero``)."""
    preset, _, rest = m.partition(":")
    over, opts = {}, {}
    for kv in filter(None, rest.split(";")):
        k, _, v = kv.partition("=")
        try:
            val = json.loads(v)
        except json.JSONDecodeError:
            val = v
        (opts if k in SERDE_KEYS else over)[k] = val
    return preset, over, opts


def build_methods(a, model: str, model_name: str, model_dir: str, fp, dtype) -> tuple[list, list[dict]]:
    """Every method's serde object; a method that cannot even be built here is a row with its reason."""
    from kvcodec.integrations.lmcache import register

    register()
    L, H, D = fp.num_layers, fp.num_kv_heads, fp.head_dims[0]
    specs: list[tuple[str, Any]] = [("fp8", lambda: MPSerde("fp8", {"type": "fp8", "fp8_dtype": "float8_e4m3fn"}))]
    for p in [x for x in a.turboquant_presets.split(",") if x and not a.fp8_only]:
        specs.append((f"turboquant:{p}", lambda p=p: MPSerde(f"turboquant:{p}", {"type": "turboquant", "preset": p,
                                                                                  "head_dim": D})))
    if not a.fp8_only:
        specs.append(("cachegen", lambda: CacheGen(model_dir, L, H, D, a.chunk, dtype)))
    for p in [x for x in a.presets.split(",") if x]:
        preset, over, opts = parse_method(p)
        specs.append((f"kvcodec:{p}", lambda p=p, preset=preset, over=over, opts=opts: MPSerde(f"kvcodec:{p}", {
            "type": "kvcodec", "preset": preset, "models": {model_name: model}, "pad": False,
            **({"overrides": over} if over else {}), **opts})))
    methods, failed = [], []
    for name, make in specs:
        try:
            methods.append(make())
        except Exception as e:  # noqa: BLE001
            failed.append({"method": name, "why": f"{type(e).__name__}: {e}".splitlines()[0]})
    return methods, failed


def measure_text(lm, a, text: str, methods: list, model_name: str, dtype, broken: dict) -> dict[str, Any]:
    import torch

    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.quality import compare_logits, continue_logits
    from kvcodec.texts import load_text

    ids = tokenize(lm.tokenizer, load_text(text))
    T, C = a.tokens, a.continuation
    if len(ids) < T + C:
        return {"text": text, "skipped": f"{len(ids)} tokens, fewer than {T} + {C}"}
    with harness.stopwatch() as pf:  # the CPU engine producing this KV: one prefill (kvcodec's capture)
        cache = capture(lm, token_ids=ids[:T], full_layers=True)
    elems = sum(k.numel() + v.numel() for k, v in zip(cache.keys, cache.values))
    cont = np.asarray(ids[T:T + C], np.int64)
    chunks = cut_chunks(cache, a.chunk, dtype)
    exact = join_chunks(chunks, cache)  # the chunks as LMCache holds them: the reference
    with torch.inference_mode():
        ref_logits = continue_logits(lm, exact, cont)
        fp32_logits = continue_logits(lm, cache, cont)
    cast = compare_logits(fp32_logits, ref_logits, cont)
    out: dict[str, Any] = {
        "text": text, "tokens": T, "chunks": len(chunks), "chunk_tokens": a.chunk, "continuation": C,
        "elements": elems, "elements_per_chunk": chunks[0].numel(), "fp16_mb_per_chunk": chunks[0].numel() * 2 / 1e6,
        "prefill_cpu_s": pf.cpu, "prefill_wall_s": pf.wall, "prefill_fp16_mb_s_per_core": elems * 2 / 1e6 / pf.cpu,
        "max_abs": {"keys": max(float(k.abs().max()) for k in cache.keys),
                    "values": max(float(v.abs().max()) for v in cache.values)},
        "cast": {"kl": cast["kl_mean"], "top1": cast["top1_agreement"]}, "rows": [],
    }
    print(f"  {text}: {T} tokens, {len(chunks)} chunks; prefill {pf.cpu:.1f} CPU-s "
          f"({out['prefill_fp16_mb_s_per_core']:.1f} MB/s fp16 KV per core); {a.dtype} cast KL {cast['kl_mean']:.2e}",
          file=sys.stderr, flush=True)
    for m in methods:
        if m.name in broken:
            continue
        row: dict[str, Any] = {"method": m.name, "config": m.kwargs}
        nbytes, enc, dec, got, offsets = [], [], [], [], []
        try:
            for i, t in enumerate(chunks):
                key = _obj_key(model_name, text, i)
                data, ce = m.encode(t, key)
                if m.name.startswith("kvcodec:"):
                    offsets.append(_rope_offset(data))
                back, cd = m.decode(data, t, key)
                nbytes.append(int(data.numel()))
                enc.append(ce)
                dec.append(cd)
                got.append(back)
        except Exception as e:  # noqa: BLE001 - a method that cannot run here: its reason, once
            why = broken[m.name] = _reason(e)
            print(f"    {m.name}: cannot run: {why}", file=sys.stderr, flush=True)
            continue
        dec_cache = join_chunks(got, cache)
        nonfinite = int(sum((~torch.isfinite(c)).sum() for c in got))
        with torch.inference_mode():
            q = compare_logits(ref_logits, continue_logits(lm, dec_cache, cont), cont)
        if offsets:  # the serde's estimate of each chunk's start against the truth (i * chunk)
            row.update(rope_offsets=offsets, rope_offsets_right=sum(o == i * a.chunk for i, o in enumerate(offsets)))
        row.update(bytes_per_chunk=nbytes, bytes=sum(nbytes), bits_per_element=sum(nbytes) * 8 / elems,
                   encode_cpu_s=enc, decode_cpu_s=dec, encode_cpu_s_per_chunk=float(np.mean(enc)),
                   decode_cpu_s_per_chunk=float(np.mean(dec)),
                   encode_mb_s_per_core=out["fp16_mb_per_chunk"] / float(np.mean(enc)),
                   decode_mb_s_per_core=out["fp16_mb_per_chunk"] / float(np.mean(dec)),
                   kl=q["kl_mean"], top1=q["top1_agreement"], dppl_percent=q["dppl_percent"], nonfinite=nonfinite,
                   bit_exact=all(torch.equal(a_.view(torch.int16), b_.view(torch.int16)) for a_, b_ in zip(chunks, got)))
        out["rows"].append(row)
        print(f"    {m.name}: {row['bits_per_element']:.3f} bits/el, KL {row['kl']:.2e}, top-1 {row['top1']:.3f}, "
              f"enc {row['encode_cpu_s_per_chunk']:.3f} / dec {row['decode_cpu_s_per_chunk']:.3f} CPU-s per chunk"
              + (f", {nonfinite} non-finite values" if nonfinite else ""), file=sys.stderr, flush=True)
    if a.whole:
        _whole_rows(lm, a, chunks, cache, cont, ref_logits, out)
    return out


def _whole_rows(lm, a, chunks, cache, cont, ref_logits, out) -> None:
    """Reference rows, not LMCache: each kvcodec preset on the whole context at once (its true positions, the same
    ``kvcodec.encode`` call the serde makes per chunk, no model): what cutting it into chunks costs."""
    import torch

    import kvcodec
    from kvcodec.calibration.store import load_calibration
    from kvcodec.models.quality import compare_logits, continue_logits
    from kvcodec.plan.presets import preset_info

    whole = join_chunks(chunks, cache, fp32=False)
    for p in [x for x in a.presets.split(",") if x]:
        preset, over, _ = parse_method(p)
        cal = load_calibration(cache.fingerprint.id) if preset_info(preset).lossy else None
        c0 = time.process_time()
        enc = kvcodec.encode(whole, None, preset=preset, overrides=over or None, calibration=cal, verify="file")
        ce = time.process_time() - c0
        assert enc.data is not None
        c0 = time.process_time()
        with kvcodec.open(enc.data) as r:
            dec = r.read_cache()
        cd = time.process_time() - c0
        with torch.inference_mode():
            q = compare_logits(ref_logits, continue_logits(lm, dec.to(torch.float32), cont), cont)
        n = len(chunks)
        row = {"method": f"whole:{p}", "config": {"preset": preset, "overrides": over, "tokens": a.tokens}, "bytes_per_chunk": [len(enc.data) / n] * n,
               "bytes": len(enc.data), "bits_per_element": len(enc.data) * 8 / out["elements"],
               "encode_cpu_s": [ce / n] * n, "decode_cpu_s": [cd / n] * n, "encode_cpu_s_per_chunk": ce / n,
               "decode_cpu_s_per_chunk": cd / n, "encode_mb_s_per_core": out["fp16_mb_per_chunk"] * n / ce,
               "decode_mb_s_per_core": out["fp16_mb_per_chunk"] * n / cd, "kl": q["kl_mean"],
               "top1": q["top1_agreement"], "dppl_percent": q["dppl_percent"], "nonfinite": 0, "bit_exact": False}
        out["rows"].append(row)
        print(f"    whole:{p}: {row['bits_per_element']:.3f} bits/el, KL {row['kl']:.2e}, top-1 {row['top1']:.3f}, "
              f"enc {ce:.2f} / dec {cd:.2f} CPU-s for {n} chunks' tokens", file=sys.stderr, flush=True)


def summarize(texts: list[dict], methods_order: list[str], broken: dict, failed: list[dict], fixed_bytes: dict) -> dict:
    """Per method, pooled over the texts; the bytes ratio vs fp8 at equal or better KL (mean over every
    continuation token of every text; top-1 beside it)."""
    done = [t for t in texts if "rows" in t]
    per: dict[str, Any] = {}
    for name in methods_order:
        rows = [r for t in done for r in t["rows"] if r["method"] == name]
        if not rows:
            continue
        elems = sum(t["elements"] for t in done if any(r["method"] == name for r in t["rows"]))
        enc = [c for r in rows for c in r["encode_cpu_s"]]
        dec = [c for r in rows for c in r["decode_cpu_s"]]
        mb = done[0]["fp16_mb_per_chunk"]
        per[name] = {
            "texts": len(rows), "chunks": len(enc), "bytes": sum(r["bytes"] for r in rows),
            "bytes_per_chunk": sum(r["bytes"] for r in rows) / len(enc),
            "bits_per_element": sum(r["bytes"] for r in rows) * 8 / elems,
            "kl": float(np.mean([r["kl"] for r in rows])), "kl_max": max(r["kl"] for r in rows),
            "top1": float(np.mean([r["top1"] for r in rows])), "top1_min": min(r["top1"] for r in rows),
            "encode_cpu_s_per_chunk": float(np.mean(enc)), "decode_cpu_s_per_chunk": float(np.mean(dec)),
            "encode_mb_s_per_core": mb / float(np.mean(enc)), "decode_mb_s_per_core": mb / float(np.mean(dec)),
            "nonfinite": sum(r["nonfinite"] for r in rows), "bit_exact": all(r["bit_exact"] for r in rows),
        }
        if all("rope_offsets" in r for r in rows):
            per[name]["rope_offsets_right"] = sum(r["rope_offsets_right"] for r in rows)
    fp8 = per.get("fp8")
    vs: list[dict[str, Any]] = []
    if fp8:
        for name, s in per.items():
            if not name.startswith("kvcodec:"):
                continue
            rows = {t["text"]: r for t in done for r in t["rows"] if r["method"] == name}
            f_rows = {t["text"]: r for t in done for r in t["rows"] if r["method"] == "fp8"}
            every = all(rows[x]["kl"] <= f_rows[x]["kl"] for x in rows)
            vs.append({"method": name, "bytes_ratio": fp8["bytes"] / s["bytes"],
                       "kl_over_fp8": s["kl"] / fp8["kl"] if fp8["kl"] > 0 else float("inf"),
                       "equal_or_better": s["kl"] <= fp8["kl"], "equal_or_better_every_text": every,
                       "top1_at_least_fp8": s["top1"] >= fp8["top1"]})
    ok = [v for v in vs if v["equal_or_better"]]
    best = max(ok, key=lambda v: v["bytes_ratio"]) if ok else None
    both = [v for v in ok if v["top1_at_least_fp8"]]  # mean KL at most fp8's and mean top-1 at least fp8's
    best_both = max(both, key=lambda v: v["bytes_ratio"]) if both else None
    prefill = [t["prefill_fp16_mb_s_per_core"] for t in done]
    return {"methods": per, "vs_fp8": vs, "best_at_equal_or_better": best, "best_at_equal_or_better_kl_and_top1": best_both,
            "prefill_fp16_mb_s_per_core": float(np.median(prefill)) if prefill else None,
            "prefill_fp16_mb_s_per_core_range": [min(prefill), max(prefill)] if prefill else None,
            "cast": {"kl": float(np.mean([t["cast"]["kl"] for t in done])) if done else None},
            "cannot_run": [{"method": k, "why": v, "bits_per_element": fixed_bytes.get(k)} for k, v in broken.items()]
            + failed}


def markdown(model_doc: dict) -> str:
    s = model_doc["summary"]
    fp8 = s["methods"].get("fp8")
    lines = ["| method | bits/element | bytes per chunk | fp8 bytes / these | mean KL (max) | top-1 mean (min) | "
             "encode CPU-s / chunk | decode CPU-s / chunk | encode MB/s per core | decode MB/s per core |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, m in s["methods"].items():
        ratio = f"{fp8['bytes'] / m['bytes']:.2f}x" if fp8 else "-"
        extra = " (bit-exact)" if m["bit_exact"] else ""
        if name.startswith("whole:"):
            name, extra = f"kvcodec:{name[6:]}", " on the whole context (reference: not LMCache's chunks)"
        lines.append(f"| {name}{extra} | {m['bits_per_element']:.3f} | {m['bytes_per_chunk']:,.0f} | {ratio} | "
                     f"{m['kl']:.2e} ({m['kl_max']:.2e}) | {m['top1']:.3f} ({m['top1_min']:.3f}) | "
                     f"{m['encode_cpu_s_per_chunk']:.3f} | {m['decode_cpu_s_per_chunk']:.3f} | "
                     f"{m['encode_mb_s_per_core']:.0f} | {m['decode_mb_s_per_core']:.0f} |")
    for c in s["cannot_run"]:
        b = c.get("bits_per_element")
        bits = f"{b:.3f} (its layout)" if b else "-"
        r = f"{fp8['bits_per_element'] / b:.2f}x" if b and fp8 else "-"
        lines.append(f"| {c['method']} | {bits} | - | {r} | cannot run here: {c['why']} | - | - | - | - | - |")
    pre = s["prefill_fp16_mb_s_per_core"]
    if pre is not None:
        lo, hi = s["prefill_fp16_mb_s_per_core_range"]
        lines.append(f"\nThe CPU engine (a prefill, one thread) produces {pre:.1f} MB/s of fp16 KV per core "
                     f"(median over texts, {lo:.1f}-{hi:.1f}).")
    b = s["best_at_equal_or_better"]
    lines.append(f"The {model_doc.get('dtype', 'bfloat16')} cast itself (the chunks against the fp32 capture): "
                 f"KL {s['cast']['kl']:.2e}.")
    lines.append("Best kvcodec preset at equal or better mean KL than fp8: "
                 + (f"`{b['method']}`, fp8's bytes / its bytes = {b['bytes_ratio']:.2f}x (top-1 "
                    f"{'at least' if b['top1_at_least_fp8'] else 'below'} fp8's)" if b else "none"))
    both = [v for v in s["vs_fp8"] if v["equal_or_better"] and v["top1_at_least_fp8"]]  # also for files before it
    b2 = max(both, key=lambda v: v["bytes_ratio"]) if both else None
    lines.append("Best at mean KL at most fp8's and mean top-1 at least fp8's: "
                 + (f"`{b2['method']}`, {b2['bytes_ratio']:.2f}x" if b2 else "none"))
    offs = {n: m["rope_offsets_right"] for n, m in s["methods"].items() if "rope_offsets_right" in m}
    if offs:
        lines.append("Chunk offsets the serde found right (of " + str(next(iter(s["methods"].values()))["chunks"])
                     + "): " + ", ".join(f"{n} {k}" for n, k in offs.items()))
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2", help="comma-separated kvcodec models (gemma3-270m: one more)")
    ap.add_argument("--texts", default="pydoc-exec,py-argparse,c-stdio", help="held-out texts (kvcodec.texts)")
    ap.add_argument("--tokens", type=int, default=2048, help="context tokens per text (a multiple of --chunk)")
    ap.add_argument("--chunk", type=int, default=256, help="tokens per LMCache chunk (LMCache's chunk_size)")
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="the chunks' dtype (what the engine holds)")
    ap.add_argument("--presets", default="lossless,near-lossless,faithful,balanced,small",
                    help="kvcodec presets, through kvcodec's LMCache serde; PRESET:step0=X (';'-separated KEY=JSON) "
                    "gives the serde the preset with those overrides (a step sweep)")
    ap.add_argument("--turboquant-presets", default="turboquant_k8v4,turboquant_4bit_nc,turboquant_k3v4_nc,turboquant_3bit_nc")
    ap.add_argument("--fp8-only", action="store_true",
                    help="of LMCache's serdes only fp8 (the reference for a step sweep): no turboquant, no cachegen")
    ap.add_argument("--whole", action="store_true",
                    help="reference rows (not LMCache): each kvcodec preset on the whole context at once, no model")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--report-from", default=None, help="print the tables of this saved result (JSON) and exit")
    run = harness.cli(ap, argv, case="lmcache_serdes")
    a = run.args
    if a.report_from:
        doc = json.loads(Path(a.report_from).read_text())["results"]
        for m in doc["models"]:
            print(f"\n**{m['model']}**\n\n{markdown(m)}")
        return
    if a.tokens % a.chunk:
        ap.error("--tokens must be a multiple of --chunk")
    import torch

    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.load import load_model, resolve_model_dir
    from kvcodec.texts import load_text

    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    docs = []
    for model in [m for m in a.models.split(",") if m]:
        lm = load_model(model)
        fp = lm.fingerprint
        model_dir = str(resolve_model_dir(model))
        model_name = model_dir  # the model name LMCache's ObjectKey carries when the engine serves this directory
        methods, failed = build_methods(a, model, model_name, model_dir, fp, dtype)
        # untimed warm-up on a tuning text's chunk: numba's kernels compile or load, imports, calibration loads
        warm = cut_chunks(capture(lm, token_ids=tokenize(lm.tokenizer, load_text("gpl3"))[:a.chunk], full_layers=True),
                          a.chunk, dtype)[0]
        broken: dict[str, str] = {}
        fixed_bytes: dict[str, float] = {}
        for m in methods:
            try:
                data, _ = m.encode(warm, _obj_key(model_name, "warm-up", 0))
                m.decode(data, warm, _obj_key(model_name, "warm-up", 0))
            except Exception as e:  # noqa: BLE001
                broken[m.name] = _reason(e)
                if m.name.startswith("turboquant"):  # its estimate is exactly what serialize writes
                    fixed_bytes[m.name] = m.estimate(warm) * 8 / warm.numel()
                print(f"{model}: {m.name} cannot run here: {broken[m.name]}", file=sys.stderr, flush=True)
        print(f"{model}: {len(methods) - len(broken)} methods run, {len(broken) + len(failed)} cannot",
              file=sys.stderr, flush=True)
        texts = [measure_text(lm, a, t, methods, model_name, dtype, broken) for t in a.texts.split(",") if t]
        for m in methods:
            m.close()
        order = [m.name for m in methods] + ([f"whole:{p}" for p in a.presets.split(",") if p] if a.whole else [])
        doc = {"model": model, "dtype": a.dtype, "fingerprint": fp.id, "layers": fp.num_layers, "kv_heads": fp.num_kv_heads,
               "head_dim": fp.head_dims[0], "texts": texts}
        doc["summary"] = summarize(texts, order, broken, failed, fixed_bytes)
        docs.append(doc)
        print(f"\n**{model}**\n\n{markdown(doc)}", flush=True)
    run.emit({"models": docs, "finished": time.time()})


if __name__ == "__main__":
    main()
