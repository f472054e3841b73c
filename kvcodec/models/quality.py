"""Quality of a decoded KV cache, measured on the real model.

The model continues the same continuation tokens twice: once from the exact
cache, once from the decoded one. We compare the next-token distributions at
every continuation position:

* ``kl_mean``: mean KL(exact || decoded) in nats;
* ``top1_agreement``: fraction of positions whose argmax token agrees;
* ``dppl_percent``: relative change of perplexity of the continuation
  (positions 1..N-1 are scored; position 0's target is the first
  continuation token, whose logits come from the context and not the cache);
* ``greedy_match``: fraction of ``greedy_tokens`` greedily generated tokens
  (after the first continuation token) that are identical, counted up to the
  first divergence — one early divergence ends the match.

Pruned caches continue at their original positions (``next_position``), not
at the number of stored tokens.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import numpy as np
import torch

from kvcodec.models.cachelayout import cache_for, cache_for_model
from kvcodec.errors import KvcInputError
from kvcodec.core.kvcache import KVCache
from kvcodec.models.load import LoadedModel


@dataclass
class Quality:
    kl_mean: float
    top1_agreement: float
    ppl_exact: float
    ppl_decoded: float
    dppl_percent: float
    greedy_match: float
    continuation_tokens: int
    dppl_ci95_percent: tuple[float, float] = (float("nan"), float("nan"))  # 95 % interval of the mean (per-token terms)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@torch.inference_mode()
def continue_logits(lm: LoadedModel, cache: KVCache, continuation: np.ndarray) -> torch.Tensor:
    """Logits [N, vocab] (fp32) of the continuation tokens fed after ``cache``."""
    past = cache_for_model(lm, cache)
    ids = torch.as_tensor(np.asarray(continuation, dtype=np.int64)).unsqueeze(0)
    pos = torch.arange(cache.next_position, cache.next_position + ids.shape[1]).unsqueeze(0)
    out = lm.model(input_ids=ids, past_key_values=past, position_ids=pos, use_cache=True)
    return out.logits[0].float()


@torch.inference_mode()
def greedy(lm: LoadedModel, cache: KVCache, first_token: int, n: int) -> list[int]:
    """``n`` greedy tokens generated after feeding ``first_token`` to ``cache``."""
    past = cache_for_model(lm, cache)
    tok, pos, out = int(first_token), cache.next_position, []
    for _ in range(n):
        logits = lm.model(
            input_ids=torch.tensor([[tok]]), past_key_values=past, position_ids=torch.tensor([[pos]]), use_cache=True
        ).logits[0, -1]
        tok, pos = int(logits.argmax()), pos + 1
        out.append(tok)
    return out


@torch.inference_mode()
def greedy_answer(lm: LoadedModel, cache: KVCache, question: np.ndarray, n: int, stop_at_eos: bool = True) -> list[int]:
    """Up to ``n`` greedy tokens answering ``question`` (token ids, fed after ``cache``), stopping at EOS unless
    ``stop_at_eos`` is False (then exactly ``n``: a continuation whose length is fixed, as the chat factors use)."""
    past = cache_for_model(lm, cache)
    ids = torch.as_tensor(np.asarray(question, dtype=np.int64)).unsqueeze(0)
    pos = cache.next_position
    logits = lm.model(input_ids=ids, past_key_values=past, position_ids=torch.arange(pos, pos + ids.shape[1]).unsqueeze(0),
                      use_cache=True, logits_to_keep=1).logits[0, -1]
    pos += ids.shape[1]
    eos = getattr(lm.tokenizer, "eos_token_id", None)
    out: list[int] = []
    for _ in range(n):
        tok = int(logits.argmax())
        out.append(tok)
        if (stop_at_eos and tok == eos) or len(out) == n:
            break
        logits = lm.model(input_ids=torch.tensor([[tok]]), past_key_values=past, position_ids=torch.tensor([[pos]]),
                          use_cache=True).logits[0, -1]
        pos += 1
    return out


def greedy_answers(lm: LoadedModel, cache: KVCache | list[KVCache], questions: list[np.ndarray], n: int,
                   stop_at_eos: bool = True) -> list[list[int]]:
    """:func:`greedy_answer` of each of ``questions`` after ``cache`` (one for all, or one per question), batched:
    each greedy step reads the model's weights once for every row (a step of a 0.5B model in fp32 reads ~2 GB of
    weights: 0.2 s on one core of the 2-vCPU Xeon, where four rows took 1.8x less than four steps of one).

    A model whose layers all attend to every token batches every row at once: a shorter cache is padded after its
    tokens and a shorter question before its tokens, both masked (in no row's context), each row at its own
    positions. A model with sliding-window layers batches only questions of equal length after the same cache (no
    padding, which would move a window's edge). The tokens are :func:`greedy_answer`'s up to float rounding: a
    batched matrix product sums in another order than a one-row one, so only a near-tie of the top-2 logits can
    pick another token."""
    qs = [np.asarray(q, dtype=np.int64).reshape(-1) for q in questions]
    caches = list(cache) if isinstance(cache, list) else [cache] * len(qs)
    if len(caches) != len(qs):
        raise KvcInputError(f"greedy_answers: {len(caches)} caches for {len(qs)} questions")
    sliding = any(w is not None for w in (lm.layout.windows or ()))
    groups: dict[Any, list[int]] = {}
    for i, q in enumerate(qs):
        groups.setdefault((id(caches[i]), len(q)) if sliding else 0, []).append(i)
    out: list[list[int]] = [[] for _ in qs]
    for rows in groups.values():
        for i, got in zip(rows, _greedy_batch(lm, [caches[i] for i in rows], [qs[i] for i in rows], n, stop_at_eos)):
            out[i] = got
    return out


@torch.inference_mode()
def _greedy_batch(lm: LoadedModel, caches: list[KVCache], qs: list[np.ndarray], n: int,
                  stop_at_eos: bool) -> list[list[int]]:
    """:func:`greedy_answers` of one batch (row ``b``: ``qs[b]`` after ``caches[b]``)."""
    if len(qs) == 1:
        return [greedy_answer(lm, caches[0], qs[0], n, stop_at_eos)]
    B, P = len(qs), max(len(q) for q in qs)
    for c in caches:
        lm.fingerprint.check_compatible(c.fingerprint)
    dtype = next(lm.model.parameters()).dtype
    C = max(c.num_tokens for c in caches)

    def rows(tensors: list[torch.Tensor]) -> torch.Tensor:  # [B, H, C, D]: each row's tokens, then zeros (masked)
        if all(c is caches[0] for c in caches):
            return tensors[0].to(dtype).unsqueeze(0).expand(B, -1, -1, -1).contiguous()
        return torch.stack([torch.nn.functional.pad(t.to(dtype), (0, 0, 0, C - t.shape[1])) for t in tensors])

    ref = max(caches, key=lambda c: c.num_tokens)
    past = cache_for(lm, ref, [(rows([c.keys[l] for c in caches]), rows([c.values[l] for c in caches]))
                               for l in range(ref.num_layers)])
    ids = torch.zeros((B, P), dtype=torch.int64)
    pos = torch.zeros((B, P), dtype=torch.int64)
    pad = [P - len(q) for q in qs]
    mask = torch.ones((B, C + P), dtype=torch.int64)
    for b, (c, q) in enumerate(zip(caches, qs)):
        p0 = c.next_position
        ids[b, pad[b]:] = torch.as_tensor(q)
        pos[b] = p0
        pos[b, pad[b]:] = torch.arange(p0, p0 + len(q))
        mask[b, c.num_tokens:C + pad[b]] = 0  # the row's cache padding and question padding
    mask = None if bool(mask.all()) else mask  # no padding: transformers' own unmasked path
    out: list[list[int]] = [[] for _ in qs]
    with _gqa_masked(lm, mask is not None):
        logits = lm.model(input_ids=ids, past_key_values=past, position_ids=pos, attention_mask=mask, use_cache=True,
                          logits_to_keep=1).logits[:, -1]
        nxt = pos[:, -1] + 1
        eos = getattr(lm.tokenizer, "eos_token_id", None)
        done = [False] * B
        for _ in range(n):
            toks = logits.argmax(-1)
            for b in range(B):
                if not done[b]:
                    out[b].append(int(toks[b]))
                    done[b] = (stop_at_eos and int(toks[b]) == eos) or len(out[b]) == n
            if all(done):
                break
            if mask is not None:
                mask = torch.cat([mask, torch.ones((B, 1), dtype=torch.int64)], 1)
            logits = lm.model(input_ids=toks[:, None], past_key_values=past, position_ids=nxt[:, None],
                              attention_mask=mask, use_cache=True).logits[:, -1]
            nxt = nxt + 1
    return out


def _gqa_masked_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                          scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> Any:
    """transformers' SDPA attention, except that a masked call with grouped query heads reads each KV head once
    (``enable_gqa``) instead of copying it per query head: transformers repeats the keys and values whenever there
    is a mask, which for a padded batch over a 2K-token cache copied ~1.4 GB per greedy step of a 0.5B model.
    The same softmax (tests/onboard); anything it does not model is transformers' own call."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (attention_mask is not None and attention_mask.dtype == torch.bool and dropout == 0.0
            and query.device.type == "cpu" and query.shape[1] % key.shape[1] == 0 and not kwargs.get("softcap")
            and kwargs.get("s_aux") is None and kwargs.get("position_bias") is None and kwargs.get("cache") is None
            and query.shape[-1] == key.shape[-1] == value.shape[-1]):
        o = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                                             enable_gqa=query.shape[1] != key.shape[1])
        return o.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


