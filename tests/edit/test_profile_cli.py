"""``kvc edit profile-heads``: the head profile of a model from the command line (issue 57: there was none)."""

from __future__ import annotations

import json

import pytest

from cliutil import run_kvc  # noqa: E402

pytestmark = pytest.mark.model


@pytest.fixture()
def patched(lm, monkeypatch):
    import kvcodec.models.load

    monkeypatch.setattr(kvcodec.models.load, "load_model", lambda *a, **k: lm)
    return lm


def test_profile_heads_reports_the_kept_layers_as_steer_heads_with_progress(patched, capsys):
    """Two candidate layers on one example (seconds, not the full profile's minutes): a progress line per layer on
    stderr, and JSON whose ``heads_spec`` is exactly what ``kvc edit steer --heads`` parses back into the kept heads."""
    from kvcodec.edit.steer import parse_heads
    from kvcodec.integrations.attn_bias import model_attention_heads

    code, out, err = run_kvc(["edit", "profile-heads", "--layers", "20,2", "--examples", "1", "--top", "1", "--json"], capsys)
    assert code == 0, err
    res = json.loads(out)
    assert set(res["gain_by_layer"]) == {"20", "2"} and res["examples"] == 1 and res["texts"] == ["apache2", "changelog-apt"]
    assert "layer 20 (1/2): mean margin gain" in err and "layer 2 (2/2)" in err
    gained = sorted((g, int(la)) for la, g in res["gain_by_layer"].items() if g > 0)
    assert res["layers"] == [la for _, la in gained[-1:]]  # the top one, if it gained at all
    if res["layers"]:
        assert [list(h) for h in parse_heads(res["heads_spec"], model_attention_heads(patched))] == res["heads"]
    else:
        assert res["heads_spec"] is None and res["heads"] == []


@pytest.mark.parametrize("args, msg", [
    (["--layers", "99"], "distinct integers in [0, 29]"), (["--layers", "3,3"], "distinct integers"),
    (["--layers", "a"], "comma-separated layer numbers"), (["--examples", "0"], "examples must be an integer"),
    (["--top", "0"], "top must be an integer in [1, 30]"), (["--alpha", "0"], "alpha must be"),
    (["--alpha", "nan"], "alpha must be"), (["--texts", "no-such-text"], "no such text"),
    (["--texts", ","], "at least one text")])
def test_bad_input_is_one_line_before_any_forward(patched, capsys, monkeypatch, args, msg):
    import kvcodec.edit.steer_profile as sp

    monkeypatch.setattr(sp, "answer_margin", lambda *a, **k: pytest.fail("a forward pass ran"))
    code, out, err = run_kvc(["edit", "profile-heads", *args], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0 and out == "" and len(lines) == 1 and lines[0].startswith("kvc: error:") and msg in lines[0], err
