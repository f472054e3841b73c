"""The one GPU check (issue 36): run it first whenever a GPU is available. At most 8 minutes on one H100.

    bash benchmarks/gpu_check                 # on a CUDA machine
    bash benchmarks/gpu_check --quick         # anywhere: TRITON_INTERPRET=1 on the CPU, tiny sizes (CI)

Five steps, each recorded (passed / failed / skipped, with the reason) in ONE results file, the harness's
result document (``benchmarks/harness.py``; default ``benchmarks/results/gpu_check/<machine-id>[-quick].json``,
``--result`` to change it) whose ``results`` hold every step and ``results.table``, the short text table
also printed at the end:

(a) **tests on real CUDA**: ``pytest -m triton`` over ``tests/`` (the Triton kernels' tests and the device-path
    tests: reader, HF loader, CacheBlend, streaming, connector) with ``TRITON_INTERPRET=0``, so the "GPU" path
    is the compiled kernels on CUDA tensors (``tests/eval`` is left out: it holds the interpreter smoke runs,
    this check's own among them).
(b) **whole-file decode throughput per preset**: the embedded model's (SmolLM2) real KV cache of ``--tokens``
    tokens in fp16, encoded with each preset on the CPU, then ``KvcReader(bytes).read_cache(backend="gpu")``
    from the file's bytes in host memory to the whole cache on the GPU (payload copies, kernels, assembly;
    median of ``--repeats`` after a warm-up, CUDA-synchronised). GB/s = fp16 bytes of the decoded cache
    (2 x elements) / seconds. Beside it, the card's memory bandwidth: the theoretical peak
    ``2 x memory_clock_rate x memory_bus_width / 8`` from ``torch.cuda.get_device_properties`` (double data
    rate; CuPy's ``getDeviceProperties`` when torch lacks the fields), and a measured device-to-device copy
    (bytes read + written / second).
(c) **HF on CUDA end to end** for both shipped models (``smollm2``, ``gemma3-270m``; one not installed is
    skipped with the reason) at ``--ttft-tokens`` (4096, 8192), bfloat16 on the GPU: TTFT of prefilling
    context + question vs TTFT of loading the context's ``.kvc`` (bytes in host memory; layers decoded on the
    GPU by ``kvcodec.integrations.hf.load_cache``) + prefilling the question; the first tokens are compared
    (``lossless`` must give the first token the exact cache gives, the context's prefill cache followed by the
    question: a one-pass prefill of context + question may differ from it in a near tie on a GPU, as Gemma 3 did
    at 4K on an H100; lossy presets may legitimately differ, the table says).
    Median of ``--repeats`` after a warm-up.
(d) **vLLM on the GPU**: ``tests/integrations/vllm_connector/test_vllm_connector.py`` on real CUDA where vLLM imports;
    skipped with the reason otherwise.
(e) **SGLang HiCache with the kvcodec backend** (``benchmarks/gpu_check_sglang.py``): an SGLang server on the
    embedded model with ``--hicache-storage-backend dynamic`` and kvcodec's backend; a prompt answered, the caches
    flushed, the same prompt answered from the store's pages. Skipped with the reason where SGLang or CUDA is missing.

Targets (BENCHMARKS.md, "GPU"): whole-file decode >= 200 GB/s on an H100; ``.kvc`` TTFT <= 0.5 x prefill TTFT
at 8K tokens. ``--quick`` runs every step under the Triton interpreter on the CPU with tiny sizes (one layer
decoded per preset, 16-token contexts, the fast test subset): it checks the script, its timings mean nothing.
Exit status: 0 when every step that ran passed, 1 otherwise (the results file is written either way).
"""

from __future__ import annotations

import os
import sys

QUICK = "--quick" in sys.argv[1:]
if QUICK:  # before anything imports triton: the interpreter is chosen at import
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.util  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
import warnings  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402

import harness  # noqa: E402
from gpu_check_sglang import step_sglang  # noqa: E402

