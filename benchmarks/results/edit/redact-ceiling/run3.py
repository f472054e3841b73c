# ruff: noqa  (a one-off probe kept as it ran; see README.md)
import sys; import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sel import *
lm = load_model(sys.argv[1])
texts = sys.argv[2].split(",")
L = lm.fingerprint.num_layers
def patched(c0, fresh, idx):
    K = [k.clone() for k in c0.keys]; V = [v.clone() for v in c0.values]
    for li in range(L):
        K[li][:, idx] = fresh.keys[li][:, idx].to(K[li].dtype); V[li][:, idx] = fresh.values[li][:, idx].to(V[li].dtype)
    return KVCache(K, V, c0.token_ids, c0.fingerprint)
for t in texts:
    S = setup(lm, t)
    a, n_ctx = S["a"], S["n_ctx"]
    c0 = repair(lm, S["chunks"], S["q"], 1, lambda d, n: [])
    ids = np.concatenate([S["fresh"].token_ids, S["cont"]])
    lm.model.set_attn_implementation("eager")
    with torch.inference_mode():
        out = lm.model(input_ids=torch.as_tensor(ids)[None], output_attentions=True)
    lm.model.set_attn_implementation("sdpa")
    N = len(S["fresh"].token_ids)
    w_cont = sum(at[0, :, N:, :n_ctx].float().mean((0, 1)) for at in out.attentions).numpy()  # from cont queries
    w_self = sum(at[0, :, :N, :n_ctx].float().sum(1).mean(0) for at in out.attentions).numpy()  # from context queries
    res = {}
    dev = np.zeros(n_ctx)
    for li in range(L):
        dev += ((c0.keys[li][:, :n_ctx].float() - S["fresh"].keys[li][:, :n_ctx].float()).pow(2).sum((0,2)) + (c0.values[li][:, :n_ctx].float() - S["fresh"].values[li][:, :n_ctx].float()).pow(2).sum((0,2))).numpy()
    suffix = np.arange(n_ctx) >= a
    for r in (0.05, 0.1, 0.2):
        k = int(round(r * n_ctx))
        for nm, sc in (("wcont", w_cont), ("wcont*dev", w_cont*dev), ("wself", w_self), ("wself*dev", w_self*dev)):
            sc = np.where(suffix, sc, -1)
            res[f"{nm} {r}"] = kl(lm, S, patched(c0, S["fresh"], np.argsort(-sc)[:k]))
    print(t, {k: round(v, 4) for k, v in res.items()}, flush=True)
    print("  top wcont suffix:", np.argsort(-np.where(suffix, w_cont, -1))[:12].tolist())
