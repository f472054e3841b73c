"""Bits the ragged layout saves on a sliding-window model, and encode / decode speed (issue 19).

    python benchmarks/bench_ragged.py --lm gemma3-270m --texts apache2,py-argparse,c-stdio --tokens 1024

Per text, the context is captured twice from one model: in the *ragged* layout
(what ``kvc capture`` writes: a sliding-window layer keeps only its last
``window - 1`` tokens, spec/kvc-v1.md section 4.2) and in the *full* layout
(every layer keeps every token, ``capture(..., full_layers=True)``: what kvcodec
stored before). Both are encoded with the same preset plan (fixed knobs,
``guard=False``, so the layouts are compared at the same settings; the guarded
presets' quality is measured by ``kvc curve``) and the file bytes compared:
``saved`` = 1 - ragged bytes / full bytes. Bits/element are given per stored
element (the ragged file's own elements) and per element of the full layout
(the same denominator for both files). Encode time is ``encode_kvc_bytes``
(including its read-back check), decode is ``KvcReader(bytes).read_cache()``
on the ragged file; MB/s count fp16 bytes of the stored elements. Before any
number, the ragged capture is checked to equal the full one's last tokens in
every layer, and the lossless ragged file to decode bit-exactly.
Single thread. On a shared machine read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import harness


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lm", default="gemma3-270m")
    ap.add_argument("--texts", default="apache2,py-argparse,c-stdio")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--presets", default="lossless,near-lossless,balanced,small")
    ap.add_argument("--json", default=None, help="write the rows here")
    run = harness.cli(ap, argv, case="ragged")
    args = run.args
    torch.set_num_threads(1)

    from kvcodec.models.capture import capture, tokenize
    from kvcodec.format import KvcReader, encode_kvc_bytes
    from kvcodec.models.load import load_model
    from kvcodec.plan.presets import get_plan
    from kvcodec.models.importance import cache_importance
    from kvcodec.texts import load_text

    lm = load_model(args.lm)
    rows = []
    print(f"model {args.lm}: windows {sorted(set(map(str, lm.attention_windows)))}, load {os.getloadavg()[0]:.1f}")
    print("| text | preset | ragged bytes | full bytes | saved | bits/stored el (ragged) | bits/full-layout el "
          "(ragged / full) | encode s (ragged / full) | decode MB/s (ragged) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for text in args.texts.split(","):
        ids = tokenize(lm.tokenizer, load_text(text))[: args.tokens]
        if len(ids) < args.tokens:
            raise SystemExit(f"{text}: only {len(ids)} tokens")
        rag = capture(lm, token_ids=ids)
        full = capture(lm, token_ids=ids, full_layers=True)
        assert rag.ragged and not full.ragged
        for a, b in zip(rag.keys + rag.values, full.keys + full.values):
            assert torch.equal(a, b[:, b.shape[1] - a.shape[1]:]), "ragged capture differs from the full one's tail"
        imp: dict[str, object] = {}  # token importance, scored once per layout when a lossy preset needs it
        for preset in args.presets.split(","):
            out = {}
            for name, c in (("ragged", rag), ("full", full)):
                lossy = preset not in ("lossless", "fp16")
                if lossy and name not in imp:
                    imp[name] = cache_importance(lm, c)
                plan = get_plan(preset, c, lm=lm, rate="fixed", importance=imp[name]) if lossy else get_plan(preset, c)
                with harness.stopwatch(cpu=None) as sw:
                    data = encode_kvc_bytes(c, plan)
                out[name] = (data, sw.wall)
            data = out["ragged"][0]
            with harness.stopwatch(cpu=None) as sw:
                with KvcReader(data) as r:
                    dec = r.read_cache()
            dec_s = sw.wall
            if preset == "lossless":
                assert all(torch.equal(a, b) for a, b in zip(dec.keys + dec.values, rag.keys + rag.values))
            nr, nf = len(out["ragged"][0]), len(out["full"][0])
            row = {"text": text, "preset": preset, "tokens": args.tokens, "ragged_bytes": nr, "full_bytes": nf,
                   "saved": 1 - nr / nf, "ragged_elements": rag.num_elements, "full_elements": full.num_elements,
                   "bits_per_stored_element": 8 * nr / rag.num_elements,
                   "bits_per_full_element_ragged": 8 * nr / full.num_elements,
                   "bits_per_full_element_full": 8 * nf / full.num_elements,
                   "encode_s_ragged": out["ragged"][1], "encode_s_full": out["full"][1],
                   "decode_mb_s": rag.num_elements * 2 / 1e6 / dec_s, "load": os.getloadavg()[0]}
            rows.append(row)
            print(f"| {text} | {preset} | {nr:,} | {nf:,} | {100 * row['saved']:.1f} % | {row['bits_per_stored_element']:.3f} | "
                  f"{row['bits_per_full_element_ragged']:.3f} / {row['bits_per_full_element_full']:.3f} | "
                  f"{row['encode_s_ragged']:.1f} / {row['encode_s_full']:.1f} | {row['decode_mb_s']:.1f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"lm": args.lm, "rows": rows}, f, indent=1)
    run.emit({"lm": args.lm, "rows": rows})


if __name__ == "__main__":
    main()
