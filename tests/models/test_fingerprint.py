"""Fingerprint v2 without the model: the streamed weights digest, its authenticated cache, strict parsing.

The model-level look-alike tests (every load path) are in test_lookalike.py.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from kvcodec.models import fingerprint as F
from kvcodec.errors import KvcFormatError, KvcModelMismatchError, KvcModelNotFoundError
from kvcodec.core.fingerprint import ModelFingerprint
from kvcodec.digest import json_sha256
from kvcodec.models.fingerprint import cache_config, weights_sha256


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    F._memo.clear()
    F._warned.clear()
    yield
    F._memo.clear()


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"model.layers.{i}.self_attn.{p}.weight": torch.randn(8, 8, generator=g) for i in range(3) for p in ("q_proj", "k_proj")} | {
        "model.norm.weight": torch.ones(8), "model.embed_tokens.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16)}


def _model_dir(path, tensors=None, shards: int = 1):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 2,
                                                 "num_key_value_heads": 1, "hidden_size": 8,
                                                 "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}))
    t = tensors or _tensors()
    if shards == 1:
        save_file(t, str(path / "model.safetensors"))
    else:
        names = sorted(t)
        wm = {}
        for s in range(shards):
            part = {n: t[n] for n in names[s::shards]}
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(path / fn))
            wm.update({n: fn for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    return path


def _offset_of(path, name):
    """Absolute byte offset of tensor ``name`` in a safetensors file."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        hdr = json.loads(f.read(n))
    return 8 + n + hdr[name]["data_offsets"][0]


def _count_hashes(monkeypatch) -> list[int]:
    calls = [0]
    real = F._hash_files

    def counting(files):
        calls[0] += 1
        return real(files)

    monkeypatch.setattr(F, "_hash_files", counting)
    return calls


def test_one_element_anywhere_changes_the_digest(tmp_path):
    base = weights_sha256(_model_dir(tmp_path / "base"))
    seen = {base}
    for name in sorted(_tensors()):
        t = _tensors()
        flat = t[name].view(-1)
        flat[3] = flat[3] + 1  # one element of one tensor
        d = weights_sha256(_model_dir(tmp_path / name, t))
        assert d not in seen, name
        seen.add(d)


def test_digest_ignores_sharding_and_file_order_but_not_names_or_dtype(tmp_path):
    base = weights_sha256(_model_dir(tmp_path / "one"))
    assert weights_sha256(_model_dir(tmp_path / "three", shards=3)) == base
    renamed = {("x." + k if k == "model.norm.weight" else k): v for k, v in _tensors().items()}
    assert weights_sha256(_model_dir(tmp_path / "renamed", renamed)) != base
    t = _tensors()
    t["model.norm.weight"] = t["model.norm.weight"].to(torch.float16)  # same values, other dtype
    assert weights_sha256(_model_dir(tmp_path / "dtype", t)) != base


def test_digest_is_streamed_with_a_bounded_buffer(tmp_path, monkeypatch):
    """The hasher reads through one buffer of _READ_BYTES, never a whole file or tensor at once."""
    monkeypatch.setattr(F, "_READ_BYTES", 64)
    small = weights_sha256(_model_dir(tmp_path / "a"), use_cache=False)
    monkeypatch.setattr(F, "_READ_BYTES", 4 << 20)
    assert weights_sha256(tmp_path / "a", use_cache=False) == small


