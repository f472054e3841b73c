"""A model directory whose files lie is refused in one line before transformers reads it (kvcodec.models.precheck).

A tiny random LLaMA (tests/_support/tiny_models.py) is copied and one of its files is made hostile: a
config.json describing more layers or other sizes than the checkpoint holds (transformers filled the rest
with random values, or allocated what the sizes describe), a weight renamed so the config's is missing, a
RoPE base that makes every key NaN, side files that are FIFOs or gigabytes, a FIFO named
``*.safetensors`` (``open`` blocked for ever).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from kvcodec.errors import KvcModelNotFoundError

from cliutil import run_kvc  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests._support.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("precheck") / "base", "dense")


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))


def _copy(tiny: Path, dest: Path, **config) -> Path:
    shutil.copytree(tiny, dest)
    cfg = json.loads((dest / "config.json").read_text())
    cfg.update(config)
    (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def _family(dest: Path, config: dict) -> Path:
    """A random 3-layer model of ``config``'s family at hidden size 128 with the tiny 512-token tokenizer (seconds)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests._support.tiny_models import tiny_tokenizer

    kw, tok = dict(config), tiny_tokenizer()
    cfg = AutoConfig.for_model(kw.pop("model_type"), hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                               vocab_size=len(tok), max_position_embeddings=256, **kw)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def _never_loaded(monkeypatch) -> None:
    import transformers

    def never(*a, **kw):
        raise AssertionError("transformers was asked to load the model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)


def _rename_a_weight(d: Path) -> None:
    from safetensors.numpy import load_file, save_file

    t = load_file(d / "model.safetensors")
    t["model.final_norm.weight"] = t.pop("model.norm.weight")  # same values, a name the config does not make
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("config, words", [
    # 40 layers over a 2-layer checkpoint loaded as a random model (and with real sizes allocated terabytes)
    (dict(num_hidden_layers=40), "describes a model of"),
    # sizes describing 100 GB of embeddings, key heads that do not match the checkpoint's projections
    (dict(vocab_size=10**11), "disagrees with the weights"),
    (dict(num_key_value_heads=4), "disagrees with the weights"),
    (dict(num_key_value_heads=3), "4 query heads in groups over 3 KV heads"),
    (dict(num_hidden_layers=10**12), "invalid head layout"),
    # a RoPE base that makes every rotated key NaN (the calibration then saved NaNs and crashed in a matrix inverse)
    (dict(rope_parameters={"rope_type": "default", "rope_theta": -5}), "rope_theta -5"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": float("nan")}), "rope_theta nan"),
    (dict(partial_rotary_factor=3), "partial_rotary_factor 3"),
    (dict(partial_rotary_factor=0), "partial_rotary_factor 0"),
])
def test_a_config_that_does_not_fit_the_weights_is_refused_before_the_load(tiny, tmp_path, monkeypatch, config, words):
    from kvcodec.models.load import load_model

    d = _copy(tiny, tmp_path / "m", **config)
    _never_loaded(monkeypatch)
    with pytest.raises(KvcModelNotFoundError, match=words) as e:
        load_model(str(d))
    assert "\n" not in str(e.value)


def test_a_weight_the_config_needs_but_the_checkpoint_lacks_is_refused(tiny, tmp_path):
    from kvcodec.models.load import load_model

    d = _copy(tiny, tmp_path / "m")
    _rename_a_weight(d)
    with pytest.raises(KvcModelNotFoundError, match="'model.norm.weight'.*would be random"):
        load_model(str(d))


def test_the_cli_says_one_line_not_transformers_load_report(tiny, tmp_path, monkeypatch, capsys):
    d = _copy(tiny, tmp_path / "m", num_hidden_layers=3)  # one layer missing: transformers' report is a table
    (tmp_path / "t.txt").write_text("a short text to capture")
    monkeypatch.chdir(tmp_path)
    code, _, err = run_kvc(["capture", "--text", "t.txt", "-o", "c.h5", "-m", str(d)], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == KvcModelNotFoundError.exit_code
    assert len(lines) == 1 and lines[0].startswith("kvc: error: ") and "describes a model" in lines[0], err


@pytest.mark.parametrize("name, make", [
    ("config.json", "huge"), ("tokenizer.json", "huge"), ("tokenizer.json", "fifo"), ("tokenizer_config.json", "fifo"),
    ("generation_config.json", "fifo"), ("chat_template.jinja", "dir"),
])
def test_side_files_are_regular_and_bounded_before_transformers_reads_them(tiny, tmp_path, monkeypatch, name, make):
    import transformers

    from kvcodec.models.load import load_model

    d = _copy(tiny, tmp_path / "m")
    p = d / name
    if p.exists():
        p.unlink()
    if make == "huge":  # 2 GB, sparse: transformers read it whole
        with open(p, "wb") as f:
            f.truncate(2 * 10**9)
    elif make == "fifo":
        os.mkfifo(p)
    else:
        p.mkdir()
    _never_loaded(monkeypatch)

    def never(*a, **kw):
        raise AssertionError("transformers read the directory")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", never)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", never)
    with pytest.raises(KvcModelNotFoundError, match="MiB a model's|not a regular file") as e:
        load_model(str(d))
    assert name in str(e.value)


def test_a_fifo_named_safetensors_is_refused_not_waited_on(tiny, tmp_path):
    from kvcodec.models.load import check_weights

    d = tiny.parent / "fifo-weights"
    shutil.copytree(tiny, d)
    (d / "model.safetensors").unlink()
    os.mkfifo(d / "model.safetensors")

    def release() -> None:  # frees an open() blocked on the FIFO, so a failing run ends instead of hanging
        time.sleep(5)
        try:
            os.close(os.open(d / "model.safetensors", os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass

    threading.Thread(target=release, daemon=True).start()
    t0 = time.monotonic()
    with pytest.raises(KvcModelNotFoundError, match="not a regular file"):
        check_weights(d)
    assert time.monotonic() - t0 < 4


def test_a_tokenizer_with_more_tokens_than_the_model_embeds_is_refused(tiny, tmp_path):
    """Another model's tokenizer copied in: ordinary text gave ids past the embedding (kvc ask: torch IndexError)."""
    from kvcodec.models.load import load_model, shipped_model_dir

    d = _copy(tiny, tmp_path / "m")
    for f in ("tokenizer.json", "tokenizer_config.json"):  # the embedded model's 49,152 tokens over 512 embeddings
        shutil.copy(shipped_model_dir("smollm2") / f, d / f)
    with pytest.raises(KvcModelNotFoundError, match="tokenizer has 49,152 tokens but the model embeds 512"):
        load_model(str(d))


def test_a_shipped_model_with_an_unwritable_cache_is_one_io_error(tmp_path, monkeypatch, capsys):
    """KVCODEC_CACHE naming a file: the first use's conversion escaped as NotADirectoryError, after announcing it."""
    from kvcodec.errors import KvcIOError
    from kvcodec.models.load import resolve_model_dir

    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "file"))
    with pytest.raises(KvcIOError, match="cannot write the converted model to .*Not a directory"):
        resolve_model_dir("smollm2")
    assert "converting" not in capsys.readouterr().err  # the error is the one line


def test_a_bidirectional_twin_of_a_causal_model_never_takes_its_cache(tmp_path):
    """Same weights, ``use_bidirectional_attention`` true: other K/V, and the fingerprint said the same model."""
    import torch

    from kvcodec.errors import KvcModelMismatchError
    from kvcodec.models.capture import capture
    from kvcodec.models.fingerprint import cache_config
    from kvcodec.models.load import load_model
    from tests._support.tiny_models import make_tiny_model

    causal = make_tiny_model(tmp_path / "causal", "sliding")
    bidi = _copy(causal, tmp_path / "bidi", use_bidirectional_attention=True)
    a, b = load_model(str(causal)), load_model(str(bidi))
    ca, cb = capture(a, token_ids=list(range(3, 15))), capture(b, token_ids=list(range(3, 15)))
    assert not all(torch.equal(x, y) for x, y in zip(ca.keys, cb.keys))
    with pytest.raises(KvcModelMismatchError, match="config_sha256"):
        b.fingerprint.check_compatible(ca.fingerprint)
    # the flag at its default (false, as Gemma 3's configs write it) changes no fingerprint: shipped calibrations hold
    cfg = json.loads((causal / "config.json").read_text())
    assert cache_config({**cfg, "use_bidirectional_attention": False}) == cache_config(
        {k: v for k, v in cfg.items() if k != "use_bidirectional_attention"})


@pytest.mark.parametrize("config, field, value", [
    (dict(model_type="gpt2", n_head=4), "scale_attn_weights", False),
    (dict(model_type="gpt_neox", num_attention_heads=4), "use_parallel_residual", False),
    (dict(model_type="stablelm", num_attention_heads=4, num_key_value_heads=2), "use_parallel_residual", True),
    (dict(model_type="opt", num_attention_heads=4, ffn_dim=256, word_embed_proj_dim=128), "do_layer_norm_before", False),
    # a mixture of experts' routing (its family's defaults pinned in fingerprint.py: no existing id changes)
    (dict(model_type="mixtral", num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
          num_experts_per_tok=2), "num_experts_per_tok", 1),
    (dict(model_type="qwen2_moe", num_attention_heads=4, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
          moe_intermediate_size=64, shared_expert_intermediate_size=64), "norm_topk_prob", True),
    # fields only a few families have (the unseen-family sweep): OLMo's Q/K/V clamp, norm epsilons named otherwise,
    # BLOOM's residual after the norm, group-limited routing, Llama 4's query temperature on NoPE layers
    (dict(model_type="olmo", num_attention_heads=4), "clip_qkv", 0.05),
    (dict(model_type="starcoder2", num_attention_heads=4, num_key_value_heads=2), "norm_epsilon", 0.5),
    (dict(model_type="nemotron", num_attention_heads=4, num_key_value_heads=2), "norm_eps", 0.5),
    (dict(model_type="bloom", n_head=4), "apply_residual_connection_post_layernorm", True),
    (dict(model_type="glm4_moe", num_attention_heads=4, num_key_value_heads=2, head_dim=32, n_routed_experts=4,
          num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=0, pad_token_id=None), "n_group", 2),
    (dict(model_type="llama4_text", num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=2,
          num_experts_per_tok=1, no_rope_layers=[1, 0, 1], intermediate_size_mlp=256), "floor_scale", 4),
])
def test_a_config_flag_that_changes_the_kv_changes_the_fingerprint(tmp_path, config, field, value):
    """Same weights, one flag flipped: other K/V, and the fingerprint said the same model (found by flipping every
    field of each family's config.json that CONFIG_FIELDS leaves out, one at a time)."""
    import torch

    from kvcodec.errors import KvcModelMismatchError
    from kvcodec.models.capture import capture
    from kvcodec.models.load import load_model
    a = _family(tmp_path / "a", config)
    b = _copy(a, tmp_path / "b", **{field: value})
    la, lb = load_model(str(a)), load_model(str(b))
    ids = list(range(3, 20))
    ca, cb = capture(la, token_ids=ids), capture(lb, token_ids=ids)
    assert not all(torch.allclose(x, y) for x, y in zip(ca.keys + ca.values, cb.keys + cb.values))
    with pytest.raises(KvcModelMismatchError, match="config_sha256"):
        lb.fingerprint.check_compatible(ca.fingerprint)


@pytest.mark.parametrize("change, words", [
    # MPT's fused projection is 3 x hidden whatever the head count: 9 heads over 128 loaded, then the forward failed
    (dict(n_heads=9), "9 heads over hidden size 128"),
])
def test_heads_that_do_not_divide_are_refused_at_load(tmp_path, change, words):
    from kvcodec.models.load import load_model

    d = _family(tmp_path / "mpt", dict(model_type="mpt", num_attention_heads=4))
    with pytest.raises(KvcModelNotFoundError, match=words):
        load_model(str(_copy(d, tmp_path / "m", **change)))


def test_a_router_top_k_past_the_experts_is_refused_at_load(tmp_path):
    """num_experts_per_tok 5 of 4 experts: the weights fit, the forward escaped as RuntimeError."""
    from kvcodec.models.load import load_model

    d = _family(tmp_path / "moe", dict(model_type="mixtral", num_attention_heads=4, num_key_value_heads=2,
                                                  num_local_experts=4, num_experts_per_tok=2))
    with pytest.raises(KvcModelNotFoundError, match="5 of its 4 experts"):
        load_model(str(_copy(d, tmp_path / "m", num_experts_per_tok=5)))


def test_an_added_token_past_the_embedding_is_one_line_from_ask(tiny, tmp_path, monkeypatch, capsys):
    """A pad-like token added to the tokenizer without resizing the embedding loads (real checkpoints do this); a
    document or question holding it escaped kvc ask's prefill (plain and --blend) as torch IndexError."""
    from transformers import AutoTokenizer

    d = _copy(tiny, tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(d)
    tok.add_tokens(["<|extra|>"], special_tokens=True)
    tok.save_pretrained(d)
    (tmp_path / "doc.txt").write_text("a document with <|extra|> in it")
    (tmp_path / "plain.txt").write_text("a plain document")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    common = ["--preset", "lossless", "--max-new-tokens", "2", "--store", str(tmp_path / "st"), "-m", str(d)]
    for args in (["--doc", "doc.txt", "what?"], ["--doc", "plain.txt", "what <|extra|>?"],
                 ["--blend", "--doc", "doc.txt", "--doc", "plain.txt", "what?"]):
        code, _, err = run_kvc(["ask", *args, *common], capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and len(lines) == 1 and "got 512 (a token of its tokenizer" in lines[0], (args, err)


def test_a_fifo_as_the_fingerprint_key_disables_the_cache_instead_of_hanging(tiny, tmp_path, capsys):
    """<cache>/fingerprint.key a FIFO: opening it blocked every model load for ever."""
    from kvcodec.models import fingerprint as F

    key = tmp_path / "cache" / "fingerprint.key"
    key.parent.mkdir()
    os.mkfifo(key)

    def release() -> None:  # frees an open() blocked on the FIFO, so a failing run ends instead of hanging
        time.sleep(5)
        try:
            os.close(os.open(key, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass

    threading.Thread(target=release, daemon=True).start()
    t0 = time.monotonic()
    F._warned.clear()
    assert F._secret() is None
    assert time.monotonic() - t0 < 4
    assert "fingerprint cache disabled" in capsys.readouterr().err


def test_a_fingerprint_cache_entry_nested_too_deep_is_ignored(tiny, tmp_path):
    """A planted cache entry of JSON nested 400,000 deep escaped every load of the model as RecursionError."""
    from kvcodec.models import fingerprint as F

    F._memo.clear()
    d = _copy(tiny, tmp_path / "m").resolve()
    F._secret()  # the key, so the cache is read
    path = F._cache_path("weights", d)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[" * 400_000 + "]" * 400_000)
    assert F.weights_sha256(d) == F._hash_files(F.weight_files(d))


def test_a_huge_safetensors_index_is_refused_unread(tiny, tmp_path):
    """A 2 GB model.safetensors.index.json (sparse here) was read whole by check_weights."""
    from kvcodec.models.load import check_weights

    d = _copy(tiny, tmp_path / "m")
    with open(d / "model.safetensors.index.json", "wb") as f:
        f.truncate(2 * 10**9)
    with pytest.raises(KvcModelNotFoundError, match="more than an index can be"):
        check_weights(d)


def test_a_directory_with_custom_code_is_refused_without_asking(tiny, tmp_path, monkeypatch):
    """config.json naming its own Python (auto_map): transformers asked "Do you wish to run the custom code? [y/N]"
    (input(), on a terminal or from whatever stdin holds: `yes | kvc ...`), and a "y" ran the directory's code."""
    import builtins

    from kvcodec.models.load import load_model

    d = _copy(tiny, tmp_path / "m", model_type="evil_custom",
              auto_map={"AutoConfig": "configuration_evil.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"})
    marker = tmp_path / "RAN"
    for f in ("configuration_evil.py", "modeling_evil.py"):
        (d / f).write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n")
    asked = []
    monkeypatch.setattr(builtins, "input", lambda *a: asked.append(a) or "y")
    with pytest.raises(KvcModelNotFoundError, match="custom code"):
        load_model(str(d))
    assert not asked and not marker.exists()


def test_integers_stored_for_a_float_weight_are_refused(tiny, tmp_path):
    """A header naming I32 for the (float) lm_head: transformers turned each stored integer into a float weight and
    the model loaded, silently another model."""
    import struct

    from kvcodec.models.load import load_model

    d = _copy(tiny, tmp_path / "m")
    p = d / "model.safetensors"
    b = p.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    hdr = json.loads(b[8:8 + n])
    hdr["lm_head.weight"]["dtype"] = "I32"
    new = json.dumps(hdr).encode()
    new += b" " * (-len(new) % 8)
    p.write_bytes(struct.pack("<Q", len(new)) + new + b[8 + n:])
    with pytest.raises(KvcModelNotFoundError, match="stores lm_head.weight as I32, not as floating point"):
        load_model(str(d))


def test_loads_in_two_threads_run_one_at_a_time_and_leave_transformers_as_they_found_it(tiny, monkeypatch):
    """transformers' loading patches process-wide state and puts back what it saved (from_pretrained's
    no_tie_weights: PreTrainedModel.tie_weights a no-op, then back; the log level). Two threads' loads that
    overlapped put each other's patches back in the wrong order: tie_weights stayed a no-op for the process, so
    every later load of a model with tied embeddings (SmolLM2) was refused for an untied, random head, and
    transformers stayed at error level with its progress bars back on. Loads now run one at a time."""
    from transformers import PreTrainedModel
    from transformers.utils import logging as hf_logging

    from kvcodec.models import load, precheck

    real = precheck.check_vocabulary
    lock = threading.Lock()
    inside, most, second_in = [0], [0], threading.Event()

    def check_vocabulary(*a, **kw):  # called inside the load section, after transformers' from_pretrained
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            if inside[0] > 1:
                second_in.set()
        try:
            if threading.current_thread().name == "first":
                second_in.wait(3)  # old code: the second load comes in meanwhile
            return real(*a, **kw)
        finally:
            with lock:
                inside[0] -= 1

    monkeypatch.setattr(precheck, "check_vocabulary", check_vocabulary)
    tie = PreTrainedModel.tie_weights
    before = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_warning()
    hf_logging.disable_progress_bar()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            load.load_model(str(tiny))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        first = threading.Thread(target=run, name="first")
        first.start()
        time.sleep(0.5)
        second = threading.Thread(target=run, name="second")
        second.start()
        for t in (first, second):
            t.join(120)
        assert not errors, errors
        assert most[0] == 1, "two loads were inside transformers' loading at once"
        assert PreTrainedModel.tie_weights is tie
        assert hf_logging.get_verbosity() == hf_logging.WARNING
        assert not hf_logging.is_progress_bar_enabled()
    finally:
        PreTrainedModel.tie_weights = tie
        hf_logging.set_verbosity(before[0])
        (hf_logging.enable_progress_bar if before[1] else hf_logging.disable_progress_bar)()


def test_multi_head_latent_attention_is_refused_at_load(tmp_path):
    """DeepSeek-V2's MLA: transformers caches one compressed latent (kv_lora_rank wide) and one shared RoPE key per
    token, not the 4 heads x 16 its config's head layout says. The load succeeded and the first capture failed on a
    shape no one could read ("layer 0 key has shape (1, 120, 32), expected (4, 120, 16)"); now the load says why."""
    from kvcodec.models.load import load_model

    d = _family(tmp_path / "mla", dict(model_type="deepseek_v2", num_attention_heads=4, kv_lora_rank=32, q_lora_rank=None,
                                       qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4,
                                       num_experts_per_tok=2, moe_intermediate_size=64, first_k_dense_replace=1,
                                       n_group=1, topk_group=1))
    with pytest.raises(KvcModelNotFoundError, match=r"multi-head latent attention \(kv_lora_rank 32\)"):
        load_model(str(d))