ROOT = harness.REPO
BUDGET_S = 470.0  # the whole check, under the 8 minutes of the issue
MODELS = ("smollm2", "gemma3-270m")
TARGET_GBPS = 200.0
TARGET_TTFT_RATIO = 0.5
QUICK_TESTS = (  # no model, seconds: the stand-in's connector path, the layout probe, the block table
    "tests/integrations/test_device_paths.py::test_paged_views_only_for_a_layout_the_backend_op_confirms",
    "tests/integrations/test_device_paths.py::test_block_table_marks_positions_not_to_write",
    "tests/integrations/test_device_paths.py::test_connector_decodes_a_chunk_entry_into_the_paged_blocks[384]",
)


class Deadline:
    """The check's time budget: each step gets what is left, minus what later steps reserve."""

    def __init__(self, total: float) -> None:
        self.t0 = time.perf_counter()
        self.total = total

    def left(self, reserve: float = 0.0) -> float:
        return self.total - (time.perf_counter() - self.t0) - reserve


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"


def _median_time(fn: Callable[[], Any], repeats: int, warmup: int, sync: Callable[[], None]) -> tuple[float, Any]:
    out = None
    for _ in range(warmup):
        out = fn()
        sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


# ----------------------------------------------------------------------------------------------- the device
def device_info(quick: bool) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "interpreter": quick}
    try:
        import triton

        info["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001
        info["triton"] = None
        info["triton_error"] = _err(e)
    if quick or not torch.cuda.is_available():
        info["gpu"] = None
        info["peak_bandwidth_gbps"] = None
        info["peak_bandwidth_how"] = "no CUDA device" + (" (quick mode: Triton interpreter on the CPU)" if quick else "")
        return info
    p = torch.cuda.get_device_properties(0)
    info.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count,
                memory_gib=round(p.total_memory / 2**30, 1))
    clock_khz, bus_bits = getattr(p, "memory_clock_rate", 0), getattr(p, "memory_bus_width", 0)
    how = "torch.cuda.get_device_properties: 2 x memory_clock_rate (kHz) x memory_bus_width (bits) / 8"
    if not (clock_khz and bus_bits):
        try:
            import cupy

            cp = cupy.cuda.runtime.getDeviceProperties(0)
            clock_khz, bus_bits = cp["memoryClockRate"], cp["memoryBusWidth"]
            how = "cupy getDeviceProperties (torch lacks the fields): 2 x memoryClockRate (kHz) x memoryBusWidth (bits) / 8"
        except Exception as e:  # noqa: BLE001
            how = f"unknown: torch lacks memory_clock_rate/memory_bus_width and CuPy failed ({_err(e)})"
    info["memory_clock_khz"], info["memory_bus_bits"] = clock_khz or None, bus_bits or None
    info["peak_bandwidth_gbps"] = round(2 * clock_khz * 1e3 * bus_bits / 8 / 1e9, 1) if clock_khz and bus_bits else None
    info["peak_bandwidth_how"] = how
    try:  # what a plain device-to-device copy reaches (bytes read + bytes written)
        n = 1 << 30
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        t, _ = _median_time(lambda: y.copy_(x), 5, 2, torch.cuda.synchronize)
        info["d2d_copy_gbps"] = round(2 * n / t / 1e9, 1)
    except Exception as e:  # noqa: BLE001
        info["d2d_copy_error"] = _err(e)
    return info


