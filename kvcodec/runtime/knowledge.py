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

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np
import torch

from kvcodec.models.cachelayout import cache_prefix
from kvcodec.models.capture import check_fits, in_vocabulary, model_cache, tokenize
from kvcodec.models.chat import ChatFormat
from kvcodec.models.sdpa_schedule import fast_sdpa
from kvcodec.errors import KvcError, KvcInputError
from kvcodec.api import check_by_default, check_overrides, default_preset, encode_cache, resolve_calibration
from kvcodec.format import KvcReader
from kvcodec.integrations.hf import check_answer_length, greedy_from, load_cache
from kvcodec.core.kvcache import KVCache
from kvcodec.models.load import LoadedModel, cache_root
from kvcodec.accounting import bits_per_element, context_elements
from kvcodec.store import Store, StoreKey
from kvcodec.store.keys import check_id, codec_key

log = logging.getLogger("kvcodec.runtime.knowledge")


def default_store_url() -> str:
    return str(cache_root() / "store")


def key_for_file(reader: KvcReader, namespace: str = "default") -> StoreKey:
    """The store key of an existing `.kvc` file (for ``kvc store put``)."""
    preset = reader.header.codec or "custom"
    return StoreKey.for_tokens(
        reader.token_ids, model=reader.fingerprint.id, codec=codec_key(preset), namespace=namespace
    )


@dataclass
class Answer:
    answer: str
    answer_ids: list[int]
    source: str  # "store" (whole context loaded), "store+prefill" (prefix loaded), "prefill", "blend" (chunks blended)
    # or "stream" (multi-level entry streamed under a TTFT budget)
    context_tokens: int
    cached_tokens: int
    ttft_s: float
    prefill_ttft_s: float | None  # TTFT of the prefill path, as measured when the entry was stored
    stored: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    # store entries found but unreadable (corrupt, vanished, undecodable, calibration missing): each was
    # evicted and answered by prefill instead; {"key", "reason"} per entry
    unreadable: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d = self.__dict__.copy()
        if self.prefill_ttft_s and self.source != "prefill":
            d["speedup_vs_prefill"] = self.prefill_ttft_s / self.ttft_s
        return d


