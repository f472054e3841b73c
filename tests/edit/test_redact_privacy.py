"""What a redacted entry still says about what was removed (issue 55, spec/kvc-v1.md §4.5).

The property: take two parents that are the same text except for a secret (a code, an e-mail address, a
name, a sentence; drawn at random, seeded), redact the secret from each, and compare everything a holder of
the child gets: the child file byte for byte, the edit's result record (what ``kvc edit --json`` prints and
the service answers), the child's store key and its store metadata. The only differences allowed are the
ones the spec allows: the removed tokens' count and positions (``params.removed_tokens`` and
``params.token_spans`` of the last record, and the same two in the result record), the timings, and what
follows from the header's length (the preamble's ``header_length``, the header CRC and the footer's
``index_offset`` and CRC). The test checks that those differences are exactly that, too.

On today's main (ed2abf1) this fails at once: the log held the parent's token-id digest and the pattern.
"""

from __future__ import annotations

import json
import random
import struct
from typing import Any

import numpy as np
import pytest

from kvcodec.edit.redact import redact
from kvcodec.format import KvcReader

pytestmark = pytest.mark.model

PREFIX = ("Minutes of the weekly operations meeting. The team reviewed the backlog, agreed to move the "
          "release review to next week, and noted that the staging machines need new disks.\n")
SUFFIX = ("\nAfter that, the meeting moved on to the budget. Nobody objected to the proposal, and the notes "
          "were sent to everyone who could not attend.")
FIRST = ("Alice", "Jonas", "Mireille", "Tomasz", "Keiko", "Oluwaseun", "Brigitte", "Rafael", "Ingrid", "Dmitri")
LAST = ("Moreau", "Berg", "Kowalczyk", "Tanaka", "Adeyemi", "Lindqvist", "Castillo", "Novak", "Haddad", "Olsen")
WORDS = ("vault", "river", "orange", "ladder", "seven", "quiet", "window", "copper", "winter", "garden", "signal")


def _secret(kind: str, rng: random.Random) -> str:
    if kind == "code":
        return "".join(rng.choice("0123456789") for _ in range(rng.randint(4, 6)))
    if kind == "email":
        user = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(4, 9)))
        return f"{user}.{rng.choice(LAST).lower()}@{rng.choice(WORDS)}-{rng.choice(WORDS)}.{rng.choice(['com', 'org', 'net'])}"
    if kind == "name":
        return f"{rng.choice(FIRST)} {rng.choice(LAST)}"
    return f"The {rng.choice(WORDS)} {rng.choice(WORDS)} opens at {rng.randint(1, 12)} on {rng.choice(WORDS)} days."


def _lines(kind: str, secret: str) -> str:
    return {"code": f"The door code is {secret}.", "email": f"Write to {secret} for access.",
            "name": f"The on-call engineer is {secret}.", "sentence": f"Remember: {secret}"}[kind]


def _parts(data: bytes) -> tuple[dict[str, Any], bytes, bytes]:
    """(header JSON, bytes that do not depend on the header's length, the file's tail) of a `.kvc`."""
    (hl,) = struct.unpack_from("<I", data, 12)
    header = json.loads(data[32:32 + hl])
    start = (36 + hl + 63) // 64 * 64
    fixed = data[:12] + data[16:32] + data[start:-32] + data[-24:-12] + data[-8:]  # footer minus offset and its CRC
    return header, fixed, data[32 + hl:36 + hl]


