"""The dtype onboarding computes in (kvcodec.models.compute): a bfloat16 twin where the CPU computes it natively.

What must hold: the twin answers for the model (same fingerprint and layout, so what it measures is filed under the
model the user runs), the model itself is never touched, tied weights stay tied, RoPE's buffers keep float32, the
twin's logits are the model's to bfloat16 rounding, and the choice follows ``KVCODEC_ONBOARD_DTYPE``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec.errors import KvcInputError
from kvcodec.models import compute


@pytest.mark.parametrize("env,model_dtype,want", [("float32", "float32", "float32"), ("bfloat16", "float32", "bfloat16"),
                                                  ("bfloat16", "bfloat16", "bfloat16"), ("float32", "float16", "float16"),
                                                  (" BFloat16 ", "float32", "bfloat16")])
def test_the_dtype_follows_the_setting_and_never_widens_a_half_model(monkeypatch, env, model_dtype, want):
    monkeypatch.setenv(compute.ENV, env)
    assert compute.onboard_dtype(model_dtype) == want


def test_auto_is_bfloat16_only_where_the_cpu_computes_it(monkeypatch):
    monkeypatch.delenv(compute.ENV, raising=False)
    for native in (True, False):
        monkeypatch.setattr(compute, "native_bf16", lambda n=native: n)
        assert compute.onboard_dtype("float32") == ("bfloat16" if native else "float32")


def test_a_bad_setting_is_one_line(monkeypatch):
    monkeypatch.setenv(compute.ENV, "fp8\nplease")
    with pytest.raises(KvcInputError, match="KVCODEC_ONBOARD_DTYPE") as e:
        compute.onboard_dtype("float32")
    assert "\n" not in str(e.value)


def test_float32_onboarding_is_the_model_itself(monkeypatch, lm):
    monkeypatch.setenv(compute.ENV, "float32")
    assert compute.onboard_model(lm) is lm
    assert compute.compute_dtype_name(lm) is None


def test_the_twin_answers_for_the_model_and_leaves_it_alone(monkeypatch, lm, gpl3_ids):
    monkeypatch.setenv(compute.ENV, "bfloat16")
    before = {n: (p.dtype, p.data_ptr()) for n, p in lm.model.named_parameters()}
    twin = compute.onboard_model(lm)
    assert twin is not lm and twin.onboard_of is lm
    assert compute.compute_dtype_name(twin) == "bfloat16"
    assert compute.onboard_model(twin) is twin  # a twin is never twinned again
    assert twin.fingerprint is lm.fingerprint and twin.layout is lm.layout
    assert {n: (p.dtype, p.data_ptr()) for n, p in lm.model.named_parameters()} == before
    assert {p.dtype for p in twin.model.parameters()} == {torch.bfloat16}
    emb, head = twin.model.get_input_embeddings().weight, twin.model.get_output_embeddings().weight
    tied = lm.model.get_input_embeddings().weight is lm.model.get_output_embeddings().weight
    assert (emb is head) == tied
    floats = [b.dtype for n, b in twin.model.named_buffers() if "inv_freq" in n]
    assert floats and set(floats) == {torch.float32}
    ids = torch.as_tensor(np.asarray(gpl3_ids[:96], dtype=np.int64))[None]
    with torch.inference_mode():
        exact = lm.model(input_ids=ids).logits.float()
        half = twin.model(input_ids=ids).logits.float()
    agree = (exact.argmax(-1) == half.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree  # bfloat16 rounding moves near-ties only
    assert (half - exact).abs().mean().item() < 0.1 * exact.std().item()


def test_no_twin_where_its_weights_would_not_fit_in_memory(monkeypatch, lm):
    monkeypatch.setenv(compute.ENV, "bfloat16")
    weights = sum(p.numel() for p in lm.model.parameters()) * 2
    monkeypatch.setattr(compute, "available_memory", lambda: int(weights / compute.TWIN_MEMORY_SHARE) - 1)
    assert compute.onboard_model(lm) is lm
    monkeypatch.setattr(compute, "available_memory", lambda: int(weights / compute.TWIN_MEMORY_SHARE) + 1)
    assert compute.onboard_model(lm) is not lm
    monkeypatch.setattr(compute, "available_memory", lambda: None)  # unknown: no guard to apply
    assert compute.onboard_model(lm) is not lm


def test_available_memory_reads_the_os():
    import os

    got = compute.available_memory()
    if os.path.exists("/proc/meminfo"):
        assert isinstance(got, int) and 0 < got <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        assert got is None


@pytest.mark.model
def test_a_family_whose_bfloat16_twin_cannot_run_onboards_in_its_own_dtype(monkeypatch, tmp_path):
    """XGLM (config.json names its heads ``attention_heads``: refused at load as lacking a head layout before) adds its
    float32 sinusoidal positions to the hidden states, which then met the twin's bfloat16 layer norm: its first lossy
    encode escaped as RuntimeError ("mixed dtype (CPU)") from the calibration on a CPU computing bfloat16 natively.
    The twin is tried on two tokens first, and such a model onboards in its own dtype."""
    from kvcodec.models.capture import capture
    from kvcodec.models.load import load_model
    from tests._support.tiny_models import save_family_model

    lm = load_model(str(save_family_model(tmp_path / "xglm", dict(model_type="xglm", attention_heads=4, d_model=128,
                                                                   num_layers=2, ffn_dim=256))))
    assert (lm.layout.num_heads, lm.layout.head_dim, lm.layout.num_layers) == (4, 32, 2)
    monkeypatch.setenv(compute.ENV, "bfloat16")
    assert compute.onboard_model(lm) is lm
    cache = capture(lm, token_ids=list(range(5, 45)))
    assert cache.keys[0].shape == (4, 40, 32)
