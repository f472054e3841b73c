"""The KDN paper's Table 1 on a CPU, measured with answers: fine-tuning vs in-context vs KV-cache learning (issue 34).

The paper (../shared/papers/kdn-paper.md): a RAG setup, 2M-token knowledge
base, requests of 8K tokens of retrieved knowledge + 2K tokens of chat
history (80 : 20), Llama 3.1 70B on 2 A40s. Scaled here to a CPU:

* knowledge base: real texts of a fresh machine (licenses, Python reference
  chapters, C headers; ``--texts``), ~68K tokens, with 240 invented facts
  planted as paragraphs (``--questions``, benchmarks/data/rag_questions.json,
  written by ``benchmarks/rag_workload.py``; a fifth of them held out: nothing
  is tuned on them and they are reported apart);
* requests: the knowledge is the segment of the knowledge base BM25 (bm25s)
  retrieves for the question (the base is cut into consecutive segments of
  the request's knowledge size), then ``history`` tokens of real chat history
  (apt's changelog, a different slice per request), then the question. Shapes:
  8K + 2K on Gemma 3 270M, 6.4K + 1.6K on SmolLM2 (its window is 8K), and
  4K + 1K on both (``--shapes``);
* in-context learning: a full prefill of everything (``KnowledgeBase.ask`` on
  an empty store);
* KV-cache learning through the KDN: every segment's KV cache is deposited
  once into a directory store (capture + ``--preset`` encode + put: the
  injection time); a request finds the retrieved segment's entry by its
  token-prefix key, loads it layer by layer and prefills history + question
  (``KnowledgeBase.ask``). An entry that is missing, corrupt or of another
  model is answered by prefill and counted (``fallbacks``);
* fine-tuning: LoRA (peft, rank 16, every projection) trained on the whole
  knowledge base text in 256-token chunks for ``--ft-epochs`` epochs or
  ``--ft-budget-s`` seconds, whichever ends first; the request is history +
  question only (the paper's footnote 3: history cannot be pre-learned).

Why one retrieved segment served as a prefix entry, not CacheBlend of many
chunks: see BENCHMARKS.md "Knowledge injection (the KDN paper's Table 1)".

Measured per request: TTFT (request in to first answer token) and CPU-seconds
(process CPU time, all threads, from request in to the last answer token);
per method: exact-match and lenient accuracy, injection wall and CPU-seconds
for the whole knowledge base, bytes stored. ICL and KV-cache requests are
interleaved (their order alternates) so contention hits both alike; the
fine-tuned model's requests run after its training. torch runs on
``--threads`` threads (1 by default: on this 2-vCPU box with another job
running, 2 threads made a prefill 3x slower).

Every result goes to ``<out>/results.jsonl`` as it is measured; a rerun with
the same ``--out`` resumes (deposits, LoRA adapter and requests already done
are kept), and the summary and table are computed from the file. ``--small``
runs a minute-scale version of everything.

    python benchmarks/bench_rag.py --small --out rag-small
    nohup python benchmarks/bench_rag.py --out benchmarks/results/rag/table1 &
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import harness
import rag_workload as w

from kvcodec.errors import KvcError, KvcInputError  # noqa: E402
from kvcodec.integrations.hf import greedy_from  # noqa: E402
from kvcodec.models.capture import max_context, tokenize  # noqa: E402
from kvcodec.models.load import LoadedModel, load_model  # noqa: E402
from kvcodec.runtime.knowledge import KnowledgeBase  # noqa: E402
from kvcodec.store import Store, TenantKey  # noqa: E402
from kvcodec.texts import load_text  # noqa: E402

METHODS = ("fine-tuning", "in-context learning", "KV-cache learning")
PAPER = {  # Table 1 of the KDN paper (Llama 3.1 70B, 2 x A40, 8K knowledge + 2K history per request)
    "fine-tuning": {"inject": "10 hours", "cost_usd": 0.0052, "ttft_s": 2.63},
    "in-context learning": {"inject": "0", "cost_usd": 0.0149, "ttft_s": 10.91},
    "KV-cache learning": {"inject": "0.25 hours", "cost_usd": 0.0059, "ttft_s": 2.97},
}
# The paper's shape per shipped model: knowledge : history = 80 : 20 (SmolLM2's window is 8,192 tokens).
PAPER_SHAPE = {"gemma3-270m": (8192, 2048), "smollm2": (6400, 1600)}
SMALL_TEXTS = ("apache2", "mpl2")


class Results:
    """The append-only JSONL of one run directory: every measurement, as it is made (resume reads it back)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    try:
                        self.rows.append(json.loads(line))
                    except json.JSONDecodeError:  # a line cut by a killed run: that measurement is redone
                        continue

    def find(self, **match: Any) -> dict[str, Any] | None:
        return next((r for r in self.rows if all(r.get(k) == v for k, v in match.items())), None)

    def add(self, row: dict[str, Any]) -> None:
        row = {**row, "t": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "loadavg": os.getloadavg()[0]}
        self.rows.append(row)
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row, default=str) + "\n")


