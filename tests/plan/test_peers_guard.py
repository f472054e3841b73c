"""Issue 15: the evaluation sets, the opt-in encode-time check (issue 33), and the real peers' bit accounting."""

from __future__ import annotations

import numpy as np
import pytest


def test_eval_sets_load_and_are_disjoint():
    from kvcodec.texts import EVAL_SET, HELD_OUT, TUNING, load_text

    assert len(EVAL_SET) >= 8 and not set(TUNING) & set(HELD_OUT)
    texts = {n: load_text(n) for n in EVAL_SET}
    assert all(len(t) > 5000 for t in texts.values())
    assert len({t[:2000] for t in texts.values()}) == len(texts)  # all different documents


def test_held_out_texts_share_nothing_with_tuning_or_calibration():
    """Held-out means never fitted on: no held-out document, nor any of its paragraphs, is in the
    tuning set or in the calibration corpus (whose PCA bases and sensitivities every lossy file uses)."""
    from kvcodec.calibration.record import CALIB_TEXTS
    from kvcodec.texts import HELD_OUT, TUNING, load_text

    seen = "\n".join(load_text(n) for n in (*TUNING, *CALIB_TEXTS))
    for name in HELD_OUT:
        paras = [p.strip() for p in load_text(name).split("\n\n") if len(p.strip()) > 200]
        shared = [p[:60] for p in paras if p in seen]
        assert not shared, f"held-out {name} shares paragraphs with tuning/calibration texts: {shared[:3]}"


@pytest.fixture(scope="module")
def stdio_cache(lm):
    """A real 256-token cache of a held-out text (a C header)."""
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.texts import load_text

    return capture(lm, token_ids=tokenize(lm.tokenizer, load_text("c-stdio"))[:256])


def _probe_quality(lm, cache, step0, args, n):
    """Independent re-measurement of the guard's probe: the context minus its last n tokens encoded as a
    document of its own at ``step0`` into a .kvc file, read back, continued on those n tokens, against the exact prefix."""
    from kvcodec.format import KvcReader, encode_kvc_bytes
    from kvcodec.models.quality import compare_logits, continue_logits
    from kvcodec.plan.pipelines import transform_plan

    T = cache.num_tokens
    probe, prefix = cache.token_ids[T - n:], cache.prefix(T - n)
    # through a real file (container, reader, fast decoder), not the guard's in-memory pipeline round trip
    dec = KvcReader(encode_kvc_bytes(prefix, transform_plan(prefix, step0, lm=lm, **args))).read_cache()
    return compare_logits(continue_logits(lm, prefix, probe), continue_logits(lm, dec, probe), probe)


@pytest.mark.model
def test_check_meets_a_target_the_starting_step_misses(lm, stdio_cache):
    """A target tighter than the starting step's quality forces step0 down (predicted, not blind halving); the
    step it writes meets the target when re-measured independently."""
    from kvcodec.calibration.store import require_calibration
    from kvcodec.plan.check import CHECK_MARGIN, MAX_TRIES, guarded_plan
    from kvcodec.plan.targets import QualityTarget
    from kvcodec.plan.presets import PRESETS

    args = {k: v for k, v in PRESETS["balanced"].settings.items() if k != "tokenscale"}
    args["cal"] = require_calibration(stdio_cache.fingerprint)  # the planner's input (kvcodec.api.make_plan resolves it)
    target = QualityTarget(kl=4e-3, top1=0.9, dppl_percent=1.0)
    plan = guarded_plan(stdio_cache, lm, "balanced", dict(args), target)
    g = plan.params["check"]
    assert g["checked"] and g["met"] and g["tries"][-1]["ok"]
    assert 2 <= len(g["tries"]) < MAX_TRIES and not g["tries"][0]["ok"]  # the starting step missed; prediction fixed it
    assert plan.params["step0"] == g["tries"][-1]["step0"] < args["step0"]
    m = _probe_quality(lm, stdio_cache, plan.params["step0"], {k: v for k, v in args.items() if k != "step0"},
                       g["probe_tokens"])
    assert m["kl_mean"] == pytest.approx(g["tries"][-1]["kl_mean"], rel=1e-6)
    assert m["kl_mean"] <= CHECK_MARGIN * target.kl and m["top1_agreement"] >= target.top1


