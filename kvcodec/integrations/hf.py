"""Load `.kvc` caches into HF transformers, decoding layer by layer.

:func:`load_cache` returns a ``DynamicCache`` whose layers are
:class:`LazyKvcLayer` objects (:class:`LazyKvcSlidingLayer`, transformers'
sliding-window layer class, for a model's sliding-window layers: the cache is
the one a fresh prefill leaves, :mod:`kvcodec.models.cachelayout`): each knows its
sequence length up front (so masks can be built before anything is decoded)
and decodes its K/V on first use. A background thread decodes layers in order ahead of the model, so
decoding layer i overlaps computing layer i-1 (the decoders spend their time
in numpy/numba/zstd code that releases the GIL).

One line around ``generate``::

    out = kvcodec.integrations.hf.generate(lm, "doc.kvc", question_ids, max_new_tokens=32)
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from kvcodec.models.cachelayout import DynamicCache, LazyKvcLayer, LazyKvcSlidingLayer, cache_windows, check_layer_tokens, hf_cache
from kvcodec.errors import KvcInputError
from kvcodec.models.load import LoadedModel

__all__ = ["LazyKvcLayer", "LazyKvcSlidingLayer", "LoadedKvc", "generate", "greedy_from", "load_cache"]


@dataclass
class LoadedKvc:
    """A cache ready for ``model(...)``/``generate`` plus what the caller needs to continue it."""

    cache: DynamicCache
    token_ids: np.ndarray  # the context the cache encodes
    next_position: int  # position id of the first token after the context
    reader: Any


def load_cache(source: Any, lm: LoadedModel, backend: str | None = None, prefetch: bool = True) -> LoadedKvc:
    """Open a `.kvc` (path, bytes, file object or ranged source) for ``lm``.

    Refuses a file of another model before decoding anything.
    """
    from kvcodec.format import KvcReader

    reader = source if isinstance(source, KvcReader) else KvcReader(source)
    lm.fingerprint.check_compatible(reader.fingerprint, what=".kvc file")
    dtype = next(lm.model.parameters()).dtype
    n_layers = reader.fingerprint.num_layers
    seq_len = reader.header.num_tokens
    windows = cache_windows(lm.model.config)
    check_layer_tokens(windows, reader.header.layer_tokens, seq_len, "the .kvc file")

    def decode(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = reader.read_layer(i, backend=backend)
        return k.to(dtype).unsqueeze(0), v.to(dtype).unsqueeze(0)

    futures: list[Future] = []
    if prefetch:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvc-decode")
        futures = [pool.submit(decode, i) for i in range(n_layers)]
        pool.shutdown(wait=False)
        fetchers = [f.result for f in futures]
    else:
        lock = threading.Lock()

        def make(i: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
            def fetch() -> tuple[torch.Tensor, torch.Tensor]:
                with lock:
                    return decode(i)
            return fetch

        fetchers = [make(i) for i in range(n_layers)]
    cache = hf_cache(windows, fetchers, seq_len)
    return LoadedKvc(
        cache=cache, token_ids=reader.token_ids, next_position=reader.header.num_context_tokens, reader=reader
    )


@torch.inference_mode()
def generate(
    lm: LoadedModel, source: Any, input_ids: np.ndarray | list[int], max_new_tokens: int = 32, backend: str | None = None
) -> list[int]:
    """Greedy continuation of a cached context followed by ``input_ids`` (e.g. a question)."""
    loaded = load_cache(source, lm, backend=backend)
    return greedy_from(lm, loaded.cache, loaded.next_position, input_ids, max_new_tokens)[0]


@torch.inference_mode()
def greedy_from(
    lm: LoadedModel, cache: Any, next_position: int, ids: np.ndarray | list[int], max_new_tokens: int
) -> tuple[list[int], float]:
    """Feed ``ids`` after ``cache`` (at ``next_position``) and decode greedily.

    Returns the tokens and the ``time.perf_counter()`` instant the first one
    was known (for time-to-first-token).
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.size == 0:
        raise KvcInputError("need at least one token after the cached context")
    if max_new_tokens < 1:
        raise KvcInputError("max_new_tokens must be at least 1")
    eos = getattr(lm.tokenizer, "eos_token_id", None)
    pos = torch.arange(next_position, next_position + len(ids)).unsqueeze(0)
    logits = lm.model(input_ids=torch.as_tensor(ids).unsqueeze(0), past_key_values=cache, position_ids=pos, use_cache=True,
                      logits_to_keep=1).logits
    out: list[int] = []
    first_at = 0.0
    nxt = next_position + len(ids)
    for i in range(max_new_tokens):
        tok = int(logits[0, -1].argmax())
        if i == 0:
            first_at = time.perf_counter()
        out.append(tok)
        if tok == eos or i == max_new_tokens - 1:
            break
        logits = lm.model(
            input_ids=torch.tensor([[tok]]), past_key_values=cache, position_ids=torch.tensor([[nxt]]), use_cache=True
        ).logits
        nxt += 1
    return out, first_at
