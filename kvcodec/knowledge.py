"""Put knowledge once, answer from it fast: the store-backed Q&A runtime.

The first question about a document pays for prefill, answers, then encodes
the document's KV cache and deposits it in the store. Every later question
(from any process or machine sharing the store) finds the longest cached
prefix of its context, loads it layer by layer, prefills only what is not
cached (further documents of a prefix chain, then the question) and answers.

Entries are keyed by (model fingerprint, codec id, namespace, chained token
hash), so a cache is never served to another model, codec or tenant. The
codec id is derived from the preset name and its options, which are known
before encoding (the bit allocation a preset computes per cache is inside
the `.kvc` itself).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .capture import tokenize
from .chat import ChatFormat
from .errors import KvcInputError
from .format import KvcReader, encode_kvc_bytes, get_plan
from .hf import greedy_from, load_cache
from .kvcache import KVCache
from .model import LoadedModel, cache_root
from .store import Store, StoreKey

def default_store_url() -> str:
    return str(cache_root() / "store")


def codec_id(preset: str, options: dict[str, Any] | None = None) -> str:
    """Stable id of an encoding configuration, part of every store key."""
    blob = json.dumps({"preset": preset, "options": options or {}}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def key_for_file(reader: KvcReader, namespace: str = "default") -> StoreKey:
    """The store key of an existing `.kvc` file (for ``kvc store put``)."""
    preset = reader.header.codec or "custom"
    return StoreKey.for_tokens(
        reader.token_ids, model=reader.fingerprint.id, codec=codec_id(preset), namespace=namespace
    )


@dataclass
class Answer:
    answer: str
    answer_ids: list[int]
    source: str  # "store" (whole context loaded), "store+prefill" (prefix loaded), "prefill", or "blend" (chunks blended)
    context_tokens: int
    cached_tokens: int
    ttft_s: float
    prefill_ttft_s: float | None  # TTFT of the prefill path, as measured when the entry was stored
    stored: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        if self.prefill_ttft_s and self.source != "prefill":
            d["speedup_vs_prefill"] = self.prefill_ttft_s / self.ttft_s
        return d


class KnowledgeBase:
    """Documents as cached KV in a store, for one model, preset and namespace."""

    def __init__(
        self, lm: LoadedModel, store: Store | str | None = None, preset: str = "balanced", namespace: str = "default"
    ) -> None:
        self.lm = lm
        self.store = store if isinstance(store, Store) else Store.open(store or default_store_url())
        self.preset = preset
        self.namespace = namespace
        self.codec = codec_id(preset)
        self.chat = ChatFormat.for_tokenizer(lm.tokenizer)

    # -- tokens ------------------------------------------------------------
    def context_ids(self, docs: list[str]) -> tuple[np.ndarray, list[int]]:
        """Token ids of the chat prefix + documents, and the document boundaries."""
        if not docs:
            raise KvcInputError("give at least one document")
        parts = [self.prefix_ids()] + [self.doc_ids(d) for d in docs]
        bounds = list(np.cumsum([len(p) for p in parts])[1:])
        return np.concatenate(parts), bounds

    def prefix_ids(self) -> np.ndarray:
        """Token ids of the chat prefix every context starts with (the model's own template, :mod:`kvcodec.chat`)."""
        return self.chat.prefix

    def doc_ids(self, doc: str) -> np.ndarray:
        """Token ids of one document as it appears in a context (tokenized on its own)."""
        return tokenize(self.lm.tokenizer, doc.rstrip() + "\n\n")

    def question_ids(self, question: str) -> np.ndarray:
        """Token ids of the question turn, ending with the model's assistant-turn opener."""
        return self.chat.question_ids(question)

    def key(self, ids: np.ndarray) -> StoreKey:
        return StoreKey.for_tokens(ids, model=self.lm.fingerprint.id, codec=self.codec, namespace=self.namespace)

    # -- lookup / deposit ----------------------------------------------------
    def lookup(self, ids: np.ndarray, bounds: list[int]) -> tuple[StoreKey | None, int]:
        """Longest cached prefix: document boundaries first, then 256-token chunk boundaries."""
        cands = [self.key(ids[:b]) for b in sorted(set(bounds), reverse=True)]
        found = self.store.contains_many(cands)
        best = next((k for k, ok in zip(cands, found) if ok), None)
        key, n = self.store.longest_prefix(ids, model=self.lm.fingerprint.id, codec=self.codec, namespace=self.namespace)
        if best is not None and best.n_tokens >= n:
            return best, best.n_tokens
        return key, n

    def deposit(self, cache: KVCache, prefill_ttft_s: float | None = None) -> dict[str, Any]:
        """Encode a context's KV with the preset and put it in every tier.

        ``prefill_ttft_s`` (the measured TTFT of a full prefill of exactly this
        context) is recorded so later hits can report their speed-up.
        """
        t0 = time.perf_counter()
        ids = cache.token_ids
        if prefill_ttft_s is not None:
            cache.meta["prefill_ttft_s"] = prefill_ttft_s
        plan = get_plan(self.preset, cache, lm=self.lm)
        data = encode_kvc_bytes(cache, plan.pipelines, attachments=plan.attachments, preset=plan.preset, meta=cache.meta)
        res = self.store.put(self.key(ids), data, {"preset": self.preset, "tokens": int(len(ids)), "prefill_ttft_s": prefill_ttft_s})
        return {
            "key": self.key(ids).to_str(), "bytes": len(data), "encode_s": time.perf_counter() - t0,
            "bits_per_element": len(data) * 8 / cache.num_elements, "stored_in": res.stored_in, "failed": res.failed,
        }

    # -- the main job --------------------------------------------------------
    @torch.inference_mode()
    def ask(self, docs: list[str], question: str, max_new_tokens: int = 48, store_new: bool = True) -> Answer:
        t0 = time.perf_counter()
        ids, bounds = self.context_ids(docs)
        q = self.question_ids(question)
        key, n_cached = self.lookup(ids, bounds)
        timings: dict[str, float] = {"lookup_s": time.perf_counter() - t0}
        prefill_ttft = None
        if key is not None:
            data = self.store.get(key)
            timings["fetch_s"] = time.perf_counter() - t0 - timings["lookup_s"]
            loaded = load_cache(data, self.lm)
            if not np.array_equal(loaded.token_ids, ids[:n_cached]):
                raise KvcInputError(f"store entry {key} encodes other tokens than its key says")
            past = loaded.cache
            prefill_ttft = (loaded.reader.header.meta or {}).get("prefill_ttft_s")
        else:
            past = None
        rest = ids[n_cached:]
        if rest.size:  # prefill what the store did not have (all of it on a miss)
            pos = torch.arange(n_cached, len(ids)).unsqueeze(0)
            out = self.lm.model(input_ids=torch.as_tensor(rest).unsqueeze(0), past_key_values=past, position_ids=pos, use_cache=True)
            past = out.past_key_values
        # DynamicLayer.update concatenates into new tensors, so these references stay the context's KV.
        context_kv = [(layer.keys[0], layer.values[0]) for layer in past.layers] if (store_new and rest.size) else None
        answer_ids, first_at = greedy_from(self.lm, past, len(ids), q, max_new_tokens)
        ttft = first_at - t0
        source = "prefill" if key is None else ("store" if not rest.size else "store+prefill")
        stored = None
        if context_kv is not None:
            snapshot = KVCache([k for k, _ in context_kv], [v for _, v in context_kv], ids, self.lm.fingerprint)
            stored = self.deposit(snapshot, ttft if key is None else None)
        return Answer(
            answer=self.lm.tokenizer.decode(answer_ids, skip_special_tokens=True).strip(),
            answer_ids=answer_ids, source=source, context_tokens=int(len(ids)), cached_tokens=int(n_cached),
            ttft_s=ttft, prefill_ttft_s=ttft if key is None else prefill_ttft, stored=stored, timings=timings,
        )

    # -- blended answers (issue 9) ---------------------------------------------
    def chunk_cache(self, ids: np.ndarray) -> KVCache | None:
        """The position-independent chunk cache of ``ids`` (captured alone, at positions 0..n-1) from the store, or None."""
        key = self.key(ids)
        data = self.store.get(key)
        if data is None:
            return None
        with KvcReader(data) as r:
            self.lm.fingerprint.check_compatible(r.fingerprint, what=f"store entry {key}")
            cache = r.read_cache()
        if not np.array_equal(cache.token_ids, ids) or cache.positions is not None:
            raise KvcInputError(f"store entry {key} encodes other tokens than its key says")
        return cache

    @torch.inference_mode()
    def ask_blended(
        self,
        docs: list[str],
        question: str,
        max_new_tokens: int = 48,
        recompute_ratio: float = 0.15,
        store_new: bool = True,
    ) -> Answer:
        """Answer from per-document chunk caches blended CacheBlend-style (:mod:`kvcodec.blend`).

        Every document is a chunk of its own: its tokens alone, captured from
        position 0 and kept in the store under the key of those tokens, so any
        later ask with the documents in any order or subset loads each chunk
        from the store. The chat prefix (a few tokens) is prefilled each time;
        the question is the blend's query. ``recompute_ratio`` is the fraction
        of context tokens recomputed (1.0 == a full prefill of the same tokens).
        ``cached_tokens`` counts the context tokens loaded from the store;
        ``stored`` sums the chunk entries this call deposited (None if none).
        """
        from .blend import _validate_ratio, generate_blended
        from .capture import capture

        if max_new_tokens < 1:
            raise KvcInputError("max_new_tokens must be at least 1")
        t0 = time.perf_counter()
        ratio = _validate_ratio(recompute_ratio)
        if not docs:
            raise KvcInputError("give at least one document")
        pre = self.prefix_ids()
        parts = [self.doc_ids(d) for d in docs]
        q = self.question_ids(question)
        chunks: list[KVCache] = [capture(self.lm, token_ids=pre)]
        fresh: dict[str, KVCache] = {}  # chunks captured by this call, by key (a document given twice is captured once)
        cached = 0
        timings: dict[str, float] = {"fetch_s": 0.0, "capture_s": 0.0}
        for ids in parts:
            k = self.key(ids).to_str()
            t1 = time.perf_counter()
            c = fresh.get(k)
            if c is None:
                c = self.chunk_cache(ids)
                if c is not None:
                    cached += len(ids)
                    timings["fetch_s"] += time.perf_counter() - t1
            if c is None:
                c = capture(self.lm, token_ids=ids)
                fresh[k] = c
                timings["capture_s"] += time.perf_counter() - t1
            chunks.append(c)
        t_gen = time.perf_counter()
        gen = generate_blended(self.lm, chunks, q, max_new_tokens=max_new_tokens, recompute_ratio=ratio)
        ttft = t_gen - t0 + gen.timings["ttft_s"]
        timings.update(blend_s=gen.timings["ttft_s"], decode_s=gen.timings["decode_s"])
        stored = None
        if store_new and fresh:
            deps = [self.deposit(c) for c in fresh.values()]
            n_bytes = sum(d["bytes"] for d in deps)
            elems = sum(c.num_elements for c in fresh.values())
            stored = {
                "chunks": deps, "keys": [d["key"] for d in deps], "bytes": n_bytes, "bits_per_element": n_bytes * 8 / elems,
                "encode_s": sum(d["encode_s"] for d in deps),
                "stored_in": sorted(set.intersection(*(set(d["stored_in"]) for d in deps))),
                "failed": {t: e for d in deps for t, e in d["failed"].items()},
            }
        context_tokens = len(pre) + sum(len(p) for p in parts)
        return Answer(
            answer=gen.text.strip(), answer_ids=list(gen.token_ids), source="blend", context_tokens=int(context_tokens),
            cached_tokens=int(cached), ttft_s=ttft, prefill_ttft_s=None, stored=stored, timings=timings,
        )


def read_docs(paths: list[str]) -> list[str]:
    from .texts import load_text

    return [load_text(p) for p in paths]


def doc_label(paths: list[str]) -> str:
    return " + ".join(Path(p).name for p in paths)