@pytest.mark.model
def test_check_warns_when_the_prediction_was_far_off(lm, stdio_cache, caplog):
    """A first probe far from the rate model's prediction is a warning naming both numbers, never a silent miss."""
    from kvcodec.calibration.store import require_calibration
    from kvcodec.plan.check import guarded_plan
    from kvcodec.plan.presets import PRESETS

    args = {k: v for k, v in PRESETS["balanced"].settings.items() if k != "tokenscale"}
    args["cal"] = require_calibration(stdio_cache.fingerprint)
    with caplog.at_level("WARNING", logger="kvcodec.guard"):
        plan = guarded_plan(stdio_cache, lm, "balanced", dict(args), PRESETS["balanced"].target, predicted_kl=1e-9)
    assert plan.params["check"]["predictor_off"] > 3
    assert any("the rate model predicted KL" in r.getMessage() for r in caplog.records)


def test_step_prediction_follows_the_kl_law():
    """After a miss, the predicted step meets the target under KL ∝ step²; top-1 and greedy misses shrink it."""
    from kvcodec.plan.check import CHECK_MARGIN, GREEDY_SHRINK, TOP1_SHRINK, ProbeStats
    from kvcodec.plan.targets import QualityTarget

    t = QualityTarget(kl=0.01, top1=0.93, dppl_percent=1.0)
    s = ProbeStats(kl=0.012, top1=0.97, d_mean=0.003, d_std=0.09, n=256, greedy_ok=True)
    assert not s.meets(t)
    r = s.step_factor(t)
    assert 0 < r < 1 and s.kl * r * r == pytest.approx(CHECK_MARGIN * t.kl)  # the largest such step
    ok = ProbeStats(kl=1e-4, top1=0.99, d_mean=0.5, d_std=0.5, n=256, greedy_ok=True)
    assert ok.meets(t) and ok.step_factor(t) == 1.0  # ΔPPL on one probe is reported, not checked
    low = ProbeStats(kl=1e-4, top1=0.9, d_mean=0.0, d_std=0.01, n=256, greedy_ok=True)
    assert not low.meets(t) and low.step_factor(t) == TOP1_SHRINK
    flip = ProbeStats(kl=1e-4, top1=0.99, d_mean=0.0, d_std=0.01, n=256, greedy_ok=False)
    assert not flip.meets(t) and flip.step_factor(t) == GREEDY_SHRINK


def test_greedy_promise_stops_at_the_first_near_tie():
    """Identical greedy tokens are promised up to the exact run's first top-2 margin under NEAR_TIE."""
    from kvcodec.models.quality import first_near_tie, greedy_promise_met
    from kvcodec.plan.targets import NEAR_TIE

    exact, margins = [5, 6, 7, 8], [1.0, 0.5, NEAR_TIE / 2, 2.0]
    assert first_near_tie(margins, NEAR_TIE) == 2 and first_near_tie([1.0, 1.0], NEAR_TIE) is None
    assert greedy_promise_met(exact, [5, 6, 9, 9], margins, NEAR_TIE)  # flipped at the near-tie: not promised
    assert not greedy_promise_met(exact, [5, 4, 7, 8], margins, NEAR_TIE)  # flipped at a clear margin: a miss
    assert greedy_promise_met(exact, exact, [1.0] * 4, NEAR_TIE) and not greedy_promise_met(exact, [5, 6, 7, 9], [1.0] * 4, NEAR_TIE)


