# ruff: noqa  (a one-off probe kept as it ran; see README.md)
import sys; import os; sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sel import *
lm = load_model(sys.argv[1])
texts = sys.argv[2].split(",")
L = lm.fingerprint.num_layers
for t in texts:
    S = setup(lm, t)
    a, n_ctx = S["a"], S["n_ctx"]
    # oracle deviation: ratio-0 child vs fresh, per token, per layer normalised
    c0 = repair(lm, S["chunks"], S["q"], 1, lambda d, n: [])
    true = np.zeros(n_ctx)
    for li in range(L):
        d = (c0.keys[li][:, :n_ctx].float() - S["fresh"].keys[li][:, :n_ctx].float()).pow(2).sum((0,2)) + (c0.values[li][:, :n_ctx].float() - S["fresh"].values[li][:, :n_ctx].float()).pow(2).sum((0,2))
        true += (d / d.sum().clamp_min(1e-12)).numpy()
    res = {"r0": kl(lm, S, c0)}
    for r in (0.05, 0.1, 0.2):
        k = int(round(r * n_ctx))
        top = lambda d, n: np.argsort(-d)[:k]
        res[f"L1 {r}"] = kl(lm, S, repair(lm, S["chunks"], S["q"], 1, top))
        res[f"L3 {r}"] = kl(lm, S, repair(lm, S["chunks"], S["q"], 3, top))
        res[f"band {r}"] = kl(lm, S, repair(lm, S["chunks"], S["q"], 1, lambda d, n: np.arange(a, a + k)))
        res[f"oracle {r}"] = kl(lm, S, repair(lm, S["chunks"], S["q"], 1, lambda d, n: np.argsort(-true)[:k]))
    print(t, {k: round(v, 4) for k, v in res.items()}, flush=True)
    print("  oracle top tokens:", np.argsort(-true)[:20].tolist(), "a=", a)
