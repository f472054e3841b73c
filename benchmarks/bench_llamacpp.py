"""The local anchor: kvcodec vs llama.cpp (llama-cpp-python) on one document, one run, one thread count (issue 20).

On the same machine, model (the embedded SmolLM2: HF loads the dequantised
fp32 conversion, llama.cpp the GGUF itself), document (``--tokens`` real
tokens) and question, with ``--threads`` for torch and llama.cpp alike:

* **HF prefill**: document + question, last-token logits only (``logits_to_keep=1``);
* **llama.cpp prefill**: the same tokens (flash attention on, fp16 KV);
* **llama.cpp restore (fp16 / q8_0 / q4_0)**: llama.cpp saves its own KV of
  the document with ``llama_state_seq_get_data`` (the sequence's KV only) to
  a file; TTFT = read the file + ``llama_state_seq_set_data`` + evaluate the
  question. Quantised V needs flash attention, so every llama.cpp context
  here has it on;
* **kvcodec `.kvc` -> HF**: read the file + lazy layer-by-layer decode + the
  question's forward pass (``kvcodec.integrations.hf``), per preset;
* **kvcodec `.kvc` -> llama.cpp**: read the file + decode into llama.cpp's
  fp16 KV (``kvcodec.integrations.llamacpp.load_kvc``) + evaluate the question.

Quality, each against its own engine's exact cache over ``--continuation``
tokens of the same text: llama.cpp's states (and the `.kvc` loaded into
llama.cpp) against llama.cpp's fp32 KV; kvcodec's presets in HF against
HF's exact fp32 cache (``kvcodec.models.quality``). Greedy tokens (``--greedy``)
from llama.cpp after loading each `.kvc` are compared with llama.cpp's own
prefill.

The profile splits the `.kvc` -> HF TTFT into its stages, run one after the
other (no prefetch overlap): read the file, open it (header, index,
calibration resolve), decode every layer, the question's forward pass on the
decoded cache.

Timings are medians of ``--repeats`` after one warm-up.

    python benchmarks/bench_llamacpp.py --tokens 2048 --threads 1 --json benchmarks/results/llamacpp/llamacpp.json
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import harness
from common import QUESTION, long_ids
from kvcodec.models.capture import capture, tokenize  # noqa: E402
from kvcodec.models.quality import compare_logits, continue_logits  # noqa: E402
from kvcodec.format import KvcReader, encode_kvc_bytes  # noqa: E402
from kvcodec.api import make_plan
from kvcodec.integrations.hf import greedy_from, load_cache  # noqa: E402
from kvcodec.integrations.llamacpp import gguf_fingerprint, load_kvc  # noqa: E402
from kvcodec.models.load import _gguf_path, load_model  # noqa: E402

KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}  # ggml_type ids


class Engine:
    """One llama.cpp context (llama-cpp-python) with the sequence-level operations the benchmark needs."""

    def __init__(self, gguf: Path, n_ctx: int, threads: int, kv_type: str) -> None:
        import llama_cpp

        self.lc = llama_cpp
        t = KV_TYPES[kv_type]
        self.llm = llama_cpp.Llama(
            model_path=str(gguf), n_ctx=n_ctx, n_batch=512, n_threads=threads, n_threads_batch=threads,
            flash_attn=True, type_k=t, type_v=t, verbose=False,
        )

    def clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.llm.ctx), True)
        self.llm.n_tokens = 0

    def last_token(self) -> int:
        ptr = self.lc.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).argmax())

    def prefill(self, ids: np.ndarray) -> int:
        self.clear()
        self.llm.eval(ids.tolist())
        return self.last_token()

    def save(self, path: Path) -> int:
        ctx = self.llm.ctx
        n = self.lc.llama_state_seq_get_size(ctx, 0)
        buf = (ctypes.c_uint8 * n)()
        got = self.lc.llama_state_seq_get_data(ctx, buf, n, 0)
        path.write_bytes(bytes(buf[:got]))
        return got

    def restore(self, path: Path, ids: np.ndarray) -> None:
        data = bytearray(path.read_bytes())
        self.clear()
        arr = (ctypes.c_uint8 * len(data)).from_buffer(data)
        if self.lc.llama_state_seq_set_data(self.llm.ctx, arr, len(data), 0) != len(data):
            raise SystemExit(f"llama.cpp refused its own state {path}")
        self.llm.n_tokens = len(ids)
        self.llm.input_ids[: len(ids)] = ids

    def continuation_logits(self, cont: np.ndarray) -> torch.Tensor:
        """Logits [N, vocab] of ``cont`` fed after the current sequence, every position."""
        llm = self.llm
        llm._ctx.kv_cache_seq_rm(-1, llm.n_tokens, -1)
        llm._batch.set_batch(batch=cont.tolist(), n_past=llm.n_tokens, logits_all=True)
        llm._ctx.decode(llm._batch)
        out = np.ctypeslib.as_array(self.lc.llama_get_logits(llm.ctx), shape=(len(cont), llm.n_vocab())).copy()
        return torch.from_numpy(out)

    def greedy(self, first: list[int], n: int) -> list[int]:
        """n greedy tokens after feeding ``first`` (the question)."""
        out = []
        self.llm.eval(first)
        for _ in range(n):
            tok = self.last_token()
            out.append(tok)
            self.llm.eval([tok])
        return out


def median_time(fn, repeats: int) -> tuple[float, object]:
    """(median seconds of ``repeats`` calls after one warm-up call, the last call's value) (harness.timeit)."""
    t = harness.timeit(fn, repeats, warmup=1, cpu=None)
    return t.median, t.value


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--presets", default="balanced,near-lossless,fp16")
    ap.add_argument("--json", dest="json_out", default=None)
    run = harness.cli(ap, argv, case="llamacpp")
    args = run.args
    torch.set_num_threads(args.threads)
    gguf = _gguf_path()
    lm = load_model()
    n, c = args.tokens, args.continuation
    all_ids = long_ids(lm.tokenizer, n + c)
    doc, cont = all_ids[:n], all_ids[n:]
    q = tokenize(lm.tokenizer, QUESTION)
    full = np.concatenate([doc, q])
    n_ctx = n + max(len(q) + args.greedy, c) + 64
    tmp = Path(tempfile.mkdtemp(prefix="kvc-llamacpp-"))
    rows: list[dict] = []

    def row(name: str, **kw) -> dict:
        r = {"method": name, **kw}
        rows.append(r)
        print(json.dumps(r), file=sys.stderr)
        return r

    # -- HF prefill, last-token logits only ---------------------------------------
    @torch.inference_mode()
    def hf_prefill() -> int:
        out = lm.model(input_ids=torch.as_tensor(full).unsqueeze(0), use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    t_hf, tok_hf = median_time(hf_prefill, args.repeats)
    row("HF prefill (logits_to_keep=1)", ttft_s=t_hf, bytes=None, first_token=tok_hf)

    # -- llama.cpp: prefill, own states, quality against its fp32 KV -------------------
    ref = Engine(gguf, n_ctx, args.threads, "f32")
    ref.prefill(doc)
    ref_logits = ref.continuation_logits(cont)
    del ref
    eng16 = Engine(gguf, n_ctx, args.threads, "f16")
    t_lp, tok_lp = median_time(lambda: eng16.prefill(full), args.repeats)
    row("llama.cpp prefill", ttft_s=t_lp, bytes=None, first_token=tok_lp)
    eng16.prefill(doc)
    greedy_lp = eng16.greedy(q.tolist(), args.greedy)
    for kv in ("f16", "q8_0", "q4_0"):
        eng = eng16 if kv == "f16" else Engine(gguf, n_ctx, args.threads, kv)
        eng.prefill(doc)
        path = tmp / f"state-{kv}.bin"
        size = eng.save(path)

        def restore(eng=eng, path=path) -> int:
            eng.restore(path, doc)
            eng.llm.eval(q.tolist())
            return eng.last_token()

        t, tok = median_time(restore, args.repeats)
        eng.restore(path, doc)
        m = compare_logits(ref_logits, eng.continuation_logits(cont), cont)
        row(f"llama.cpp restore {kv}", ttft_s=t, bytes=size, first_token=tok, kl=m["kl_mean"], dppl_percent=m["dppl_percent"],
            top1=m["top1_agreement"], quality_ref="llama.cpp fp32 KV")

    # -- kvcodec -------------------------------------------------------------------
    exact = capture(lm, token_ids=doc)
    hf_exact_logits = continue_logits(lm, exact, cont)
    identity = gguf_fingerprint(gguf)
    for preset in args.presets.split(","):
        plan = make_plan(exact, preset, model=lm)
        data = encode_kvc_bytes(exact, plan)
        path = tmp / f"doc-{preset}.kvc"
        path.write_bytes(data)

        def kvc_hf(path=path) -> int:
            loaded = load_cache(path.read_bytes(), lm)
            return greedy_from(lm, loaded.cache, loaded.next_position, q, 1)[0][0]

        t, tok = median_time(kvc_hf, args.repeats)
        if preset == args.presets.split(",")[0]:  # the same without the decode thread: strictly one thread of work at a time
            def kvc_hf_serial(path=path) -> int:
                loaded = load_cache(path.read_bytes(), lm, prefetch=False)
                return greedy_from(lm, loaded.cache, loaded.next_position, q, 1)[0][0]

            t_s, tok_s = median_time(kvc_hf_serial, args.repeats)
            row(f"kvcodec {preset} .kvc -> HF, no prefetch thread", ttft_s=t_s, bytes=len(data), first_token=tok_s)
        decoded = KvcReader(data).read_cache(model=lm)
        m = compare_logits(hf_exact_logits, continue_logits(lm, decoded, cont), cont)
        row(f"kvcodec {preset} .kvc -> HF", ttft_s=t, bytes=len(data), first_token=tok, kl=m["kl_mean"],
            dppl_percent=m["dppl_percent"], top1=m["top1_agreement"], quality_ref="HF fp32 cache")

        def kvc_llama(path=path) -> int:
            load_kvc(eng16.llm, path.read_bytes(), identity=identity)
            eng16.llm.eval(q.tolist())
            return eng16.last_token()

        t, tok = median_time(kvc_llama, args.repeats)
        load_kvc(eng16.llm, data, identity=identity)
        m = compare_logits(ref_logits, eng16.continuation_logits(cont), cont)
        load_kvc(eng16.llm, data, identity=identity)
        g = eng16.greedy(q.tolist(), args.greedy)
        row(f"kvcodec {preset} .kvc -> llama.cpp", ttft_s=t, bytes=len(data), first_token=tok, kl=m["kl_mean"],
            dppl_percent=m["dppl_percent"], top1=m["top1_agreement"], quality_ref="llama.cpp fp32 KV",
            greedy_matches_llamacpp_prefill=g == greedy_lp, greedy_agree=sum(1 for _ in _common_prefix(g, greedy_lp)))

    # -- profile of .kvc -> HF (balanced), stage by stage --------------------------------
    profile = profile_kvc(lm, tmp / f"doc-{args.presets.split(',')[0]}.kvc", q, args.repeats)
    print(json.dumps({"profile": profile}), file=sys.stderr)

    fp16_restore = next(r for r in rows if r["method"] == "llama.cpp restore f16")
    print(f"\nTTFT at {n} tokens, {args.threads} thread(s), median of {args.repeats}; ratio = llama.cpp fp16 restore TTFT / this TTFT, "
          "bytes ratio = fp16 state bytes / these bytes\n")
    print("| method | TTFT s | vs fp16 restore | bytes | fewer bytes than fp16 state | KL | dPPL % | quality vs |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        b = r["bytes"]
        size = "" if b is None else f"{b:,}"
        fewer = "" if b is None else f"{fp16_restore['bytes'] / b:.1f}x"
        print(f"| {r['method']} | {r['ttft_s']:.3f} | {fp16_restore['ttft_s'] / r['ttft_s']:.2f}x | {size} | {fewer} | "
              f"{_f(r.get('kl'))} | {_f(r.get('dppl_percent'), '+.2f')} | {r.get('quality_ref', '')} |")
    print("\nprofile of the first preset's .kvc -> HF TTFT (stages run one after the other):\n")
    for k, v in profile.items():
        print(f"  {k:28s} {v * 1000:8.1f} ms")
    doc = {"machine": machine(args.threads), "tokens": n, "continuation": c, "rows": rows, "profile": profile}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(doc, indent=2))
    run.emit(doc)


def _common_prefix(a: list[int], b: list[int]):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def _f(x, fmt: str = ".2e") -> str:
    return "" if x is None else format(x, fmt)


@torch.inference_mode()
def profile_kvc(lm, path: Path, q: np.ndarray, repeats: int) -> dict[str, float]:
    """Median seconds of each stage of the `.kvc` -> HF path, run separately (laps of one clock per repeat)."""
    stages: dict[str, list[float]] = {}

    def note(k: str, t0: float) -> float:
        t = time.perf_counter()
        stages.setdefault(k, []).append(t - t0)
        return t

    for i in range(repeats + 1):
        t0 = time.perf_counter()
        data = path.read_bytes()
        t = note("read file", t0)
        reader = KvcReader(data)
        _ = reader.attachments
        t = note("open (header, index, calibration)", t)
        layers = [reader.read_layer(j) for j in range(reader.num_layers)]
        t = note("decode all layers", t)
        dtype = next(lm.model.parameters()).dtype
        from transformers import DynamicCache

        cache = DynamicCache()
        for j, (k, v) in enumerate(layers):
            cache.update(k.to(dtype).unsqueeze(0), v.to(dtype).unsqueeze(0), j)
        t = note("build HF cache", t)
        n = reader.header.num_context_tokens
        pos = torch.arange(n, n + len(q)).unsqueeze(0)
        out = lm.model(input_ids=torch.as_tensor(q).unsqueeze(0), past_key_values=cache, position_ids=pos, use_cache=True, logits_to_keep=1)
        int(out.logits[0, -1].argmax())
        note("question forward (HF)", t)
        stages.setdefault("sum of stages", []).append(time.perf_counter() - t0)
        if i == 0:
            stages = {}  # warm-up
    return {k: statistics.median(v) for k, v in stages.items()}


def machine(threads: int) -> dict:
    import llama_cpp

    return {**harness.machine(), "threads": threads, "llama_cpp_python": llama_cpp.__version__}


if __name__ == "__main__":
    main()
