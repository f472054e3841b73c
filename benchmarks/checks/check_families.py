"""Which transformers families kvcodec onboards: one tiny random model per family, through the paths a user gets.

For each family: a 2-layer random model saved as a local HF directory (the embedded model's tokenizer), then

* ``lossless``: ``encode_cache`` and ``kvcodec.open`` round trip, bit for bit;
* ``ask``: ``KnowledgeBase.ask`` twice on a lossless store: the second answer comes from the store and equals the first;
* ``balanced``: the first lossy encode (calibration, a short rate-model fit, then the encode): its bits per stored
  element, or the one line it was refused with; and which layers the calibration weighed evenly (``even_weights``);
* ``default ask``: where a ``KnowledgeBase`` with the default preset answered the second time from.

Random weights say nothing about quality: this is a map of what works, not of how well. The builds are cut short
(one calibration text at the minimum context, one fit text at 256 tokens), as in tests/models/test_model_families.py.

    OMP_NUM_THREADS=1 python benchmarks/checks/check_families.py [FAMILY ...] > out.txt

Writes calibrations and rate models of the random models under the kvcodec cache (``KVCODEC_CACHE`` to move it).
"""

from __future__ import annotations

import functools
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=49152, max_position_embeddings=1024)
FAMILIES = {
    "llama": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "llama3-rope": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen2_moe": dict(model_type="qwen2_moe", num_attention_heads=4, num_key_value_heads=2, num_experts=2,
                      num_experts_per_tok=1, moe_intermediate_size=64, shared_expert_intermediate_size=64),
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=1, sliding_window=48, head_dim=32),
    "mixtral": dict(model_type="mixtral", num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                    num_experts_per_tok=1),
    "gemma": dict(model_type="gemma", num_attention_heads=4, num_key_value_heads=1, head_dim=32),
    "gemma2": dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=48),
    "gemma3_text": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                        sliding_window=48),
    "phi": dict(model_type="phi", num_attention_heads=4, partial_rotary_factor=0.5),
    "phi3": dict(model_type="phi3", num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5),
    "stablelm": dict(model_type="stablelm", num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.25),
    "granite": dict(model_type="granite", num_attention_heads=4, num_key_value_heads=2, attention_multiplier=0.1,
                    residual_multiplier=0.5, embedding_multiplier=2.0, logits_scaling=4.0),
    "starcoder2": dict(model_type="starcoder2", num_attention_heads=4, num_key_value_heads=2, sliding_window=48),
    "cohere": dict(model_type="cohere", num_attention_heads=4, num_key_value_heads=2),
    "olmo": dict(model_type="olmo", num_attention_heads=4),
    "olmo2": dict(model_type="olmo2", num_attention_heads=4, num_key_value_heads=2),
    "helium": dict(model_type="helium", num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "exaone4": dict(model_type="exaone4", num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "gpt_neox": dict(model_type="gpt_neox", num_attention_heads=4, rotary_pct=0.25),
    "opt": dict(model_type="opt", num_attention_heads=4, ffn_dim=256, word_embed_proj_dim=128),
    "gpt2": dict(model_type="gpt2", n_head=4),
    "falcon": dict(model_type="falcon", num_attention_heads=4, new_decoder_architecture=False, multi_query=True),
    "mpt": dict(model_type="mpt", num_attention_heads=4),
    "bloom": dict(model_type="bloom", n_head=4),
    "gptj": dict(model_type="gptj", n_head=4, rotary_dim=16),
    "codegen": dict(model_type="codegen", n_head=4, rotary_dim=16),
    "gpt_neo": dict(model_type="gpt_neo", num_heads=4, attention_types=[[["global", "local"], 1]], window_size=48,
                    num_layers=2),
}


def _short_builds() -> None:
    from kvcodec.calibration import build
    from kvcodec.onboard import ratefit

    build.build_calibration = functools.partial(build.build_calibration, texts=("mpl2",), context=build.MIN_CONTEXT)
    ratefit.fit_rate_model = functools.partial(ratefit.fit_rate_model, texts=("gpl3",), lengths=(256,))


def check(name: str, d: Path) -> dict[str, str]:
    import kvcodec
    from kvcodec.api import encode_cache
    from kvcodec.calibration.store import load_calibration
    from kvcodec.errors import KvcError
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.load import load_model
    from kvcodec.runtime.knowledge import KnowledgeBase
    from kvcodec.texts import load_text

    row = {"family": name}
    stage = "load"
    try:
        lm = load_model(str(d))
        ids = tokenize(lm.tokenizer, load_text("c-stdio"))[:120]
        stage = "lossless"
        cache = capture(lm, token_ids=ids)
        with kvcodec.open(encode_cache(cache, "lossless", model=lm).data) as r:
            dec = r.read_cache()
        ok = all(torch.equal(a, b) for a, b in zip(dec.keys + dec.values, cache.keys + cache.values))
        row["lossless"] = "bit-exact" if ok else "DIFFERS"
        stage = "ask"
        kb = KnowledgeBase(lm, str(d / "store"), preset="lossless")
        doc = lm.tokenizer.decode(ids)
        a1, a2 = (kb.ask([doc], "What is this?", max_new_tokens=8) for _ in range(2))
        row["ask"] = "store = prefill" if (a2.source, list(a2.answer_ids)) == ("store", list(a1.answer_ids)) else \
            f"DIFFERS ({a1.source}, {a2.source})"
        stage = "balanced"
        try:
            enc = encode_cache(cache, "balanced", model=lm)
            with kvcodec.open(enc.data) as r:
                assert r.verify() == []
            row["balanced"] = f"{enc.bits_per_element:.2f} bits/element"
        except KvcError as exc:
            row["balanced"] = f"refused: {str(exc).splitlines()[0][:110]}"
        cal = load_calibration(lm.fingerprint.id)
        even = cal.meta.get("even_weights") if cal is not None else None
        row["even_weights"] = "-" if cal is None else ("none" if not even else f"k {even['k']}, v {even['v']}")
        stage = "default ask"
        kb2 = KnowledgeBase(lm, str(d / "store-default"))
        kb2.ask([doc], "What is this?", max_new_tokens=8)
        row["default ask"] = kb2.ask([doc], "What is this?", max_new_tokens=8).source
    except KvcError as exc:
        row[stage] = f"KvcError: {str(exc).splitlines()[0][:110]}"
    except Exception as exc:  # noqa: BLE001 - what this check exists to find: a crash is reported, not raised
        row[stage] = f"CRASH {type(exc).__name__}: {str(exc)[:110]}"
    return row


def main(argv: list[str]) -> int:
    import logging
    import platform

    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvcodec.models.load import shipped_model_dir

    logging.disable(logging.WARNING)
    _short_builds()
    names = argv or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        print(f"unknown families {unknown}; known: {', '.join(FAMILIES)}", file=sys.stderr)
        return 2
    tok = shipped_model_dir("smollm2")
    cols = ("family", "lossless", "ask", "balanced", "even_weights", "default ask")
    print(f"# transformers {transformers.__version__}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    with tempfile.TemporaryDirectory() as root:
        for name in names:
            kw = dict(FAMILIES[name])
            cfg = AutoConfig.for_model(kw.pop("model_type"), **SMALL, **kw)
            torch.manual_seed(0)
            np.random.seed(0)
            d = Path(root) / name
            AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tok / f, d / f)
            row = check(name, d)
            print("| " + " | ".join(row.get(c, "") for c in cols) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
