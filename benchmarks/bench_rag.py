"""The KDN paper's Table 1 in miniature: fine-tuning vs in-context learning vs KV-cache learning (issue 17).

Setup, scaled from the paper's (2M-token knowledge base; requests of 8K tokens
of retrieved knowledge + 2K tokens of chat history, i.e. 80 % / 20 %; Llama 3.1
70B on 2 A40s) to SmolLM2-135M on this CPU:

* knowledge base: real texts that exist on a fresh machine (Debian's license
  texts, CPython's language reference), cut into 256-token chunks; ``--facts``
  invented facts ("The access code of the Halvorsen archive is 7391.") are
  planted, one per chunk, in chunks spread over the base;
* retriever: BM25 (``bm25s``, from PyPI) over the chunks; a request retrieves
  the top ``--top-k`` chunks for its question;
* request = retrieved knowledge (``--top-k`` x 256 tokens) + chat history
  (a quarter of the knowledge's tokens, real text, so knowledge : history =
  80 : 20 as in the paper) + the question; one request per planted fact.

Methods (same process, same requests, interleaved per request):

* **in-context learning**: a full prefill of prefix + knowledge + history + question
  (``KnowledgeBase.ask`` on an empty store, nothing stored);
* **KV-cache learning**: every chunk's KV cache was put once into a store (the
  KDN's deposit: capture + ``balanced`` encode + put); a request loads its
  retrieved chunks from the store and composes them with CacheBlend
  (``KnowledgeBase.ask_blended``, recompute ratio 0.15; the first chunk sits at the
  prefix position, the others are non-prefix), then prefills history + question;
* **fine-tuning**: LoRA (``peft``; rank 16 on every projection) trained on all
  chunks of the knowledge base for ``--ft-steps`` steps; the request is history +
  question only (the paper's footnote 3: history cannot be pre-learned).

Measured: time to inject the knowledge base (encode + store every chunk, vs
LoRA training to the loss it reaches, both on this CPU); per request, TTFT
(request to first answer token) and CPU-seconds (process CPU time of the
request, all threads); answer quality = share of answers that contain the
planted fact's value (greedy, 12 tokens). Cost in the paper is dollars at AWS
prices; here it is CPU-seconds (the ratio is what compares).

    python benchmarks/bench_rag.py --json-out benchmarks/results/rag.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

import harness

from kvcodec.atomic import atomic_write_text  # noqa: E402
from kvcodec.models.capture import capture  # noqa: E402
from kvcodec.integrations.hf import greedy_from  # noqa: E402
from kvcodec.runtime.knowledge import KnowledgeBase  # noqa: E402
from kvcodec.models.load import load_model  # noqa: E402
from kvcodec.store import Store, TenantKey  # noqa: E402
from kvcodec.texts import load_text  # noqa: E402

TEXTS = ("gpl3", "lgpl21", "apache2", "mpl2", "gpl2", "pydoc")
PAPER = {  # Table 1 of the KDN paper (Llama 3.1 70B, 2 x A40, 8K knowledge + 2K history per request)
    "fine-tuning": {"inject": "10 hours", "cost_usd": 0.0052, "ttft_s": 2.63},
    "in-context learning": {"inject": "0", "cost_usd": 0.0149, "ttft_s": 10.91},
    "KV-cache learning": {"inject": "0.25 hours", "cost_usd": 0.0059, "ttft_s": 2.97},
}
NAMES = ["Halvorsen", "Quillby", "Marrowgate", "Tesselin", "Varnholt", "Okonkwo", "Brisendale", "Petrakova"]
THINGS = ["archive", "observatory", "ferry line", "seed vault", "harbour office", "glass works", "library", "mill"]


def facts(n: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """(sentence to plant, question, answer) triples with invented names and numbers."""
    out = []
    for i in range(n):
        who, what, code = NAMES[i % len(NAMES)], THINGS[i % len(THINGS)], str(rng.randint(1000, 9999))
        out.append((f" The access code of the {who} {what} is {code}. ",
                    f"What is the access code of the {who} {what}?", code))
    return out


def build_kb(lm, n_facts: int, rng: random.Random) -> tuple[list[str], list[tuple[str, str, str, int]]]:
    """256-token chunks of the texts, with facts planted in chunks spread over the base."""
    tok = lm.tokenizer
    chunks: list[str] = []
    for name in TEXTS:
        ids = tok(load_text(name), add_special_tokens=False)["input_ids"]
        for s in range(0, len(ids) - 255, 256):
            chunks.append(tok.decode(ids[s:s + 256]))
    planted = []
    spots = rng.sample(range(len(chunks)), n_facts)
    for (sent, q, a), i in zip(facts(n_facts, rng), spots):
        words = chunks[i].split(" ")
        at = len(words) // 2
        chunks[i] = " ".join(words[:at]) + sent + " ".join(words[at:])
        planted.append((sent, q, a, i))
    return chunks, planted


def cpu_timed(fn):
    """(fn's value, process CPU seconds, wall seconds) of one call."""
    with harness.stopwatch() as sw:
        out = fn()
    return out, sw.cpu, sw.wall


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--facts", type=int, default=6)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--kb-chunks", type=int, default=48, help="Chunks in the knowledge base (first N of the texts).")
    ap.add_argument("--ft-steps", type=int, default=48)
    ap.add_argument("--seed", type=int, default=17)
    ap.add_argument("--json-out", default=None, metavar="FILE")
    run = harness.cli(ap, argv, case="rag")
    a = run.args
    n_facts, top_k, kb_chunks, ft_steps, seed, json_out = a.facts, a.top_k, a.kb_chunks, a.ft_steps, a.seed, a.json_out
    import bm25s

    rng = random.Random(seed)
    torch.manual_seed(seed)
    lm = load_model("smollm2")
    chunks, planted = build_kb(lm, n_facts, rng)
    keep = sorted(set(range(min(kb_chunks, len(chunks)))) | {i for *_, i in planted})
    index_of = {old: new for new, old in enumerate(keep)}
    chunks = [chunks[i] for i in keep]
    planted = [(s, q, a, index_of[i]) for s, q, a, i in planted]
    history_src = lm.tokenizer(load_text("lgpl21"), add_special_tokens=False)["input_ids"]
    hist_tokens = top_k * 256 // 4  # knowledge : history = 80 : 20, as in the paper
    retriever = bm25s.BM25()
    retriever.index(bm25s.tokenize(chunks, stopwords="en", show_progress=False), show_progress=False)

    # -- injection: KV-cache learning (encode + store every chunk) ---------------------------
    store = Store.open(tempfile.mkdtemp(prefix="bench-rag-"), key=TenantKey(os.urandom(32)))
    kb = KnowledgeBase(lm, store, preset="balanced")
    stored_bytes = 0
    with harness.stopwatch() as sw:
        for text in chunks:
            c = capture(lm, token_ids=kb.doc_ids(text))
            stored_bytes += kb.deposit(c)["bytes"]
    inject_kv = {"wall_s": sw.wall, "cpu_s": sw.cpu, "chunks": len(chunks), "bytes": stored_bytes}
    print(f"KV-cache injection: {len(chunks)} chunks in {inject_kv['wall_s']:.1f} s", file=sys.stderr)

    # -- injection: fine-tuning (LoRA) ---------------------------------------------------------
    inject_ft, ft_model = finetune(lm, chunks, ft_steps, rng)
    print(f"LoRA: {ft_steps} steps in {inject_ft['wall_s']:.1f} s, loss {inject_ft['loss_first']:.3f} -> "
          f"{inject_ft['loss_last']:.3f}", file=sys.stderr)

    # -- requests --------------------------------------------------------------------------------
    rows = []
    for n, (_sent, q, a, where) in enumerate(planted):
        got = retriever.retrieve(bm25s.tokenize([q], stopwords="en", show_progress=False), k=top_k,
                                 show_progress=False)[0][0]
        docs = [chunks[int(i)] for i in got]
        s = (n * 997) % max(1, len(history_src) - hist_tokens)
        history = lm.tokenizer.decode(history_src[s:s + hist_tokens])
        question = f"Earlier in this conversation:\n{history}\n\nNow answer briefly. {q}"
        icl, icl_cpu, _ = cpu_timed(lambda: KnowledgeBase(lm, Store.open("mem://"), preset="balanced").ask(
            docs, question, max_new_tokens=12, store_new=False))
        kvl, kvl_cpu, _ = cpu_timed(lambda: kb.ask_blended(docs, question, max_new_tokens=12, store_new=False))
        (ft_ans, ft_ttft), ft_cpu, _ = cpu_timed(lambda: ask_plain(lm, ft_model, kb, question))
        row = {"question": q, "answer_key": a, "retrieved_fact_chunk": where in [int(i) for i in got],
               "context_tokens": icl.context_tokens,
               "in-context learning": {"ttft_s": icl.ttft_s, "cpu_s": icl_cpu, "answer": icl.answer, "correct": a in icl.answer},
               "KV-cache learning": {"ttft_s": kvl.ttft_s, "cpu_s": kvl_cpu, "answer": kvl.answer, "correct": a in kvl.answer,
                                     "cached_tokens": kvl.cached_tokens},
               "fine-tuning": {"ttft_s": ft_ttft, "cpu_s": ft_cpu, "answer": ft_ans, "correct": a in ft_ans}}
        rows.append(row)
        print(f"request {n}: " + "; ".join(f"{m} {row[m]['ttft_s']:.2f} s {'OK' if row[m]['correct'] else '--'}"
                                          for m in PAPER), file=sys.stderr)
    doc = {"machine": {**harness.machine(), "loadavg": os.getloadavg()},
           "setup": {"kb_chunks": len(chunks), "kb_tokens": len(chunks) * 256, "top_k": top_k,
                     "knowledge_tokens": top_k * 256, "history_tokens": hist_tokens, "facts": n_facts,
                     "ft_steps": ft_steps},
           "inject": {"KV-cache learning": inject_kv, "fine-tuning": inject_ft},
           "rows": rows, "paper": PAPER,
           "command": harness.command_line(run.argv, run.script)}
    doc["summary"] = summary(doc)
    if json_out:
        atomic_write_text(json_out, json.dumps(doc, indent=2, default=str))
    print(table(doc))
    run.emit({k: v for k, v in doc.items() if k not in ("machine", "command")})


