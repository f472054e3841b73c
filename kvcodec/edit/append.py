"""``append``: extend a stored context with more text, prefilling only the new text.

The parent's cache is decoded and handed to the model as its past; the new tokens are prefilled over it at
positions ``n .. n+m-1`` (one forward of ``m`` tokens), and the child stores the parent's K/V followed by the
new tokens' (a sliding-window layer keeps its last ``window - 1``, as after any prefill). Cost: the parent's
decode plus the new text's own prefill over the stored context, never a prefill of the old text.

What is exact, and what is not (measured in ``tests/edit/test_append.py`` and BENCHMARKS.md):

* the child's first ``n`` tokens' K/V are the decoded parent's, bit for bit (on a lossless parent: the
  parent's prefill's), and the new tokens' K/V are *exactly* what incremental prefill of the new tokens over
  that cache computes: the same K/V a generation loop continuing the parent would hold;
* compared with one prefill of all ``n + m`` ids at once, the new tokens' K/V and the next-token logits
  agree only to float rounding: the attention and matmul reductions run over different shapes (chunked vs
  whole prefill), so fp32 sums round differently. The test bounds that gap rather than claiming zero.

The new text is tokenized on its own (no special tokens) and its ids follow the parent's: a word split across
the boundary is tokenized as two pieces, exactly as if the two texts had been fed one after the other.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from kvcodec.edit.entry import EditResult, check_dest, check_token_ids, open_parent, write_child
from kvcodec.errors import KvcInputError
from kvcodec.models.cachelayout import cache_for
from kvcodec.models.capture import cache_from_hf, check_fits, context_ids

__all__ = ["append", "append_cache"]


@torch.inference_mode()
def append_cache(lm: Any, cache: Any, new_ids: np.ndarray) -> tuple[Any, torch.Tensor]:
    """``cache`` (an unpruned KVCache of ``lm``) extended by ``new_ids``: (child KVCache, last-token logits).

    Runs on the model's device; the child's tensors come back in the model's dtype.
    """
    from kvcodec.integrations.hf import land, model_device

    new = np.asarray(new_ids, dtype=np.int64).reshape(-1)
    if new.size == 0:
        raise KvcInputError("nothing to append: the new text has no tokens")
    n = cache.num_context_tokens
    check_fits(lm, n + len(new), "the extended context")
    dev = model_device(lm)
    lm.fingerprint.check_compatible(cache.fingerprint)
    dtype = next(lm.model.parameters()).dtype
    # the decoded cache lands where the model computes, in its dtype (copies: the parent's tensors stay as they are)
    past = cache_for(lm, cache, [(land(k, dev, dtype).unsqueeze(0).clone(), land(v, dev, dtype).unsqueeze(0).clone())
                                 for k, v in zip(cache.keys, cache.values)])
    ids = torch.as_tensor(new, device=dev).unsqueeze(0)
    pos = torch.arange(n, n + len(new), device=dev).unsqueeze(0)
    out = lm.model(input_ids=ids, past_key_values=past, position_ids=pos, use_cache=True, logits_to_keep=1)
    child = cache_from_hf(out.past_key_values, np.concatenate([cache.token_ids, new]), lm, meta=dict(cache.meta))
    return child, out.logits[0, -1].float()


def append(lm: Any, source: Any, text: str | None = None, token_ids: Any = None, dest: Any = None,
           preset: str | None = None, progress: Callable[[str], None] | None = None) -> EditResult:
    """Extend the stored entry ``source`` (a `.kvc` path or bytes) by ``text`` (or ``token_ids``) into a new
    entry at ``dest`` (None: bytes in the result), encoded with the parent's preset unless ``preset`` is given.
    """
    check_dest(source, dest)
    if text is not None and not isinstance(text, str):
        raise KvcInputError(f"text must be a string, got {type(text).__name__}")
    if token_ids is not None:
        token_ids = check_token_ids(token_ids)
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    parent = open_parent(source)
    new = context_ids(lm, text, token_ids)
    say(f"decoding the stored entry ({parent.reader.header.num_context_tokens} tokens)")
    cache = parent.decode(lm)
    t1 = time.perf_counter()
    say(f"prefilling {len(new)} new tokens over it")
    child, _ = append_cache(lm, cache, new)
    t2 = time.perf_counter()
    params = {"tokens": int(len(new)), "appended_token_ids_sha256": _ids_sha(new)}
    return write_child(lm, parent, child, "append", params, dest=dest, preset=preset, progress=progress,
                       timings={"decode_s": t1 - t0, "prefill_s": t2 - t1},
                       info={"parent_tokens": int(cache.num_context_tokens), "appended_tokens": int(len(new))})


def _ids_sha(ids: np.ndarray) -> str:
    from kvcodec.digest import token_ids_sha256

    return token_ids_sha256(ids)
