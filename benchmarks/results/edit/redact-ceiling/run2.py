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
    raw = np.zeros(n_ctx); rel = np.zeros(n_ctx)
    for li in range(L):
        d = ((c0.keys[li][:, :n_ctx].float() - S["fresh"].keys[li][:, :n_ctx].float()).pow(2).sum((0,2)) + (c0.values[li][:, :n_ctx].float() - S["fresh"].values[li][:, :n_ctx].float()).pow(2).sum((0,2))).numpy()
        raw += d
    res = {}
    for r in (0.05, 0.1, 0.2, 0.4):
        k = int(round(r * n_ctx))
        res[f"exact-top {r}"] = kl(lm, S, patched(c0, S["fresh"], np.argsort(-raw)[:k]))
        res[f"exact-band {r}"] = kl(lm, S, patched(c0, S["fresh"], np.arange(a, a+k)))
    res["exact-all-suffix"] = kl(lm, S, patched(c0, S["fresh"], np.arange(a, n_ctx)))
    print(t, {k: round(v, 4) for k, v in res.items()}, flush=True)
    print("  top raw:", np.argsort(-raw)[:15].tolist(), np.sort(raw)[::-1][:15].round(0).tolist())
