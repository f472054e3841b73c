"""vLLM TTFT with and without the kvcodec connector for a shared prefix (CPU build of vLLM).

Run in the vLLM venv (``bash .ci/vllm.sh`` with VLLM_SETUP_ONLY=1 builds it)::

    .venv-vllm/bin/python benchmarks/bench_vllm.py --prefix 4096 --suffix 64 --preset lossless

Side by side in one run, on the embedded SmolLM2-135M (fp32), vLLM's own
prefix cache off in both engines (so only the connector can skip prefill):

* plain vLLM: TTFT of ``prefix + question_i`` (full prefill every time);
* connector, cold: the first request prefills and saves the prefix's whole
  chunks into a fresh directory store (TTFT includes encoding + writing);
* connector, warm: later requests with the same prefix and a different
  question load the prefix from the store and prefill only the rest.

TTFT = wall time of ``generate(max_tokens=1)`` for one request (engine
in-process, one request at a time), median of ``--reps``. Prints a Markdown
table and writes JSON next to it with ``--json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import tempfile

import harness

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _ids(tok, n_prefix: int, n_suffix: int, n_q: int) -> tuple[list[int], list[list[int]]]:
    from kvcodec.texts import load_text

    ids: list[int] = []
    for name in ("gpl3", "pydoc", "lgpl21", "gfdl13", "gpl2"):
        ids += tok(load_text(name))["input_ids"]
        if len(ids) >= n_prefix + n_q * n_suffix:
            break
    prefix = ids[:n_prefix]
    rest = ids[n_prefix:]
    qs = [rest[i * n_suffix:(i + 1) * n_suffix] for i in range(n_q)]
    return prefix, qs


def _engine(model_dir: str, max_len: int, kv_cfg=None):
    from vllm import LLM

    kw = {"kv_transfer_config": kv_cfg} if kv_cfg is not None else {}
    return LLM(model=model_dir, max_model_len=max_len, enforce_eager=True, dtype="float32", max_num_seqs=1,
               kv_cache_memory_bytes=max(256 << 20, max_len * 30 * 2 * 3 * 64 * 4 * 2), enable_prefix_caching=False,
               seed=0, **kw)


def _ttft(llm, ids: list[int]) -> tuple[float, int]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with harness.stopwatch(cpu=None) as sw:
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return sw.wall, out[0].outputs[0].token_ids[0]


def _drop(llm) -> None:
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefix", type=int, default=4096, help="shared prefix tokens")
    ap.add_argument("--suffix", type=int, default=64, help="tokens of each distinct question after the prefix")
    ap.add_argument("--reps", type=int, default=3, help="warm requests (each with its own question)")
    ap.add_argument("--preset", default="lossless")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--store", default=None, help="store URL (default: a fresh temp directory)")
    ap.add_argument("--json", default=None)
    run = harness.cli(ap, argv, case="vllm")
    a = run.args

    from transformers import AutoTokenizer
    from vllm.config import KVTransferConfig

    from kvcodec.models.load import resolve_model_dir
    from kvcodec.integrations.vllm import connector as conn
    model_dir = str(resolve_model_dir("smollm2"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    prefix, qs = _ids(tok, a.prefix, a.suffix, a.reps + 2)
    prompts = [prefix + q for q in qs]
    max_len = a.prefix + a.suffix + 16
    warm_ids = prompts[0][:64]

    res: dict = {"prefix_tokens": a.prefix, "suffix_tokens": a.suffix, "preset": a.preset, "chunk": a.chunk,
                 "threads": os.environ.get("OMP_NUM_THREADS", "vllm default"), "cpus": os.cpu_count()}
    llm = _engine(model_dir, max_len)
    _ttft(llm, warm_ids)
    plain = [_ttft(llm, p) for p in prompts[1:1 + a.reps]]
    _drop(llm)
    res["plain_ttft_s"] = [t for t, _ in plain]

    tmp = None
    url = a.store
    if url is None:
        tmp = tempfile.mkdtemp(prefix="kvc-bench-vllm-")
        url = tmp
    try:
        cfg = KVTransferConfig(kv_connector="KvcodecConnector", kv_connector_module_path="kvcodec.integrations.vllm.connector",
                               kv_role="kv_both", kv_connector_extra_config={"store_url": url, "preset": a.preset,
                                                                            "chunk_tokens": a.chunk, "namespace": "bench"})
        llm = _engine(model_dir, max_len, cfg)
        _ttft(llm, warm_ids)
        conn.reset_stats()
        cold = _ttft(llm, prompts[0])
        saved = dict(conn.STATS)
        warm = [_ttft(llm, p) for p in prompts[1:1 + a.reps]]
        st = dict(conn.STATS)
        _drop(llm)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    res["connector_cold_ttft_s"] = cold[0]
    res["connector_warm_ttft_s"] = [t for t, _ in warm]
    res["saved_chunks"] = saved.get("saved_chunks", 0)
    res["stored_bytes"] = saved.get("save_bytes", 0)
    res["save_s"] = saved.get("save_s", 0.0)
    res["loaded_tokens_per_request"] = (st.get("loaded_tokens", 0)) / max(1, a.reps)
    res["load_s_per_request"] = st.get("load_s", 0.0) / max(1, a.reps)
    res["same_first_token"] = [p[1] == w[1] for p, w in zip(plain, warm)]
    res["stats"] = st

    p_med = statistics.median(res["plain_ttft_s"])
    w_med = statistics.median(res["connector_warm_ttft_s"])
    kv_mb = a.prefix * 30 * 2 * 3 * 64 * 4 / 2**20
    print(f"\nvLLM CPU TTFT, SmolLM2-135M fp32, {a.prefix}-token shared prefix + {a.suffix}-token question, "
          f"preset {a.preset}, chunk {a.chunk}")
    print("| engine | TTFT (median) | prefill tokens | notes |")
    print("|---|---|---|---|")
    print(f"| plain vLLM | {p_med:.2f} s | {a.prefix + a.suffix} | prefix caching off |")
    print(f"| connector, cold (miss + save) | {cold[0]:.2f} s | {a.prefix + a.suffix} | saved {res['saved_chunks']} "
          f"chunks, {res['stored_bytes'] / 2**20:.1f} MiB (raw fp32 KV {kv_mb:.1f} MiB), encode+put {res['save_s']:.2f} s |")
    print(f"| connector, warm (load) | {w_med:.2f} s | {a.prefix + a.suffix - int(res['loaded_tokens_per_request'])} | "
          f"loaded {int(res['loaded_tokens_per_request'])} tokens, fetch+decode {res['load_s_per_request']:.2f} s |")
    print(f"speedup warm vs plain: {p_med / w_med:.2f}x; same first token: {all(res['same_first_token'])}")
    if a.json:
        from kvcodec.atomic import atomic_write_text

        atomic_write_text(a.json, json.dumps(res, indent=2))
    run.emit(res)


if __name__ == "__main__":
    main()
