"""Fine-tuned look-alikes are refused on every load path (issue 14, model identity).

Each look-alike is the embedded model's HF directory copied to tmp with ONE
element of ONE weight tensor changed — same shapes, config and tokenizer, so
only an exact weights fingerprint tells it apart. Each must be refused by
`kvc eval`, the HF loader, the store / `ask`, blend, and the vLLM connector's
identity check, for a cache made by the original model. One look-alike
directory exists at a time (module fixture per variant).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from cliutil import run_kvc
from kvcodec.models.cachelayout import cache_for_model
from kvcodec.errors import KvcModelMismatchError

pytestmark = pytest.mark.model

VARIANTS = {
    "mlp": "model.layers.7.mlp.down_proj.weight",
    "q_proj": "model.layers.0.self_attn.q_proj.weight",
    "mid_k_proj": "model.layers.15.self_attn.k_proj.weight",
    "embedding": "model.embed_tokens.weight",
}
DOC = "The GNU General Public License is a free, copyleft license for software and other kinds of works."
QUESTION = "What kind of license is it?"


@pytest.fixture(scope="module", autouse=True)
def private_cache(lm, tmp_path_factory):
    """Fingerprint-cache entries of the look-alikes go to a private cache dir (after ``lm`` is loaded)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KVCODEC_CACHE", str(tmp_path_factory.mktemp("kvc-cache")))
    yield
    mp.undo()


def _offset_of(path: Path, name: str) -> tuple[int, str]:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        hdr = json.loads(f.read(n))
    return 8 + n + hdr[name]["data_offsets"][0], hdr[name]["dtype"]


@pytest.fixture(scope="module")
def base(lm, gpl3_ids, tmp_path_factory):
    """What the original model made: a lossless .kvc, a store entry for DOC, a chunk cache."""
    from kvcodec.models.capture import capture
    from kvcodec.format import write_kvc
    from kvcodec.plan.presets import get_plan
    from kvcodec.runtime.knowledge import KnowledgeBase

    d = tmp_path_factory.mktemp("base")
    cache = capture(lm, token_ids=gpl3_ids[:32])
    plan = get_plan("lossless", cache)
    write_kvc(cache, d / "base.kvc", plan.pipelines, preset=plan.preset)
    kb = KnowledgeBase(lm, store=str(d / "store"), preset="lossless")
    first = kb.ask([DOC], QUESTION, max_new_tokens=1)
    assert first.source == "prefill" and first.stored is not None
    ids, _ = kb.context_ids([DOC])
    again = kb.ask([DOC], QUESTION, max_new_tokens=1, store_new=False)
    assert again.source == "store"  # positive control: the original model does use its entry
    return {"dir": d, "kvc": d / "base.kvc", "cache": cache, "store": str(d / "store"), "ids": ids,
            "entry": kb.store.get(kb.key(ids)), "chunk": capture(lm, token_ids=kb.doc_ids(DOC))}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def lookalike(request, lm, tmp_path_factory):
    """The embedded model with one element of VARIANTS[param] changed, loaded from its own directory."""
    from kvcodec.models.load import load_model

    d = tmp_path_factory.mktemp(f"lookalike-{request.param}") / "model"
    shutil.copytree(lm.path, d)
    st = d / "model.safetensors"
    off, dtype = _offset_of(st, VARIANTS[request.param])
    assert dtype == "F32"
    with open(st, "r+b") as f:
        f.seek(off + 4 * 5)  # element 5 of the tensor
        x = np.frombuffer(f.read(4), np.float32)[0]
        f.seek(off + 4 * 5)
        f.write(np.float32(x + 0.01 * max(abs(float(x)), 1e-3)).tobytes())
    vlm = load_model(str(d))
    yield vlm
    del vlm
    shutil.rmtree(d.parent, ignore_errors=True)


def test_only_the_weights_digest_differs(lookalike, lm):
    a, b = lm.fingerprint, lookalike.fingerprint
    assert a.id != b.id and a.weights_sha256 != b.weights_sha256
    assert (a.config_sha256, a.tokenizer_sha256, a.rope, a.head_dims) == (b.config_sha256, b.tokenizer_sha256, b.rope, b.head_dims)


def test_eval_refuses(lookalike, base, capsys):
    code, out, err = run_kvc(["eval", str(base["kvc"]), "--text", "gpl3", "--continuation", "4", "--greedy-tokens", "0",
                              "--model", str(lookalike.path)], capsys)
    assert code == 4, err
    assert "different model" in err and "weights_sha256" in err and err.count("\n") == 1


def test_hf_loader_refuses(lookalike, base):
    from kvcodec.integrations.hf import load_cache

    with pytest.raises(KvcModelMismatchError, match="weights_sha256"):
        load_cache(str(base["kvc"]), lookalike)
    with pytest.raises(KvcModelMismatchError):
        cache_for_model(lookalike, base["cache"])