def _allowed(header: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The header with the allowed fields taken out, and those fields."""
    h = json.loads(json.dumps(header))
    params = h["meta"]["edits"][-1]["params"]
    allowed = {k: params.pop(k, None) for k in ("token_spans", "removed_tokens")}
    allowed["parent_mac"] = h["meta"]["edits"][-1].pop("parent_mac", None)
    return h, allowed


def _record(res: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    d = json.loads(json.dumps(res.to_json()))
    d.pop("timings")
    d.pop("parent_mac", None)
    d.pop("output", None)
    allowed = {"token_spans": d["params"].pop("token_spans"), "removed_tokens": d["params"].pop("removed_tokens", None),
               "spans": d.pop("spans"), "info_removed": d.pop("removed_tokens"), "size": d.pop("size")}
    return d, allowed


@pytest.fixture(scope="module")
def parent_of(lm):
    from kvcodec.api import encode
    from kvcodec.models.capture import capture, tokenize

    def make(kind: str, secret: str) -> tuple[bytes, np.ndarray]:
        ids = tokenize(lm.tokenizer, PREFIX + _lines(kind, secret) + SUFFIX)
        return encode(capture(lm, token_ids=ids), None, preset="lossless").data, ids

    return make


@pytest.mark.parametrize("kind", ["code", "email", "name", "sentence"])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_child_does_not_tell_two_secrets_apart(lm, parent_of, kind, seed, tmp_path):
    from kvcodec.edit.stored import edit_stored
    from kvcodec.store import Store, StoreKey
    from kvcodec.store.keys import codec_key
    from kvcodec.store.tenant import TenantKey

    rng = random.Random(f"{kind}-{seed}")
    secrets = [_secret(kind, rng), _secret(kind, rng)]
    while secrets[1] == secrets[0]:
        secrets[1] = _secret(kind, rng)
    store = Store.open(str(tmp_path / "store"), key=TenantKey(bytes(range(7, 39))))
    got = []
    for secret in secrets:
        data, ids = parent_of(kind, secret)
        # by the literal (what the guide shows for an address) and, for a code, by a pattern as well
        res = redact(lm, data, text=secret)
        key = StoreKey.for_tokens(ids, model=lm.fingerprint.id, codec=codec_key("lossless"), namespace="t")
        store.put(key, data, {})
        child_key, stored = edit_stored(lm, store, key, "redact", {"text": secret})
        got.append((res, child_key, store.get_meta(child_key), stored))
        assert secret not in lm.tokenizer.decode(res.cache.token_ids.tolist())
        if kind == "code":
            by_pattern = redact(lm, data, pattern=r"(?<=code is )\d+")
            assert by_pattern.data == res.data  # the pattern leaves no trace the literal does not
    (ra, ka, ma, sa), (rb, kb, mb, sb) = got
    parents = [parent_of(kind, s) for s in secrets]

    # the child file: header equal but for the allowed fields, every other byte equal
    ha, fixed_a, _ = _parts(ra.data)
    hb, fixed_b, _ = _parts(rb.data)
    (ha_rest, allowed_a), (hb_rest, allowed_b) = _allowed(ha), _allowed(hb)
    assert ha_rest == hb_rest
    assert fixed_a == fixed_b
    with KvcReader(ra.data) as a, KvcReader(rb.data) as b:
        assert np.array_equal(a.token_ids, b.token_ids)
    # the allowed fields are what the spec says: the removed tokens' count and positions (no lineage key was
    # given, so no parent is named at all)
    for allowed, res in ((allowed_a, ra), (allowed_b, rb)):
        (s, e), = allowed["token_spans"]
        assert allowed["removed_tokens"] == e - s and res.params["token_spans"] == [[s, e]]
        assert allowed["parent_mac"] is None
    # the result record, the store key and the store's metadata (its parent_mac: the parent key's HMAC
    # under the tenant's lineage key), the stored child (its parent_mac under that key too)
    (da, _), (db, _) = _record(ra), _record(rb)
    assert da == db
    assert ka == kb and set(ma) == set(mb) == {"edit"} and ma["edit"].keys() == {"op", "parent_mac"}
    assert ma["edit"]["op"] == mb["edit"]["op"] == "redact" and ma["edit"]["parent_mac"] != mb["edit"]["parent_mac"]
    (hsa, fsa, _), (hsb, fsb, _) = _parts(sa.data), _parts(sb.data)
    (hsa_rest, sa_allowed), (hsb_rest, sb_allowed) = _allowed(hsa), _allowed(hsb)
    assert hsa_rest == hsb_rest and fsa == fsb
    # the stored children name their parents by an HMAC under the tenant's lineage key: a different
    # pseudo-random value per parent, which only a holder of that key can check
    from kvcodec.edit.log import file_sha256, lineage_mac
    from kvcodec.edit.stored import lineage_key_for

    lkey = lineage_key_for(store, "t")
    assert sa_allowed["parent_mac"] == lineage_mac(lkey, file_sha256(parents[0][0]))
    assert sb_allowed["parent_mac"] == lineage_mac(lkey, file_sha256(parents[1][0]))
    text = (ra.data + json.dumps(ra.to_json()).encode() + json.dumps(ma).encode()).decode("latin-1")
    assert all(s not in text for s in secrets)


def test_the_lineage_is_checkable_with_the_key_only(lm, parent_of):
    """The child names its parent only by an HMAC under the lineage key: the key's holder can check it
    against the parent, and the child alone names no parent."""
    from kvcodec.edit.log import file_sha256, lineage_mac, parse_log

    data, _ = parent_of("code", "4711")
    key = b"k" * 32
    with_key = redact(lm, data, text="4711", lineage_key=key)
    without = redact(lm, data, text="4711")
    with KvcReader(with_key.data) as r:
        rec = parse_log(r.header.meta)[-1]
    assert rec.parent_mac == lineage_mac(key, file_sha256(data)) != lineage_mac(b"x" * 32, file_sha256(data))
    with KvcReader(without.data) as r:
        assert parse_log(r.header.meta)[-1].parent_mac is None
    assert file_sha256(data) not in json.dumps(with_key.to_json())


def test_earlier_records_are_sealed(lm, parent_of):
    """An append before the redaction recorded the appended ids' digest and the grandparent's: a redacted
    child keeps only their op (the appended text may be what is removed)."""
    from kvcodec.edit.append import append
    from kvcodec.edit.log import parse_log

    data, _ = parent_of("name", "Keiko Tanaka")
    grown = append(lm, data, text=" Her code is 9321.")
    child = redact(lm, grown.data, text="9321")
    with KvcReader(child.data) as r:
        raw = r.header.meta["edits"]
        assert raw[0] == {"op": "append", "sealed": True}
        assert [x.op for x in parse_log(r.header.meta)] == ["append", "redact"]
        assert set(r.header.meta) == {"model", "edits"}


def test_blend_repair_keeps_what_the_spec_says_it_keeps(lm, parent_of):
    """repair='blend' reuses the parent's K/V for the tokens it does not recompute, so its children of two
    secrets differ in their K/V: the spec says blend gives no privacy guarantee, and this is why."""
    a, _ = parent_of("code", "1234")
    b, _ = parent_of("code", "8765")
    ra = redact(lm, a, text="1234", repair="blend")
    rb = redact(lm, b, text="8765", repair="blend")
    assert np.array_equal(ra.cache.token_ids, rb.cache.token_ids)
    assert any(not np.array_equal(x.float().numpy(), y.float().numpy()) for x, y in zip(ra.cache.values, rb.cache.values))