# ----------------------------------------------------------------------------------------------- (a) tests
def step_tests(quick: bool, dl: Deadline, reserve: float, log: Any = None) -> dict[str, Any]:
    """``log``: a path that gets pytest's whole output (the result keeps its tail), so a failure on a
    borrowed GPU can be read after the machine is gone."""
    env = dict(os.environ, TRITON_INTERPRET="1" if quick else "0", KVCODEC_STRICT_BACKENDS="1", PYTHONUNBUFFERED="1")
    # the files that hold triton-marked tests, so a module needing what this machine lacks (moto, redis, ...)
    # cannot stop the run at collection
    files = sorted(str(f.relative_to(ROOT)) for f in (ROOT / "tests").rglob("test_*.py")
                   if "mark.triton" in f.read_text(errors="replace") and "tests/eval" not in f.as_posix())
    sel = list(QUICK_TESTS) if quick else ["-m", "triton", "--continue-on-collection-errors", *files]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short", "--durations=5", *sel]
    limit = max(30.0, dl.left(reserve))
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        if log is not None:
            Path(log).write_text(out)
        return {"status": "failed", "why": f"timed out after {limit:.0f} s", "command": " ".join(cmd[1:]),
                "wall_s": round(time.perf_counter() - t0, 1), "tail": out[-3000:]}
    text = r.stdout + r.stderr
    if log is not None:
        Path(log).write_text(text)
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)", text)}
    failures = [line.split(" - ")[0] for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return {"status": "passed" if r.returncode == 0 else "failed", "returncode": r.returncode, "counts": counts,
            "failures": failures[:50], "command": "python " + " ".join(cmd[1:]),
            "env": {"TRITON_INTERPRET": env["TRITON_INTERPRET"]}, "wall_s": round(time.perf_counter() - t0, 1),
            "tail": text[-3000:] if r.returncode else text[-600:]}


# ----------------------------------------------------------------------------------------------- models
def load(name: str, quick: bool) -> tuple[Any, str | None]:
    """(LoadedModel on the check's device, None) or (None, why it is skipped)."""
    import torch

    from kvcodec.models.load import SHIPPED, load_model

    m = SHIPPED[name]
    if importlib.util.find_spec(m.module) is None:
        return None, f"model {name} is not installed ({m.install_hint})"
    try:
        lm = load_model(name)  # float32 on the CPU; its fingerprint (and calibration) are the shipped model's
    except Exception as e:  # noqa: BLE001
        return None, f"model {name} did not load: {_err(e)}"
    if not quick:
        lm.model.to("cuda", torch.bfloat16)
    return lm, None


def capture_on_device(lm: Any, ids: np.ndarray, question: np.ndarray | None = None) -> tuple[Any, int | None]:
    """The KV cache of ``ids`` as a fresh prefill on the model's device leaves it (sliding layers: their window),
    copied to the host for the encoder; and, given ``question``, the first token the model answers it with on
    that exact cache (what a lossless ``.kvc`` must reproduce: one prefill of context + question can differ in
    its last bits on a GPU, and so in a near-tie first token)."""
    import torch

    from kvcodec.core.kvcache import KVCache
    from kvcodec.integrations.hf import greedy_from, model_device
    from kvcodec.models.capture import model_cache

    with torch.inference_mode():
        past = model_cache(lm)
        x = torch.as_tensor(ids, device=model_device(lm)).unsqueeze(0)
        lm.model(input_ids=x, past_key_values=past, use_cache=True, logits_to_keep=1)
        keys = [layer.keys[0].detach().cpu() for layer in past.layers]
        values = [layer.values[0].detach().cpu() for layer in past.layers]
        exact = greedy_from(lm, past, len(ids), question, 1)[0][0] if question is not None else None
    return KVCache(keys, values, ids, lm.fingerprint, meta={"model": lm.name}), exact


def _gpu_time_split(fn: Callable[[], Any]) -> dict[str, Any]:
    """One profiled run of ``fn`` on CUDA: milliseconds of kernels, of copies (memcpy/memset) and of wall time,
    and how many of each; what the wall time holds beyond the device's own work is host-side (parsing,
    checksums, CPU stages, launches, waits). Why: the first H100 run decoded at 1-2 GB/s with no way to tell
    the kernels from the host path (BENCHMARKS.md, "GPU")."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    kern_us = copy_us = 0.0
    kernels = copies = 0
    for e in prof.events():
        if e.device_type != DeviceType.CUDA:
            continue
        us = e.time_range.elapsed_us()
        if e.name.lower().startswith(("memcpy", "memset")):
            copy_us, copies = copy_us + us, copies + 1
        else:
            kern_us, kernels = kern_us + us, kernels + 1
    return {"wall_ms_profiled": round(1e3 * wall, 2), "kernel_ms": round(kern_us / 1e3, 2), "kernels": kernels,
            "copy_ms": round(copy_us / 1e3, 2), "copies": copies}


def _backend_warnings(record: list) -> list[str]:
    return sorted({str(w.message)[:300] for w in record if "decoder backend" in str(w.message)})


# ----------------------------------------------------------------------------------------------- (b) decode
def step_decode(lm: Any, quick: bool, tokens: int, repeats: int, info: dict[str, Any], dl: Deadline,
                reserve: float) -> dict[str, Any]:
    import torch

    from common import long_ids
    from kvcodec.format import KvcReader, encode_kvc_bytes
    from kvcodec.plan.presets import PRESETS, get_plan

    sync = torch.cuda.synchronize if not quick else (lambda: None)
    ids = long_ids(lm.tokenizer, tokens)
    cache = capture_on_device(lm, ids)[0].to(torch.float16)  # an engine's KV dtype
    rows: list[dict[str, Any]] = []
    peak = info.get("peak_bandwidth_gbps")
    for preset in PRESETS:
        row: dict[str, Any] = {"preset": preset}
        rows.append(row)
        if dl.left(reserve) < 5:
            row.update(status="skipped", why="the check's time budget ran out")
            continue
        try:
            data = encode_kvc_bytes(cache, get_plan(preset, cache))
        except Exception as e:  # noqa: BLE001 - e.g. a lossy preset without this model's calibration
            row.update(status="skipped", why=f"encode: {_err(e)}")
            continue
        layers = [0] if quick else None  # quick: one layer (the interpreter runs a fused chunk in seconds)

        def decode(layers: list[int] | None = layers) -> Any:
            with KvcReader(data) as r:
                if layers is None:
                    return r.read_cache(backend="gpu")
                return [r.read_layer(i, backend="gpu") for i in layers]

        elems = cache.num_elements if layers is None else 2 * cache.keys[0].numel()
        try:
            with warnings.catch_warnings(record=True) as rec:
                warnings.simplefilter("always")
                t, out = _median_time(decode, 1 if quick else repeats, 0 if quick else 1, sync)
            dev = (out.keys[0] if layers is None else out[0][0]).device
            gbps = 2 * elems / t / 1e9
            row.update(status="passed", tokens=tokens, layers="all" if layers is None else layers, elements=elems,
                       file_bytes=len(data), ratio=round(2 * cache.num_elements / len(data), 2), seconds=round(t, 5),
                       gbps=float(f"{gbps:.4g}"), device=str(dev), backend_warnings=_backend_warnings(rec))
            if peak:
                row["fraction_of_peak"] = round(gbps / peak, 4)
            if not quick:
                with KvcReader(data) as r:
                    row["chunks"] = len(r.entries)
                try:
                    row["split"] = _gpu_time_split(decode)
                except Exception as e:  # noqa: BLE001 - the split is a diagnosis, never the check's verdict
                    row["split"] = {"error": _err(e)}
            if not quick and dev.type != "cuda":
                row.update(status="failed", why=f"decoded onto {dev}, not the GPU")
        except Exception as e:  # noqa: BLE001
            row.update(status="failed", why=_err(e), traceback=traceback.format_exc()[-2000:])
        gc.collect()
    ok = [r for r in rows if r["status"] == "passed"]
    best = max((r["gbps"] for r in ok), default=None)
    status = "failed" if any(r["status"] == "failed" for r in rows) else "passed" if ok else "skipped"
    return {"status": status, "tokens": tokens, "model": lm.name, "dtype": "float16", "rows": rows,
            "target_gbps": TARGET_GBPS, "best_gbps": best,
            "meets_target": None if quick or best is None else best >= TARGET_GBPS,
            "how": "fp16 bytes of the decoded cache / seconds from the file's bytes in host memory to the cache on the "
                   "device (KvcReader.read_cache(backend='gpu'), synchronised)"}


# ----------------------------------------------------------------------------------------------- (c) TTFT
def step_ttft(quick: bool, tokens: list[int], presets: list[str], repeats: int, dl: Deadline, reserve: float,
              first_lm: Any = None) -> dict[str, Any]:
    import torch

    from common import QUESTION, long_ids
    from kvcodec.format import encode_kvc_bytes
    from kvcodec.integrations.hf import greedy_from, load_cache, model_device
    from kvcodec.models.capture import tokenize
    from kvcodec.plan.presets import get_plan

    sync = torch.cuda.synchronize if not quick else (lambda: None)
    models: dict[str, Any] = {}
    for name in MODELS:
        entry: dict[str, Any] = {"rows": []}
        models[name] = entry
        if dl.left(reserve) < 20:
            entry.update(status="skipped", why="the check's time budget ran out")
            continue
        lm, why = (first_lm, None) if first_lm is not None and name == first_lm.name else load(name, quick)
        if lm is None:
            entry.update(status="skipped", why=why)
            continue
        dev = model_device(lm)
        entry["device"], entry["dtype"] = str(dev), str(next(lm.model.parameters()).dtype).removeprefix("torch.")
        q = tokenize(lm.tokenizer, QUESTION)
        for n in tokens:
            try:
                ids = long_ids(lm.tokenizer, n)
                cache, tok_exact = capture_on_device(lm, ids, q)

                def prefill(ids: np.ndarray = ids) -> int:
                    with torch.inference_mode():
                        x = torch.as_tensor(np.concatenate([ids, q]), device=dev).unsqueeze(0)
                        return int(lm.model(input_ids=x, logits_to_keep=1).logits[0, -1].argmax())

                t_pre, tok_pre = _median_time(prefill, 1 if quick else repeats, 0 if quick else 1, sync)
            except Exception as e:  # noqa: BLE001
                entry["rows"].append({"tokens": n, "status": "failed", "why": f"prefill: {_err(e)}"})
                continue
            for preset in presets:
                row: dict[str, Any] = {"tokens": n, "preset": preset, "prefill_s": round(t_pre, 5), "prefill_token": tok_pre,
                                       "exact_cache_token": tok_exact}
                entry["rows"].append(row)
                if dl.left(reserve) < 5:
                    row.update(status="skipped", why="the check's time budget ran out")
                    continue
                try:
                    data = encode_kvc_bytes(cache, get_plan(preset, cache))
                except Exception as e:  # noqa: BLE001
                    row.update(status="skipped", why=f"encode: {_err(e)}")
                    continue
                where: dict[str, Any] = {}

                def kvc(data: bytes = data, where: dict = where) -> int:
                    loaded = load_cache(data, lm)
                    tok = greedy_from(lm, loaded.cache, loaded.next_position, q, 1)[0][0]
                    where["device"] = str(loaded.cache.layers[-1].keys.device)
                    return tok

                try:
                    with warnings.catch_warnings(record=True) as rec:
                        warnings.simplefilter("always")
                        t_kvc, tok_kvc = _median_time(kvc, 1 if quick else repeats, 0 if quick else 1, sync)
                    same = tok_kvc == tok_pre
                    row.update(kvc_s=round(t_kvc, 5), kvc_token=tok_kvc, first_token_identical=same,
                               same_as_exact_cache=tok_kvc == tok_exact,
                               ratio=round(t_kvc / t_pre, 3), file_bytes=len(data), cache_device=where.get("device"),
                               backend_warnings=_backend_warnings(rec))
                    bad = []
                    if preset == "lossless" and tok_kvc != tok_exact:
                        bad.append("the lossless .kvc gave another first token than its exact cache")
                    if not quick and not str(where.get("device", "")).startswith("cuda"):
                        bad.append(f"the loaded cache is on {where.get('device')}, not the GPU")
                    row.update(status="failed" if bad else "passed", why="; ".join(bad) or None)
                    if not quick and n >= 8192:
                        row["meets_target"] = t_kvc <= TARGET_TTFT_RATIO * t_pre
                except Exception as e:  # noqa: BLE001
                    row.update(status="failed", why=_err(e), traceback=traceback.format_exc()[-2000:])
            del cache
            gc.collect()
        st = [r["status"] for r in entry["rows"]]
        entry["status"] = "failed" if "failed" in st else "passed" if "passed" in st else "skipped"
        if lm is not first_lm:
            del lm
        gc.collect()
        if not quick:
            torch.cuda.empty_cache()
    st = [m["status"] for m in models.values()]
    return {"status": "failed" if "failed" in st else "passed" if "passed" in st else "skipped", "tokens": tokens,
            "presets": presets, "models": models, "target_ratio_at_8k": TARGET_TTFT_RATIO}


# ----------------------------------------------------------------------------------------------- (d) vLLM
def step_vllm(quick: bool, dl: Deadline) -> dict[str, Any]:
    if importlib.util.find_spec("vllm") is None:
        return {"status": "skipped", "why": "vLLM is not installed in this Python (it cannot be installed without a "
                                            "package index; CI runs its CPU build in .venv-vllm, bash .ci/vllm.sh)"}
    if quick:
        return {"status": "skipped", "why": "quick mode: vLLM needs a GPU build and a device here"}
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
           "tests/integrations/vllm_connector/test_vllm_connector.py"]
    limit = max(30.0, dl.left())
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "why": f"timed out after {limit:.0f} s"}
    text = r.stdout + r.stderr
    return {"status": "passed" if r.returncode == 0 else "failed", "returncode": r.returncode, "tail": text[-3000:]}


# ----------------------------------------------------------------------------------------------- the table
def table(res: dict[str, Any]) -> list[str]:
    d = res["device"]
    lines = [f"GPU check ({'quick: Triton interpreter on the CPU, timings meaningless' if res['quick'] else d.get('gpu')})",
             f"memory bandwidth: peak {d.get('peak_bandwidth_gbps')} GB/s ({d.get('peak_bandwidth_how')}); "
             f"d2d copy {d.get('d2d_copy_gbps')} GB/s"]
    a = res["steps"]["tests"]
    lines.append(f"(a) tests on {'the interpreter' if res['quick'] else 'CUDA'}: {a['status']} {a.get('counts', '')} "
                 f"{a.get('why') or ''}".rstrip())
    b = res["steps"]["decode"]
    lines.append(f"(b) whole-file decode, {b.get('model')} {b.get('tokens')} tokens fp16: {b['status']} {b.get('why') or ''}".rstrip())
    lines.append(f"    {'preset':<14}{'ratio':>7}{'GB/s':>10}{'of peak':>9}{'chunks':>7}{'kernel ms':>10}{'copy ms':>8}"
                 f"{'wall ms':>8}  status")
    for r in b.get("rows", []):
        frac = f"{100 * r['fraction_of_peak']:.1f}%" if r.get("fraction_of_peak") is not None else "-"
        sp = r.get("split") or {}
        lines.append(f"    {r['preset']:<14}{r.get('ratio', '-'):>7}{r.get('gbps', '-'):>10}{frac:>9}{r.get('chunks', '-'):>7}"
                     f"{sp.get('kernel_ms', '-'):>10}{sp.get('copy_ms', '-'):>8}{sp.get('wall_ms_profiled', '-'):>8}  "
                     f"{r['status']}{' (' + r['why'][:70] + ')' if r.get('why') else ''}")
    c = res["steps"]["ttft"]
    lines.append(f"(c) HF end to end (TTFT): {c['status']}")
    lines.append(f"    {'model':<13}{'tokens':>7} {'preset':<10}{'prefill s':>10}{'.kvc s':>9}{'ratio':>7}  same 1st  "
                 "=exact  status")
    for name, m in c.get("models", {}).items():
        if not m.get("rows"):
            lines.append(f"    {name:<13} {m['status']}: {m.get('why')}")
        for r in m.get("rows", []):
            lines.append(f"    {name:<13}{r['tokens']:>7} {r.get('preset', '-'):<10}{r.get('prefill_s', '-'):>10}"
                         f"{r.get('kvc_s', '-'):>9}{r.get('ratio', '-'):>7}  {str(r.get('first_token_identical', '-')):<8}  "
                         f"{str(r.get('same_as_exact_cache', '-')):<6}  "
                         f"{r['status']}{' (' + str(r['why'])[:70] + ')' if r.get('why') else ''}")
    dd = res["steps"]["vllm"]
    lines.append(f"(d) vLLM on the GPU: {dd['status']}{': ' + dd['why'] if dd.get('why') else ''}")
    e = res["steps"]["sglang"]
    lines.append(f"(e) SGLang HiCache + kvcodec backend: {e['status']}{': ' + e['why'] if e.get('why') else ''}")
    lines.append(f"targets: decode >= {TARGET_GBPS:.0f} GB/s on an H100 -> {b.get('meets_target')}; "
                 f".kvc TTFT <= {TARGET_TTFT_RATIO} x prefill at 8K -> "
                 f"{[r.get('meets_target') for m in c.get('models', {}).values() for r in m.get('rows', []) if 'meets_target' in r] or None}")
    lines.append(f"overall: {res['status']} in {res['wall_s']:.0f} s")
    return lines


# ----------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192, help="decode throughput: context tokens (quick: 32)")
    ap.add_argument("--ttft-tokens", default="4096,8192", help="HF TTFT: context lengths (quick: 16)")
    ap.add_argument("--ttft-presets", default="lossless,balanced", help="HF TTFT: presets of the .kvc")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs after one warm-up (quick: one, no warm-up)")
    ap.add_argument("--steps", default="tests,decode,ttft,vllm,sglang", help="which steps run (the others are recorded as skipped)")
    run = harness.cli(ap, argv, case="gpu_check")
    args = run.args
    quick = run.quick
    if quick:
        args.tokens, args.ttft_tokens, args.ttft_presets, args.repeats = min(args.tokens, 32), "16", "lossless", 1
    if args.result is None:
        args.result = harness.RESULTS / "gpu_check" / f"{harness.machine_id()}{'-quick' if quick else ''}.json"
    steps = set(args.steps.split(","))
    dl = Deadline(BUDGET_S)
    t0 = time.perf_counter()
    import torch

    info = device_info(quick)
    if not quick and torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bandwidth probe's 2 GiB
    res: dict[str, Any] = {"quick": quick, "device": info, "steps": {}}
    print(f"gpu_check: {info.get('gpu') or info['peak_bandwidth_how']}; torch {info['torch']}, triton {info.get('triton')}",
          flush=True)
    skipped = {"status": "skipped", "why": "not in --steps"}
    if not quick and not torch.cuda.is_available():
        why = "no CUDA device: run this on a GPU machine, or --quick to check the script on the CPU"
        for s in ("tests", "decode", "ttft", "vllm", "sglang"):
            res["steps"][s] = {"status": "skipped", "why": why}
        res["status"], res["wall_s"] = "no_gpu", time.perf_counter() - t0
        res["table"] = table(res)
        print("\n".join(res["table"]))
        run.emit(res)
        return 1
    # (a) first: a kernel that fails on CUDA is the first thing to know; the other steps get their share
    log = Path(args.result).with_suffix(".tests.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    res["steps"]["tests"] = step_tests(quick, dl, reserve=0.6 * BUDGET_S, log=log) if "tests" in steps else skipped
    res["steps"]["tests"]["log"] = str(log) if "tests" in steps else None
    print(f"(a) tests: {res['steps']['tests']['status']} {res['steps']['tests'].get('counts', '')}", flush=True)
    lm, why = load("smollm2", quick) if steps & {"decode", "ttft"} else (None, "not in --steps")
    if "decode" in steps and lm is not None:
        try:
            res["steps"]["decode"] = step_decode(lm, quick, args.tokens, args.repeats, info, dl, reserve=0.3 * BUDGET_S)
        except Exception as e:  # noqa: BLE001
            res["steps"]["decode"] = {"status": "failed", "why": _err(e), "traceback": traceback.format_exc()[-3000:]}
    else:
        res["steps"]["decode"] = skipped if "decode" not in steps else {"status": "skipped", "why": why}
    print(f"(b) decode: {res['steps']['decode']['status']} best {res['steps']['decode'].get('best_gbps')} GB/s", flush=True)
    if "ttft" in steps:
        try:
            res["steps"]["ttft"] = step_ttft(quick, [int(x) for x in args.ttft_tokens.split(",")],
                                             [p for p in args.ttft_presets.split(",") if p], args.repeats, dl,
                                             reserve=0.03 * BUDGET_S, first_lm=lm)
        except Exception as e:  # noqa: BLE001
            res["steps"]["ttft"] = {"status": "failed", "why": _err(e), "traceback": traceback.format_exc()[-3000:]}
    else:
        res["steps"]["ttft"] = skipped
    print(f"(c) ttft: {res['steps']['ttft']['status']}", flush=True)
    res["steps"]["vllm"] = step_vllm(quick, dl) if "vllm" in steps else skipped
    res["steps"]["sglang"] = step_sglang(quick, dl.left(), ROOT) if "sglang" in steps else skipped
    statuses = [s["status"] for s in res["steps"].values()]
    res["status"] = "failed" if "failed" in statuses else "passed"
    res["wall_s"] = time.perf_counter() - t0
    res["table"] = table(res)
    print("\n".join(res["table"]))
    run.emit(res)
    print(f"results: {args.result}")
    return 0 if res["status"] == "passed" else 1


if __name__ == "__main__":
    sys.exit(main())