class KnowledgeBase:
    """Documents as cached KV in a store, for one model, preset and namespace."""

    def __init__(
        self, lm: LoadedModel, store: Store | str | None = None, preset: str | None = None, namespace: str = "default",
        overrides: Mapping[str, Any] | None = None, check: bool | None = None,
    ) -> None:
        """``preset``: the codec of new entries; None: the KDN's default (:func:`kvcodec.api.default_preset`: the
        lossy default, or ``lossless`` with one warning line for a model whose window cannot hold a calibration).
        ``overrides``: the preset's settings to change (checked now, by the one validator), e.g. a fixed ``step0``
        for a step sweep; they are part of the entries' codec key, so they never share entries with the plain preset.
        ``check``: confirm each deposit's step with the model (``kvc encode --check``); None decides per model, once,
        at the first deposit (:func:`kvcodec.api.check_by_default`: on where the rate model's chat probe says the
        prediction alone can miss the promise). The check changes the step, not the promise, so a checked entry and
        an unchecked one share a key."""
        self.lm = lm
        # a namespace no key can carry (`kvc ask --namespace a/b`) answered by prefill with two warning lines, exit 0
        check_id("namespace", namespace)
        if preset is None:
            preset, why = default_preset(lm)
            if why is not None:
                log.warning("storing %s entries: %s", preset, why)
        self.preset = preset
        self.overrides = check_overrides(preset, dict(overrides or {}), "overrides")
        self.store = store if isinstance(store, Store) else Store.open(store or default_store_url())
        self.namespace = namespace
        self.codec = codec_key(preset, self.overrides)
        self.chat = ChatFormat.for_tokenizer(lm.tokenizer)
        self._cal: Any = None
        self.check = check
        self.check_reason: str | None = None  # why the deposits are checked when check=None chose it

    def _calibration(self) -> Any:
        """The model's calibration for a lossy preset (built once, with progress, if the model has none), resolved
        once for every deposit (:func:`kvcodec.api.resolve_calibration`)."""
        if self._cal is None:
            self._cal = resolve_calibration(self.lm, self.preset)
        return self._cal

    def _rate(self) -> str:
        """``"check"`` or ``"predict"`` for this knowledge base's deposits (``check``), decided once."""
        if self.check is None:
            self.check_reason = check_by_default(self.lm, self.preset, self._calibration(), self.overrides)
            self.check = self.check_reason is not None
            if self.check:
                log.warning("checking each deposit of %s with the model: %s", self.preset, self.check_reason)
        return "check" if self.check else "predict"

    # -- tokens ------------------------------------------------------------
    def context_ids(self, docs: list[str]) -> tuple[np.ndarray, list[int]]:
        """Token ids of the chat prefix + documents, and the document boundaries."""
        if not docs:
            raise KvcInputError("give at least one document")
        parts = [self.prefix_ids()] + [self.doc_ids(d) for d in docs]
        bounds = list(np.cumsum([len(p) for p in parts])[1:])
        return in_vocabulary(self.lm, np.concatenate(parts)), bounds

    def prefix_ids(self) -> np.ndarray:
        """Token ids of the chat prefix every context starts with (the model's own template, :mod:`kvcodec.models.chat`)."""
        return self.chat.prefix

    def doc_ids(self, doc: str) -> np.ndarray:
        """Token ids of one document as it appears in a context (tokenized on its own)."""
        return in_vocabulary(self.lm, tokenize(self.lm.tokenizer, doc.rstrip() + "\n\n"))

    def question_ids(self, question: str) -> np.ndarray:
        """Token ids of the question turn, ending with the model's assistant-turn opener."""
        return in_vocabulary(self.lm, self.chat.question_ids(question))

    def key(self, ids: np.ndarray) -> StoreKey:
        return StoreKey.for_tokens(ids, model=self.lm.fingerprint.id, codec=self.codec, namespace=self.namespace)

    # -- lookup / deposit ----------------------------------------------------
    def lookup(self, ids: np.ndarray, bounds: list[int]) -> tuple[StoreKey | None, int]:
        """Longest cached prefix: document boundaries first, then 256-token chunk boundaries.

        A store that cannot be searched (a tier down) is a miss: the answer
        does not need the store, so it is produced by prefill with a warning.
        """
        try:
            return self._lookup(ids, bounds)
        except KvcError as exc:
            log.warning("store lookup failed (%s); answering by prefill", _one_line(exc))
            return None, 0

    def _lookup(self, ids: np.ndarray, bounds: list[int]) -> tuple[StoreKey | None, int]:
        cands = [self.key(ids[:b]) for b in sorted(set(bounds), reverse=True)]
        found = self.store.contains_many(cands)
        best = next((k for k, ok in zip(cands, found) if ok), None)
        key, n = self.store.longest_prefix(ids, model=self.lm.fingerprint.id, codec=self.codec, namespace=self.namespace)
        if best is not None and best.n_tokens >= n:
            return best, best.n_tokens
        return key, n

    def capture(self, ids: np.ndarray) -> KVCache:
        """The KV cache of context ``ids`` as :meth:`deposit` wants it.

        Why not a plain capture: the lossy presets' plans read the context's
        token importance, and a cache that does not carry it makes the encoder
        run a scoring forward pass of its own (on a sliding-window model, a
        second prefill of the whole context: Gemma 3's 8K-token deposit cost two
        prefills). Observed by the capture's own prefill, it costs no forward.
        """
        from kvcodec.api import capture

        return capture(self.lm, token_ids=ids, preset=self.preset, overrides=self.overrides)

    def deposit(self, cache: KVCache, prefill_ttft_s: float | None = None) -> dict[str, Any]:
        """Encode a context's KV with the preset and put it in every tier.

        ``prefill_ttft_s`` (the measured TTFT of a full prefill of exactly this
        context) is recorded so later hits can report their speed-up.
        """
        t0 = time.perf_counter()
        ids = cache.token_ids
        if prefill_ttft_s is not None:
            cache.meta["prefill_ttft_s"] = prefill_ttft_s
        enc = encode_cache(cache, self.preset, overrides=self.overrides, model=self.lm, calibration=self._calibration(),
                           meta=cache.meta, rate=self._rate())
        data = enc.data
        assert data is not None
        key = self.key(ids)
        res = self.store.put(key, data, {"preset": self.preset, "tokens": int(len(ids)), "prefill_ttft_s": prefill_ttft_s})
        return {
            "key": key.to_str(), "bytes": len(data), "encode_s": time.perf_counter() - t0,
            "bits_per_element": enc.bits_per_element, "stored_in": res.stored_in, "failed": res.failed,
            "checked": bool(self.check), **({"check_reason": self.check_reason} if self.check_reason else {}),
        }

    # -- unreadable entries ------------------------------------------------------
    def drop_unreadable(self, key: StoreKey, why: BaseException | str) -> dict[str, str]:
        """Warn about an entry that cannot be used, evict it (best effort) and say what happened.

        Called for an entry that is corrupt, undecodable, of another model or
        tokens, or needs a calibration this machine lacks: leaving it in place
        would make every later ask pay for the same failure. An entry that
        vanished (evicted or deleted between lookup and get) has nothing to evict.
        """
        reason = why if isinstance(why, str) else _one_line(why)
        if isinstance(why, _Partial):  # a good entry of another layout: used by its writer, never evicted
            log.info("store entry %s holds part of its prefix (%s); prefilling instead", key.to_str(), reason)
            return {"key": key.to_str(), "reason": reason}
        log.warning("store entry %s is unreadable (%s); evicting it and prefilling instead", key.to_str(), reason)
        if isinstance(why, _Vanished):
            return {"key": key.to_str(), "reason": reason}
        try:
            self.store.rm(key)
        except KvcError as exc:
            log.warning("could not evict store entry %s: %s", key.to_str(), _one_line(exc))
        return {"key": key.to_str(), "reason": reason}

    def _open_entry(self, key: StoreKey, ids: np.ndarray) -> tuple[Any, float | None]:
        """The lazily decoded cache of ``key`` (which must hold exactly ``ids``) and its recorded prefill TTFT."""
        data = self.store.get(key)
        if data is None:
            raise _Vanished("it vanished from the store between lookup and get")
        reader = KvcReader(data)
        self.lm.fingerprint.check_compatible(reader.fingerprint, what=".kvc file")
        if reader.token_ids is None or not np.array_equal(reader.token_ids, ids):
            raise KvcInputError(f"store entry {key} encodes other tokens than its key says")
        if reader.positions is not None:  # e.g. a vLLM connector chunk: the KV of its last tokens only
            raise _Partial(f"it stores {reader.header.num_tokens} of the prefix's {len(ids)} tokens")
        loaded = load_cache(reader, self.lm)
        meta = loaded.reader.header.meta
        ttft = meta.get("prefill_ttft_s") if isinstance(meta, dict) else None
        return loaded.cache, ttft if isinstance(ttft, (int, float)) and not isinstance(ttft, bool) else None

    # -- the main job --------------------------------------------------------
    @torch.inference_mode()
    def ask(self, docs: list[str], question: str, max_new_tokens: int = 48, store_new: bool = True) -> Answer:
        """Answer ``question`` about ``docs``: from the longest cached prefix, else by prefill.

        An entry found but unusable (see :meth:`drop_unreadable`) is evicted and
        the answer comes from a full prefill; with ``store_new`` a good entry
        then replaces it (and the full context is stored as on any miss).
        """
        check_answer_length(max_new_tokens)  # checked up front: a bad argument must never look like a bad entry
        t0 = time.perf_counter()
        ids, bounds = self.context_ids(docs)
        q = self.question_ids(question)
        check_fits(self.lm, len(ids) + len(q) + max_new_tokens, "the documents + question + answer",
                   ("max_new_tokens",))
        key, n_cached = self.lookup(ids, bounds)
        timings: dict[str, float] = {"lookup_s": time.perf_counter() - t0}
        unreadable: list[dict[str, str]] = []
        if key is not None:
            try:
                return self._answer(ids, q, key, n_cached, max_new_tokens, store_new, t0, timings, unreadable).answer
            except KvcError as exc:  # raised by the entry: fetching or opening it, or decoding a layer inside the forward
                unreadable.append(self.drop_unreadable(key, exc))
            timings = {"lookup_s": timings["lookup_s"], "failed_load_s": time.perf_counter() - t0 - timings["lookup_s"]}
        ans = self._answer(ids, q, None, 0, max_new_tokens, store_new, t0, timings, unreadable)
        if store_new and key is not None and key.n_tokens < len(ids) and ans.context_kv is not None:
            # the evicted entry was a shorter prefix: put a good one back in its place (causal: a prefix's KV is a
            # slice; a sliding-window layer's is prefilled again, KVCache.prefix)
            full = KVCache([k for k, _ in ans.context_kv], [v for _, v in ans.context_kv], ids, self.lm.fingerprint)
            prefix = cache_prefix(full, key.n_tokens, self.lm)
            ans.answer.stored = dict(ans.answer.stored or {}, replaced=self._deposit_or_warn(prefix))
        return ans.answer

    def _deposit_or_warn(self, cache: KVCache, prefill_ttft_s: float | None = None) -> dict[str, Any] | None:
        """:meth:`deposit`, but a store that refuses the entry costs a warning, not the answer."""
        try:
            return self.deposit(cache, prefill_ttft_s)
        except KvcError as exc:
            log.warning("could not store the context's cache: %s", _one_line(exc))
            return None

    def _answer(
        self, ids: np.ndarray, q: np.ndarray, key: StoreKey | None, n_cached: int, max_new_tokens: int,
        store_new: bool, t0: float, timings: dict[str, float], unreadable: list[dict[str, str]],
    ) -> "_Answered":
        prefill_ttft = None
        past = None
        if key is not None:
            t1 = time.perf_counter()
            past, prefill_ttft = self._open_entry(key, ids[:n_cached])
            timings["fetch_s"] = time.perf_counter() - t1
        rest = ids[n_cached:]
        if rest.size:  # prefill what the store did not have (all of it on a miss)
            pos = torch.arange(n_cached, len(ids)).unsqueeze(0)
            # a miss starts from the model's own cache (sliding-window layers keep their window: the ragged layout)
            with fast_sdpa(self.lm):  # the engine greedy_from and the capture use (kvcodec.models.sdpa_schedule)
                out = self.lm.model(input_ids=torch.as_tensor(rest).unsqueeze(0),
                                    past_key_values=past if past is not None else model_cache(self.lm), position_ids=pos,
                                    use_cache=True, logits_to_keep=1)
            past = out.past_key_values
        # DynamicLayer.update concatenates into new tensors, so these references stay the context's KV.
        context_kv = [(layer.keys[0], layer.values[0]) for layer in past.layers] if (store_new and rest.size) else None
        answer_ids, first_at = greedy_from(self.lm, past, len(ids), q, max_new_tokens)
        ttft = first_at - t0
        source = "prefill" if key is None else ("store" if not rest.size else "store+prefill")
        stored = None
        if context_kv is not None:
            snapshot = KVCache([k for k, _ in context_kv], [v for _, v in context_kv], ids, self.lm.fingerprint)
            stored = self._deposit_or_warn(snapshot, ttft if key is None and not unreadable else None)
        answer = Answer(
            answer=self.lm.tokenizer.decode(answer_ids, skip_special_tokens=True).strip(),
            answer_ids=answer_ids, source=source, context_tokens=int(len(ids)), cached_tokens=int(n_cached),
            ttft_s=ttft, prefill_ttft_s=ttft if key is None else prefill_ttft, stored=stored, timings=timings,
            unreadable=unreadable,
        )
        return _Answered(answer, context_kv)

    # -- adaptive streaming under a TTFT budget (issue 17) ----------------------
    @torch.inference_mode()
    def ask_streamed(self, docs: list[str], question: str, budget_s: float | None, max_new_tokens: int = 48,
                     fixed: str | None = None) -> tuple[Answer, dict[str, Any]]:
        """Answer from the documents' multi-level entry, streamed under ``budget_s`` (:mod:`kvcodec.runtime.stream`).

        Each chunk comes at the highest level that fits the budget, or from its
        text; the second value is the per-chunk report (choices and reasons).
        """
        from kvcodec.runtime.stream import AdaptiveStreamer

        from kvcodec.runtime.stream import _check_budget

        check_answer_length(max_new_tokens)
        _check_budget(budget_s)
        ids, _ = self.context_ids(docs)
        q = self.question_ids(question)
        check_fits(self.lm, len(ids) + len(q) + max_new_tokens, "the documents + question + answer",
                   ("max_new_tokens",))
        out, rep = AdaptiveStreamer(self.lm, self.store, fixed=fixed).answer(
            ids, q, budget_s=budget_s, max_new_tokens=max_new_tokens, namespace=self.namespace)
        cached = sum(c.end - c.start for c in rep.chunks if c.choice != "text")
        ans = Answer(answer=self.lm.tokenizer.decode(out, skip_special_tokens=True).strip(), answer_ids=out,
                     source="stream", context_tokens=int(len(ids)), cached_tokens=int(cached),
                     ttft_s=float(rep.ttft_s or 0.0), prefill_ttft_s=None, timings={"load_s": rep.load_s})
        return ans, rep.to_json()

    # -- blended answers (issue 9) ---------------------------------------------
    def chunk_cache(self, ids: np.ndarray, unreadable: list[dict[str, str]] | None = None) -> KVCache | None:
        """The position-independent chunk cache of ``ids`` (captured alone, at positions 0..n-1) from the store, or None.

        None also for an entry that cannot be used: it is evicted (see
        :meth:`drop_unreadable`, recorded in ``unreadable``) so the caller
        captures the chunk again and stores a good entry in its place.
        """
        key = self.key(ids)
        try:
            data = self.store.get(key)
            if data is None:
                return None
            with KvcReader(data) as r:
                self.lm.fingerprint.check_compatible(r.fingerprint, what=f"store entry {key}")
                cache = r.read_cache()
            if not np.array_equal(cache.token_ids, ids) or cache.positions is not None:
                raise KvcInputError(f"store entry {key} encodes other tokens than its key says")
        except KvcError as exc:
            rec = self.drop_unreadable(key, exc)
            if unreadable is not None:
                unreadable.append(rec)
            return None
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
        """Answer from per-document chunk caches blended CacheBlend-style (:mod:`kvcodec.runtime.blend`).

        Every document is a chunk of its own: its tokens alone, captured from
        position 0 and kept in the store under the key of those tokens, so any
        later ask with the documents in any order or subset loads each chunk
        from the store. The chat prefix (a few tokens) is prefilled each time;
        the question is the blend's query. ``recompute_ratio`` is the fraction
        of context tokens recomputed (1.0 == a full prefill of the same tokens).
        ``cached_tokens`` counts the context tokens loaded from the store;
        ``stored`` sums the chunk entries this call deposited (None if none).
        """
        from kvcodec.runtime.blend import _validate_ratio, generate_blended
        from kvcodec.models.capture import capture

        check_answer_length(max_new_tokens)
        t0 = time.perf_counter()
        ratio = _validate_ratio(recompute_ratio)
        if not docs:
            raise KvcInputError("give at least one document")
        pre = self.prefix_ids()
        parts = [self.doc_ids(d) for d in docs]
        q = self.question_ids(question)
        check_fits(self.lm, len(pre) + sum(len(p) for p in parts) + len(q) + max_new_tokens,
                   "the documents + question + answer",
                   ("max_new_tokens",))
        chunks: list[KVCache] = [capture(self.lm, token_ids=pre)]
        fresh: dict[str, KVCache] = {}  # chunks captured by this call, by key (a document given twice is captured once)
        unreadable: list[dict[str, str]] = []
        cached = 0
        timings: dict[str, float] = {"fetch_s": 0.0, "capture_s": 0.0}
        for ids in parts:
            k = self.key(ids).to_str()
            t1 = time.perf_counter()
            c = fresh.get(k)
            if c is None:
                c = self.chunk_cache(ids, unreadable)
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
        done = [(c, self._deposit_or_warn(c)) for c in fresh.values()] if store_new else []
        deps = [d for _, d in done if d is not None]
        if deps:
            n_bytes = sum(d["bytes"] for d in deps)
            elems = sum(context_elements(c) for c, d in done if d is not None)
            stored = {
                "chunks": deps, "keys": [d["key"] for d in deps], "bytes": n_bytes,
                "bits_per_element": bits_per_element(n_bytes, elems),
                "encode_s": sum(d["encode_s"] for d in deps),
                "stored_in": sorted(set.intersection(*(set(d["stored_in"]) for d in deps))),
                "failed": {t: e for d in deps for t, e in d["failed"].items()},
            }
        context_tokens = len(pre) + sum(len(p) for p in parts)
        return Answer(
            answer=gen.text.strip(), answer_ids=list(gen.token_ids), source="blend", context_tokens=int(context_tokens),
            cached_tokens=int(cached), ttft_s=ttft, prefill_ttft_s=None, stored=stored, timings=timings,
            unreadable=unreadable,
        )


@dataclass
class _Answered:
    answer: Answer
    context_kv: list[tuple[torch.Tensor, torch.Tensor]] | None  # the full context's K/V when it was computed here


class _Vanished(KvcError):
    """A store entry found by lookup was gone by the time it was fetched (evicted or deleted meanwhile)."""


class _Partial(KvcError):
    """A valid entry whose key names a prefix but which stores the KV of part of it (the vLLM connector's chunk
    entries share keys with whole-prefix entries: one codec id, spec/store-keys.md §1). Not a whole context."""


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def read_docs(paths: list[str]) -> list[str]:
    from kvcodec.texts import load_text

    return [load_text(p) for p in paths]


def doc_label(paths: list[str]) -> str:
    return " + ".join(Path(p).name for p in paths)
