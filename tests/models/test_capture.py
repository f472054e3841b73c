"""Issue 2: capture real KV, write/read it, continue from it, refuse other models."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from kvcodec.models.cachelayout import cache_for_model
from kvcodec.models.capture import capture, prefill, select_context
from kvcodec.errors import KvcError, KvcFormatError, KvcInputError, KvcModelMismatchError
from kvcodec.core.fingerprint import ModelFingerprint
from kvcodec.core.kvcache import KVCache, load_capture, load_h5, save_capture, save_h5

from cliutil import run_kvc as run_cli  # noqa: E402

pytestmark = pytest.mark.model


@pytest.mark.parametrize("suffix", [".h5", ".safetensors"])
def test_capture_file_continues_like_full_prefill(lm, gpl3_ids, tmp_path, suffix):
    """KV written to disk, loaded back into a DynamicCache and continued == one full prefill."""
    n_ctx, n_cont = 96, 24
    cache = capture(lm, token_ids=gpl3_ids[:n_ctx])
    path = tmp_path / f"cap{suffix}"
    save_capture(cache, path)
    back = load_capture(path)
    assert back.fingerprint == cache.fingerprint
    assert np.array_equal(back.token_ids, gpl3_ids[:n_ctx])
    for a, b in zip(cache.keys + cache.values, back.keys + back.values):
        assert a.dtype == b.dtype and torch.equal(a, b)

    _, full_logits = prefill(lm, gpl3_ids[: n_ctx + n_cont], logits_to_keep=0)
    with torch.inference_mode():
        out = lm.model(
            input_ids=torch.as_tensor(gpl3_ids[n_ctx : n_ctx + n_cont]).unsqueeze(0),
            past_key_values=cache_for_model(lm, back),
            use_cache=True,
        )
    diff = (out.logits[0] - full_logits[n_ctx:]).abs().max().item()
    assert diff <= 1e-4, diff


def test_cli_capture_writes_h5(tmp_path, capsys):
    text = tmp_path / "doc.txt"
    text.write_text(Path("/usr/share/common-licenses/Apache-2.0").read_text())
    out = tmp_path / "c.h5"
    code, stdout, _ = run_cli(["capture", "--text", str(text), "--max-tokens", "40", "-o", str(out), "--json"], capsys)
    assert code == 0
    info = json.loads(stdout)
    assert info["tokens"] == 40 and info["layers"] == 30 and info["kv_heads"] == 3 and info["head_dim"] == 64
    with h5py.File(out) as f:
        assert f["layers/0/key"].shape == (3, 40, 64)
        assert f["token_ids"].shape == (40,)
        assert json.loads(f.attrs["fingerprint"])["num_layers"] == 30


def test_capture_refuses_a_different_model(lm, other_lm, small_cache, tmp_path):
    other = other_lm
    assert not other.fingerprint.same_model(lm.fingerprint)
    fp_o, fp_l = other.fingerprint, lm.fingerprint
    assert (fp_o.num_layers, fp_o.num_kv_heads, fp_o.head_dims) == (fp_l.num_layers, fp_l.num_kv_heads, fp_l.head_dims)
    save_h5(small_cache, tmp_path / "c.h5")
    cache = load_h5(tmp_path / "c.h5")
    with pytest.raises(KvcModelMismatchError, match="different model"):
        cache_for_model(other, cache)
    cache_for_model(lm, cache)  # the right model is accepted


def test_fingerprint_is_stable_and_json_roundtrips(lm):
    from kvcodec.models.fingerprint import fingerprint_dir, fingerprint_model

    again = fingerprint_dir(lm.path, lm.tokenizer)
    assert again == lm.fingerprint and again.id == lm.fingerprint.id
    # the same weights known only in memory get their own (stable) id, never the directory's
    mem = fingerprint_model(lm.model, lm.tokenizer)
    assert mem == fingerprint_model(lm.model, lm.tokenizer) and mem.id != lm.fingerprint.id
    assert ModelFingerprint.from_json(json.loads(json.dumps(lm.fingerprint.to_json()))) == lm.fingerprint
    with pytest.raises(KvcFormatError):
        ModelFingerprint.from_json({"architecture": "llama"})


def test_select_context_checks_lengths():
    ids = np.arange(10)
    assert len(select_context(ids, 4, min_follow=6)) == 4
    with pytest.raises(KvcInputError, match="only 10 tokens"):
        select_context(ids, 8, min_follow=3)
    with pytest.raises(KvcInputError):
        select_context(ids, 0)


def _bad_h5(path: Path, small_cache: KVCache, mutate) -> Path:
    save_h5(small_cache, path)
    with h5py.File(path, "r+") as f:
        mutate(f)
    return path


@pytest.mark.parametrize(
    "case",
    ["missing", "empty_text", "too_short", "garbage_h5", "wrong_shape", "missing_layer", "bad_fingerprint"],
)
def test_bad_inputs_give_one_line_errors(case, tmp_path, capsys, small_cache):
    """Every bad input: a KvcError subclass, a one-line message, a non-zero exit, no traceback."""
    text = tmp_path / "t.txt"
    text.write_text("A few words only.")
    h5 = tmp_path / "bad.h5"
    if case == "missing":
        args = ["capture", "--text", str(tmp_path / "nope.txt"), "-o", str(tmp_path / "o.h5")]
    elif case == "empty_text":
        text.write_text("  \n")
        args = ["capture", "--text", str(text), "-o", str(tmp_path / "o.h5")]
    elif case == "too_short":
        args = ["capture", "--text", str(text), "--max-tokens", "5000", "-o", str(tmp_path / "o.h5")]
    else:
        if case == "garbage_h5":
            h5.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\x00" * 100)
        elif case == "wrong_shape":
            def mutate(f):
                del f["layers/3/key"]
                f["layers/3"].create_dataset("key", data=np.zeros((3, 7, 64), np.float32))
            _bad_h5(h5, small_cache, mutate)
        elif case == "missing_layer":
            _bad_h5(h5, small_cache, lambda f: f["layers"].__delitem__("29"))
        elif case == "bad_fingerprint":
            _bad_h5(h5, small_cache, lambda f: f.attrs.__setitem__("fingerprint", "{not json"))
        with pytest.raises(KvcError) as exc:
            load_h5(h5)
        assert "\n" not in str(exc.value)
        return
    code, _, err = run_cli(args, capsys)
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvc: error: "), err
    assert "Traceback" not in err


@pytest.mark.parametrize("suffix", [".h5", ".safetensors"])
@pytest.mark.parametrize("window", [16, None])
def test_capture_file_keeps_the_observed_importance(lm, gpl3_ids, tmp_path, suffix, window):
    """The token importance the capture's prefill observed rides in the file (issue 53: `kvc capture` then
    `kvc encode` ran a second forward pass over the context to recompute it); a file without it loads as before."""
    cache = capture(lm, token_ids=gpl3_ids[:48], score_window=window or 48)
    if window is None:  # every query observed: the file's window code 0
        cache.attention = type(cache.attention)(None, cache.attention.scores)
    path = tmp_path / f"cap{suffix}"
    save_capture(cache, path)
    back = load_capture(path)
    assert back.attention is not None and back.attention.window == window
    assert np.array_equal(back.attention.scores, cache.attention.scores)
    cache.attention = None
    save_capture(cache, tmp_path / f"plain{suffix}")
    assert load_capture(tmp_path / f"plain{suffix}").attention is None


def test_capture_file_with_hostile_importance_is_one_line(lm, gpl3_ids, tmp_path):
    """Scores of the wrong shape, negative or non-finite, of an integer dtype, or without a valid window code, are
    refused in one line before a cache is built."""
    cache = capture(lm, token_ids=gpl3_ids[:24], score_window=8)
    good = tmp_path / "good.h5"
    save_capture(cache, good)
    cases = {
        "shape": lambda f: (f.__delitem__("attention_scores"), f.create_dataset("attention_scores", data=np.ones((30, 23)))),
        "negative": lambda f: f["attention_scores"].__setitem__((0, 0), -1.0),
        "nan": lambda f: f["attention_scores"].__setitem__((1, 2), np.nan),
        "integers": lambda f: (f.__delitem__("attention_scores"),
                               f.create_dataset("attention_scores", data=np.ones((30, 24), np.uint16))),
        "window": lambda f: f.attrs.__setitem__("attention_window", -3),
        "no window": lambda f: f.attrs.__delitem__("attention_window"),
    }
    for name, mutate in cases.items():
        bad = tmp_path / f"{name.replace(' ', '_')}.h5"
        bad.write_bytes(good.read_bytes())
        with h5py.File(bad, "r+") as f:
            mutate(f)
        with pytest.raises(KvcFormatError, match="attention"):
            load_capture(bad)


def test_cli_capture_then_encode_runs_one_forward_pass(tmp_path, capsys, monkeypatch):
    """`kvc capture` observes the importance the default lossy preset reads, and `kvc encode` of its file plans with
    it: the model never runs inside the encode, and the file is the one that recomputing the importance gives."""
    import kvcodec.models.importance as importance

    text = tmp_path / "doc.txt"
    text.write_text(Path("/usr/share/common-licenses/Apache-2.0").read_text())
    cap = tmp_path / "c.h5"
    code, stdout, err = run_cli(["capture", "--text", str(text), "--max-tokens", "600", "-o", str(cap), "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["attention_window"] is not None

    def no_forward(*a, **k):
        raise AssertionError("the encode ran a forward pass over the context")

    with monkeypatch.context() as m:
        m.setattr(importance, "_tapped_scores", no_forward)
        m.setattr(importance, "attention_importance", no_forward)
        code, _, err = run_cli(["encode", str(cap), "-o", str(tmp_path / "a.kvc"), "--preset", "balanced", "-m", "smollm2"], capsys)
        assert code == 0, err
    plain = load_capture(cap)
    plain.attention = None  # what a capture file without the scores gives: the encoder recomputes them
    save_capture(plain, tmp_path / "plain.h5")
    code, _, err = run_cli(["encode", str(tmp_path / "plain.h5"), "-o", str(tmp_path / "b.kvc"), "--preset", "balanced",
                            "-m", "smollm2"], capsys)
    assert code == 0, err
    assert (tmp_path / "a.kvc").stat().st_size == pytest.approx((tmp_path / "b.kvc").stat().st_size, rel=0.01)