def test_rival_gain_bounds_where_a_greedy_token_can_flip():
    """max_rival_gain: the largest gain of any token on the exact top-1; a flip needs more than the margin."""
    import torch

    from kvcodec.models.quality import max_rival_gain
    from kvcodec.plan.check import ProbeStats
    from kvcodec.plan.targets import NEAR_TIE, QualityTarget

    exact = torch.tensor([[3.0, 2.9, 0.0], [0.0, 1.0, 5.0]])
    dec = exact + torch.tensor([[0.00, 0.07, 0.0], [0.0, 0.02, -0.01]])  # row 0: token 1 gains 0.07 on token 0
    assert max_rival_gain(exact, dec) == pytest.approx(0.07)
    assert max_rival_gain(exact, exact + 0.5) == pytest.approx(0.0)  # a common shift moves no ranking
    flipped = exact.clone()
    flipped[0, 1] = 3.05  # the 0.1 margin is overtaken: the gain must exceed it
    assert int(flipped[0].argmax()) != int(exact[0].argmax()) and max_rival_gain(exact, flipped) > 0.1
    t = QualityTarget(kl=2e-4, top1=0.99, dppl_percent=0.5, greedy_tokens=16, rival_gain=NEAR_TIE)
    hi = ProbeStats(kl=1e-7, top1=1.0, d_mean=0.0, d_std=1e-4, n=256, greedy_ok=True, rival_gain=0.05)
    assert not hi.meets(t) and hi.step_factor(t) == pytest.approx(NEAR_TIE / 0.05)  # gains scale as the step
    lo = ProbeStats(kl=1e-7, top1=1.0, d_mean=0.0, d_std=1e-4, n=256, greedy_ok=True, rival_gain=0.01)
    assert lo.meets(t)


