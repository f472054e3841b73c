"""Prune spec parsing, validation and the selection rules (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.errors import KvcInputError
from kvcodec.prune.budget import Amount, H2OBudget, LinguaBudget, parse_prune
from kvcodec.prune.h2o import scores_from_meta, scores_to_meta, select_h2o
from kvcodec.prune.lingua import _apportion, pack_mask, select_lingua, unpack_mask


def test_h2o_single_budget_splits_evenly():
    b = parse_prune("h2o:0.25")
    assert isinstance(b, H2OBudget) and b.window == 64
    assert b.resolve(2048) == (256, 256)
    assert parse_prune("h2o:25%").resolve(2048) == (256, 256)
    assert parse_prune("h2o:512").resolve(2048) == (256, 256)
    assert parse_prune("h2o:1.0").resolve(100) == (50, 50)
    assert parse_prune("h2o:100%").kept(7) == 7


def test_h2o_heavy_recent_and_window():
    b = parse_prune("h2o:heavy=0.1,recent=0.1")
    assert b.resolve(1000) == (100, 100)
    b = parse_prune(" H2O : heavy=128, recent=0.05 , window=all ")
    assert b.window is None and b.resolve(1000) == (128, 50)
    assert parse_prune("h2o:recent=64").resolve(100) == (0, 64)
    assert parse_prune("h2o:heavy=0,recent=0.5,window=16").window == 16
    assert parse_prune(b.spec()) == b  # spec() round-trips
    for spec in ("h2o:1.0", "h2o:0.25", "h2o:heavy=1.0,recent=0", "lingua:1.0", "h2o:33%", "h2o:0.0001"):
        assert parse_prune(parse_prune(spec).spec()) == parse_prune(spec)


def test_lingua_specs():
    b = parse_prune("lingua:0.5")
    assert isinstance(b, LinguaBudget) and b.resolve(1000) == 500 and b.segment == 200
    b = parse_prune("lingua:keep=300,segment=100,spread=0")
    assert b.resolve(1000) == 300 and b.segment == 100 and b.spread == 0
    assert parse_prune(b.spec()) == b


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("", "empty prune spec"),
        ("h2o", "missing budget"),
        ("h2o:", "missing budget"),
        ("snapkv:0.5", "unknown method"),
        ("h2o:0", "> 0"),
        ("h2o:-0.5", "> 0"),
        ("h2o:0.0", "> 0"),
        ("h2o:1.5", "above 1"),
        ("h2o:150%", "over 100%"),
        ("h2o:1", "ambiguous"),
        ("h2o:abc", "not a number"),
        ("h2o:nan", "not a number"),
        ("h2o:inf", "not a number"),
        ("h2o:0.25,0.5", "more than one bare"),
        ("h2o:0.25,heavy=0.1", "not both"),
        ("h2o:heavy=0.6,recent=0.6", "exceeds 1"),
        ("h2o:heavy=0,recent=0", "nothing would be kept"),
        ("h2o:heavy=0.1,heavy=0.2", "given twice"),
        ("h2o:0.2,window=0", "window"),
        ("h2o:0.2,window=x", "window"),
        ("h2o:0.2,sink=4", "unknown h2o option"),
        ("h2o:0.2,", "empty item"),
        ("lingua:0", "> 0"),
        ("lingua:2.0", "above 1"),
        ("lingua:segment=100", "no budget"),
        ("lingua:0.5,segment=2", "segment"),
        ("lingua:0.5,spread=2", "spread"),
        ("lingua:0.5,question=x", "unknown lingua option"),
    ],
)
def test_bad_specs_are_clear_input_errors(spec, needle):
    with pytest.raises(KvcInputError) as ei:
        parse_prune(spec)
    assert needle in str(ei.value)


def test_counts_beyond_the_context_are_refused():
    with pytest.raises(KvcInputError, match="only 100"):
        parse_prune("h2o:4096").resolve(100)
    with pytest.raises(KvcInputError, match="only 100"):
        parse_prune("lingua:101").resolve(100)
    with pytest.raises(KvcInputError, match="exceed"):
        parse_prune("h2o:heavy=80,recent=30").resolve(100)
    with pytest.raises(KvcInputError, match="keeps no token"):
        parse_prune("h2o:0.001").resolve(100)
    with pytest.raises(KvcInputError, match="empty"):
        parse_prune("h2o:0.5").resolve(0)


def test_amount_rounding():
    assert Amount(0.125, False).tokens(10) == 1
    assert Amount(0.5, False).tokens(3) == 2
    assert Amount(5.0, True).tokens(5) == 5


def test_select_h2o_keeps_recent_and_top_scores_per_head():
    scores = np.zeros((2, 3, 10), dtype=np.float32)
    scores[0, 0, [1, 4]] = [5, 3]
    scores[0, 1, [2, 7]] = [9, 8]
    scores[1, :, 0] = 1
    scores[..., 9] = 100  # recent tokens are kept anyway; their score must not steal heavy slots
    kept = select_h2o(scores, heavy=2, recent=2)
    assert kept.shape == (2, 3, 4)
    assert kept[0, 0].tolist() == [1, 4, 8, 9]
    assert kept[0, 1].tolist() == [2, 7, 8, 9]
    assert kept[1, 2].tolist() == [0, 1, 8, 9]  # tie among zeros broken toward earlier tokens
    assert (np.diff(kept, axis=-1) > 0).all()


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 60), st.data())
def test_select_h2o_properties(t, data):
    r = data.draw(st.integers(0, t))
    h = data.draw(st.integers(0, t - r))
    if h + r == 0:
        return
    rng = np.random.default_rng(t * 1000 + h * 7 + r)
    s = rng.random((2, 2, t)).astype(np.float32)
    kept = select_h2o(s, h, r)
    assert kept.shape == (2, 2, h + r)
    for row, sc in zip(kept.reshape(-1, h + r), s.reshape(-1, t)):
        assert len(set(row.tolist())) == h + r and row.min() >= 0 and row.max() < t
        assert set(range(t - r, t)) <= set(row.tolist())
        heavy = [i for i in row if i < t - r]
        if heavy and t - r > h:
            assert sc[heavy].min() >= np.sort(sc[: t - r])[::-1][h - 1] - 1e-7


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 700), st.integers(8, 256), st.data())
def test_select_lingua_exact_count_and_segment_quota(n, seg, data):
    keep = data.draw(st.integers(1, n))
    rng = np.random.default_rng(n + seg + keep)
    info = rng.random(n)
    info[0] = np.inf
    rel = rng.random((n + seg - 1) // seg) if data.draw(st.booleans()) else None
    kept = select_lingua(info, keep, seg, rel, 0.5)
    assert len(kept) == keep and len(np.unique(kept)) == keep and (np.diff(kept) > 0).all()
    assert kept[0] == 0  # the first token (no prefix, infinite self-information) is always kept
    if rel is None:  # uniform quotas: each segment keeps its share to within one token
        lens = np.array([min(seg, n - a) for a in range(0, n, seg)])
        counts = np.array([((kept >= a) & (kept < a + seg)).sum() for a in range(0, n, seg)])
        assert (np.abs(counts - keep * lens / n) <= 1 + 1e-9).all()


def test_select_lingua_drops_the_most_predictable():
    info = np.array([np.inf, 0.1, 5.0, 0.2, 3.0, 0.05, 4.0, 0.3])
    assert select_lingua(info, 4, 200).tolist() == [0, 2, 4, 6]


def test_question_aware_gives_relevant_segments_more():
    info = np.ones(400)
    kept = select_lingua(info, 200, 100, relevance=np.array([-5.0, -1.0, -9.0, -3.0]), spread=0.5)
    counts = [((kept >= a) & (kept < a + 100)).sum() for a in range(0, 400, 100)]
    assert counts[1] > counts[3] > counts[0] > counts[2] and sum(counts) == 200


def test_apportion_respects_caps():
    q = _apportion(np.array([10.0, 1.0, 1.0]), np.array([5, 50, 50]), 40)
    assert q.tolist()[0] == 5 and q.sum() == 40


def test_mask_and_scores_round_trip():
    kept = np.array([0, 3, 4, 9, 10])
    assert unpack_mask(pack_mask(kept, 11), 11).tolist() == kept.tolist()
    s = np.random.default_rng(0).random((2, 3, 5)).astype(np.float32)
    m = scores_to_meta(s, None)
    assert m["window"] == "all"
    np.testing.assert_allclose(scores_from_meta(m), s, rtol=1e-3)
    with pytest.raises(KvcInputError):
        scores_from_meta({"shape": [1]})
