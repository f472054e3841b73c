# ruff: noqa  (a one-off probe kept as it ran; see README.md)
"""Probe (issue 37): blend's repair with a pluggable token choice, for the redact ceiling study (README.md)."""
import os, sys, time
import torch; torch.set_num_threads(1)
import numpy as np
from kvcodec.models.load import load_model
from kvcodec.models.capture import capture, tokenize
from kvcodec.texts import load_text
from kvcodec.models.quality import compare_logits, continue_logits
from kvcodec.core.kvcache import KVCache
from kvcodec.runtime.blend import _place, _Forward, _Stop, _ragged, layer_inv_freqs
from kvcodec.edit.redact import _piece, _pieces

@torch.inference_mode()
def repair(lm, chunks, q_ids, sel, choose):
    dev = torch.device("cpu")
    q_ids = torch.as_tensor(q_ids)
    n_q = len(q_ids)
    placed = _place(lm, chunks, n_q, dev)
    n_ctx = len(placed.token_ids); T = n_ctx + n_q
    fwd = _Forward(lm, placed.keys, placed.values, placed.windows)
    all_ids = torch.cat([torch.as_tensor(placed.token_ids), q_ids]); all_pos = torch.arange(T)
    q_pos = torch.arange(n_ctx, T)
    stored = {w: s for w, s in zip(placed.windows, placed.stored)}
    fresh = {}
    def tap(k):
        fresh["k"] = k; raise _Stop
    for li, layer in enumerate(fwd.layers_kv):
        layer.rows = all_pos if li < sel else None
    fwd.layers_kv[sel].tap = tap
    everything = {w: torch.ones(T, dtype=torch.bool) for w in stored}
    _, h = fwd.run(all_ids, all_pos, fwd.mask(all_pos, T, everything), 1, capture_at=sel)
    fwd.layers_kv[sel].tap = None
    cached = fwd.layers_kv[sel].store_k[0, :, :n_ctx].float()
    dev_sq = (fresh["k"][0, :, :n_ctx].float() - cached).pow(2).sum(dim=(0, 2))
    ctx_sel = torch.as_tensor(np.sort(np.asarray(choose(dev_sq.numpy(), n_ctx), dtype=np.int64)))
    rows = torch.cat([ctx_sel, q_pos])
    hidden_at = (sel, h[:, rows])
    for li, layer in enumerate(fwd.layers_kv):
        layer.rows = None if li < sel else rows
    is_row = torch.zeros(T, dtype=torch.bool); is_row[rows] = True
    visible = {w: s | is_row for w, s in stored.items()}
    fwd.run(all_ids[rows], rows, fwd.mask(rows, T, visible), 1, hidden_at=hidden_at)
    K = [l.store_k[0] for l in fwd.layers_kv]; V = [l.store_v[0] for l in fwd.layers_kv]
    return KVCache(_ragged(K, placed.windows, T), _ragged(V, placed.windows, T), np.concatenate([placed.token_ids, q_ids.numpy()]), lm.fingerprint)

def setup(lm, text, n=448, span=48, ncont=32):
    ids = tokenize(lm.tokenizer, load_text(text))
    ctx, cont = ids[:n], ids[n:n+ncont]
    a = n // 3
    cache = capture(lm, token_ids=ctx)
    edited = np.concatenate([ctx[:a], ctx[a+span:]])
    fresh = capture(lm, token_ids=edited)
    ref = continue_logits(lm, fresh, cont)
    freqs = layer_inv_freqs(lm)
    kept = _pieces(cache, [(a, a+span)])
    (a0,b0),(a1,b1) = kept
    chunks = [_piece(cache, a0, b0, freqs), _piece(cache, a1, b1-1, freqs)]
    return dict(cache=cache, fresh=fresh, ref=ref, cont=cont, chunks=chunks, q=cache.token_ids[b1-1:b1], a=a, n_ctx=n-span-1)

def kl(lm, S, c):
    return float(compare_logits(S["ref"], continue_logits(lm, c, S["cont"]), S["cont"])["kl_mean"])
