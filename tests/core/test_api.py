"""``kvcodec.encode`` / ``kvcodec.open``: what they refuse is one KvcError line, never a raw exception, and
``encode`` never writes over its own input (issue 55). ``kvcodec.api.encode_cache`` is the one door to the
encoder (issue 56): the writer with the plan's inputs resolved once, and nothing above the API around it."""

from __future__ import annotations

import ast
import io
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import kvcodec
from kvcodec.core.kvcache import save_capture
from kvcodec import api
from kvcodec.errors import KvcError, KvcInputError, KvcIOError, KvcModelMismatchError
from kvcodec.accounting import PruneRecord, context_elements, prune_record
from kvcodec.testing.golden import _synthetic


@pytest.fixture()
def capture_file(tmp_path):
    p = tmp_path / "cap.h5"
    save_capture(_synthetic(torch.float16, 8), p)
    return p


@pytest.fixture()
def kvc_file(tmp_path):
    p = tmp_path / "a.kvc"
    p.write_bytes(kvcodec.encode(_synthetic(torch.float16, 8), None, preset="lossless").data)
    return p


def test_encode_refuses_to_overwrite_its_source(capture_file, tmp_path):
    before = capture_file.read_bytes()
    link = tmp_path / "link.h5"
    link.symlink_to(capture_file)
    for dest in (capture_file, str(capture_file), link):
        with pytest.raises(KvcInputError, match="same file as the input"):
            kvcodec.encode(capture_file, dest, preset="lossless")
    assert capture_file.read_bytes() == before
    assert kvcodec.encode(capture_file, tmp_path / "out.kvc", preset="lossless").size > 0  # a different file is fine


def test_encode_refuses_sources_and_destinations_it_cannot_use(capture_file, kvc_file, tmp_path):
    with pytest.raises(KvcInputError, match="KVCache or the path"):
        kvcodec.encode(kvc_file.read_bytes(), None, preset="lossless")
    with open(kvc_file, "rb") as ro, pytest.raises(KvcInputError, match="not writable"):
        kvcodec.encode(capture_file, ro, preset="lossless")
    with open(tmp_path / "t.txt", "w") as text, pytest.raises(KvcInputError, match="text mode"):
        kvcodec.encode(capture_file, text, preset="lossless")
    with pytest.raises(KvcInputError, match="NUL"):
        kvcodec.encode(capture_file, str(tmp_path / "a\0b.kvc"), preset="lossless")
    buf = io.BytesIO()  # a writable binary object is fine
    assert kvcodec.encode(capture_file, buf, preset="lossless").size == len(buf.getvalue()) > 0


def test_encode_refuses_settings_that_cannot_apply(capture_file):
    with pytest.raises(KvcInputError, match="chunk_heads must be an integer in \\[1, 2\\] .the cache has 2 KV heads"):
        kvcodec.encode(capture_file, None, preset="lossless", chunk_heads=99)
    with pytest.raises(KvcInputError, match="chunk_heads"):
        kvcodec.encode(capture_file, None, preset="lossless", chunk_heads=True)
    with pytest.raises(KvcInputError, match="sink .100000. is more tokens than the context has .8."):
        kvcodec.encode(capture_file, None, preset="near-lossless", overrides={"sink": 100000})


@pytest.mark.parametrize("kw, words", [
    ({"preset": 3}, "preset must be a preset name"), ({"overrides": 3}, "overrides must be a dict"),
    ({"overrides": [1]}, "overrides must be a dict"), ({"progress": 3}, "progress must be a callable"),
    ({"prune": 3}, "prune must be a spec string"), ({"chunk_tokens": 2**70}, "chunk_tokens must be an integer"),
])
def test_encode_refuses_arguments_of_the_wrong_type(capture_file, kw, words):
    """Each escaped as AttributeError / TypeError, or (chunk_tokens=2**70) failed only the writer's read-back;
    prune=3 loaded the default model first."""
    with pytest.raises(KvcInputError, match=words):
        kvcodec.encode(capture_file, None, **{"preset": "lossless", **kw})


