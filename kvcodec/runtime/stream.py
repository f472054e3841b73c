"""Bandwidth-adaptive streaming of multi-level entries under a time-to-first-token budget.

CacheGen's delivery loop on kvcodec's store: a document's KV cache is kept
chunk by chunk at several presets (:mod:`kvcodec.store.levels`,
``spec/levels-v1.md``); a request with a TTFT budget fetches the chunks in
order and, for each one, picks the highest level whose estimated completion
still leaves time for the rest of the context and the question. When no level
fits, the chunk's *text* is prefilled instead (on top of the chunks already
loaded: the causal model needs nothing else). Why each choice was made is
recorded per chunk (:class:`ChunkChoice`) and logged.

Two threads, so decoding overlaps transfer:

* the *planner* decides chunk ``i`` as soon as the link is free (while the
  main thread is still decoding or prefilling earlier chunks) and downloads it
  through :class:`~kvcodec.runtime.progressive.ProgressiveReader`, which fetches the `.kvc` trailer (its
  index) first and then the body in order, in seal-block pieces;
* the *main* thread opens each chunk as soon as its trailer has arrived and
  decodes it layer by layer, each ``read`` waiting only for the bytes of the
  layer it needs; text chunks are prefilled in order.

Estimators (defaults documented in ``spec/levels-v1.md`` §6):

* **bandwidth**: the harmonic mean of the last ``window`` per-chunk
  throughputs (bytes of a chunk / wall time from request to last byte, so a
  tier's per-request latency is charged). The harmonic mean is the mean of
  rates that the time-weighted total obeys, and a single fast sample cannot
  inflate it: it is what adaptive-bitrate players (FESTIVE, Jiang et al. 2012)
  and CacheGen use for the same decision. Before any sample, the last
  estimate this process measured for the same store URL is used; with none
  at all, the manifest fetch's rate (its bytes over its wall time, latency
  included, so a lower bound on the link's rate) plans the first chunk, which
  is then fetched at the highest level that fits even at that pessimistic
  rate; only when the caller supplied the manifest (nothing timed) is the
  first chunk fetched at the smallest level as a probe.
* **decode and prefill speed**: seconds per token, per level for decoding,
  a prior from :class:`~kvcodec.runtime.speeds.Priors` replaced by an exponential moving average of
  what this process measured.

A stalled or dropped link is detected by the main thread (no new piece for
``stall_s`` plus twice a piece's transfer time at the estimated bandwidth): the
chunk is prefilled from text and every later chunk too (``link_failed``). A
transfer that works but is so slow that its text would be ready sooner and it
would miss the budget is abandoned too, and that chunk is prefilled from text;
the link is not failed: the rate it showed becomes a bandwidth sample, so later
chunks are planned with it (a smaller level, or text).

This module is the streamer (its two threads and its decisions).  Writing the entry is
:mod:`kvcodec.runtime.level_encode`, the background-filled reader is :mod:`kvcodec.runtime.progressive`, the
estimators are :mod:`kvcodec.runtime.speeds`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch

from kvcodec.errors import KvcError, KvcFormatError, KvcInputError, KvcStoreError
from kvcodec.core.kvcache import KVCache, as_token_ids
from kvcodec.models.load import LoadedModel
from kvcodec.store import Store, StoreKey
from kvcodec.store.keys import DEFAULT_CHUNK
from kvcodec.store.levels import (
    LEVEL_RANK,
    MAX_CHUNKS,
    ChunkLevels,
    LevelManifest,
    manifest_key,
)
from kvcodec.runtime.level_encode import encode_levels
from kvcodec.runtime.progressive import ProgressiveReader, one_line
from kvcodec.runtime.speeds import SPEEDS, Speeds, harmonic_mean

# encode_levels is level_encode's, Speeds and SPEEDS the estimators': named here because benchmarks/bench_stream.py
# imports them from this module
__all__ = ["AdaptiveStreamer", "ChunkChoice", "StreamReport", "Streamed", "read_manifest", "TEXT", "encode_levels",
           "SPEEDS", "Speeds"]

log = logging.getLogger("kvcodec.runtime.stream")

TEXT = "text"
STALL_FLOOR_BPS = 10e6 / 8  # bandwidth assumed by the stall rule before any estimate
FIRST_PIECE_GRACE_S = 0.25  # before a second piece arrives, a transfer is judged only after this long


def read_manifest(store: Store, key: StoreKey) -> LevelManifest | None:
    """The verified manifest of ``key`` (None if absent; a malformed one is refused with a warning)."""
    data = store.get(key)
    if data is None:
        return None
    try:
        return LevelManifest.from_bytes(data, key)
    except KvcFormatError as e:
        log.warning("multi-level manifest %s refused: %s", key, e)
        return None




# ----------------------------------------------------------------------------- choices
@dataclass
class ChunkChoice:
    """What the client did with one chunk, and why (one element of the ``--json`` report)."""

    chunk: int
    start: int
    end: int
    choice: str  # a level name, or "text"
    reason: str
    bandwidth_Bps: float | None  # the estimate the decision used
    budget_left_s: float  # at decision time
    estimates_s: dict[str, float]  # estimated completion (from decision time) per option considered
    bytes: int = 0
    fetch_s: float | None = None
    throughput_Bps: float | None = None
    compute_s: float | None = None  # decode or prefill time on the main thread
    fell_back: str | None = None  # a fetched level that failed and was replaced by text, and why

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StreamReport:
    key: str
    budget_s: float | None
    levels: list[str]
    chunks: list[ChunkChoice]
    load_s: float = 0.0
    ttft_s: float | None = None
    link_failed: str | None = None
    manifest_problem: str | None = None  # no usable manifest: everything was prefilled from text

    @property
    def text_share(self) -> float:
        return sum(c.choice == TEXT for c in self.chunks) / max(1, len(self.chunks))

    def level_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.chunks:
            out[c.choice] = out.get(c.choice, 0) + 1
        return out

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "chunks"}
        d.update(text_share=self.text_share, level_counts=self.level_counts(),
                 within_budget=None if self.budget_s is None or self.ttft_s is None else self.ttft_s <= self.budget_s,
                 chunks=[c.to_json() for c in self.chunks])
        return d


@dataclass
class Streamed:
    """The assembled context cache (a transformers ``DynamicCache``) and the report."""

    cache: Any
    n_tokens: int
    report: StreamReport

    def to_kvcache(self, ids: np.ndarray, lm: LoadedModel) -> KVCache:
        return KVCache([layer.keys[0] for layer in self.cache.layers], [layer.values[0] for layer in self.cache.layers],
                       ids, lm.fingerprint)


@dataclass
class _Item:
    i: int
    choice: ChunkChoice
    reader: ProgressiveReader | None = None
    est_s: float = 0.0


class AdaptiveStreamer:
    """Loads a multi-level entry chunk by chunk under a TTFT budget (see the module docstring).

    ``fixed`` forces one option for every chunk (a level name, or ``"text"``):
    the baselines of ``benchmarks/bench_stream.py``. ``budget_s=None`` with no
    ``fixed`` takes the highest level of every chunk.

    The assembled cache lives on ``device`` (default: the model's): level chunks are decoded there
    (:func:`kvcodec.integrations.hf.decode_device`; ``backend`` names another decoder) and appended
    without a host round trip, text chunks are prefilled there.
    """

    def __init__(self, lm: LoadedModel, store: Store, *, speeds: Speeds | None = None, window: int = 5,
                 stall_s: float = 1.0, fixed: str | None = None, device: torch.device | str | None = None,
                 backend: str | None = None) -> None:
        from kvcodec.integrations.hf import decode_device, target_device

        import math

        from kvcodec.errors import is_int

        # checked here, not where used: window "x" / 2.5 escaped as TypeError mid-request, and a stall_s of NaN or
        # -1 switched the stall rule off or on for good (a NaN one never gave up on a stalled link)
        if not is_int(window, lo=1):
            raise KvcInputError(f"window must be an integer >= 1 (bandwidth samples averaged), got {window!r:.40}")
        if isinstance(stall_s, bool) or not isinstance(stall_s, (int, float)) or not (math.isfinite(stall_s) and stall_s > 0):
            raise KvcInputError(f"stall_s must be a positive number of seconds, got {stall_s!r:.40}")
        if fixed is not None and not isinstance(fixed, str):
            raise KvcInputError(f"fixed must be a level name or {TEXT!r}, got {type(fixed).__name__}")
        self.lm, self.store = lm, store
        self.device = target_device(device, lm)
        self.backend = decode_device(self.device, backend)
        self.speeds = speeds or SPEEDS
        self.window = window
        self.stall_s = stall_s
        self.fixed = fixed
        self._url = getattr(store, "url", "?")

    # -- public ------------------------------------------------------------------
    @torch.inference_mode()
    def load(self, ids: np.ndarray, *, budget_s: float | None, question_tokens: int = 0, namespace: str = "default",
             t0: float | None = None, manifest: LevelManifest | None = None) -> Streamed:
        """The KV cache of ``ids`` assembled from the store's multi-level entry (text where needed)."""
        from kvcodec.models.capture import check_fits, context_ids

        t0 = time.perf_counter() if t0 is None else t0
        # the context's ids checked like any capture's (integers in the vocabulary, within the window) and the budget
        # a positive number: float ids were truncated, "abc" / an id past the vocabulary / budget "x" escaped as
        # ValueError / IndexError / TypeError, and a context past the window was streamed and prefilled
        ids = context_ids(self.lm, token_ids=ids)
        _check_budget(budget_s)
        check_fits(self.lm, len(ids) + question_tokens, "the context + question")
        key = manifest_key(ids, model=self.lm.fingerprint.id, namespace=namespace)
        floor_bw = None
        problem = None  # any manifest problem: the whole context is prefilled from text (issue 35), never a failure
        if manifest is None:
            tm = time.perf_counter()
            try:
                manifest = read_manifest(self.store, key)
            except KvcError as e:
                problem = f"manifest unreadable: {one_line(e)}"
            if manifest is not None:  # a lower bound on the link's rate: latency included, tiny payload
                floor_bw = len(manifest.to_bytes()) / max(time.perf_counter() - tm, 1e-6)
        if manifest is None:
            problem = problem or (f"no usable multi-level manifest for these {len(ids)} tokens in {self._url} "
                                  "(absent, replaced or refused; write one with kvc encode --levels)")
        elif self.fixed is not None and self.fixed != TEXT and self.fixed not in manifest.levels:
            problem = f"level {self.fixed!r} is not in the entry (has {', '.join(manifest.levels)})"
        if problem is not None:
            log.warning("stream %s: %s; prefilling the context from text", key, problem)
            manifest = _text_only(key, len(ids))
        report = StreamReport(key.to_str(), budget_s, [] if problem else list(manifest.levels), [],
                              manifest_problem=problem)
        run = _Run(self, manifest, ids, budget_s, question_tokens, t0, report, floor_bw)
        if problem is not None:
            run.link_failed = problem  # every chunk: text
        past = run.go()
        report.load_s = time.perf_counter() - t0
        return Streamed(past, len(ids), report)

    @torch.inference_mode()
    def answer(self, ids: np.ndarray, question_ids: np.ndarray, *, budget_s: float | None, max_new_tokens: int = 32,
               namespace: str = "default") -> tuple[list[int], StreamReport]:
        """Stream the context, feed the question, decode greedily; the report carries the TTFT."""
        from kvcodec.integrations.hf import _new_token_ids, greedy_from
        from kvcodec.models.capture import check_fits

        t0 = time.perf_counter()
        # checked before the load's work (a float question id was truncated, a bad max_new_tokens refused only after it)
        q = _new_token_ids(self.lm, question_ids, max_new_tokens)
        check_fits(self.lm, len(as_token_ids(ids)) + len(q) + max_new_tokens, "the context + question + answer",
                   ("max_new_tokens",))
        got = self.load(ids, budget_s=budget_s, question_tokens=len(q), namespace=namespace, t0=t0)
        t1 = time.perf_counter()
        out, first_at = greedy_from(self.lm, got.cache, got.n_tokens, q, max_new_tokens)
        self.speeds.saw_prefill(len(q), first_at - t1)
        got.report.ttft_s = first_at - t0
        log.info("stream %s: TTFT %.3f s (budget %s), choices %s", got.report.key, got.report.ttft_s, budget_s,
                 got.report.level_counts())
        return out, got.report


def _check_budget(budget_s: Any) -> None:
    """A TTFT budget is None (no budget) or a number of seconds > 0 (NaN, 0, -1 and True were taken as budgets)."""
    if budget_s is None:
        return
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float, np.integer, np.floating)) or not budget_s > 0:
        raise KvcInputError(f"the TTFT budget must be a positive number of seconds or None, got {budget_s!r:.40}")