@pytest.mark.model
@pytest.mark.parametrize("name", ["quanto4-g32-kivi", "hqq2-g64-hf"])
def test_real_peer_bits_and_roundtrip(real_cache, name):
    """HF QuantizedCache (the real libraries): bits = codes + 16-bit scale and zero per group; lossy but close."""
    from kvcodec.eval.peers import HFQuantSpec, available, hf_quantized_roundtrip

    spec = HFQuantSpec.parse(name)
    if available(spec.backend) is not None:
        pytest.skip(available(spec.backend))
    cache = real_cache(128)
    dec, bits = hf_quantized_roundtrip(cache, spec)
    n = sum(k.numel() + v.numel() for k, v in zip(cache.keys, cache.values))
    assert bits == n * spec.nbits + 2 * (n // spec.group) * 16  # one scale + one zero per group of `group` elements
    for a, b in zip(cache.keys + cache.values, dec.keys + dec.values):
        assert a.shape == b.shape and not np.array_equal(a.numpy(), b.numpy())
        rng = float(a.abs().max())
        assert float((a - b).abs().max()) <= rng * (1.0 if spec.nbits == 2 else 0.25)


def test_peer_families_are_selected_or_skipped_with_a_reason(monkeypatch):
    """Real peers run when their library is installed; a missing one is a printed note, never a faked row."""
    from kvcodec.eval import peers
    from kvcodec.eval.methods import select_methods

    got = select_methods(["hf-quanto", "hf-hqq:hqq4-g64-kivi"])
    for backend, n in (("quanto", 8), ("hqq", 1)):
        ms = [m for m in got.methods if m.family == f"hf-{backend}"]
        if peers.available(backend) is None:
            assert len(ms) == n and all(m.roundtrip is not None and m.build is None for m in ms)
    monkeypatch.setattr(peers, "available", lambda backend: f"{backend} is not installed")
    got = select_methods(["hf-quanto", "hf-hqq", "int8"])
    assert [m.key for m in got.methods] == ["int8/int8"]
    assert got.notes == ["hf-quanto skipped: quanto is not installed", "hf-hqq skipped: hqq is not installed"]


def test_kvpress_specs_parse_and_refuse():
    """kvpress settings round-trip through their names; a bad one is one KvcCodecError line."""
    from kvcodec.errors import KvcCodecError
    from kvcodec.eval.peers import DEFAULT_KVPRESS_SPECS, KvpressSpec

    for sp in DEFAULT_KVPRESS_SPECS:
        assert KvpressSpec.parse(sp.name) == sp
    assert KvpressSpec.parse("snapkv-0.25+quanto4-g32-kivi") == KvpressSpec("snapkv", 0.25, "quanto4-g32-kivi")
    for bad in ("snapkv", "snapkv-1.5", "nopress-0.25", "snapkv-0.25+quanto3-g32-kivi", "snapkv-x"):
        with pytest.raises(KvcCodecError):
            KvpressSpec.parse(bad)


@pytest.mark.model
def test_kvpress_roundtrip_keeps_the_press_tokens_and_charges_them(real_cache):
    """A press's kept indices gather the exact entries, per layer and head; bits = kept x 16 (or the quantizer's)."""
    import torch

    from kvcodec.eval.peers import HFQuantSpec, KvpressSpec, available, kvpress_roundtrip

    cache = real_cache(128)
    L, H = cache.fingerprint.num_layers, cache.fingerprint.num_kv_heads
    rng = np.random.default_rng(0)
    kept = np.sort(np.stack([[rng.choice(128, 96, replace=False) for _ in range(H)] for _ in range(L)]), -1)
    dec, bits = kvpress_roundtrip(cache, kept, KvpressSpec("snapkv", 0.25))
    assert dec.num_tokens == 96 and np.array_equal(dec.positions, kept) and dec.next_position == 128
    for l in (0, L - 1):
        for h in range(H):
            assert torch.equal(dec.keys[l][h], cache.keys[l][h, kept[l, h]])
            assert torch.equal(dec.values[l][h], cache.values[l][h, kept[l, h]])
    n_kept = sum(k.numel() + v.numel() for k, v in zip(dec.keys, dec.values))
    assert bits == 16 * n_kept
    if available("quanto") is None:
        _, qbits = kvpress_roundtrip(cache, kept, KvpressSpec("snapkv", 0.25, "quanto4-g32-hf"))
        assert qbits == n_kept * 4 + 2 * (n_kept // 32) * 16
        assert HFQuantSpec.parse("quanto4-g32-hf").nbits == 4


def test_kvpress_is_skipped_with_a_reason_when_its_venv_is_missing(monkeypatch, tmp_path):
    """No .venv-kvpress: the kvpress family is a printed note, never a faked row."""
    from kvcodec.eval.methods import select_methods

    monkeypatch.setenv("KVCODEC_KVPRESS_PYTHON", str(tmp_path / "missing" / "python"))
    got = select_methods(["kvpress", "int8"])
    assert [m.key for m in got.methods] == ["int8/int8"]
    assert len(got.notes) == 1 and got.notes[0].startswith("kvpress skipped: kvpress venv not found") and ".ci/kvpress.sh" in got.notes[0]


@pytest.mark.model
def test_kvpress_runner_in_its_venv(lm, real_cache):
    """The real library (own venv): every press keeps the fraction it promises, per layer and head, in range."""
    from kvcodec.eval.peers import KvpressSpec, kvpress_available, kvpress_indices

    if kvpress_available() is not None:
        pytest.skip(kvpress_available())
    cache = real_cache(128)
    specs = [KvpressSpec("expected_attention", 0.25), KvpressSpec("snapkv", 0.5), KvpressSpec("observed_attention", 0.25)]
    got = kvpress_indices(lm, cache, specs)
    L, H = cache.fingerprint.num_layers, cache.fingerprint.num_kv_heads
    for sp in specs:
        idx = got[sp.runner_key]
        assert idx.shape == (L, H, int(128 * (1 - sp.ratio)))
        assert all(len(np.unique(idx[l, h])) == idx.shape[-1] for l in range(L) for h in range(H))
    assert not np.array_equal(got["expected_attention:0.25"], got["observed_attention:0.25"])  # different presses choose differently


def test_bad_method_settings_are_refused_when_selected():
    """`kvc curve --h2o bogus` or `--methods kvcodec:nope` was refused only when that method's turn came, after the
    model load, the captures and every method before it."""
    from kvcodec.errors import KvcInputError
    from kvcodec.eval.methods import select_methods

    for args in ((["h2o"], None, ["bogus"]), (["h2o"], None, ["lingua:0.5"]), (["h2o:bogus"], None, None),
                 (["kvcodec:nope"], None, None)):
        with pytest.raises(KvcInputError):
            select_methods(*args)
    assert [m.key for m in select_methods(["h2o", "kvcodec:balanced"], None, ["h2o:0.3"]).methods] == \
        ["h2o/h2o:0.3", "kvcodec/balanced"]
