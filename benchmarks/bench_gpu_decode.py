"""GPU decode throughput of kvcodec vs plain copies of the same fp16 bytes (H100/H200).

    python benchmarks/bench_gpu_decode.py [--tokens 4096 8192 16384 32768] [--chunk 256]

Caches: the real KV cache of the embedded SmolLM2 model for the first
``--source-tokens`` tokens of the GPL-3 text, **tiled (repeated) along the
token axis** to each target length (so the symbol statistics are those of real
KV, the content repeats). Each (layer, kind) is cut into ``--chunk``-token
chunks and encoded on the CPU with the pipeline chosen by ``--pipeline``:

* ``step``:  quantize(step, step=--step, max_bits=8) -> rans(channel_group=8)
* ``kivi4``: quantize(minmax, 4 bits, per channel, groups of 32 tokens) -> rans
* ``chain`` (default): the lossy presets' shape -- rope (keys) -> keep(4 sink tokens)
  -> transform(hadamard, all 64 coefficients: the densest case) -> quantize(step) ->
  rans(channel_group=8); its inverse stages run as ONE fused kernel

Measured (CUDA events, median of ``--iters``), all as GB/s of fp16 output
(2 bytes x elements of the cache):

* ``rans kernel``: the rANS decode of every chunk of the cache in one batched
  launch per alphabet size, device buffers already staged (kernel time only);
* ``rans e2e``:   the same including host header validation and the H2D copy
  of the compressed payload;
* ``pipeline``:   full per-chunk decode through ``decode_chunk_gpu`` (rANS +
  inverse stages + cast; per-chunk Python overhead and host validation included)
  for one layer, scaled to the cache;
* ``into HF``:    the same through ``decode_chunk_into`` writing each chunk into a
  preallocated HF per-layer tensor (1, H, T, D) -- the engine-facing path;
* ``h2d copy`` / ``d2d copy``: torch copies of the fp16 cache bytes (pinned host
  -> device, device -> device).

Exits 0 with a message when no CUDA device (or Triton) is present; nothing is
measured then. ``--smoke`` with TRITON_INTERPRET=1 runs the script logic on a
tiny cache on the CPU (no timings meaningful).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

import harness


def _no_gpu_exit(msg: str) -> None:
    print(f"bench_gpu_decode: {msg}; nothing measured.")
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--source-tokens", type=int, default=512)
    ap.add_argument("--pipeline", choices=["chain", "step", "kivi4"], default="chain")
    ap.add_argument("--step", type=float, default=None, help="quantizer step (default 0.33 for chain, as balanced; 0.1 for step)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--table", choices=["auto", "search", "table"], default="auto")
    ap.add_argument("--smoke", action="store_true", help="tiny run under TRITON_INTERPRET=1 (checks the script, not speed)")
    run = harness.cli(ap, argv, case="gpu_decode")
    args = run.args

    import torch

    try:
        import triton  # noqa: F401
    except ImportError:
        _no_gpu_exit("Triton is not installed")
    smoke = args.smoke and os.environ.get("TRITON_INTERPRET") == "1"
    if not torch.cuda.is_available() and not smoke:
        _no_gpu_exit("no CUDA device (run on an H100/H200; --smoke with TRITON_INTERPRET=1 checks the script on the CPU)")
    if smoke:
        args.tokens, args.chunk, args.source_tokens, args.iters = [64], 32, 32, 1
    dev = torch.device("cpu") if smoke else torch.device("cuda")

    from kvcodec.models.capture import capture
    from kvcodec.decode.registry import decode_chunk_gpu
    from kvcodec.decode.triton.backend import decode_chunk_into
    from kvcodec.decode.triton.rans_kernel import RansItem, decode_streams
    from kvcodec.codecs.rans import RansStage
    from kvcodec.models.load import load_model
    from kvcodec.codecs.rope_tables import rope_config_from_fingerprint
    from kvcodec.codecs.keep import KeepStage
    from kvcodec.codecs.quantize import QuantizeStage
    from kvcodec.codecs.rope import RopeStage
    from kvcodec.codecs.transform import TransformStage
    from kvcodec.core.stage import ArraySpec, ChunkContext, Pipeline
    from kvcodec.texts import load_text

    lm = load_model("smollm2")
    from kvcodec.models.capture import tokenize

    ids = tokenize(lm.tokenizer, load_text("gpl3"))[: args.source_tokens]
    src = capture(lm, token_ids=ids)
    L = src.num_layers
    if args.smoke:
        L = 2
    fp = src.fingerprint
    H, D = fp.num_kv_heads, fp.head_dims[0]
    step = args.step if args.step is not None else (0.33 if args.pipeline == "chain" else 0.1)

    def pipe_for(kind: str) -> Pipeline:
        if args.pipeline == "step":
            return Pipeline([QuantizeStage(mode="step", step=step, max_bits=8), RansStage(channel_group=8)])
        if args.pipeline == "kivi4":
            return Pipeline([QuantizeStage(mode="minmax", bits=4, axis="channel", group=32), RansStage()])
        rope = [RopeStage(**rope_config_from_fingerprint(fp.rope, D))] if kind == "k" else []
        return Pipeline(rope + [KeepStage(sink=4), TransformStage(basis="hadamard"),
                                QuantizeStage(mode="step", step=step, max_bits=8), RansStage(channel_group=8)])

    pipes = {"k": pipe_for("k"), "v": pipe_for("v")}
    table = None if args.table == "auto" else args.table == "table"
    name = torch.cuda.get_device_name() if not smoke else "interpreter"
    print(f"device: {name}; model {lm.name}: {L} layers x {src.fingerprint.num_kv_heads} kv heads x {src.fingerprint.head_dims[0]} dims; "
          f"source {len(ids)} real tokens tiled; chunks of {args.chunk} tokens; pipeline {args.pipeline}")

    def timed(fn, iters):
        """Median seconds of ``iters`` runs after one warm-up, by CUDA events (smoke: one wall-clock run)."""
        if smoke:
            return harness.timeit(fn, 1, cpu=None).min
        fn()
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        return float(np.median(ts))

    rows = []
    print(f"{'tokens':>7s} {'fp16 MB':>8s} {'ratio':>6s} {'rans kernel':>12s} {'rans e2e':>9s} {'pipeline':>9s} {'into HF':>8s} {'h2d copy':>9s} {'d2d copy':>9s}   (GB/s of fp16 output)")
    for T in args.tokens:
        reps = -(-T // src.num_tokens)
        enc = []  # (layer, kind, chunk start, payload, sides, sizes, spec)
        n_el = 0
        comp = 0
        for layer in range(L):
            for kind, t in (("k", src.keys[layer]), ("v", src.values[layer])):
                x = t.to(torch.float16).repeat(1, reps, 1)[:, :T].numpy()
                n_el += x.size
                for c0 in range(0, T, args.chunk):
                    xc = np.ascontiguousarray(x[:, c0 : c0 + args.chunk])
                    ctx = ChunkContext(layer=layer, kind=kind, token_start=c0)
                    pipe = pipes[kind]
                    payload, sides, sizes = pipe.encode(xc, ctx)
                    comp += len(payload) + sum(v.nbytes for s in sides for v in s.values())
                    enc.append((layer, kind, c0, payload, sides, sizes, ArraySpec(xc.shape, "float16"), ctx, pipe))
        fp16_bytes = 2 * n_el
        gbs = lambda sec: fp16_bytes / sec / 1e9  # noqa: E731
        items = [RansItem(e[3], e[8].specs(e[6])[-1].shape, e[8].bytes_stage.channel_group) for e in enc]
        t_e2e = timed(lambda: decode_streams(items, dev, table=table), max(1, args.iters // 2))
        launches: list = []
        decode_streams(items, dev, table=table, launches=launches)
        t_kernel = timed(lambda: [f() for f in launches], args.iters)
        one_layer = [e for e in enc if e[0] == 0]
        t_pipe = timed(lambda: [decode_chunk_gpu(e[8], e[3], e[4], e[5], e[6], e[7]) for e in one_layer], max(1, args.iters // 5))
        t_pipe *= len(enc) / len(one_layer)
        dst = {kind: torch.empty((1, H, T, D), dtype=torch.float16, device=dev) for kind in ("k", "v")}
        t_into = timed(lambda: [decode_chunk_into(e[8], e[3], e[4], e[5], e[6], e[7], dst[e[1]], e[2]) for e in one_layer],
                       max(1, args.iters // 5))
        t_into *= len(enc) / len(one_layer)
        host = torch.empty(fp16_bytes, dtype=torch.uint8, pin_memory=not smoke)
        d1 = torch.empty(fp16_bytes, dtype=torch.uint8, device=dev)
        d2 = torch.empty(fp16_bytes, dtype=torch.uint8, device=dev)
        t_h2d = timed(lambda: d1.copy_(host, non_blocking=True), args.iters)  # noqa: F821 (timed before the del below)
        t_d2d = timed(lambda: d2.copy_(d1), args.iters)  # noqa: F821 (timed before the del below)
        rows.append({"tokens": T, "fp16_mb": fp16_bytes / 1e6, "ratio": fp16_bytes / comp, "rans_kernel_gb_s": gbs(t_kernel),
                     "rans_e2e_gb_s": gbs(t_e2e), "pipeline_gb_s": gbs(t_pipe), "into_hf_gb_s": gbs(t_into),
                     "h2d_copy_gb_s": gbs(t_h2d), "d2d_copy_gb_s": gbs(t_d2d)})
        print(f"{T:7d} {fp16_bytes / 1e6:8.1f} {fp16_bytes / comp:6.2f} {gbs(t_kernel):12.1f} {gbs(t_e2e):9.1f} {gbs(t_pipe):9.1f} {gbs(t_into):8.1f} {gbs(t_h2d):9.1f} {gbs(t_d2d):9.1f}")
        del host, d1, d2
    if smoke:
        print("(smoke run under the interpreter: the numbers above are not GPU measurements)")
    run.emit({"device": name, "smoke": smoke, "pipeline": args.pipeline, "chunk": args.chunk, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