def shapes_for(model: str, lm: LoadedModel, which: list[str], small: bool) -> list[tuple[str, int, int]]:
    """(label, knowledge tokens, history tokens) per requested shape, 80 : 20."""
    out = []
    for s in which:
        if small:
            out.append((s, 1024 if s == "paper" else 512, 256 if s == "paper" else 128))
        elif s == "paper":
            if model in PAPER_SHAPE:
                k, h = PAPER_SHAPE[model]
            else:  # another model: the largest 80 : 20 request its window holds, up to the paper's 10K
                k = min(8192, int(0.8 * ((max_context(lm) or 10496) - 256)))
                h = k // 4
            out.append((s, k, h))
        elif s == "4k":
            out.append((s, 4096, 1024))
        else:
            raise KvcInputError(f"unknown shape {s!r} (paper, 4k)")
    return out


def pick_requests(facts: list[w.Fact], n: int, seed: int) -> list[w.Fact]:
    """``n`` facts in a fixed shuffled order (the same on every model and shape), held-in and held-out alike."""
    order = list(facts)
    random.Random(seed).shuffle(order)
    return order[:n]


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` -> (i, n): this process answers the requests whose number is ``i`` modulo ``n``.

    Why shards: a request is one-threaded here (``--threads 1``), so ``n``
    processes on the same ``--out`` use ``n`` cores; every row is one appended
    line, and each process skips what the file already holds when it starts.
    Deposit first (a run with ``--requests 0``), then start the shards.
    """
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard wants i/n, e.g. 0/2, not {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"--shard {text}: need 0 <= i < n")
    return i, n


def rescore(rows: list[dict[str, Any]], facts: list[w.Fact]) -> list[dict[str, Any]]:
    """The request rows scored again with today's :func:`rag_workload.score`, from the answers they hold.

    So a report never mixes scoring rules: rows written before a change of the
    rule are judged by the current one (the answers are kept verbatim).
    """
    by_id = {f.id: f for f in facts}
    out = []
    for r in rows:
        f = by_id.get(r.get("fact", "")) if r.get("kind") == "request" else None
        out.append({**r, **w.score(r["answer"], f.answer, f.fact)} if f is not None and "answer" in r else r)
    return out


def timed(fn: Any) -> tuple[Any, float, float]:
    with harness.stopwatch() as sw:
        out = fn()
    return out, float(sw.cpu or 0.0), sw.wall


# -- injection ---------------------------------------------------------------------------------------------------

def calibrate(lm: LoadedModel, preset: str, res: Results) -> None:
    """Build (or load) the model's calibration and rate model before any deposit is timed; record what that cost.

    Why apart: the calibration is made once per model and shared by every file
    and every knowledge base (``kvc calibrate``), like the model weights; left
    inside the first deposit it would charge one knowledge base with it and
    make the injection time depend on whether this machine had built it before.
    Its row says which happened, so the report can show it beside the injection.
    """
    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.api import resolve_rate_model
    from kvcodec.plan.presets import preset_info

    if not preset_info(preset).lossy:
        return
    with harness.stopwatch() as sw:  # bases + sensitivities, then the rate model the controlled presets plan with
        resolve_rate_model(lm, ensure_calibration(lm))  # loaded when this machine has them
    if not res.find(kind="calibration", model=lm.name):  # the first time of the run; a resumed run loads or rebuilds
        res.add({"kind": "calibration", "model": lm.name, "wall_s": sw.wall, "cpu_s": sw.cpu})
    print(f"  calibration of {lm.name} ready in {sw.wall:.1f} s (not part of the injection)", file=sys.stderr)


def deposit_all(kb: KnowledgeBase, segs: list[str], res: Results, tag: dict[str, Any]) -> None:
    """Capture, encode and put every segment's KV (the KDN's deposit), one result row per segment.

    The model's calibration is ready before the first one (:func:`calibrate`).
    """
    for i, seg in enumerate(segs):
        ids, _ = kb.context_ids([seg])
        if res.find(kind="deposit", seg=i, **tag) and kb.store.contains(kb.key(ids)):
            continue
        with harness.stopwatch() as sw:
            cache = kb.capture(ids)
            d = kb.deposit(cache)
        res.add({"kind": "deposit", "seg": i, **tag, "tokens": int(len(ids)), "bytes": d["bytes"],
                 "bits_per_element": d["bits_per_element"], "wall_s": sw.wall, "cpu_s": sw.cpu})
        print(f"  deposit {tag['model']} {tag['shape']} segment {i + 1}/{len(segs)}: {len(ids)} tokens, "
              f"{d['bytes']:,} bytes, {sw.wall:.1f} s", file=sys.stderr)


def kb_chunks(lm: LoadedModel, paras: list[str], n: int = 256) -> list[np.ndarray]:
    """The knowledge base's tokens in ``n``-token training chunks."""
    ids = tokenize(lm.tokenizer, "\n\n".join(paras))
    return [ids[s:s + n] for s in range(0, len(ids), n) if len(ids[s:s + n]) > 8]


def finetune(lm: LoadedModel, chunks: list[np.ndarray], epochs: float, budget_s: float, out_dir: Path,
             res: Results, seed: int) -> Any:
    """LoRA on a copy of the model; the adapter is saved so a resumed run reloads it instead of training again.

    Trains for ``epochs`` passes over the knowledge base or ``budget_s`` wall seconds, whichever ends first.
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    tag = {"kind": "ft-train", "model": lm.name}
    base = copy.deepcopy(lm.model)
    if res.find(**tag) and (out_dir / "adapter_config.json").exists():
        return PeftModel.from_pretrained(base, str(out_dir)).eval()
    cfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(base, cfg)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    rng = random.Random(seed)
    steps_max = max(1, int(epochs * len(chunks)))
    losses: list[float] = []
    order: list[int] = []
    with torch.enable_grad(), harness.stopwatch() as sw:
        while len(losses) < steps_max and sw.elapsed() < budget_s:
            if not order:
                order = list(range(len(chunks)))
                rng.shuffle(order)
            ids = torch.as_tensor(chunks[order.pop()]).unsqueeze(0)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if len(losses) % 25 == 0:
                print(f"  LoRA {lm.name}: step {len(losses)}/{steps_max}, loss {statistics.mean(losses[-25:]):.3f}, "
                      f"{sw.elapsed():.0f} s", file=sys.stderr)
    model.eval()
    model.save_pretrained(str(out_dir))
    k = max(1, len(losses) // 10)
    res.add({**tag, "wall_s": sw.wall, "cpu_s": sw.cpu, "steps": len(losses), "chunks": len(chunks),
             "epochs": len(losses) / len(chunks), "budget_s": budget_s, "stopped_by": "budget" if len(losses) < steps_max
             else "epochs", "loss_first": statistics.mean(losses[:k]), "loss_last": statistics.mean(losses[-k:]),
             "adapter_bytes": sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())})
    return model


# -- one request per method ----------------------------------------------------------------------------------------

def ask_icl(lm: LoadedModel, seg: str, question: str, max_new: int) -> dict[str, Any]:
    a = KnowledgeBase(lm, Store.open("mem://")).ask([seg], question, max_new_tokens=max_new, store_new=False)
    return {"answer": a.answer, "ttft_s": a.ttft_s, "context_tokens": a.context_tokens}


def ask_kv(kb: KnowledgeBase, seg: str, question: str, max_new: int) -> dict[str, Any]:
    a = kb.ask([seg], question, max_new_tokens=max_new, store_new=False)
    return {"answer": a.answer, "ttft_s": a.ttft_s, "source": a.source, "cached_tokens": a.cached_tokens,
            "fallback": a.source == "prefill", "unreadable": a.unreadable, "timings": a.timings}


@torch.inference_mode()
def ask_ft(lm: LoadedModel, model: Any, kb: KnowledgeBase, question: str, max_new: int) -> dict[str, Any]:
    """The fine-tuned model on the chat prefix + history + question (no retrieved knowledge)."""
    t0 = time.perf_counter()
    ids = np.concatenate([kb.prefix_ids(), kb.question_ids(question)])
    view = copy.copy(lm)
    view.model = model
    from kvcodec.models.capture import model_cache

    out, first = greedy_from(view, model_cache(lm), 0, ids, max_new)
    return {"answer": lm.tokenizer.decode(out, skip_special_tokens=True).strip(), "ttft_s": first - t0}


def history_for(hist_ids: np.ndarray, n: int, tokens: int, lm: LoadedModel) -> str:
    """``tokens`` tokens of real chat history, a different slice per request ``n``."""
    s = (n * 7919) % max(1, len(hist_ids) - tokens)
    return str(lm.tokenizer.decode(hist_ids[s:s + tokens]))


def record(res: Results, base: dict[str, Any], method: str, fact: w.Fact, out: dict[str, Any], cpu: float) -> None:
    res.add({**base, "method": method, **out, "cpu_s": cpu, **w.score(out["answer"], fact.answer, fact.fact)})


# -- the run ---------------------------------------------------------------------------------------------------------

def run_model(model: str, a: argparse.Namespace, facts: list[w.Fact], texts: list[str], res: Results,
              out: Path) -> None:
    lm = load_model(model)
    paras = w.plant(texts, facts)
    hist_ids = tokenize(lm.tokenizer, load_text(a.history))
    reqs = pick_requests(facts, a.requests, a.seed)
    key = TenantKey.load(out / "tenant.key")
    if "KV-cache learning" in a.methods:  # once per model, before any shape's deposit is timed
        calibrate(lm, a.preset, res)
    plans = []
    for label, k, h in shapes_for(model, lm, a.shapes, a.small):
        segs = w.segments(paras, lambda s: len(tokenize(lm.tokenizer, s)), k)
        homes = {f.id: w.home_segment(segs, f) for f in facts}
        retriever = w.Retriever(segs)
        kb = KnowledgeBase(lm, Store.open(str(out / f"store-{model}-{label}"), key=key), preset=a.preset)
        tag = {"model": model, "shape": label, "knowledge_tokens": k, "history_tokens": h}
        if not res.find(kind="setup", requests=len(reqs), **tag):
            res.add({"kind": "setup", **tag, "segments": len(segs), "kb_tokens": sum(len(tokenize(lm.tokenizer, s))
                     for s in segs), "texts": a.texts, "facts": len(facts), "requests": len(reqs), "preset": a.preset,
                     "threads": torch.get_num_threads(), "max_new_tokens": a.max_new_tokens})
        plans.append((tag, segs, homes, retriever, kb))
        served = [m for m in ("in-context learning", "KV-cache learning") if m in a.methods]
        if "KV-cache learning" in served:
            deposit_all(kb, segs, res, {"model": model, "shape": label})
        for n, fact in enumerate(reqs):
            if n % a.shard[1] != a.shard[0]:
                continue
            if all(res.find(kind="request", model=model, shape=label, fact=fact.id, method=m) for m in served):
                continue
            got = retriever.top(fact.question)
            question = w.prompt(history_for(hist_ids, n, h, lm), fact.question)
            base = {"kind": "request", **tag, "n": n, "fact": fact.id, "split": fact.split,
                    "retrieved_home": got == homes[fact.id], "question_tokens": len(kb.question_ids(question))}
            first = served if n % 2 == 0 else served[::-1]  # alternate which method goes first
            for method in first:
                if res.find(kind="request", model=model, shape=label, fact=fact.id, method=method):
                    continue
                if method == "in-context learning":
                    o, cpu, _ = timed(lambda: ask_icl(lm, segs[got], question, a.max_new_tokens))
                else:
                    o, cpu, _ = timed(lambda: ask_kv(kb, segs[got], question, a.max_new_tokens))
                record(res, base, method, fact, o, cpu)
            r = {m: res.find(kind="request", model=model, shape=label, fact=fact.id, method=m) for m in first}
            print(f"  {model} {label} request {n + 1}/{len(reqs)} ({fact.split}, key {fact.answer!r}): " + "; ".join(
                f"{m.split()[0]} {r[m]['ttft_s']:.2f} s {r[m]['cpu_s']:.1f} CPU-s {'OK' if r[m]['lenient'] else '--'} "
                f"{r[m]['answer'][:30]!r}" for m in first if r[m]), file=sys.stderr)
    if "fine-tuning" not in a.methods:
        return
    budget = a.ft_budget_s
    kv_inject = injection(res.rows, model, plans[0][0]["shape"])["wall_s"]
    if a.ft_budget_x and kv_inject > 0:  # fine-tuning gets this many times the KV-cache injection's wall time
        budget = min(budget, a.ft_budget_x * kv_inject)
    ft = finetune(lm, kb_chunks(lm, paras), a.ft_epochs, budget, out / f"lora-{model}", res, a.seed)
    for tag, _segs, _homes, _retriever, kb in plans:
        for n, fact in enumerate(reqs):
            if n % a.shard[1] != a.shard[0]:
                continue
            if res.find(kind="request", model=model, shape=tag["shape"], fact=fact.id, method="fine-tuning"):
                continue
            question = w.prompt(history_for(hist_ids, n, tag["history_tokens"], lm), fact.question)
            o, cpu, _ = timed(lambda: ask_ft(lm, ft, kb, question, a.max_new_tokens))
            record(res, {"kind": "request", **tag, "n": n, "fact": fact.id, "split": fact.split}, "fine-tuning",
                   fact, o, cpu)


def forward_flops(cfg: Any, windows: list[int | None], cached: int, new: int) -> float:
    """FLOPs of a forward pass of ``new`` tokens over ``cached`` tokens: projections, MLP and attention.

    Why: where both passes turn FLOPs into seconds at one rate, the TTFT
    ratio in-context / KV-cache is this ratio, so it tells a target the model's
    arithmetic rules out from one the code misses. Only a prefill that is less
    efficient per FLOP than the KV-cache pass beats it (as Gemma 3's did before
    :mod:`kvcodec.models.sdpa_schedule`: transformers computed its sliding-window
    layers over every key and then masked). Counted: q/k/v/o
    projections and a gated MLP (2 FLOPs per weight per token), QK^T and AV
    (4 x heads x head_dim per key, a sliding-window layer's keys capped by its
    window). Not counted: norms, RoPE, softmax, the LM head (one position
    either way).
    """
    c = cfg.get_text_config(decoder=True)
    h, nq = int(c.hidden_size), int(c.num_attention_heads)
    nkv = int(getattr(c, "num_key_value_heads", None) or nq)
    d = int(getattr(c, "head_dim", None) or h // nq)
    per_token = 2 * (2 * h * nq * d + 2 * h * nkv * d + 3 * h * int(c.intermediate_size)) * len(windows)
    pos = np.arange(cached + 1, cached + new + 1, dtype=np.float64)  # keys each new token sees
    keys = sum(float(np.minimum(pos, w or np.inf).sum()) for w in windows)  # a query sees `w` keys, itself included
    return per_token * new + 4 * nq * d * keys


def flop_ratio(model: str, rows: list[dict[str, Any]], history_tokens: int) -> float | None:
    """In-context / KV-cache FLOPs of the requests in ``rows``, their means (see :func:`forward_flops`).

    New tokens: the rows' ``question_tokens`` (history + question + chat
    turn), or the shape's history alone where a row predates that field (a
    bound ~2 % high: the question turn's ~30 tokens are left out).
    """
    from transformers import AutoConfig

    from kvcodec.models.layout import attention_windows
    from kvcodec.models.load import resolve_model_dir

    ctx = [r["context_tokens"] for r in rows if r.get("method") == "in-context learning" and r.get("context_tokens")]
    if not ctx:
        return None
    new = [r.get("question_tokens", history_tokens) for r in rows if r.get("method") == "in-context learning"]
    try:
        cfg = AutoConfig.from_pretrained(str(resolve_model_dir(model)))
        windows = attention_windows(cfg)
    except (OSError, ValueError, KvcError):
        return None
    n_ctx, n_new = int(statistics.mean(ctx)), int(statistics.mean(new))
    return forward_flops(cfg, windows, 0, n_ctx + n_new) / forward_flops(cfg, windows, n_ctx, n_new)


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if xs else float("nan")


def injection(rows: list[dict[str, Any]], model: str, shape: str) -> dict[str, Any]:
    """The KV-cache injection of one (model, shape): every segment's capture + encode + put, summed.

    One row per segment, its last: a run resumed on a machine without its
    store deposits a segment again. The model's calibration is made once per
    model before any deposit and is shown beside the sum, not inside it
    (None: a run older than that row).
    """
    deps = list({r["seg"]: r for r in rows if r["kind"] == "deposit" and r["model"] == model
                 and r["shape"] == shape}.values())
    cal = next((r for r in rows if r["kind"] == "calibration" and r["model"] == model), None)
    return {"wall_s": sum(r["wall_s"] for r in deps), "cpu_s": sum(r["cpu_s"] for r in deps),
            "bytes": sum(r["bytes"] for r in deps), "segments_deposited": len(deps),
            "calibration": None if cal is None else {k: cal[k] for k in ("wall_s", "cpu_s")}}


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary per (model, shape), every number computed from the result rows."""
    out = []
    groups = sorted({(r["model"], r["shape"]) for r in rows if r["kind"] == "setup"})
    for model, shape in groups:
        setup = [r for r in rows if r["kind"] == "setup" and r["model"] == model and r["shape"] == shape][-1]
        kv_inj = injection(rows, model, shape)
        ft = next((r for r in rows if r["kind"] == "ft-train" and r["model"] == model), None)
        req = [r for r in rows if r["kind"] == "request" and r["model"] == model and r["shape"] == shape]
        s: dict[str, Any] = {"model": model, "shape": shape, "knowledge_tokens": setup["knowledge_tokens"],
                             "history_tokens": setup["history_tokens"], "kb_tokens": setup["kb_tokens"],
                             "segments": setup["segments"], "requests_planned": setup["requests"],
                             "threads": setup.get("threads"),
                             "complete": kv_inj["segments_deposited"] >= setup["segments"], "methods": {}}
        inj = {"KV-cache learning": kv_inj,
               "in-context learning": {"wall_s": 0.0, "cpu_s": 0.0, "bytes": 0}}
        if ft:
            inj["fine-tuning"] = {"wall_s": ft["wall_s"], "cpu_s": ft["cpu_s"], "bytes": ft["adapter_bytes"],
                                  "steps": ft["steps"], "epochs": ft["epochs"], "stopped_by": ft["stopped_by"],
                                  "loss_first": ft["loss_first"], "loss_last": ft["loss_last"]}
        # ICL and KV-cache on the requests both answered; fine-tuning on those of them it answered (its passes
        # run after theirs, so a cut run may hold fewer of its requests)
        facts_by = {m: {r["fact"] for r in req if r["method"] == m} for m in METHODS}
        served = facts_by["in-context learning"] & facts_by["KV-cache learning"]
        for m in METHODS:
            rs = [r for r in req if r["method"] == m and r["fact"] in (served or facts_by[m])]
            if not rs:
                continue
            ms: dict[str, Any] = {"requests": len(rs), "inject": inj.get(m)}
            for split in ("all", "held-in", "held-out"):
                sub = [r for r in rs if split == "all" or r["split"] == split]
                ms[split] = {"n": len(sub), "exact": sum(r["exact"] for r in sub) / max(1, len(sub)),
                             "lenient": sum(r["lenient"] for r in sub) / max(1, len(sub))}
            for k in ("ttft_s", "cpu_s"):
                xs = [r[k] for r in rs]
                ms[k] = {"p50": pct(xs, 50), "p99": pct(xs, 99), "mean": statistics.mean(xs)}
            if m == "KV-cache learning":
                ms["fallbacks"] = sum(bool(r.get("fallback")) for r in rs)
                ms["retrieved_home"] = sum(bool(r.get("retrieved_home")) for r in rs)
            s["methods"][m] = ms
        s["flop_ratio_icl_over_kv"] = flop_ratio(model, [r for r in req if r["fact"] in served], setup["history_tokens"])
        out.append(s)
    return out


def ratios(s: dict[str, Any]) -> dict[str, float]:
    m = s["methods"]
    icl, kv, ft = m.get("in-context learning"), m.get("KV-cache learning"), m.get("fine-tuning")
    r: dict[str, float] = {}
    if icl and kv:
        r["cpu_p50_icl_over_kv"] = icl["cpu_s"]["p50"] / kv["cpu_s"]["p50"]
        r["ttft_p50_icl_over_kv"] = icl["ttft_s"]["p50"] / kv["ttft_s"]["p50"]
        r["ttft_p99_icl_over_kv"] = icl["ttft_s"]["p99"] / kv["ttft_s"]["p99"]
        r["accuracy_points_kv_minus_icl"] = 100 * (kv["all"]["exact"] - icl["all"]["exact"])
        r["lenient_points_kv_minus_icl"] = 100 * (kv["all"]["lenient"] - icl["all"]["lenient"])
        if s.get("flop_ratio_icl_over_kv"):  # the arithmetic's bound on the TTFT ratio (forward_flops)
            r["flop_ratio_icl_over_kv"] = s["flop_ratio_icl_over_kv"]
    if kv and ft and ft.get("inject") and kv["inject"]["wall_s"] > 0:
        r["inject_wall_ft_over_kv"] = ft["inject"]["wall_s"] / kv["inject"]["wall_s"]
        r["inject_cpu_ft_over_kv"] = ft["inject"]["cpu_s"] / kv["inject"]["cpu_s"]
    return r


def table(summ: list[dict[str, Any]]) -> str:
    lines = ["| model, shape | method | requests | exact (held-in / held-out) | lenient | inject wall (CPU-s) | "
             "bytes stored | CPU-s/request p50 (p99) | TTFT s p50 (p99) | paper: inject / $ / TTFT s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in summ:
        head = f"{s['model']}, {s['knowledge_tokens']}+{s['history_tokens']}"
        for m in METHODS:
            ms = s["methods"].get(m)
            if not ms:
                continue
            inj = ms["inject"] or {}
            inj_s = f"{inj['wall_s']:.0f} s ({inj['cpu_s']:.0f})" if inj else "-"
            if m == "fine-tuning" and inj:
                inj_s += f", {inj['steps']} steps = {inj['epochs']:.2f} epochs"
            if m == "KV-cache learning" and inj.get("calibration"):
                inj_s += f" + calibration once per model {inj['calibration']['wall_s']:.0f} s"
            if m == "KV-cache learning" and inj and not s["complete"]:
                inj_s += f" (partial: {inj['segments_deposited']}/{s['segments']} segments)"
            extra = f", {ms['fallbacks']} by prefill" if m == "KV-cache learning" else ""
            lines.append(
                f"| {head} | {m} | {ms['requests']}{extra} | {100 * ms['all']['exact']:.1f} % "
                f"({100 * ms['held-in']['exact']:.0f} / {100 * ms['held-out']['exact']:.0f}) | "
                f"{100 * ms['all']['lenient']:.1f} % | {inj_s} | {inj.get('bytes', 0):,} | "
                f"{ms['cpu_s']['p50']:.2f} ({ms['cpu_s']['p99']:.2f}) | {ms['ttft_s']['p50']:.2f} ({ms['ttft_s']['p99']:.2f}) | "
                f"{PAPER[m]['inject']} / {PAPER[m]['cost_usd']} / {PAPER[m]['ttft_s']} |")
        r = ratios(s)
        if r:
            lines.append(f"| {head} | ratios | " + ", ".join(f"{k} {v:.2f}" for k, v in r.items()) + " | | | | | | | |")
    return "\n".join(lines)


def plot(summ: list[dict[str, Any]], path: Path) -> None:
    """Exact accuracy, TTFT p50 and CPU-s p50 per method, per (model, shape), beside the paper's TTFT.

    Accuracy is drawn first: a method's speed means nothing without what it answers (fine-tuning here is quick per
    request and answers almost nothing).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    labels = [f"{s['model']}\n{s['knowledge_tokens']}+{s['history_tokens']}" for s in summ]
    x = np.arange(len(summ))
    for j, m in enumerate(METHODS):
        cols = [[100 * s["methods"].get(m, {}).get("all", {}).get("exact", np.nan) for s in summ]]
        cols += [[s["methods"].get(m, {}).get(k, {}).get("p50", np.nan) for s in summ] for k in ("ttft_s", "cpu_s")]
        for ax, ys in zip(axes, cols):
            ax.bar(x + (j - 1) * 0.27, ys, 0.27, label=m)
    for ax, t in zip(axes, ("exact answers (%)", "TTFT p50 (s)", "CPU-s per request p50")):
        ax.set_xticks(x, labels, fontsize=8)
        ax.set_title(t)
    axes[0].legend(fontsize=8)
    fig.suptitle("KDN Table 1 on a CPU (paper, 70B on 2 A40: TTFT 2.63 / 10.91 / 2.97 s)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", nargs="+", default=None,
                    help="Shipped model names or local HF model directories (default gemma3-270m smollm2; --small: smollm2).")
    ap.add_argument("--shapes", nargs="+", default=None,
                    help="paper (80 : 20 at the paper's size), 4k (default both; --small: paper).")
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--questions", default=str(w.QUESTIONS), help="Question file (benchmarks/rag_workload.py make).")
    ap.add_argument("--texts", nargs="+", default=list(w.KB_TEXTS), help="Knowledge base texts (names or paths).")
    ap.add_argument("--history", default=w.HISTORY_TEXT, help="Text the chat history is sliced from.")
    ap.add_argument("--requests", type=int, default=100, help="Requests per (model, shape).")
    ap.add_argument("--preset", default="balanced")
    ap.add_argument("--max-new-tokens", type=int, default=32,
                    help="Answer tokens: the small models restate the question, or quote the fact, before the value (~24 tokens).")
    ap.add_argument("--ft-epochs", type=float, default=1.0)
    ap.add_argument("--ft-budget-s", type=float, default=3600.0, help="LoRA training wall-clock budget per model.")
    ap.add_argument("--ft-budget-x", type=float, default=12.0,
                    help="...or this many times the model's KV-cache injection wall time (first shape), if smaller; 0: off.")
    ap.add_argument("--threads", type=int, default=1, help="torch threads.")
    ap.add_argument("--seed", type=int, default=34)
    ap.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                    help="Answer only requests I, I+N, I+2N, ...: N processes on one --out share the cores (deposit first).")
    ap.add_argument("--small", action="store_true",
                    help="A few-minute version: SmolLM2, 2 texts, 24 facts, 1K+256 requests (512+128 for --shapes 4k), 6 "
                         "requests, LoRA for --ft-budget-x times the KV-cache injection.")
    ap.add_argument("--out", default="rag-run", help="Run directory (results.jsonl, stores, adapters); resumed.")
    ap.add_argument("--report", action="store_true",
                    help="Run nothing: summarise --out's results.jsonl (a cut run's too) into summary.json, the table, the plot.")
    run = harness.cli(ap, argv, case="rag")
    a = run.args
    a.models = a.models or (["smollm2"] if a.small else ["gemma3-270m", "smollm2"])
    a.shapes = a.shapes or (["paper"] if a.small else ["paper", "4k"])
    if a.small:
        a.texts = list(SMALL_TEXTS) if a.texts == list(w.KB_TEXTS) else a.texts
        a.requests = min(a.requests, 6)
        a.ft_epochs = max(a.ft_epochs, 50.0)  # the budget (ft_budget_x x the injection) ends the training
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    try:
        facts = w.load_facts(a.questions)
        if a.small:
            facts = facts[::10]
        texts = [load_text(t) for t in a.texts]
    except (ValueError, KvcError) as exc:
        raise SystemExit(f"bench_rag: {exc}") from None
    out = Path(a.out)
    need = ["bm25s"] + (["peft"] if "fine-tuning" in a.methods else [])
    missing = [m for m in need if importlib.util.find_spec(m) is None]
    if missing and not a.report:
        raise SystemExit(f"bench_rag: needs {', '.join(missing)}, from the rag extra: pip install -e '.[rag]'")
    if a.report:
        if not (out / "results.jsonl").exists():
            raise SystemExit(f"bench_rag: no {out / 'results.jsonl'} to report on")
        report(Results(out / "results.jsonl"), out, facts)
        return
    out.mkdir(parents=True, exist_ok=True)
    if not (out / "tenant.key").exists():
        fd = os.open(out / "tenant.key", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, (os.urandom(32).hex() + "\n").encode())
        os.close(fd)
    res = Results(out / "results.jsonl")
    res.add({"kind": "start", "command": harness.command_line(run.argv, run.script), "machine": harness.machine()})
    for model in a.models:
        run_model(model, a, facts, texts, res, out)
    run.emit({"summary": report(res, out, facts), "paper": PAPER})


def report(res: Results, out: Path, facts: list[w.Fact]) -> list[dict[str, Any]]:
    """summary.json, the table (printed) and table1.png of a run directory, all from its result rows (re-scored)."""
    summ = summarise(rescore(res.rows, facts))
    (out / "summary.json").write_text(json.dumps(summ, indent=1, default=str) + "\n")
    print(table(summ))
    try:
        plot(summ, out / "table1.png")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    return summ


if __name__ == "__main__":
    main()
