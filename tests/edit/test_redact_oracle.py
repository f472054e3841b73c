"""An oracle for "what a redaction removes is gone from everything it writes" (spec/kvc-v1.md §4.5).

A unique secret is planted in a real held-out text, redacted by its text through each way a redaction is made
(the library, ``kvc edit redact``, an edit of a stored entry), and every byte the redaction wrote or answered is
scanned: the child file, the CLI's output directory (no temporary file left beside the child) and its ``--json``
answer, the files the store wrote or changed, and the child's store metadata. Nothing may hold

* the secret as text (UTF-8, UTF-16), nor the decoded child's text (nor a stray byte of a character there);
* the secret's token ids (as the parent spelled them, and as the secret alone tokenizes; two or more) as
  int16/32/64;
* a digest of the parent (its file, its token ids, its store key) or its store key itself;
* the parent's K/V rows (``raw`` preset, so rows are stored as they are) of the removed tokens, or of the kept
  tokens after them, which were computed attending to the secret (layers past the first, whose values depend on
  the token id alone).

Byte needles shorter than :data:`MIN_NEEDLE` are left out (any megabyte of tensors holds them by chance).

The secrets include the two shapes that survived until this file's commit: a join that spells the secret again
(``8264`` out of ``82826464``) and a rare character spelled by several byte tokens (``龘``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from kvcodec.format import KvcReader
from tests._support.cliutil import run_kvc

pytestmark = pytest.mark.model

MIN_NEEDLE = 6  # bytes
SECRETS = [("8264", "The vault code is 82826464, changed weekly."),
           ("zq7Kw@vault-orange.org", "Write to zq7Kw@vault-orange.org for access."),
           ("龘", "The on-call engineer is 鱻龘, reachable after six.")]


@pytest.fixture(scope="module")
def planted(lm):
    """Factory ``planted(i, preset)``: (parent bytes, parent ids, secret) with SECRETS[i] inside a real text."""
    from kvcodec.api import encode
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.texts import load_text

    head = lm.tokenizer.decode(tokenize(lm.tokenizer, load_text("changelog-apt"))[:90].tolist())
    memo: dict = {}

    def make(i: int, preset: str):
        if (i, preset) not in memo:
            secret, line = SECRETS[i]
            ids = tokenize(lm.tokenizer, head + "\n" + line + "\nThe rest of the notes follow.")
            memo[i, preset] = (encode(capture(lm, token_ids=ids), None, preset=preset).data, ids, secret)
        return memo[i, preset]

    return make


def _needles(lm, data: bytes, ids: np.ndarray, secret: str, spans: list, key=None) -> dict[str, bytes]:
    from kvcodec.digest import token_ids_sha256
    from kvcodec.models.capture import tokenize

    out = {"text": secret.encode(), "text-utf16": secret.encode("utf-16-le"),
           "parent-file-sha": hashlib.sha256(data).hexdigest().encode(), "parent-file-sha-raw": hashlib.sha256(data).digest(),
           "parent-ids-sha": token_ids_sha256(ids).encode()}
    removed = np.concatenate([ids[a:b] for a, b in spans])
    alone = tokenize(lm.tokenizer, secret)
    for name, run in (("removed-ids", removed), ("secret-ids", alone)):
        if len(run) >= 2:  # one common token alone is no evidence
            for dt in ("<i2", "<i4", "<i8"):
                out[f"{name}-{dt}"] = run.astype(dt).tobytes()
    if key is not None:
        out["parent-key"] = key.to_str().encode()
        out["parent-key-digest"] = key.digest.encode()
    with KvcReader(data) as r:
        if r.header.codec == "raw":
            cache = r.read_cache()
            a, b = spans[0]
            # not layer 0: its values are a function of the token id alone (no attention yet), equal for any
            # occurrence of the same token, and its keys of the token and its position
            for layer in (1, len(cache.keys) // 2, len(cache.keys) - 1):
                for t in (a, b, b + 1, b + 4, b + 8):  # a removed token, and kept ones after the span
                    out[f"k{layer}@{t}"] = cache.keys[layer][0, t].numpy().tobytes()
                    out[f"v{layer}@{t}"] = cache.values[layer][0, t].numpy().tobytes()
    # a needle of a few bytes turns up in any megabyte of tensors by chance: short ones are left to the text check
    return {k: v for k, v in out.items() if len(v) >= MIN_NEEDLE}


def _scan(lm, needles: dict[str, bytes], secret: str, child: bytes, blobs: dict[str, bytes]) -> None:
    with KvcReader(child) as r:
        text = lm.tokenizer.decode(np.asarray(r.token_ids).tolist())
    assert secret not in text and "\ufffd" not in text
    for where, blob in {"child": child, **blobs}.items():
        hits = [n for n, nd in needles.items() if nd in blob]
        assert not hits, f"{where} holds {hits}"


@pytest.mark.parametrize("i", range(len(SECRETS)))
def test_the_library_child_holds_nothing_of_the_secret(lm, planted, i):
    from kvcodec.edit.redact import redact

    data, ids, secret = planted(i, "raw")
    res = redact(lm, data, text=secret)
    needles = _needles(lm, data, ids, secret, res.params["token_spans"])
    _scan(lm, needles, secret, res.data, {"answer": json.dumps(res.to_json()).encode()})


@pytest.mark.parametrize("i", range(len(SECRETS)))
def test_the_cli_leaves_only_the_child_and_says_nothing_of_the_secret(lm, planted, i, tmp_path, capsys):
    data, ids, secret = planted(i, "lossless")
    src, out_dir = tmp_path / "in", tmp_path / "out"
    src.mkdir(), out_dir.mkdir()
    (src / "doc.kvc").write_bytes(data)
    rc, out, err = run_kvc(["edit", "redact", str(src / "doc.kvc"), "--text", secret, "-o", str(out_dir / "red.kvc"),
                            "--json"], capsys)
    assert rc == 0, err
    assert [p.name for p in out_dir.iterdir()] == ["red.kvc"]  # no temporary file beside it
    assert (src / "doc.kvc").read_bytes() == data
    info = json.loads(out)
    needles = _needles(lm, data, ids, secret, info["params"]["token_spans"])
    _scan(lm, needles, secret, (out_dir / "red.kvc").read_bytes(), {"stdout": out.encode(), "stderr": err.encode()})


@pytest.mark.parametrize("i", range(len(SECRETS)))
def test_a_stored_edit_writes_nothing_of_the_secret(lm, planted, i, tmp_path):
    from kvcodec.edit.stored import edit_stored
    from kvcodec.store import Store, StoreKey
    from kvcodec.store.keys import codec_key
    from kvcodec.store.tenant import TenantKey

    data, ids, secret = planted(i, "raw")
    root = tmp_path / "store"
    store = Store.open(str(root), key=TenantKey(bytes(range(40, 72))))
    key = StoreKey.for_tokens(ids, model=lm.fingerprint.id, codec=codec_key("raw"), namespace="t")
    store.put(key, data, {})

    def files() -> dict[Path, bytes]:
        return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}

    before = files()
    child_key, res = edit_stored(lm, store, key, "redact", {"text": secret})
    written = {str(p): b for p, b in files().items() if before.get(p) != b}
    assert written and all(before.get(p) == b for p, b in files().items() if str(p) not in written)
    needles = _needles(lm, data, ids, secret, res.params["token_spans"], key)
    blobs = {**written, "meta": json.dumps(store.get_meta(child_key)).encode(), "answer": json.dumps(res.to_json()).encode()}
    _scan(lm, needles, secret, bytes(store.get_entry(child_key).data), blobs)
    assert store.get_entry(key).data == data  # the parent is where it was, unchanged