@pytest.mark.parametrize("kw, words", [
    ({"text": 3}, "text must be a str"), ({"text": b"some text"}, "text must be a str"), ({"text": ["a"]}, "text must be"),
    ({"text": "some text", "max_tokens": "x"}, "max_tokens must be"), ({"text": "some text", "max_tokens": 2.5}, "max_tokens"),
    ({"text": "some text", "max_tokens": True}, "max_tokens must be"),
])
def test_encode_refuses_a_text_or_max_tokens_of_the_wrong_type(kw, words):
    """Refused before the model is looked up (model="/nonexistent" is never reached): text=3 and max_tokens="x"
    escaped as AttributeError / TypeError after the model had loaded, max_tokens=2.5 / True were taken."""
    with pytest.raises(KvcInputError, match=words):
        kvcodec.encode(None, None, model="/nonexistent", preset="lossless", **kw)


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full")
def test_encode_into_a_file_object_that_cannot_be_written(capture_file, tmp_path):
    with open("/dev/full", "wb", buffering=0) as full, pytest.raises(KvcIOError, match="no space left"):
        kvcodec.encode(capture_file, full, preset="lossless", verify="off")
    with open(tmp_path / "closed.kvc", "wb") as f:
        pass
    with pytest.raises(KvcInputError, match="closed"):
        kvcodec.encode(capture_file, f, preset="lossless")


def test_read_cache_refuses_token_ids_that_are_not_integers():
    """A file that stores only the hash of its ids takes them from the caller: "abc", a dict and 2**70 escaped as
    ValueError / TypeError / OverflowError, and float ids were truncated."""
    from kvcodec.format.writer import encode_kvc_bytes
    from kvcodec.plan.presets import get_plan

    c = _synthetic(torch.float16, 8)
    r = kvcodec.open(encode_kvc_bytes(c, get_plan("lossless", c), store_token_ids=False))
    for bad in ("abc", {"a": 1}, np.array([2**70] * 8, dtype=object), np.asarray(c.token_ids, np.float64), [1.5] * 8):
        with pytest.raises(KvcInputError, match="token_ids must be integers"):
            r.read_cache(token_ids=bad)
    with pytest.raises(KvcInputError, match="do not match"):
        r.read_cache(token_ids=[1] * 8)
    assert r.read_cache(token_ids=torch.from_numpy(np.asarray(c.token_ids))).num_context_tokens == 8
    assert r.read_cache(token_ids=list(map(int, c.token_ids))).num_context_tokens == 8


def test_a_cache_of_the_wrong_parts_is_refused_when_built():
    """A KVCache (what encode takes) of numpy arrays, without a fingerprint or of meta tensors escaped as
    AttributeError / NotImplementedError; float token ids were truncated, "abc" escaped as ValueError."""
    from kvcodec.core.kvcache import KVCache
    from kvcodec.errors import KvcFormatError

    c = _synthetic(torch.float16, 8)
    for keys, values, ids, fp, words in (
        ([k.numpy() for k in c.keys], c.values, c.token_ids, c.fingerprint, "must be a torch.Tensor"),
        ([k.to("meta") for k in c.keys], c.values, c.token_ids, c.fingerprint, "meta tensor"),
        (c.keys, c.values, c.token_ids, None, "fingerprint must be a ModelFingerprint"),
        (c.keys, c.values, c.token_ids.astype(np.float64) + 0.5, c.fingerprint, "token ids must be integers"),
        (c.keys, c.values, "abc", c.fingerprint, "token ids must be integers"),
        # uint64 ids past 2**63 wrapped to negative ones (the reader's check refused them; now the one check does)
        (c.keys, c.values, np.full(8, 1 << 63, dtype=np.uint64), c.fingerprint, "token ids must be integers"),
    ):
        with pytest.raises(KvcFormatError, match=words):
            KVCache(keys, values, ids, fp)
    assert KVCache(c.keys, c.values, torch.from_numpy(np.asarray(c.token_ids)), c.fingerprint).num_context_tokens == 8


class _FailingReader:
    """A range reader whose reads fail as a network or disk would."""

    size = 4096

    def read(self, offset: int, length: int) -> bytes:
        raise OSError(5, "Input/output error")

    def close(self) -> None:
        pass


