"""The attention bias header key and required feature bit 1 (spec/kvc-v1.md §4.6)."""

from __future__ import annotations

import pytest

from formatutil import SYNTH_FP, synthetic_cache

from kvcodec.testing.surgery import assemble, header_obj, split, with_header
from kvcodec.errors import KvcFormatError, KvcInputError
from kvcodec.format import KvcReader, encode_kvc_bytes, raw_pipeline
from kvcodec.format.bias import AttentionBias

BIAS = AttentionBias.outside(4, [(1, 3), (0, 0)], -4.6, [(2, 5)], 8)


def biased() -> bytes:
    return encode_kvc_bytes(synthetic_cache(), raw_pipeline("float16"), attention_bias=BIAS)


def test_written_with_bit_1_and_read_back():
    data = biased()
    assert split(data)["req"] == 2
    with KvcReader(data) as r:
        assert r.header.attention_bias == BIAS
        assert r.verify() == []  # integrity checks need no bias
        with pytest.raises(KvcFormatError, match="attention bias .* this loader does not apply"):
            r.read_layer(0)
        with pytest.raises(KvcFormatError, match="attention bias"):
            r.read_cache()
        k, _ = r.read_layer(0, apply_bias=True)
        assert tuple(k.shape) == (2, 8, 8)
    d = BIAS.dense(1, 8)
    assert d.shape == (4, 8) and (d[3, [0, 1, 5, 6, 7]] == -4.6).all() and (d[3, 2:5] == 0).all() and (d[:3] == 0).all()


def test_a_file_without_bias_is_unchanged():
    assert split(encode_kvc_bytes(synthetic_cache(), raw_pipeline("float16")))["req"] == 0


@pytest.mark.parametrize("edit, msg", [
    (lambda h: h.pop("attention_bias"), "exactly when required feature bit 1"),
    (lambda h: h["attention_bias"].update(attention_heads=0), "attention_heads"),
    (lambda h: h["attention_bias"]["entries"][0].update(layer=2), "layer must be in"),
    (lambda h: h["attention_bias"]["entries"][0].update(head=4), "head in"),
    (lambda h: h["attention_bias"]["entries"][0].update(value=1e5), "finite number"),
    (lambda h: h["attention_bias"]["entries"][0].update(value="-1"), "finite number"),
    (lambda h: h["attention_bias"]["entries"][0].update(keys=[[5, 8], [0, 2]]), "sorted, disjoint"),
    (lambda h: h["attention_bias"]["entries"][0].update(keys=[[0, 9]]), "within"),
    (lambda h: h["attention_bias"]["entries"][0].update(keys=[]), "non-empty"),
    (lambda h: h["attention_bias"]["entries"].append(dict(h["attention_bias"]["entries"][0])), "appears twice"),
])
def test_hostile_bias_headers_are_one_line(edit, msg):
    h = header_obj(biased())
    edit(h)
    with pytest.raises(KvcFormatError, match=msg):
        KvcReader(with_header(biased(), h))


def test_the_bit_without_the_key_and_the_key_without_the_bit():
    plain = encode_kvc_bytes(synthetic_cache(), raw_pipeline("float16"))
    with pytest.raises(KvcFormatError, match="feature bit 1"):
        KvcReader(assemble(split(plain), req=2))
    with pytest.raises(KvcFormatError, match="feature bit 1"):
        KvcReader(assemble(split(biased()), req=0))


def test_nan_bias_cannot_be_written():
    bad = AttentionBias(4, (BIAS.entries[0].__class__(0, 0, float("nan"), ((0, 2),)),))
    with pytest.raises(KvcFormatError, match="finite"):
        encode_kvc_bytes(synthetic_cache(), raw_pipeline("float16"), attention_bias=bad)
    with pytest.raises(KvcInputError, match="pruned"):
        import numpy as np

        encode_kvc_bytes(synthetic_cache(T=4, n_ctx=8, positions=np.array([0, 2, 4, 6])), raw_pipeline("float16"),
                         attention_bias=BIAS)
    assert SYNTH_FP.num_layers == 2


def test_bias_golden_vectors_hold():
    from kvcodec.testing.golden import check_bias_vectors

    assert check_bias_vectors() == []


def test_kvc_info_names_the_bias():
    from kvcodec.format.describe import describe

    with KvcReader(biased()) as r:
        assert describe(r, "x.kvc")["attention_bias"] == {"attention_heads": 4, "biased_heads": 2, "layers": [0, 1]}
