"""``append``: extend a stored context with more text.

Two repairs (``repair=``), chosen by what the parent is (issue 57):

* **``"incremental"``** (what ``"auto"``, the default, runs on an *exact* parent: a lossless codec and no carried
  error, :attr:`kvcodec.edit.entry.Parent.carried`): prefill only the new text over the decoded parent, below.
  On an exact parent the child's K/V are a prefill of its ids to float rounding, so the child keeps its preset's
  promise. On a lossy parent the decoded K/V carry the parent's decode error into every new token and the
  child's encode adds its own (SmolLM2, balanced: 0.049 nats against 0.01 promised), so the child's log records
  that it promises nothing; it is there for whoever wants the cheap path and knows it.
* **``"prefill"``** (what ``"auto"`` runs on a lossy parent): prefill all the child's ids (the parent's stored ids
  and the new ones) afresh and encode that: the preset's promise holds as for any encode. It costs a prefill of
  the whole context, which is the price of the promise: a lossy parent already spends its preset's whole error
  budget, so no tighter encode of the child can make room for the error it would carry.

The incremental path: the parent's cache is decoded and handed to the model as its past; the new tokens are prefilled over it at
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

from kvcodec.edit.entry import (EditResult, breaks, check_child_preset, check_dest, check_token_ids, keeps, open_parent,
                                write_child)
from kvcodec.errors import KvcInputError
from kvcodec.models.cachelayout import cache_for
from kvcodec.models.capture import cache_from_hf, capture, check_fits, context_ids

__all__ = ["REPAIRS", "append", "append_cache"]

#: how an append computes the child's K/V: ``"auto"`` (``"prefill"`` on a lossy parent, else ``"incremental"``),
#: ``"prefill"`` (all the child's ids afresh), ``"incremental"`` (the new tokens over the decoded parent)
REPAIRS = ("auto", "prefill", "incremental")


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
           preset: str | None = None, progress: Callable[[str], None] | None = None, repair: str = "auto") -> EditResult:
    """Extend the stored entry ``source`` (a `.kvc` path or bytes) by ``text`` (or ``token_ids``) into a new
    entry at ``dest`` (None: bytes in the result), encoded with the parent's preset unless ``preset`` is given.

    ``repair`` (:data:`REPAIRS`, module doc): ``"auto"`` keeps the preset's promise (re-prefilling the child when
    the parent is lossy); ``"incremental"`` is always the cheap path, and on a lossy parent its child's log says
    it promises nothing. The parent must store its token ids (the child stores them, and a prefill needs them).
    """
    if repair not in REPAIRS:
        raise KvcInputError(f"repair must be one of {', '.join(REPAIRS)}, got {repair!r:.40}")
    check_dest(source, dest)
    if text is not None and not isinstance(text, str):
        raise KvcInputError(f"text must be a string, got {type(text).__name__}")
    if token_ids is not None:
        token_ids = check_token_ids(token_ids)
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    parent = open_parent(source)
    check_child_preset(parent, preset)
    hd = parent.reader.header
    old = parent.token_ids(lm, "append")
    if hd.pruned:
        raise KvcInputError("the entry is a pruned cache (its tokens are not all stored); edits need a full cache")
    if hd.attention_bias is not None:  # neither path may drop the steering, nor prefill new text without it
        raise KvcInputError("the entry is steered (it carries an attention bias); append to its unsteered parent, "
                            "then steer the result")
    new = context_ids(lm, text, token_ids)
    # both paths need the whole child inside the window: refused here, before the incremental path decodes the parent
    check_fits(lm, len(old) + len(new), "the extended context")
    carried = parent.carried
    path = repair if repair != "auto" else ("prefill" if carried else "incremental")
    params = {"tokens": int(len(new)), "appended_token_ids_sha256": _ids_sha(new), "repair": path}
    info: dict[str, Any] = {"parent_tokens": int(len(old)), "appended_tokens": int(len(new)), "repair": path}
    if path == "prefill":
        ids = np.concatenate([old, new])
        why = f" ({carried}, so the child is prefilled afresh)" if carried else ""
        say(f"prefilling all {len(ids)} tokens of the child{why}")
        t1 = time.perf_counter()
        child = capture(lm, token_ids=ids)
        t2 = time.perf_counter()
        info["prefilled_tokens"] = int(len(ids))
        return write_child(lm, parent, child, "append", params, dest=dest, preset=preset, progress=progress,
                           timings={"prepare_s": t1 - t0, "prefill_s": t2 - t1}, info=info,
                           promise=keeps("fresh prefill of the child's ids"))
    say(f"decoding the stored entry ({hd.num_context_tokens} tokens)")
    cache = parent.decode(lm)
    t1 = time.perf_counter()
    say(f"prefilling {len(new)} new tokens over it (incremental: the stored K/V are reused"
        + (f"; {carried}" if carried else "") + ")")
    child, _ = append_cache(lm, cache, new)
    t2 = time.perf_counter()
    info["prefilled_tokens"] = int(len(new))
    promise = (breaks(f"{carried} (repair=incremental)") if carried else
               keeps("the exact parent's K/V and a prefill of the new tokens over them (a fresh prefill's to float rounding)"))
    return write_child(lm, parent, child, "append", params, dest=dest, preset=preset, progress=progress,
                       timings={"decode_s": t1 - t0, "prefill_s": t2 - t1}, info=info, promise=promise)


def _ids_sha(ids: np.ndarray) -> str:
    from kvcodec.digest import token_ids_sha256

    return token_ids_sha256(ids)
