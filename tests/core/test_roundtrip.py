"""kvcodec.core.roundtrip: the probe decodes exactly what a file of the same plan reads back as.

The planner's check, its target searches and the rate model's fits measure a plan with :func:`roundtrip` and never
write the file; if the probe chunked, attached or decoded differently from the writer, every one of those
measurements would be of another cache than the one stored.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec.core.roundtrip import roundtrip
from kvcodec.core.stage import MAX_PIPELINES, MAX_STAGES, ExternalAttachment
from kvcodec.format import container
from kvcodec.format.reader import KvcReader
from kvcodec.format.writer import encode_kvc_bytes


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.keys + a.values, b.keys + b.values))


@pytest.mark.parametrize("preset,overrides", [
    ("lossless", {}),
    ("balanced", {"step0": 0.4}),  # tokenscale's encoder inputs and the calibration's external bases
    ("small", {"step0": 0.6}),
    ("balanced", {"step0": 0.4, "chunk_tokens": 48}),  # several chunks per tensor, the last one short
])
def test_the_probe_decodes_what_the_file_reads_back(lm, real_cache, preset, overrides):
    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.plan.presets import get_plan

    cache = real_cache(128)
    over = dict(overrides)
    chunk = over.pop("chunk_tokens", None)
    plan = get_plan(preset, cache, lm, rate="fixed", cal=ensure_calibration(lm), **over)
    if chunk:
        plan.chunk_tokens = chunk
    if preset != "lossless":
        assert any(isinstance(a, ExternalAttachment) for a in plan.attachments.values())
    dec, nbytes = roundtrip(cache, plan)
    data = encode_kvc_bytes(cache, plan)
    back = KvcReader(data, attachment_resolver=lambda name, info: plan.attachments[name].array).read_cache()
    assert _same(dec, back)
    assert [k.dtype for k in dec.keys] == [k.dtype for k in cache.keys]
    np.testing.assert_array_equal(dec.token_ids, cache.token_ids)
    # the payloads and side data, without the header, index and padding the file adds
    assert 0 < nbytes < len(data)


def test_a_bfloat16_cache_comes_back_bfloat16_as_the_file_does(small_cache):
    from kvcodec.codecs.lossless import lossless_pipeline

    cache = small_cache.to(torch.bfloat16)
    p = lossless_pipeline("bfloat16")
    dec, _ = roundtrip(cache, p)  # a bare pipeline is the plan of just that pipeline
    assert dec.dtype == torch.bfloat16
    assert _same(dec, cache)  # lossless: bit for bit
    assert _same(dec, KvcReader(encode_kvc_bytes(cache, p)).read_cache())


def test_the_container_reads_the_pipeline_limits_the_probe_uses():
    # one definition: a plan the probe measures is a plan the container may hold
    assert (container.MAX_STAGES, container.MAX_PIPELINES) == (MAX_STAGES, MAX_PIPELINES)
