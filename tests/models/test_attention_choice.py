"""kvcodec.models.attention_choice: an attention variant applies in the thread that chose it, and nowhere else.

Before it, each variant wrote its name into the model's config, which every thread shares: another thread's
forward ran the variant, and two interleaved blocks left one set after both ended.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvcodec.errors import KvcInputError
from kvcodec.models.attention_choice import DISPATCH, own_attention, use_attention, whole_model_attention

WAIT = 60.0  # seconds a test thread may wait for the other (never reached unless the code deadlocks)


def _recorder(calls: list[int]):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def fn(module, query, key, value, mask, **kw):
        calls.append(threading.get_ident())
        return sdpa_attention_forward(module, query, key, value, mask, **kw)

    return fn


def _logits(lm, ids):
    with torch.inference_mode():
        return lm.model(input_ids=ids).logits


@pytest.fixture
def ids(gpl3_ids):
    return torch.as_tensor(gpl3_ids[:24]).unsqueeze(0)


def test_a_variant_runs_only_in_the_thread_that_chose_it(lm, ids):
    plain = _logits(lm, ids)
    calls: list[int] = []
    opened, done = threading.Event(), threading.Event()
    inside: list = []

    def worker():
        with use_attention(lm, _recorder(calls)) as on:
            assert on
            inside.append(_logits(lm, ids))
            opened.set()
            done.wait(WAIT)

    t = threading.Thread(target=worker)
    t.start()
    assert opened.wait(WAIT)
    assert lm.model.config._attn_implementation == DISPATCH and own_attention(lm) == "sdpa"
    n = len(calls)
    assert n == lm.fingerprint.num_layers and set(calls) == {t.ident}  # the worker's forward ran its variant
    assert torch.equal(_logits(lm, ids), plain)  # this thread's: transformers' SDPA, to the bit
    assert len(calls) == n
    done.set()
    t.join(WAIT)
    assert torch.equal(inside[0], plain)  # the recorder is SDPA itself
    assert lm.model.config._attn_implementation == "sdpa"


def test_interleaved_blocks_leave_the_model_on_its_own_attention(lm, ids):
    """A opens, B opens, A closes (B's variant still runs in B), B closes: the model is back on SDPA."""
    a_calls: list[int] = []
    b_calls: list[int] = []
    a_open, b_open, a_closed, b_may_close = (threading.Event() for _ in range(4))

    def a():
        with use_attention(lm, _recorder(a_calls)):
            a_open.set()
            b_open.wait(WAIT)
        a_closed.set()

    def b():
        a_open.wait(WAIT)
        with use_attention(lm, _recorder(b_calls)):
            b_open.set()
            a_closed.wait(WAIT)
            _logits(lm, ids)  # after A's block closed
            b_may_close.wait(WAIT)

    ta, tb = threading.Thread(target=a), threading.Thread(target=b)
    ta.start()
    tb.start()
    ta.join(WAIT)
    assert a_closed.is_set() and lm.model.config._attn_implementation == DISPATCH  # B's block is still open
    b_may_close.set()
    tb.join(WAIT)
    assert not a_calls and len(b_calls) == lm.fingerprint.num_layers
    assert lm.model.config._attn_implementation == "sdpa"


def test_outermost_variants_apply_once_and_only_over_sdpa(lm, ids):
    calls: list[int] = []
    with use_attention(lm, _recorder(calls)) as outer:
        with use_attention(lm, _recorder([]), outermost=True) as inner:  # inside another variant: left as it is
            _logits(lm, ids)
    assert outer and not inner and len(calls) == lm.fingerprint.num_layers
    cfg = lm.model.config
    cfg._attn_implementation = "eager"
    try:
        with use_attention(lm, _recorder([]), outermost=True) as on:
            assert not on and cfg._attn_implementation == "eager"
        with use_attention(lm, _recorder(calls)) as on:  # a measurement's variant applies on any implementation
            assert on and own_attention(lm) == "eager"
        assert cfg._attn_implementation == "eager"
    finally:
        cfg._attn_implementation = "sdpa"


def test_a_whole_model_switch_waits_for_open_variants_and_they_wait_for_it(lm, ids):
    opened, release, entered = threading.Event(), threading.Event(), threading.Event()
    seen: list[str] = []

    def holder():
        with use_attention(lm, _recorder([])):
            opened.set()
            release.wait(WAIT)

    def switcher():
        with whole_model_attention(lm, "eager"):
            seen.append(lm.model.config._attn_implementation)
            entered.set()

    th = threading.Thread(target=holder)
    th.start()
    assert opened.wait(WAIT)
    ts = threading.Thread(target=switcher)
    ts.start()
    assert not entered.wait(0.5)  # the variant is still open
    release.set()
    th.join(WAIT)
    ts.join(WAIT)
    assert seen == ["eager"] and lm.model.config._attn_implementation == "sdpa"
    with use_attention(lm, _recorder([])):
        with pytest.raises(KvcInputError, match="inside one of this thread's attention variants"):
            with whole_model_attention(lm, "eager"):
                pass
    assert lm.model.config._attn_implementation == "sdpa"


def test_a_copy_made_inside_a_block_runs_sdpa_and_takes_variants(tmp_path):
    """A model copied while a block was open on it (the onboarding twin is one) holds a config naming the dispatcher
    with no block of its own: it runs SDPA, an outermost variant still applies to it, and it ends on SDPA."""
    from kvcodec.models.load import load_model
    from tests._support.tiny_models import make_tiny_model

    lm = load_model(str(make_tiny_model(tmp_path / "m", "dense")))
    ids = torch.arange(1, 17).unsqueeze(0)
    plain = _logits(lm, ids)
    lm.model.config._attn_implementation = DISPATCH
    assert own_attention(lm) == "sdpa" and torch.equal(_logits(lm, ids), plain)
    calls: list[int] = []
    with use_attention(lm, _recorder(calls), outermost=True) as on:
        _logits(lm, ids)
    assert on and len(calls) == 2 and lm.model.config._attn_implementation == "sdpa"
