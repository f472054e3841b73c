"""Run NVIDIA kvpress presses on one context and report which tokens each keeps (runs in .venv-kvpress).

A standalone script, not part of the kvcodec package's import graph: kvpress
0.5.5 pins ``transformers<5.3``, so it lives in its own venv
(``.ci/kvpress.sh``) that holds torch + transformers + kvpress and nothing of
kvcodec. :mod:`kvcodec.eval.peers` runs it as a subprocess::

    .venv-kvpress/bin/python kvcodec/eval/kvpress_runner.py MODEL_DIR IDS.npy OUT.npz PRESS:RATIO ...

A press only decides *which* KV entries stay; the kept entries are the
prefill's own keys and values (the press hook prunes the cache after each
layer's attention has run on the full context). So the script prefills the
context under the press exactly as kvpress's pipeline does, records the
indices the press's own ``score`` + top-k chose in every layer and head, checks
that the pruned cache kvpress left behind is the unpressed prefill gathered at
those indices, and writes the indices (int32 [layers, kv_heads, kept]) to
``OUT.npz`` under ``PRESS:RATIO``. kvcodec then gathers its own exact capture
at these indices and evaluates that cache with its usual evaluator, so kvpress
rows are measured on the same cache and by the same code as every other row.
The output is plain ``.npy`` arrays, read with ``allow_pickle=False``.
"""

from __future__ import annotations

import sys

PRESSES = ("expected_attention", "snapkv", "observed_attention", "knorm", "tova", "streaming_llm")


def _press(name: str, ratio: float):
    import kvpress

    cls = {"expected_attention": kvpress.ExpectedAttentionPress, "snapkv": kvpress.SnapKVPress,
           "observed_attention": kvpress.ObservedAttentionPress, "knorm": kvpress.KnormPress,
           "tova": kvpress.TOVAPress, "streaming_llm": kvpress.StreamingLLMPress}[name]
    return cls(compression_ratio=ratio)


def main(argv: list[str]) -> int:
    import numpy as np
    import torch
    from kvpress.presses.scorer_press import ScorerPress
    from kvpress.utils import compute_n_kept  # the helper ScorerPress.compress uses
    from transformers import AutoModelForCausalLM, DynamicCache

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # stderr carries only a failure's one line, not progress bars
    hf_logging.disable_progress_bar()
    model_dir, ids_path, out_path, *specs = argv
    torch.set_num_threads(1)
    ids = torch.as_tensor(np.load(ids_path, allow_pickle=False).astype(np.int64))[None]
    out: dict[str, np.ndarray] = {}
    models: dict[str, object] = {}
    exact: dict[str, list] = {}
    for spec in specs:
        name, ratio = spec.split(":")
        attn = "eager" if name == "observed_attention" else "sdpa"  # ObservedAttention reads the attention weights
        if attn not in models:
            models[attn] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=attn).eval()
            with torch.inference_mode():
                c = DynamicCache()
                models[attn](input_ids=ids, past_key_values=c, use_cache=True)
                exact[attn] = [(l.keys.clone(), l.values.clone()) for l in c.layers]
        model = models[attn]
        press = _press(name, float(ratio))
        assert isinstance(press, ScorerPress)
        kept: dict[int, torch.Tensor] = {}
        score = press.score

        def recording_score(module, hidden_states, keys, values, attentions, kwargs, _score=score, _kept=kept, _press=press):
            s = _score(module, hidden_states, keys, values, attentions, kwargs)
            n_kept = compute_n_kept(keys.shape[2], _press.compression_ratio)
            _kept[module.layer_idx] = s.topk(n_kept, dim=-1).indices[0]  # what ScorerPress.compress keeps
            return s

        press.score = recording_score
        cache = DynamicCache()
        with torch.inference_mode(), press(model):
            model(input_ids=ids, past_key_values=cache, use_cache=True)
        idx = torch.stack([kept[i] for i in range(len(cache.layers))])  # [L, H, kept]
        for i, layer in enumerate(cache.layers):  # the pruned cache is the prefill gathered at the recorded indices
            g = idx[i][..., None].expand(-1, -1, layer.keys.shape[-1])
            ek, ev = exact[attn][i]
            if not (torch.equal(layer.keys[0], ek[0].gather(1, g)) and torch.equal(layer.values[0], ev[0].gather(1, g))):
                print(f"kvpress_runner: {spec}: layer {i}: the pruned cache is not the prefill at the recorded indices",
                      file=sys.stderr)
                return 2
        out[spec] = np.sort(idx.numpy(), axis=-1).astype(np.int32)
    np.savez(out_path, **out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