def finetune(lm, chunks: list[str], steps: int, rng: random.Random):
    """LoRA on a copy of the model, one 256-token chunk per step (every chunk in turn, shuffled per epoch)."""
    from peft import LoraConfig, get_peft_model

    model = copy.deepcopy(lm.model)
    model.train()
    cfg = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, task_type="CAUSAL_LM",
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    order: list[int] = []
    losses = []
    with harness.stopwatch() as sw:
        for _step in range(steps):
            if not order:
                order = list(range(len(chunks)))
                rng.shuffle(order)
            ids = torch.as_tensor(lm.tokenizer(chunks[order.pop()], add_special_tokens=False)["input_ids"]).unsqueeze(0)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
    wall, cpu = sw.wall, sw.cpu
    model.eval()
    k = max(1, min(len(chunks), steps) // 4)
    return {"wall_s": wall, "cpu_s": cpu, "steps": steps, "epochs": steps / len(chunks),
            "loss_first": statistics.mean(losses[:k]), "loss_last": statistics.mean(losses[-k:]),
            "losses": losses}, model


@torch.inference_mode()
def ask_plain(lm, model, kb: KnowledgeBase, question: str) -> tuple[str, float]:
    """The fine-tuned model on chat prefix + question only (no retrieved knowledge)."""
    t0 = time.perf_counter()
    ids = np.concatenate([kb.prefix_ids(), kb.question_ids(question)])
    view = copy.copy(lm)
    view.model = model
    from transformers import DynamicCache

    out, first = greedy_from(view, DynamicCache(), 0, ids, 12)
    return lm.tokenizer.decode(out, skip_special_tokens=True).strip(), first - t0


def summary(doc: dict) -> dict:
    out = {}
    for m in PAPER:
        rs = [r[m] for r in doc["rows"]]
        out[m] = {"ttft_s": statistics.median(r["ttft_s"] for r in rs), "cpu_s": statistics.median(r["cpu_s"] for r in rs),
                  "correct": sum(r["correct"] for r in rs), "requests": len(rs)}
    out["inject_ratio_ft_over_kv"] = doc["inject"]["fine-tuning"]["wall_s"] / doc["inject"]["KV-cache learning"]["wall_s"]
    out["retrieval_hits"] = sum(r["retrieved_fact_chunk"] for r in doc["rows"])
    return out


def table(doc: dict) -> str:
    s, inj, p = doc["summary"], doc["inject"], PAPER
    lines = ["| method | time to inject (ours) | paper | CPU-s per request (median) | paper $ | TTFT s (median) | paper s | "
             "facts answered |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    inject = {"fine-tuning": f"{inj['fine-tuning']['wall_s']:.0f} s ({inj['fine-tuning']['steps']} LoRA steps, loss "
                             f"{inj['fine-tuning']['loss_first']:.2f} -> {inj['fine-tuning']['loss_last']:.2f})",
              "in-context learning": "0",
              "KV-cache learning": f"{inj['KV-cache learning']['wall_s']:.0f} s ({inj['KV-cache learning']['chunks']} chunks)"}
    for m in ("fine-tuning", "in-context learning", "KV-cache learning"):
        lines.append(f"| {m} | {inject[m]} | {p[m]['inject']} | {s[m]['cpu_s']:.2f} | {p[m]['cost_usd']} | "
                     f"{s[m]['ttft_s']:.2f} | {p[m]['ttft_s']} | {s[m]['correct']}/{s[m]['requests']} |")
    icl, kvl = s["in-context learning"], s["KV-cache learning"]
    lines.append("")
    lines.append(f"ratios (ours): injection fine-tuning / KV-cache {s['inject_ratio_ft_over_kv']:.1f}x (paper 40x); "
                 f"ICL / KV-cache CPU {icl['cpu_s'] / kvl['cpu_s']:.2f}x (paper cost 2.5x), "
                 f"TTFT {icl['ttft_s'] / kvl['ttft_s']:.2f}x (paper 3.7x); retrieval found the fact's chunk in "
                 f"{s['retrieval_hits']}/{len(doc['rows'])} requests")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