class _Run:
    """One request: the planner thread and the main-thread consumer share this state."""

    def __init__(self, s: AdaptiveStreamer, m: LevelManifest, ids: np.ndarray, budget_s: float | None,
                 q_tokens: int, t0: float, report: StreamReport, floor_bw: float | None = None) -> None:
        self.s, self.m, self.ids, self.budget, self.q_tokens, self.t0, self.report = s, m, ids, budget_s, q_tokens, t0, report
        self.floor_bw = floor_bw  # bytes/s of the manifest fetch: used only until the first chunk's sample
        self.deadline = None if budget_s is None else t0 + budget_s
        self.items: queue.Queue[_Item | None] = queue.Queue()
        self.lock = threading.Lock()
        self.pending_est = 0.0  # estimated compute seconds of items scheduled but not yet done
        self.done_at = t0
        self.link_failed: str | None = None
        self.stopped = False  # the main thread left go() by an exception: the planner fetches nothing more
        self.filling: ProgressiveReader | None = None  # the reader the planner is filling now
        self.samples: list[float] = list(s.speeds.bw.get(s._url, []))[-s.window:]
        self.keys = {lv: m.level_keys(ids, lv) for lv in m.levels}

    # -- estimates -----------------------------------------------------------
    def bw(self) -> float | None:
        return harmonic_mean(self.samples[-self.s.window:])

    def _prefill_s(self, n: int) -> float:
        return n * self.s.speeds.prefill_spt()

    def _decode_s(self, level: str, n: int) -> float:
        return n * self.s.speeds.decode_spt(level)

    def _rest_s(self, i: int, bw: float | None) -> float:
        """A lower bound on chunks after ``i`` plus the question: each at its cheapest option."""
        sp = self.s.speeds
        t = self._prefill_s(self.q_tokens) + sp.priors.first_token_s
        for c in self.m.chunks[i + 1:]:
            opts = [self._prefill_s(c.n_tokens)]
            if self.link_failed is None and bw:
                lv = self.m.levels[0]
                opts.append(max(c.bytes[lv] / bw, self._decode_s(lv, c.n_tokens)))
            t += min(opts)
        return t

    # -- planner -------------------------------------------------------------
    def decide(self, i: int) -> _Item:
        c = self.m.chunks[i]
        now = time.perf_counter()
        left = float("inf") if self.deadline is None else self.deadline - now
        bw = self.bw()
        floor = False
        if not bw and self.floor_bw:  # no chunk sample yet: plan with the manifest fetch's (pessimistic) rate
            bw, floor = self.floor_bw, True
        with self.lock:
            compute_free = max(now, self.done_at) + self.pending_est
        text_end = compute_free - now + self._prefill_s(c.n_tokens)
        ests: dict[str, float] = {TEXT: text_end}
        for lv in self.m.levels:
            dec = self._decode_s(lv, c.n_tokens)
            fetch = c.bytes[lv] / bw if bw else float("nan")
            ests[lv] = max(fetch, compute_free - now + dec) if bw else float("nan")
        rest = self._rest_s(i, bw)
        bw_txt = (f"{bw * 8 / 1e6:.1f} Mbit/s (lower bound: the manifest fetch)" if floor else
                  f"{bw * 8 / 1e6:.1f} Mbit/s (harmonic mean of {len(self.samples[-self.s.window:])})" if bw else "none yet")

        def item(choice: str, reason: str) -> _Item:
            ch = ChunkChoice(i, c.start, c.end, choice, reason, bw, left, {k: round(v, 4) for k, v in ests.items()
                                                                             if v == v})
            est = self._prefill_s(c.n_tokens) if choice == TEXT else self._decode_s(choice, c.n_tokens)
            return _Item(i, ch, est_s=est)

        if self.link_failed is not None:
            return item(TEXT, f"link failed earlier ({self.link_failed})")
        fixed = self.s.fixed
        if fixed is not None:
            return item(fixed, f"fixed option {fixed}")
        if self.deadline is None:
            return item(self.m.levels[-1], "no budget: highest level")
        if not bw:
            return item(self.m.levels[0], "no bandwidth sample yet: probe with the smallest level")
        for lv in reversed(self.m.levels):
            if ests[lv] + rest <= left:
                return item(lv, f"{lv}: est {ests[lv]:.3f} s + rest {rest:.3f} s <= {left:.3f} s left; bw {bw_txt}")
        if text_end + rest <= left:
            return item(TEXT, f"no level fits ({self.m.levels[0]} est {ests[self.m.levels[0]]:.3f} s + rest "
                              f"{rest:.3f} s > {left:.3f} s left; bw {bw_txt}); text prefill est {text_end:.3f} s fits")
        best = min([TEXT] + list(self.m.levels[:1]), key=lambda o: ests[o])
        return item(best, f"nothing fits {left:.3f} s left (rest {rest:.3f} s); cheapest option {best} "
                          f"(est {ests[best]:.3f} s); bw {bw_txt}")

    def plan(self) -> None:
        try:
            for i in range(len(self.m.chunks)):
                if self.stopped:
                    break
                it = self.decide(i)
                with self.lock:
                    self.pending_est += it.est_s
                if it.choice.choice != TEXT:
                    lv = it.choice.choice
                    key = self.keys[lv][i]
                    t1 = time.perf_counter()
                    try:
                        inner = self.s.store.reader(key)
                        if inner is None:
                            raise KvcStoreError(f"level chunk {key} is missing")
                        piece = getattr(getattr(inner, "seal", None), "block", None) or (256 << 10)
                        it.reader = ProgressiveReader(inner, piece, str(key))
                        it.reader.started = t1
                    except KvcError as e:
                        it.choice.fell_back = f"{lv}: {one_line(e)}"
                        it.choice.choice = TEXT
                        it.est_s = self._prefill_s(it.choice.end - it.choice.start)
                        self.fail_link(one_line(e))
                    self.items.put(it)
                    if it.reader is not None:
                        self.filling = it.reader
                        if self.stopped:  # go() ended while this reader was being made
                            it.reader.give_up("the request ended")
                        it.reader.fill()
                        self.filling = None
                        tp = it.reader.throughput()
                        it.choice.bytes = it.reader.size
                        if tp is not None:
                            it.choice.fetch_s = it.reader.finished - t1
                            it.choice.throughput_Bps = tp
                            self.saw_bandwidth(tp)
                        elif it.reader.slow_Bps is not None:  # abandoned for the budget: the link works, slowly
                            self.saw_bandwidth(it.reader.slow_Bps)
                        elif it.reader._error is not None and not self.stopped:
                            self.fail_link(one_line(it.reader._error))
                else:
                    self.items.put(it)
        finally:
            self.items.put(None)

    def saw_bandwidth(self, bps: float) -> None:
        """A measured rate of this link: plans this request's later chunks and the process's later requests."""
        self.samples.append(bps)
        self.s.speeds.bw.setdefault(self.s._url, []).append(bps)
        del self.s.speeds.bw[self.s._url][:-self.s.window]

    def fail_link(self, why: str) -> None:
        if self.link_failed is None:
            self.link_failed = why
            self.report.link_failed = why
            log.warning("stream %s: link failed (%s); the remaining chunks are prefilled from text", self.report.key, why)

    # -- main thread -----------------------------------------------------------
    def give_up_reason(self, it: _Item) -> Callable[[], str | None]:
        """When the main thread stops waiting for a chunk's bytes and prefills its text instead.

        A stall (no byte for ``stall_s``), or, under a budget, when the rest of
        the transfer at the rate seen so far would end after the deadline *and*
        later than prefilling the text from now would.
        """
        c = it.choice
        n_text = self._prefill_s(c.end - c.start)

        def check() -> str | None:
            now = time.perf_counter()
            r = it.reader
            if r is None or r.finished is not None:
                return None
            # bytes arrive a piece (a seal block, >= 1 MiB) at a time: allow the piece's transfer at the
            # estimated bandwidth (10 Mbit/s before any estimate) on top of stall_s
            stall = self.s.stall_s + 2 * r.piece / (self.bw() or STALL_FLOOR_BPS)
            if now - r.last_progress > stall:
                return f"no byte for {stall:.1f} s (stalled link)"
            if self.deadline is not None and self.s.fixed is None:
                # the rate after the first piece: the first one's time is mostly the request's setup and
                # latency (a 0.3 MB tail piece read 3.7 MB/s on a 12.5 MB/s link), which says little about
                # how fast the rest arrives; before a second piece, judge only a transfer that is already slow
                if r.first_at is not None and r.received > r.first_bytes:
                    elapsed, got = now - r.first_at, r.received - r.first_bytes
                else:
                    elapsed, got = now - r.started, r.received
                    if not got or elapsed <= FIRST_PIECE_GRACE_S:
                        return None  # no rate to judge by yet: only the stall rule applies
                left = (r.size - r.received) * elapsed / got
                if now + left + self._rest_s(it.i, self.bw()) > self.deadline and left > n_text:
                    r.slow_Bps = got / elapsed
                    return (f"transfer too slow ({r.received:,}/{r.size:,} bytes in {elapsed:.2f} s): "
                            f"text prefill ({n_text:.2f} s est) ends sooner")
            return None
        return check

    def go(self) -> Any:
        from transformers import DynamicCache

        past = DynamicCache()
        planner = threading.Thread(target=self.plan, name="kvc-stream-plan", daemon=True)
        planner.start()
        try:
            return self._consume(past)
        except BaseException:
            # a model or device error (not a KvcError: those fall back to text) ended the request: without this
            # the planner went on fetching every later chunk into memory for no one
            self.stopped = True
            r = self.filling
            if r is not None:
                r.give_up("the request ended")
            raise
        finally:
            planner.join(timeout=0.1)

    def _consume(self, past: Any) -> Any:
        """go()'s main-thread loop: each planned chunk decoded or prefilled, in order."""
        pos = 0
        while True:
            it = self.items.get()
            if it is None:
                break
            c = it.choice
            t1 = time.perf_counter()
            if c.choice != TEXT and it.reader is not None:
                try:
                    it.reader.check = self.give_up_reason(it)
                    self._append_kv(past, it, pos)
                    self.s.speeds.saw_decode(c.choice, c.end - c.start, time.perf_counter() - t1)
                except KvcError as e:
                    it.reader.give_up(one_line(e))
                    c.fell_back = f"{c.choice}: {one_line(e)}"
                    c.choice = TEXT
                    if it.reader.slow_Bps is None:  # too slow is not failed: plan() turns it into a sample
                        self.fail_link(one_line(e))
                    _truncate(past, pos)
                    t1 = time.perf_counter()
            if c.choice == TEXT:
                self._prefill(past, c.start, c.end)
                self.s.speeds.saw_prefill(c.end - c.start, time.perf_counter() - t1)
            c.compute_s = time.perf_counter() - t1
            pos = c.end
            with self.lock:
                self.pending_est = max(0.0, self.pending_est - it.est_s)
                self.done_at = time.perf_counter()
            self.report.chunks.append(c)
            log.info("stream chunk %d [%d, %d): %s (%s)", c.chunk, c.start, c.end, c.choice, c.reason)
        return past

    def _prefill(self, past: Any, s: int, e: int) -> None:
        lm, dev = self.s.lm, self.s.device
        pos = torch.arange(s, e, device=dev).unsqueeze(0)
        lm.model(input_ids=torch.as_tensor(self.ids[s:e], device=dev).unsqueeze(0), past_key_values=past, position_ids=pos,
                 use_cache=True, logits_to_keep=1)

    def _append_kv(self, past: Any, it: _Item, pos: int) -> None:
        from kvcodec.format import KvcReader
        from kvcodec.integrations.hf import device_scope, land

        c = it.choice
        r = KvcReader(it.reader)
        try:
            self.s.lm.fingerprint.check_compatible(r.fingerprint, what=f"level chunk {c.chunk}")
            tids, p = r.token_ids, r.positions
            if tids is None or not np.array_equal(tids, self.ids[:c.end]) or p is None or \
                    not np.array_equal(np.asarray(p).reshape(-1), np.arange(c.start, c.end)):
                raise KvcFormatError(f"level chunk {c.chunk} holds other tokens or positions than the manifest says")
            dtype = next(self.s.lm.model.parameters()).dtype
            dev = self.s.device
            for layer in range(r.num_layers):
                with device_scope(dev):
                    k, v = r.read_layer(layer, backend=self.s.backend)
                past.update(land(k, dev, dtype).unsqueeze(0), land(v, dev, dtype).unsqueeze(0), layer)
        finally:
            r.close()


def _text_only(key: StoreKey, n_tokens: int) -> LevelManifest:
    """A stand-in manifest whose chunks are only ever prefilled from text (no usable manifest in the store)."""
    ct = max(4 * DEFAULT_CHUNK, -(-n_tokens // (MAX_CHUNKS * DEFAULT_CHUNK)) * DEFAULT_CHUNK)
    chunks = [ChunkLevels(s, min(s + ct, n_tokens), {LEVEL_RANK[0]: 1}) for s in range(0, n_tokens, ct)]
    return LevelManifest(key, ct, [LEVEL_RANK[0]], chunks)


def _truncate(past: Any, n: int) -> None:
    """Drop what a failed chunk appended to some layers (keeps the first ``n`` tokens)."""
    for layer in past.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel() and layer.keys.shape[-2] > n:
            layer.keys = layer.keys[..., :n, :]
            layer.values = layer.values[..., :n, :]