def test_open_refusals_are_kvc_errors(kvc_file):
    with pytest.raises(KvcInputError, match="NUL"):
        kvcodec.open(str(kvc_file) + "\0x")
    with pytest.raises(KvcIOError):
        kvcodec.open(_FailingReader())
    with pytest.raises(KvcError):
        kvcodec.open(kvc_file, model="no-such-model-name")
    # each escaped as AttributeError / TypeError
    for model in (3, object()):
        with pytest.raises(KvcInputError, match="model must be a loaded model or a ModelFingerprint"):
            kvcodec.open(kvc_file, model=model)
    with pytest.raises(KvcInputError, match="takes no option 'bogus'"):
        kvcodec.open(kvc_file, bogus=1)
    with pytest.raises(KvcInputError, match="attachment_resolver must be"):
        kvcodec.open(kvc_file, attachment_resolver=3)
    with open(kvc_file) as text, pytest.raises(KvcInputError, match="text mode"):  # escaped as UnicodeDecodeError
        kvcodec.open(text)
    with kvcodec.open(kvc_file) as r:
        with pytest.raises(KvcInputError, match="model must be"):
            r.read_cache(model=3)
        with pytest.raises(KvcInputError, match="backend must be one of"):
            r.read_layer(0, backend=3)
        with pytest.raises(KvcInputError, match="unknown backend 'tpu'"):  # the caller's error, not the file's problem
            r.verify(backend="tpu")


@pytest.mark.model
class _OwnErrorReader:
    """A caller's range reader that fails its own way: a ValueError, as a closed client or a parser would."""

    def __init__(self, data: bytes, broken: bool) -> None:
        self.data, self.broken, self.size = data, broken, len(data)

    def read(self, offset: int, length: int) -> bytes:
        if self.broken:
            raise ValueError("client is closed\nsecond line")
        return self.data[offset : offset + length]


def test_a_callers_reader_failing_its_own_way_is_one_kvc_error(kvc_file):
    """A range reader (or file object) whose read raises its own exception, not an OSError, passed through raw.
    Now one KvcIOError line naming the source and the offset, with the caller's exception chained, whether the
    read fails at open (the trailer) or later (a layer's chunks); the same for a closed file object."""
    data = kvc_file.read_bytes()
    with pytest.raises(KvcIOError, match=r"_OwnErrorReader: reading at offset \d+ failed: ValueError: client is closed "
                                         r"second line") as ei:
        kvcodec.open(_OwnErrorReader(data, True))
    assert isinstance(ei.value.__cause__, ValueError) and "\n" not in str(ei.value)
    src = _OwnErrorReader(data, False)
    with kvcodec.open(src) as r:  # the header and index read fine; the chunks do not
        src.broken = True
        with pytest.raises(KvcIOError, match="failed: ValueError"):
            r.read_cache()
    f = open(kvc_file, "rb")  # noqa: SIM115 - closed under the reader on purpose
    with kvcodec.open(f) as r:
        f.close()
        with pytest.raises(KvcIOError, match="failed: ValueError: .*closed file"):
            r.read_cache()


def test_open_takes_a_model_name_as_encode_does(lm, small_cache):
    data = kvcodec.encode(small_cache, None, preset="lossless").data
    with kvcodec.open(data, model="smollm2") as r:
        assert r.header.num_context_tokens == small_cache.num_context_tokens


@pytest.mark.model
def test_capture_refuses_token_ids_that_are_not_integers(lm):
    """kvcodec.api.capture(lm, token_ids="abc") escaped as ValueError; float ids were truncated."""
    for bad in ("abc", [1.5, 2.0], {"a": 1}):
        with pytest.raises(KvcInputError, match="token ids must be integers"):
            api.capture(lm, token_ids=bad)
    assert api.capture(lm, token_ids=[1, 2, 3]).num_context_tokens == 3


