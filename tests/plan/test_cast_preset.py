"""The `cast` stage and the `fp16` preset: the cache rounded to fp16, stored losslessly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec.errors import KvcCodecError, KvcFormatError
from kvcodec.format import KvcReader, encode_kvc_bytes
from kvcodec.plan.presets import get_plan
from kvcodec.codecs.lossless import Cast
from kvcodec.core.stage import ArraySpec, ChunkContext

pytestmark = pytest.mark.model


def test_fp16_preset_equals_rounding_to_fp16(small_cache):
    plan = get_plan("fp16", small_cache)
    data = encode_kvc_bytes(small_cache, plan.pipelines, preset=plan.preset)
    back = KvcReader(data).read_cache()
    for a, b in zip(small_cache.keys + small_cache.values, back.keys + back.values):
        assert b.dtype == a.dtype == torch.float32
        assert torch.equal(b, a.to(torch.float16).to(torch.float32))
    lossless = get_plan("lossless", small_cache)
    assert len(data) < 0.6 * len(encode_kvc_bytes(small_cache, lossless.pipelines, preset="lossless"))


def test_cast_stage_rejects_bad_config_and_widening():
    with pytest.raises(KvcCodecError):
        Cast("int8")
    c = Cast("float16")
    with pytest.raises(KvcCodecError, match="overflows float16"):  # a finite value never becomes a stored inf
        c.encode(np.array([[[1.0, 65520.0, 1e-8]]], np.float32), ChunkContext())
    y, side = c.encode(np.array([[[1.0, 65504.0, 1e-8, np.inf]]], np.float32), ChunkContext())
    assert y.dtype == np.float16 and side == {} and y[0, 0, 1] == 65504 and y[0, 0, 2] == 0 and np.isinf(y[0, 0, 3])
    with pytest.raises(KvcFormatError):
        c.decode(y, {}, ArraySpec((1, 1, 4), "int32"), ChunkContext())