@contextmanager
def _gqa_masked(lm: LoadedModel, on: bool) -> Iterator[None]:
    """Within this block (when ``on``), this thread's SDPA attention of ``lm`` is :func:`_gqa_masked_attention` (a
    model on another implementation, or one this thread already runs a variant of, is left as it is)."""
    from kvcodec.models.attention_choice import use_attention

    if not on:
        yield
        return
    with use_attention(lm, _gqa_masked_attention, outermost=True):
        yield


def greedy_with_margins(lm: LoadedModel, cache: KVCache, first_token: int, n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy tokens after feeding ``first_token`` to ``cache``, and each step's top-2 logit margin."""
    past = cache_for_model(lm, cache)
    tok, pos, toks, margins = int(first_token), cache.next_position, [], []
    with torch.inference_mode():
        for _ in range(n):
            logits = lm.model(input_ids=torch.tensor([[tok]]), past_key_values=past,
                              position_ids=torch.tensor([[pos]]), use_cache=True).logits[0, -1]
            top = torch.topk(logits.float(), 2).values
            tok, pos = int(logits.argmax()), pos + 1
            toks.append(tok)
            margins.append(float(top[0] - top[1]))
    return toks, margins


def first_near_tie(margins: list[float], near_tie: float) -> int | None:
    """Index of the first greedy step whose exact top-2 margin is under ``near_tie`` (None: no near-tie;
    the presets' threshold is :data:`kvcodec.plan.targets.NEAR_TIE`)."""
    return next((i for i, m in enumerate(margins) if m < near_tie), None)


def greedy_promise_met(exact: list[int], got: list[int], exact_margins: list[float], near_tie: float) -> bool:
    """Identical up to the first near-tie of the exact run (that token and what follows are not promised)."""
    tie = first_near_tie(exact_margins, near_tie)
    upto = len(exact) if tie is None else tie
    return list(got[:upto]) == list(exact[:upto])


def max_rival_gain(exact_logits: Any, dec_logits: Any) -> float:
    """Largest gain of any token's logit over the exact top-1 token's, decoded vs exact, over all positions.

    A greedy token can flip only where this exceeds the exact top-2 margin, so a
    probe whose gain stays under the near-tie threshold bounds the flips to near-ties.
    """
    g = dec_logits.double() - exact_logits.double()
    top = exact_logits.argmax(-1, keepdim=True)
    return float((g.max(-1).values - g.gather(-1, top)[..., 0]).max()) if g.numel() else 0.0


class ExactSide:
    """The exact cache's side of KL(exact || decoded) on a continuation, for the several decoded caches compared with
    one exact one (the rate model's fit rows and chat factors: one per preset): its log-softmax, probabilities and
    top-1 computed once, and each comparison (:meth:`compare`) in blocks of rows.

    Why blocks: a continuation's [256, 151,936] logits are 311 MB per float64 tensor, so the whole-matrix form
    (``(lp_e.exp() * (lp_e - lp_d)).sum(-1)``) streams several such temporaries through memory; a few rows at a
    time stay in cache. Each row's sum, and the mean over rows, are the same operations on the same values:
    the results are the whole-matrix form's, bit for bit (tests/onboard)."""

    ROWS = 4

    def __init__(self, logits: torch.Tensor, tokens: np.ndarray | None = None) -> None:
        self.logits = logits
        self.lp = torch.log_softmax(logits.double(), -1)
        self.p = self.lp.exp()
        self.top = logits.argmax(-1, keepdim=True)
        self.tgt = None if tokens is None else torch.as_tensor(np.asarray(tokens[1:], np.int64))[:, None]
        self.nll = None if self.tgt is None else -self.lp[:-1].gather(1, self.tgt)[:, 0]

    def compare(self, dec: torch.Tensor) -> dict[str, float]:
        """``kl`` (mean over rows of KL(exact || decoded), each row's clamped at 0), ``rival_gain``
        (:func:`max_rival_gain`) and, when the continuation's tokens were given, ``dnll``: the mean change of their
        NLL over positions 1.. (:func:`compare_logits`' ΔPPL terms)."""
        N = int(dec.shape[0])
        kl, gain, nll_d = [], [], []
        for a in range(0, N, self.ROWS):
            b = min(N, a + self.ROWS)
            lp_d = torch.log_softmax(dec[a:b].double(), -1)
            kl.append((self.p[a:b] * (self.lp[a:b] - lp_d)).sum(-1))
            g = dec[a:b].double() - self.logits[a:b].double()
            gain.append(g.max(-1).values - g.gather(-1, self.top[a:b])[..., 0])
            if self.tgt is not None and a < N - 1:
                m = min(b, N - 1)
                nll_d.append(-lp_d[: m - a].gather(1, self.tgt[a:m])[:, 0])
        out = {"kl": float(torch.cat(kl).clamp_min(0).mean()),
               "rival_gain": float(torch.cat(gain).max()) if N and dec.shape[-1] else 0.0}
        if self.nll is not None:
            out["dnll"] = float((torch.cat(nll_d) - self.nll).mean())
        return out


def probe_terms(exact_logits: Any, dec_logits: Any, tokens: np.ndarray) -> dict[str, Any]:
    """The encode-time check's measures of a decoded prefix's logits against the exact prefix's on ``tokens``
    (:class:`kvcodec.plan.check.ProbeStats` without the greedy check): mean KL, top-1 agreement, the per-token
    ΔPPL terms' mean and spread, their count, and :func:`max_rival_gain`."""
    lp_e = torch.log_softmax(exact_logits.double(), -1)
    lp_d = torch.log_softmax(dec_logits.double(), -1)
    kl = float((lp_e.exp() * (lp_e - lp_d)).sum(-1).clamp_min(0).mean())
    tgt = torch.as_tensor(np.asarray(tokens[1:], np.int64))[:, None]
    d = (lp_e[:-1].gather(1, tgt) - lp_d[:-1].gather(1, tgt))[:, 0]
    top1 = float((exact_logits.argmax(-1) == dec_logits.argmax(-1)).double().mean())
    return {"kl": kl, "top1": top1, "d_mean": float(d.mean()), "d_std": float(d.std()) if d.numel() > 1 else 0.0,
            "n": int(d.numel()), "rival_gain": max_rival_gain(exact_logits, dec_logits)}


def compare_logits(exact: torch.Tensor, decoded: torch.Tensor, continuation: np.ndarray) -> dict[str, Any]:
    """KL, top-1 agreement and PPL from two logit matrices over the same tokens.

    ΔPPL comes with the 95 % interval of its mean (normal, from the spread of the per-token NLL
    differences): on a few hundred tokens that spread, ~sqrt(2 KL) per token, dominates what the
    codec does, so a ΔPPL without its interval says little (kvcodec.plan.targets).
    """
    import math

    lp_e = torch.log_softmax(exact.double(), -1)
    lp_d = torch.log_softmax(decoded.double(), -1)
    kl = (lp_e.exp() * (lp_e - lp_d)).sum(-1)
    top1 = (exact.argmax(-1) == decoded.argmax(-1)).double().mean()
    tgt = torch.as_tensor(np.asarray(continuation[1:], dtype=np.int64))
    nll_e = -lp_e[:-1].gather(1, tgt[:, None])[:, 0]
    nll_d = -lp_d[:-1].gather(1, tgt[:, None])[:, 0]
    ppl_e, ppl_d = float(nll_e.mean().exp()), float(nll_d.mean().exp())
    d = nll_d - nll_e
    half = 1.96 * float(d.std()) / math.sqrt(d.numel()) if d.numel() > 1 else float("nan")
    mean = float(d.mean()) if d.numel() else 0.0
    return {
        "kl_mean": float(kl.clamp_min(0).mean()),
        "top1_agreement": float(top1),
        "ppl_exact": ppl_e,
        "ppl_decoded": ppl_d,
        "dppl_percent": 100.0 * (ppl_d - ppl_e) / ppl_e,
        "dppl_ci95_percent": (100.0 * math.expm1(mean - half), 100.0 * math.expm1(mean + half)),
    }


def evaluate(
    lm: LoadedModel,
    exact: KVCache,
    decoded: KVCache,
    continuation: np.ndarray,
    greedy_tokens: int = 16,
    exact_logits: torch.Tensor | None = None,
    exact_greedy: list[int] | None = None,
) -> Quality:
    """Quality of ``decoded`` against ``exact`` on ``continuation``.

    Pass ``exact_logits`` / ``exact_greedy`` (from :func:`continue_logits` /
    :func:`greedy` on the exact cache) when evaluating many decodings of one
    cache, so the exact side is computed once.
    """
    continuation = np.asarray(continuation, dtype=np.int64).reshape(-1)
    if continuation.size < 2:
        raise KvcInputError("the continuation needs at least 2 tokens")
    lm.fingerprint.check_compatible(decoded.fingerprint)
    if not np.array_equal(exact.token_ids, decoded.token_ids):
        raise KvcInputError("the decoded cache encodes different tokens than the exact cache")
    return compare_caches(lm, exact, decoded, continuation, greedy_tokens, exact_logits, exact_greedy)


def compare_caches(
    lm: LoadedModel,
    exact: KVCache,
    other: KVCache,
    continuation: np.ndarray,
    greedy_tokens: int = 16,
    exact_logits: torch.Tensor | None = None,
    exact_greedy: list[int] | None = None,
) -> Quality:
    """The metrics, once the caller has checked that ``other`` stands for ``exact``'s context."""
    if exact_logits is None:
        exact_logits = continue_logits(lm, exact, continuation)
    m = compare_logits(exact_logits, continue_logits(lm, other, continuation), continuation)
    match = 1.0
    if greedy_tokens > 0:
        if exact_greedy is None:
            exact_greedy = greedy(lm, exact, int(continuation[0]), greedy_tokens)
        got = greedy(lm, other, int(continuation[0]), greedy_tokens)
        same = 0
        for a, b in zip(exact_greedy, got):
            if a != b:
                break
            same += 1
        match = same / greedy_tokens
    return Quality(greedy_match=match, continuation_tokens=int(continuation.size), **m)