def test_encode_cache_is_the_writer_with_the_plan_resolved(capture_file):
    from kvcodec.core.kvcache import load_capture
    from kvcodec.format import encode_kvc_bytes
    from kvcodec.plan.presets import get_plan

    cache = load_capture(capture_file)
    enc = api.encode_cache(cache, "lossless")
    assert enc.data == encode_kvc_bytes(cache, get_plan("lossless", cache))
    assert (enc.preset, enc.size, enc.kv_elements, enc.output) == ("lossless", len(enc.data), context_elements(cache), None)
    assert kvcodec.encode(cache, None, preset="lossless").data == enc.data  # kvcodec.encode ends in it
    plan = get_plan("zstd", cache)  # a ready plan, with the header's name and meta of the caller's
    mine = api.encode_cache(cache, plan, label="mine", meta={"x": 1}, chunk_heads=1)
    assert mine.data == encode_kvc_bytes(cache, plan, preset="mine", meta={"x": 1}, chunk_heads=1)
    assert (mine.preset, mine.meta) == ("mine", {"x": 1})
    buf = io.BytesIO()
    assert api.encode_cache(cache, plan, buf).size == len(buf.getvalue()) and buf.getvalue() == api.encode_cache(cache, plan).data
    assert api.encode_cache(cache, "lossless", capture_file.with_suffix(".kvc")).output == str(capture_file.with_suffix(".kvc"))
    assert capture_file.with_suffix(".kvc").read_bytes() == enc.data
    with pytest.raises(KvcInputError, match="ready plan"):
        api.encode_cache(cache, plan, overrides={"level": 9})


def test_a_pruned_cache_is_charged_against_its_context():
    pruned = _synthetic(torch.float16, 4, n_ctx=8, positions=np.array([0, 2, 5, 7]))
    pruned.meta["prune"] = prune_record("h2o", "h2o:0.5", 8, 4, "original", heavy=2, recent=2)
    enc = api.encode_cache(pruned, "lossless")
    assert enc.kv_elements == 2 * pruned.fingerprint.num_kv_heads * sum(pruned.fingerprint.head_dims) * 8
    assert enc.prune == PruneRecord("h2o", "h2o:0.5", 8, 4, 0.5, "original")
    assert pruned.meta["prune"]["heavy"] == 2
    with pytest.raises(ValueError, match="record's own"):
        prune_record("h2o", "h2o:0.5", 8, 4, "original", kept_fraction=0.9)


class _RateModel:
    """A rate model as far as the API looks: this context's factor is its token count (no chat factor measured)."""

    chat_factor: dict = {}

    def __init__(self, cal):
        self.cal = cal

    def factor(self, preset, tokens):
        return float(tokens)


class _Planned(Exception):
    """Raised by the planner spy with ``stop``: the encode ends where it would have planned."""


def _planner_spy(monkeypatch, stop=False):
    """Every input the planner (``plan_preset``) is handed, with the model's measures stubbed out."""
    import kvcodec.models.importance as importance
    import kvcodec.plan.presets as presets

    monkeypatch.setattr(api, "resolve_rate_model", lambda lm, cal: _RateModel(cal))  # resolved here, not planned
    monkeypatch.setattr(importance, "cache_importance", lambda lm, c, window: ("importance of", lm, window))
    seen: list = []

    def spy(name, c, **kw):
        rate = kw.get("rate")
        seen.append((name, kw.get("cal"), None if rate is None else (rate.rm.cal, rate.factor, rate.chat),
                     kw.get("importance"), kw.get("check_model")))
        if stop:
            raise _Planned

    monkeypatch.setattr(presets, "plan_preset", spy)
    return seen


def test_make_plan_resolves_the_planners_inputs_and_uses_the_model_only_where_the_preset_does(monkeypatch, capture_file):
    """The API resolves the calibration (the model's, or without one the cache's model's stored one), the rate
    model and this context's factor, and the token importance, and hands them to the planner as data; the model
    itself reaches the planner only for the opt-in check (issue 56: the planner only plans)."""
    import kvcodec.calibration.build as build
    import kvcodec.calibration.store as store
    from kvcodec.core.kvcache import load_capture

    cache = load_capture(capture_file)
    model = SimpleNamespace(fingerprint=cache.fingerprint, model=None)  # a loaded model, as far as the API looks
    monkeypatch.setattr(build, "ensure_calibration", lambda lm: ("calibration of", lm))
    monkeypatch.setattr(store, "require_calibration", lambda fp: "stored")
    seen = _planner_spy(monkeypatch)
    api.make_plan(cache, "lossless", model=model)
    api.make_plan(cache, "baseline:int8", model=model)
    api.make_plan(cache, "balanced", model=model, rate="fixed")
    api.make_plan(cache, "balanced", model=model, build_calibration=False)
    api.make_plan(cache, "balanced", model=model, calibration="given", rate="check")
    api.make_plan(cache, "balanced", model=model, calibration="given", overrides={"step0": 0.5})
    api.make_plan(cache, "balanced")
    imp, T = ("importance of", model, 512), float(cache.num_tokens)
    assert seen == [("lossless", None, None, None, None), ("baseline:int8", None, None, None, None),
                    ("balanced", ("calibration of", model), None, imp, None),
                    ("balanced", "stored", ("stored", T, 1.0), imp, None),
                    ("balanced", "given", ("given", T, 1.0), imp, model),
                    ("balanced", "given", None, imp, None), ("balanced", "stored", None, None, None)]
    assert api.resolve_calibration(None, "balanced") is None and api.resolve_calibration(model, "fp16") is None
    with pytest.raises(KvcInputError, match="rate must be one of"):
        api.make_plan(cache, "balanced", rate="guess")