def test_store_and_ask_never_use_the_originals_entry(lookalike, base):
    from kvcodec.runtime.knowledge import KnowledgeBase

    kb = KnowledgeBase(lookalike, store=base["store"], preset="lossless")
    ans = kb.ask([DOC], QUESTION, max_new_tokens=1, store_new=False)
    assert ans.source == "prefill" and ans.cached_tokens == 0  # different model id: a miss
    # the original's entry planted under the look-alike's own key is refused, never loaded as KV
    kb.store.put(kb.key(base["ids"]), base["entry"], {"preset": "lossless", "tokens": int(len(base["ids"]))})
    try:
        forged = kb.ask([DOC], QUESTION, max_new_tokens=1, store_new=False)
    except KvcModelMismatchError:
        return
    assert forged.source == "prefill" and forged.cached_tokens == 0


def test_blend_refuses(lookalike, base):
    from kvcodec.runtime.blend import blend
    from kvcodec.runtime.knowledge import KnowledgeBase

    q = np.asarray(lookalike.tokenizer(QUESTION)["input_ids"])
    with pytest.raises(KvcModelMismatchError):
        blend(lookalike, [base["chunk"]], q)
    # and through the store: the original's chunk entry under the look-alike's key
    from kvcodec.format import encode_kvc_bytes
    from kvcodec.plan.presets import get_plan

    kb = KnowledgeBase(lookalike, store=base["store"], preset="lossless")
    chunk = base["chunk"]
    plan = get_plan("lossless", chunk)
    kb.store.put(kb.key(chunk.token_ids), encode_kvc_bytes(chunk, plan.pipelines, preset=plan.preset),
                 {"preset": "lossless", "tokens": int(chunk.num_tokens)})
    try:
        got = kb.chunk_cache(chunk.token_ids)
    except KvcModelMismatchError:
        return
    assert got is None


def test_vllm_identity_check_refuses(lookalike, lm, base):
    from kvcodec.format import KvcReader
    from kvcodec.integrations.vllm.config import fingerprint_from_dir
    from kvcodec.integrations.vllm.entries import check_entry

    fp = fingerprint_from_dir(lookalike.path)
    assert fp.id == lookalike.fingerprint.id and fp.id != lm.fingerprint.id
    ids = [int(x) for x in base["cache"].token_ids]
    with KvcReader(str(base["kvc"])) as r:
        why = check_entry(r, fp, ids, 0, len(ids))
        assert why is not None and "another model" in why
        assert check_entry(r, lm.fingerprint, ids, 0, len(ids)) is None  # positive control


# --------------------------------------------------------------------------- v1 files and the directory fingerprint
def test_directory_fingerprint_equals_loaded_model_and_vllm(lm):
    from kvcodec.integrations.vllm.config import fingerprint_from_dir

    assert fingerprint_from_dir(lm.path) == lm.fingerprint
    assert lm.fingerprint.version == 2


def test_v1_files_decode_standalone_but_are_refused_against_the_model(lm, capsys):
    """spec/vectors holds a real SmolLM2 .kvc written with a version-1 fingerprint."""
    from kvcodec.format import KvcReader
    from kvcodec.integrations.hf import load_cache

    path = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "kvc" / "smollm2_8tok_f16_lossless.kvc"
    with KvcReader(str(path)) as r:
        assert r.fingerprint.version == 1
        assert r.read_cache().num_tokens == 8  # standalone decode still works
    with pytest.raises(KvcModelMismatchError, match="version-1.*re-encode"):
        load_cache(str(path), lm)
    code, out, err = run_kvc(["eval", str(path), "--text", "gpl3", "--continuation", "4", "--greedy-tokens", "0"], capsys)
    assert code == 4 and "re-encode" in err
    code, out, err = run_kvc(["info", str(path)], capsys)
    assert code == 0, err


def test_original_is_accepted_by_eval(base, capsys):
    """Positive control for test_eval_refuses: the same file and command with the original model."""
    code, out, err = run_kvc(["eval", str(base["kvc"]), "--text", "gpl3", "--continuation", "4", "--greedy-tokens", "0",
                              "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["kl_mean"] == 0.0


def test_tokenizer_digest_is_cached_and_follows_the_tokenizer_files(lm, tmp_path, monkeypatch):
    """A directory with the real tokenizer (tiny weights): the second fingerprint neither loads nor hashes it."""
    import torch
    from safetensors.torch import save_file

    from kvcodec.models import fingerprint as F

    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "m"
    d.mkdir()
    for n in F.TOKENIZER_FILES + ("config.json",):
        if (lm.path / n).is_file():
            shutil.copy(lm.path / n, d / n)
    save_file({"w": torch.zeros(4)}, str(d / "model.safetensors"))
    calls = [0]
    real = F.tokenizer_sha256

    def counting(tok):
        calls[0] += 1
        return real(tok)

    monkeypatch.setattr(F, "tokenizer_sha256", counting)
    first = F.fingerprint_dir(d)
    assert first.tokenizer_sha256 == lm.fingerprint.tokenizer_sha256 and calls[0] == 1
    F._memo.clear()
    assert F.fingerprint_dir(d) == first and calls[0] == 1
    tj = json.loads((d / "tokenizer.json").read_text())
    tj["model"]["merges"] = tj["model"]["merges"][:-1]  # one merge fewer: another tokenizer
    (d / "tokenizer.json").write_text(json.dumps(tj))
    F._memo.clear()
    assert F.fingerprint_dir(d).tokenizer_sha256 != first.tokenizer_sha256 and calls[0] == 2
