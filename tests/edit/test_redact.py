"""``redact`` on the real embedded model: an e-mail address leaves the context, the rest is prefilled afresh
(the default) or repaired CacheBlend-style (``repair="blend"``). What the child may still say about what was
removed is tests/edit/test_redact_privacy.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec.edit.log import file_sha256, parse_log
from kvcodec.edit.redact import redact, redact_cache
from kvcodec.errors import KvcInputError, KvcModelMismatchError
from kvcodec.format import KvcReader
from kvcodec.models.capture import capture
from kvcodec.models.quality import compare_logits, continue_logits
from kvcodec.plan.presets import PRESETS
from tests.edit.conftest import EMAIL

pytestmark = pytest.mark.model

N, CONT = 160, 16


@pytest.fixture(scope="module")
def redacted(lm, entry):
    _, data = entry(N)
    return data, redact(lm, data, pattern=EMAIL, repair="blend")


@pytest.fixture(scope="module")
def redacted_prefill(lm, entry):
    _, data = entry(N)
    return data, redact(lm, data, pattern=EMAIL)


@pytest.fixture(scope="module")
def reprefill(lm, redacted, changelog_ids):
    _, res = redacted
    cont = changelog_ids[N:N + CONT]
    fresh = capture(lm, token_ids=res.cache.token_ids)
    return cont, continue_logits(lm, fresh, cont)


def test_the_address_is_gone_and_the_ids_and_log_say_so(lm, redacted, changelog_ids):
    data, res = redacted
    ids = changelog_ids[:N]
    assert "jak@debian.org" in lm.tokenizer.decode(ids.tolist())
    (a, b), = res.params["token_spans"]
    want = np.concatenate([ids[:a], ids[b:]])
    with KvcReader(res.data) as r:
        assert np.array_equal(r.token_ids, want)
        log = parse_log(r.header.meta)
    assert "jak@debian.org" not in lm.tokenizer.decode(want.tolist())
    # the log names the parent by no plain digest and does not repeat the pattern (issue 55)
    assert log[-1].op == "redact" and log[-1].parent_sha256 is None and log[-1].parent_token_ids_sha256 is None
    assert "pattern" not in log[-1].params and log[-1].params["removed_tokens"] == b - a
    assert file_sha256(data) not in res.data.decode("latin-1")
    assert res.info["recomputed_tokens"] >= 1 and log[-1].params["repair"] == "blend"


def test_the_default_is_a_prefill_of_the_kept_ids(lm, redacted_prefill):
    """repair='prefill': the child's K/V are a fresh prefill of its ids, bit for bit."""
    _, res = redacted_prefill
    fresh = capture(lm, token_ids=res.cache.token_ids)
    assert res.params["repair"] == "prefill" and res.info["recomputed_tokens"] == len(res.cache.token_ids)
    want = fresh.to(res.cache.dtype)
    assert all(torch.equal(a, b) for a, b in zip(res.cache.keys, want.keys))
    assert all(torch.equal(a, b) for a, b in zip(res.cache.values, want.values))


def test_within_the_balanced_kl_target_of_a_reprefill(lm, redacted, reprefill):
    _, res = redacted
    cont, exact = reprefill
    q = compare_logits(exact, continue_logits(lm, res.cache, cont), cont)
    assert q["kl_mean"] <= PRESETS["balanced"].target.kl


def test_full_recompute_is_the_reprefill_and_beats_no_recompute(lm, entry, redacted, reprefill):
    """The repair is real: recomputing everything reproduces the re-prefill (to rounding), recomputing nothing
    (positions re-encoded only) is measurably further away."""
    cache, _ = entry(N)
    _, res = redacted
    cont, exact = reprefill
    spans = [tuple(s) for s in res.params["token_spans"]]
    kl = {}
    for r in (0.0, 1.0):
        child, _ = redact_cache(lm, cache, spans, recompute_ratio=r)
        kl[r] = compare_logits(exact, continue_logits(lm, child, cont), cont)["kl_mean"]
    assert kl[1.0] < 1e-6
    assert kl[0.0] > 10 * kl[1.0]


def test_a_tail_span_is_an_exact_truncation(lm, entry):
    cache, _ = entry(N)
    child, info = redact_cache(lm, cache, [(N - 10, N)])
    assert info["truncation"] and info["recomputed_tokens"] == 0
    assert all(torch.equal(a, b[:, :N - 10]) for a, b in zip(child.keys, cache.keys))


def test_refusals(lm, other_lm, entry):
    cache, data = entry(N)
    with pytest.raises(KvcModelMismatchError):
        redact(other_lm, data, pattern=EMAIL)
    with pytest.raises(KvcInputError, match="whole context"):
        redact_cache(lm, cache, [(0, N)])
    with pytest.raises(KvcInputError, match="matches nothing"):
        redact(lm, data, pattern="no-such-address@nowhere")
    with pytest.raises(KvcInputError, match="recompute_ratio"):
        redact(lm, data, token_spans=[(3, 5)], repair="blend", recompute_ratio=float("nan"))
    with pytest.raises(KvcInputError, match="tune repair='blend'"):
        redact(lm, data, token_spans=[(3, 5)], recompute_ratio=0.1)


def test_the_log_says_what_the_child_promises(lm, entry, redacted, redacted_prefill, changelog_ids):
    """Issue 57: a prefill repair keeps the preset's promise; a blend repair does not (approximate, and on a lossy
    parent it carries the parent's decode error), except a truncation of an exact parent."""
    from kvcodec.api import encode

    for res, kind in ((redacted_prefill[1], "basis"), (redacted[1], "none")):
        with KvcReader(res.data) as r:
            assert r.header.meta["edits"][-1]["promise"] == res.promise and kind in res.promise
    assert redacted_prefill[1].promise == {"preset": "lossless", "basis": "fresh prefill of the child's ids"}
    assert "approximate" in redacted[1].promise["none"]
    _, data = entry(N)
    assert "basis" in redact(lm, data, token_spans=[(N - 10, N)], repair="blend").promise
    lossy = encode(capture(lm, token_ids=changelog_ids[:N]), None, preset="balanced").data
    assert "lossy (balanced)" in redact(lm, lossy, token_spans=[(N - 10, N)], repair="blend", preset="lossless").promise["none"]
    assert "basis" in redact(lm, lossy, token_spans=[(10, 20)], preset="lossless").promise