def test_a_steered_cache_is_planned_without_the_model(monkeypatch, capture_file):
    """A cache with an attention bias is planned without measuring it (no rate control, no rate model, no token
    importance), with the model's calibration, resolved by the API as for any other encode."""
    from kvcodec.core.kvcache import load_capture

    cache = load_capture(capture_file)
    model = SimpleNamespace(fingerprint=cache.fingerprint, model=None)
    monkeypatch.setattr(api, "resolve_calibration", lambda m, preset, build=True: ("calibration of", m, preset))
    seen = _planner_spy(monkeypatch, stop=True)
    with pytest.raises(_Planned):
        api.encode_cache(cache, "balanced", model=model, attention_bias=object())
    with pytest.raises(_Planned):
        api.encode_cache(cache, "balanced", model=model)
    cal = ("calibration of", model, "balanced")
    assert seen == [("balanced", cal, None, None, None),
                    ("balanced", cal, (cal, float(cache.num_tokens), 1.0), ("importance of", model, 512), None)]


def test_open_names_each_side_of_a_model_mismatch():
    """kvcodec.load_into checks through kvcodec.open: the file's value is named as the file's, the model's as the model's."""
    import dataclasses

    from kvcodec.testing.golden import SYNTH_FP

    fp = dataclasses.replace(SYNTH_FP, version=2, config_sha256="c" * 64)
    data = api.encode_cache(_synthetic(torch.float16, 8, fp=fp), "lossless").data
    other = dataclasses.replace(fp, weights_sha256="0" * 64)
    with pytest.raises(KvcModelMismatchError, match=f"{fp.weights_sha256[:16]}.* in the .kvc file, 0000.* in the model"):
        kvcodec.open(data, model=other)
    with kvcodec.open(data, model=fp) as r:
        assert r.fingerprint == fp


ROOT = Path(__file__).resolve().parents[2]

def _encode_door() -> dict:
    """pyproject.toml's "one way to encode" contract (issue 56): the forbidden one on ``kvcodec.format.writer``."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    return next(c for c in contracts if c["type"] == "forbidden" and "kvcodec.format.writer" in c["forbidden_modules"])


def test_above_the_api_nothing_reaches_the_writer_through_the_format_package():
    """The contract's blind spot: ``from kvcodec.format import write_kvc`` is an import of the package, not of
    ``kvcodec.format.writer``, so import-linter lets it through. The packages the contract holds take none of the
    writer's entry points from the package root either (the contract's ignored importers excepted)."""
    door = _encode_door()
    pending = {rule.split(" -> ")[0].strip() for rule in door.get("ignore_imports", [])}
    writer_names = {"write_kvc", "encode_kvc_bytes", "write_kvc_stream", "WriteOptions"}
    bad = []
    for pkg in door["source_modules"]:
        for f in sorted((ROOT / Path(*pkg.split("."))).rglob("*.py")):
            mod = "kvcodec." + ".".join(f.relative_to(ROOT / "kvcodec").with_suffix("").parts)
            if mod in pending:
                continue
            for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
                if isinstance(node, ast.ImportFrom) and node.module == "kvcodec.format":
                    names = sorted({a.name for a in node.names} & writer_names)
                    if names:
                        bad.append(f"{mod} imports {names} from kvcodec.format (use kvcodec.api.encode_cache)")
    assert not bad, bad