@pytest.mark.parametrize("case", ["pickle_only", "truncated", "offsets_outside", "header_too_long", "no_weights", "fifo"])
def test_bad_checkpoints_are_one_line_errors(tmp_path, case):
    d = _model_dir(tmp_path / "m")
    st = d / "model.safetensors"
    if case == "pickle_only":
        st.unlink()
        (d / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    elif case == "truncated":
        data = st.read_bytes()
        st.write_bytes(data[: len(data) - 100])
    elif case == "offsets_outside":
        data = st.read_bytes()
        n = int.from_bytes(data[:8], "little")
        hdr = json.loads(data[8 : 8 + n])
        hdr["model.norm.weight"]["data_offsets"] = [0, 1 << 40]
        h = json.dumps(hdr).encode()
        st.write_bytes(len(h).to_bytes(8, "little") + h + data[8 + n :])
    elif case == "header_too_long":
        st.write_bytes((1 << 50).to_bytes(8, "little") + b"{}")
    elif case == "no_weights":
        st.unlink()
    elif case == "fifo":
        st.unlink()
        os.mkfifo(st)
    with pytest.raises(KvcModelNotFoundError) as e:
        weights_sha256(d)
    msg = str(e.value)
    assert "\n" not in msg
    if case == "pickle_only":
        assert "pickle" in msg


def test_cache_hit_rehash_on_change_and_tamper(tmp_path, monkeypatch):
    calls = _count_hashes(monkeypatch)
    d = _model_dir(tmp_path / "m")
    first = weights_sha256(d)
    assert calls[0] == 1
    F._memo.clear()
    assert weights_sha256(d) == first and calls[0] == 1  # the authenticated disk entry, no re-hash

    key = F.cache_root() / "fingerprint.key"
    assert key.stat().st_mode & 0o777 == 0o600 and key.stat().st_size == 32

    # in-place change of one element with the mtime put back: ctime still moves, so it is re-hashed
    st = d / "model.safetensors"
    before = st.stat()
    with open(st, "r+b") as f:
        f.seek(_offset_of(st, "model.norm.weight"))
        f.write(np.float32(2.0).tobytes())
    os.utime(st, ns=(before.st_atime_ns, before.st_mtime_ns))
    F._memo.clear()
    changed = weights_sha256(d)
    assert changed != first and calls[0] == 2

    # a forged cache entry (digest swapped back to the original) fails its MAC and is recomputed
    entry_path = next((F.cache_root() / "fingerprints").glob("*.json"))
    entry = json.loads(entry_path.read_text())
    entry["sha256"] = first
    entry_path.write_text(json.dumps(entry))
    F._memo.clear()
    assert weights_sha256(d) == changed and calls[0] == 3


def test_unsafe_key_file_disables_the_cache(tmp_path, monkeypatch, capsys):
    calls = _count_hashes(monkeypatch)
    d = _model_dir(tmp_path / "m")
    weights_sha256(d)
    key = F.cache_root() / "fingerprint.key"
    key.chmod(0o644)
    F._memo.clear()
    weights_sha256(d)
    assert calls[0] == 2
    assert "fingerprint cache disabled" in capsys.readouterr().err


def test_copied_look_alike_with_preserved_mtime_is_rehashed(tmp_path):
    d = _model_dir(tmp_path / "m")
    first = weights_sha256(d)
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)  # copy2: same size and mtime, other path and inode
    st = copy / "model.safetensors"
    before = st.stat()
    with open(st, "r+b") as f:
        f.seek(_offset_of(st, "model.layers.1.self_attn.k_proj.weight"))
        f.write(np.float32(0.5).tobytes())
    os.utime(st, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert weights_sha256(copy) != first


# --------------------------------------------------------------------------- the record
FP2 = ModelFingerprint("llama", 2, 3, (64, 64), '{"rope_theta": 10000.0, "rope_type": "default"}', "a" * 64, "b" * 64,
                       config_sha256="c" * 64)
FP1 = ModelFingerprint("llama", 2, 3, (64, 64), '{"rope_theta": 10000.0}', "a" * 64, "b" * 64, version=1)


@pytest.mark.parametrize("patch", [
    {"version": 2.0}, {"version": True}, {"version": 3}, {"version": None}, {"num_layers": 2.0}, {"num_layers": True},
    {"head_dims": [64, 64.0]}, {"head_dims": [64, True]}, {"weights_sha256": "B" * 64}, {"config_sha256": ""},
    {"rope": "not json"}, {"rope": "[1]"}, {"architecture": "llama\ud800"}, {"architecture": "a/b"},
])
def test_fingerprint_parsing_is_strict(patch):
    obj = {**FP2.to_json(), **patch}
    if patch.get("version", 0) is None:
        del obj["version"]
    with pytest.raises(KvcFormatError):
        ModelFingerprint.from_json(obj)


def test_v1_parses_but_is_refused_against_a_model():
    j = FP1.to_json()
    assert "config_sha256" not in j  # what v1 writers wrote, byte for byte
    back = ModelFingerprint.from_json(json.loads(json.dumps(j)))
    assert back == FP1 and back.id == FP1.id
    assert not FP2.same_model(FP1)
    with pytest.raises(KvcModelMismatchError, match="version-1 .*re-encode"):
        FP2.check_compatible(FP1, what=".kvc file")
    assert ModelFingerprint.from_json(FP2.to_json()) == FP2
    FP2.check_compatible(FP2)


def test_v2_mismatch_names_the_field():
    other = ModelFingerprint(**{**FP2.to_json(), "head_dims": (64, 64), "weights_sha256": "d" * 64})
    with pytest.raises(KvcModelMismatchError, match="weights_sha256"):
        FP2.check_compatible(other)


def test_config_fields_that_change_the_cache_change_config_sha(tmp_path):
    base = {"model_type": "gemma3_text", "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "hidden_size": 64, "sliding_window": 512,
            "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
                                "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
            "attention_bias": False, "transformers_version": "5.0", "use_cache": True}
    ref = json_sha256(cache_config(base))
    assert json_sha256(cache_config({**base, "transformers_version": "4.9", "use_cache": False})) == ref
    variants = [
        {"sliding_window": 1024},
        {"layer_types": ["sliding_attention"] * 3 + ["sliding_attention"]},
        {"rope_parameters": {**base["rope_parameters"], "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 4.0}}},
        {"rope_parameters": {**base["rope_parameters"], "sliding_attention": {"rope_theta": 2e4, "rope_type": "default"}}},
        {"num_key_value_heads": 4}, {"head_dim": 32}, {"attention_bias": True},
    ]
    for v in variants:
        assert json_sha256(cache_config({**base, **v})) != ref, v
    legacy = {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", "factor": 8.0}}
    assert cache_config(legacy)["rope"] == {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}
    assert cache_config({"rope_theta": 1e4})["rope"] == {"rope_theta": 1e4, "rope_type": "default"}


def test_info_marks_a_v1_file(capsys):
    """`kvc info` still shows a v1 file (golden vector) and says models refuse it."""
    from pathlib import Path

    from cliutil import run_kvc

    path = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "kvc" / "f16_raw_chunked.kvc"
    code, out, err = run_kvc(["info", str(path)], capsys)
    assert code == 0, err
    assert "fingerprint v1" in out and "re-encode" in out
    code, out, err = run_kvc(["info", str(path), "--json"], capsys)
    assert json.loads(out)["model"]["fingerprint_version"] == 1


@pytest.mark.parametrize("case", ["pickle_only", "truncated"])
def test_load_model_refuses_bad_checkpoints_before_transformers_reads_them(tmp_path, case, monkeypatch):
    from kvcodec.models.load import load_model

    d = _model_dir(tmp_path / "m")
    st = d / "model.safetensors"
    if case == "pickle_only":
        st.unlink()
        (d / "pytorch_model.bin").write_bytes(b"\x80\x04 a pickle would run code here")
    else:
        st.write_bytes(st.read_bytes()[:200])
    import transformers

    def never(*a, **kw):  # the checkpoint must be refused before transformers opens it
        raise AssertionError("transformers was asked to load a refused checkpoint")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    with pytest.raises(KvcModelNotFoundError) as e:
        load_model(str(d))
    assert "\n" not in str(e.value)
