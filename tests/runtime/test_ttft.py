"""TTFT paths: last-position logits only, and the cold (fresh-process) `.kvc` path (issues 20, 21)."""

from __future__ import annotations

import pytest
import torch

@pytest.mark.model
def test_prefill_keeps_only_the_last_logits_and_they_are_the_full_ones(lm, gpl3_ids):
    from kvcodec.models.capture import prefill

    ids = gpl3_ids[:96]
    past, last = prefill(lm, ids)
    _, full = prefill(lm, ids, logits_to_keep=0)
    assert last.shape == (1, full.shape[-1]) and full.shape[0] == len(ids)
    # one row vs 96 rows through the LM head take different BLAS kernels: equal up to fp32 summation order
    torch.testing.assert_close(last[0], full[-1], rtol=1e-4, atol=3e-3)
    assert int(last[0].argmax()) == int(full[-1].argmax())
    assert past.get_seq_length() == len(ids)


@pytest.mark.model
def test_cold_kvc_ttft_answers_like_prefill(lm, gpl3_ids, tmp_path):
    """A fresh process loads a lossless `.kvc` and produces exactly prefill's first token."""
    from kvcodec.models.capture import capture
    from kvcodec.format import write_kvc
    from kvcodec.plan.presets import get_plan
    from kvcodec.runtime.ttft import cold_ttft, ttft_kvc, ttft_prefill

    ids, q = gpl3_ids[:128], gpl3_ids[128:136]
    cache = capture(lm, token_ids=ids)
    path = tmp_path / "doc.kvc"
    plan = get_plan("lossless", cache)
    write_kvc(cache, path, plan)
    want = ttft_prefill(lm, ids, q)
    assert ttft_kvc(lm, path, q) == want
    res = cold_ttft("kvc", "smollm2", ids, q, kvc=path, threads=1)
    assert res["token"] == want
    assert 0 < res["ttft_s"] < res["process_s"] and res["model_load_s"] > 0


def test_demo_render_reports_cold_and_warm_ttft():
    from kvcodec.eval.demo import render

    report = {"model": "smollm2", "fingerprint": "f" * 32, "text": "gpl3", "tokens": 2048, "preset": "balanced",
              "kvc_bytes": 1000, "kv_elements": 4000, "fp16_bytes": 8000, "encode_s": 1.0, "kvc_file": "x.kvc",
              "verify": "ok",
              "quality": {"kl_mean": 0.01, "dppl_percent": 0.5, "top1_agreement": 0.97, "greedy_match": 0.3,
                          "continuation_tokens": 256},
              "ttft": {"prefill_s": 5.0, "kvc_s": 0.5, "speedup": 10.0, "cold_prefill_s": 6.0, "cold_kvc_s": 1.0,
                       "cold_speedup": 6.0, "cold_model_load_s": 1.2, "first_token_matches": True,
                       "torch_threads": 2, "cpu": "Test CPU, AVX-512, 2 cores"}}
    out = render(report)
    assert "TTFT warm  prefill 5000 ms vs load .kvc + decode 500 ms = 10.0x" in out
    assert "TTFT cold  prefill 6000 ms vs load .kvc + decode 1000 ms = 6.0x" in out
    assert "AVX-512" in out
