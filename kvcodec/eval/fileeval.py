"""``kvc eval``: the quality and rate of one existing ``.kvc`` file, continued on the text it was made from.

Why a module of its own: it measures a file someone else encoded (its preset, pruning and calibration are
whatever the file says), so it shares only the rate accounting (:func:`kvcodec.eval.curve.rate_fields`) with the
sweep, which encodes every method itself.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvcodec.calibration.store import default_resolver
from kvcodec.digest import token_ids_sha256
from kvcodec.eval.curve import check_greedy, rate_fields
from kvcodec.format import KvcReader

EVAL_CONTINUATION = 1024  # kvc eval's default: ΔPPL's interval narrows as 1/sqrt(tokens)


def eval_kvc_file(lm: Any, path: str | os.PathLike, text_ids: np.ndarray, continuation: int | None = None,
                  greedy_tokens: int = 16) -> dict[str, Any]:
    """Quality and rate of one `.kvc` file, continued on the text tokens following its context.

    Checks (each a one-line :class:`KvcError`): the file's model is ``lm``;
    the file's token ids are the text's first tokens; the text has
    ``continuation`` more tokens (None: up to :data:`EVAL_CONTINUATION`, as many as it has). The exact reference cache is recomputed by
    prefill of the file's token ids. A lingua-pruned file (a compressed prompt)
    is compared with the exact cache of its whole original context, both
    continued on the tokens after that context.
    """
    from kvcodec.errors import KvcInputError as _In
    from kvcodec.models.capture import capture
    from kvcodec.models.quality import evaluate

    if continuation is not None and continuation < 2:
        raise _In(f"--continuation must be at least 2, got {continuation}")
    path = Path(path)
    if not path.is_file():
        raise _In(f"no such file: {path}")
    size = path.stat().st_size
    with KvcReader(str(path), attachment_resolver=default_resolver) as r:
        lm.fingerprint.check_compatible(r.fingerprint, what=".kvc file")
        ids = r.token_ids
        n_ctx = int(r.header.num_context_tokens)
        text_ids = np.asarray(text_ids, dtype=np.int64).reshape(-1)
        prune = (r.header.meta or {}).get("prune")
        exact_ids = None
        if isinstance(prune, dict) and prune.get("method") == "lingua":  # a compressed prompt of the text's first tokens
            from kvcodec.prune.lingua import unpack_mask

            n_orig = prune.get("context_tokens")
            n_orig = n_orig if isinstance(n_orig, int) and not isinstance(n_orig, bool) else -1
            orig = text_ids[: max(n_orig, 0)]
            if n_orig < 1 or len(orig) < n_orig or token_ids_sha256(orig) != prune.get("original_ids_sha256"):
                raise _In(f"the text's first {n_orig} tokens are not the context this lingua-pruned file was made from")
            if ids is None or not np.array_equal(orig[unpack_mask(str(prune.get("kept_mask_b64")), n_orig)], ids):
                raise _In("the file's kept tokens are not the kept-token mask of its original context")
            exact_ids, n_ctx = orig, n_orig
        elif ids is None:  # the file stores only a hash of its ids: the text's first tokens must match it
            ids = text_ids[:n_ctx]
            if len(ids) < n_ctx or token_ids_sha256(ids) != r.header.token_ids_sha256:
                raise _In(f"the text's first {n_ctx} tokens are not the tokens this file encodes (hash mismatch)")
        else:
            common = min(len(ids), len(text_ids))
            diff = np.flatnonzero(ids[:common] != text_ids[:common])
            if diff.size:
                raise _In(f"the text differs from the tokens this file encodes at token {int(diff[0])} "
                          f"(file {int(ids[diff[0]])}, text {int(text_ids[diff[0]])})")
            if len(text_ids) < n_ctx:
                raise _In(f"the text has only {len(text_ids)} tokens but the file encodes a {n_ctx}-token context")
        if continuation is None:
            continuation = min(EVAL_CONTINUATION, len(text_ids) - n_ctx)
            if continuation < 2:
                raise _In(f"the text has only {len(text_ids) - n_ctx} tokens after the file's {n_ctx}-token context; "
                          "at least 2 are needed to score a continuation")
        if len(text_ids) < n_ctx + continuation:
            raise _In(f"the text has only {len(text_ids) - n_ctx} tokens after the file's {n_ctx}-token context, "
                      f"fewer than --continuation {continuation}")
        check_greedy(lm, n_ctx, continuation, greedy_tokens, ("continuation", "greedy_tokens"))
        t0 = time.perf_counter()
        decoded = r.read_cache(token_ids=ids)
        t_dec = time.perf_counter() - t0
        preset = r.header.codec if hasattr(r.header, "codec") else None
    exact = capture(lm, token_ids=ids if exact_ids is None else exact_ids)  # lingua: the full original context
    cont = text_ids[n_ctx : n_ctx + continuation]
    t0 = time.perf_counter()
    if exact_ids is None:
        q = evaluate(lm, exact, decoded, cont, greedy_tokens=greedy_tokens)
    else:
        from kvcodec.prune import evaluate_pruned

        q = evaluate_pruned(lm, exact, decoded, cont, greedy_tokens=greedy_tokens)
    t_eval = time.perf_counter() - t0
    out: dict[str, Any] = rate_fields(size, exact)  # charged against the whole (unpruned) context's K+V elements
    out.update(q.to_json())
    out.update(file=str(path), preset=preset, context_tokens=n_ctx, stored_tokens=decoded.num_tokens,
               pruned=decoded.positions is not None or exact_ids is not None, decode_s=round(t_dec, 3), eval_s=round(t_eval, 3),
               greedy_tokens=greedy_tokens)
    return out
