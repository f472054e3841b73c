"""Encode through every caller above the API and print each file's sha256 and size (and what load_into decodes).

check_same_bytes.py holds the planner and the writer still; this holds the callers that combine them (issue 56):
``KnowledgeBase.capture`` + ``deposit`` (kvc ask), ``encode_levels`` (multi-level entries), the vLLM connector's
``encode_chunk``, ``kvc demo``'s file, the curve's ``measure``, the warm-up, a steered edit, ``kvcodec.encode``
itself (capture, prune, overrides, target) and ``kvcodec.load_into`` (next-token logits over the loaded cache,
and its refusal of another model). Run it on two checkouts and diff the outputs: moving these onto one encode
door must leave every byte unchanged.

    PYTHONPATH=/path/to/old/checkout python benchmarks/checks/check_site_bytes.py > before.txt
    python benchmarks/checks/check_site_bytes.py > after.txt
    diff before.txt after.txt

The cache is check_same_bytes.py's (``$KVC_BENCH_CACHE/speed-gpl3-256.h5``, captured there when missing). Only
public entry points that exist on both sides of the change are called. Minutes on one thread: the embedded model's
forward passes (rate control, the curve's evaluation, the steer's prefill).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


def sha(data: bytes) -> str:
    """sha256 prefix and size of a file's bytes. A target's file records how long rate control took (``choose_s``,
    wall time in the header's meta), the one thing that differs between two runs of the same code: such a file is
    hashed as its meta without it plus every chunk's place, length and CRC (its header CRC differs with it)."""
    if b'"choose_s"' not in data:
        return hashlib.sha256(data).hexdigest()[:16] + f" {len(data)}"
    from kvcodec.format import KvcReader

    with KvcReader(data) as r:
        meta = json.loads(json.dumps(r.header.meta))
        meta.get("target", {}).pop("choose_s", None)
        chunks = [(e.layer, e.kind, e.pipeline, e.token_start, e.token_end, e.head_start, e.head_end, e.length, e.crc32c)
                  for e in r.entries]
    text = json.dumps([meta, chunks], sort_keys=True).encode()
    return hashlib.sha256(text).hexdigest()[:16] + f" {len(data)} (meta without choose_s + chunk CRCs)"


def main() -> None:  # noqa: C901 - one straight list of sites
    import kvcodec
    from kvcodec.core.kvcache import load_h5, save_h5
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.load import load_model
    from kvcodec.texts import load_text

    torch.set_num_threads(1)
    only = set(sys.argv[1:])
    cache_dir = Path(os.environ.get("KVC_BENCH_CACHE", "/tmp/kvc-cache"))
    cache_dir.mkdir(parents=True, exist_ok=True)
    lm = load_model("smollm2")
    all_ids = tokenize(lm.tokenizer, load_text("gpl3"))
    path = cache_dir / "speed-gpl3-256.h5"
    if not path.exists():
        save_h5(capture(lm, token_ids=all_ids[:256]), path)
    cache = load_h5(path)
    ids = np.asarray(cache.token_ids, np.int64)
    out: dict[str, str] = {}
    work = Path(tempfile.mkdtemp(prefix="kvc-sites-"))

    def want(site: str) -> bool:
        return not only or site in only

    if want("encode"):
        for p in ["lossless", "faithful", "small"]:
            enc = kvcodec.encode(cache, None, preset=p, model=lm)
            out[f"encode:{p}"] = f"{sha(enc.data)} {enc.preset} {enc.bits_per_element:.6f}"
        enc = kvcodec.encode(cache, None, preset="balanced")
        out["encode:balanced-nomodel"] = f"{sha(enc.data)} {enc.preset}"
        enc = kvcodec.encode(cache, None, preset="balanced", overrides={"step0": 0.5}, model=lm)
        out["encode:balanced+step0"] = f"{sha(enc.data)} {enc.preset}"
        enc = kvcodec.encode(cache, None, preset="small", model=lm, prune="h2o:0.5")
        out["encode:small+h2o"] = f"{sha(enc.data)} {enc.preset} {enc.kv_elements} {enc.bits_per_element:.6f}"
        enc = kvcodec.encode(cache, None, preset="faithful", model=lm, target_kl=1e-3)
        out["encode:target-kl"] = f"{sha(enc.data)} {enc.preset}"
        enc = kvcodec.encode(None, None, preset="faithful", model=lm, text=load_text("gpl3"), max_tokens=128)
        out["encode:text"] = f"{sha(enc.data)} {enc.preset}"
        enc = kvcodec.encode(cache, None, preset="baseline:int8")
        out["encode:baseline"] = f"{sha(enc.data)} {enc.preset}"

    if want("knowledge"):
        from kvcodec.runtime.knowledge import KnowledgeBase

        for p, ov in [("lossless", None), ("faithful", None), ("small", None), ("balanced", {"step0": 0.5})]:
            kb = KnowledgeBase(lm, store=str(work / f"store-{p}"), preset=p, overrides=ov)
            c = kb.capture(ids)
            dep = kb.deposit(c)
            data = kb.store.get(kb.key(ids))
            out[f"knowledge:{p}"] = f"{sha(data)} {dep['bits_per_element']:.6f}"

    if want("levels"):
        from kvcodec.runtime.level_encode import encode_levels
        from kvcodec.store import Store
        from kvcodec.store.levels import level_keys

        store = Store.open(str(work / "store-levels"))
        levels = ["small", "balanced", "faithful", "lossless"]
        rep = encode_levels(lm, store, ids, levels, chunk_tokens=256, cache=cache)
        for lv in levels:
            (key,) = level_keys(ids, lv, [len(ids)], model=lm.fingerprint.id)
            out[f"levels:{lv}"] = f"{sha(store.get(key))} {rep['levels'][lv]['bits_per_element']:.6f}"

    if want("vllm"):
        from kvcodec.integrations.vllm.entries import encode_chunk

        for p in ["lossless", "faithful"]:
            for s, e in [(0, 128), (128, 256)]:
                data = encode_chunk(cache.fingerprint, p, [int(x) for x in ids], s, e,
                                    [k[:, s:e] for k in cache.keys], [v[:, s:e] for v in cache.values])
                out[f"vllm:{p}:{s}-{e}"] = sha(data)

    if want("demo"):
        from kvcodec.eval import demo

        demo.cold_ttft = lambda *a, **k: {"ttft_s": 1.0, "token": 0, "model_load_s": 0.0}  # the timings are not the point
        demo.median_time = lambda fn, repeats: (1.0, 0)
        for p in ["balanced", "lossless"]:
            rep = demo.run_main_job(model="smollm2", text="gpl3", max_tokens=256, continuation=16, preset=p,
                                    out_dir=work / f"demo-{p}", curve=False, repeats=1)
            q = rep["quality"]
            out[f"demo:{p}"] = (f"{sha(Path(rep['kvc_file']).read_bytes())} {rep['kv_elements']} "
                                f"kl={q['kl_mean']:.6g}")

    if want("curve"):
        from kvcodec.digest import token_ids_sha256
        from kvcodec.eval import curve
        from kvcodec.eval.methods import TextCase, select_methods

        seen: list[str] = []
        read = curve.read_kvc_cache

        def spy(p, resolver=None):
            seen.append(sha(Path(p).read_bytes()))
            return read(p, resolver)

        curve.read_kvc_cache = spy
        case = TextCase(name="gpl3", cache=cache, continuation=all_ids[256:272], tokens_sha=token_ids_sha256(ids))
        methods = select_methods(["kvcodec:lossless", "kvcodec:small", "kvcodec-fixed:faithful",
                                  "kvcodec-embedded:balanced", "int8", "h2o:0.5"]).methods
        for m in methods:
            row = curve.measure(lm, case, m, work, greedy_tokens=4)
            out[f"curve:{m.key}"] = f"{seen[-1]} {row['kv_elements']} {row['bits_per_element']:.6f}"

    if want("warmup"):
        from kvcodec.runtime import warmup

        wdir = work / "warmup"
        warmup.warmup_dir = lambda: wdir
        warmup.warm("smollm2", tokens=64)
        for p in warmup.PRESETS:
            out[f"warmup:{p}"] = sha((wdir / f"{p}.kvc").read_bytes())

    if want("steer"):
        from kvcodec.edit.steer import steer

        for p in ["lossless", "balanced"]:
            parent = work / f"parent-{p}.kvc"
            kvcodec.encode(cache, parent, preset=p, model=lm)
            res = steer(lm, str(parent), [(3, 0), (5, 1)], token_spans=[(10, 40)])
            out[f"steer:{p}"] = f"{sha(res.data)} {res.preset}"

    if want("load_into"):
        f = work / "load.kvc"
        kvcodec.encode(cache, f, preset="balanced", model=lm)
        for src in (str(f), f.read_bytes()):
            loaded = kvcodec.load_into(src, lm)
            with torch.inference_mode():
                logits = lm.model(input_ids=torch.tensor([[int(ids[-1])]]), past_key_values=loaded.cache,
                                  position_ids=torch.tensor([[loaded.next_position]]), use_cache=True).logits
            out[f"load_into:{type(src).__name__}"] = sha(logits.float().numpy().tobytes()) + f" {loaded.next_position}"
        other = SimpleNamespace(fingerprint=dataclasses.replace(lm.fingerprint, weights_sha256="0" * 64), model=lm.model)
        try:
            kvcodec.load_into(str(f), other)
            out["load_into:other-model"] = "loaded!"
        except kvcodec.KvcError as e:
            out["load_into:other-model"] = f"{type(e).__name__}: {e}"

    for k, v in out.items():
        print(f"{k:34s} {v}")


if __name__ == "__main__":
    main()
