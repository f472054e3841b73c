"""Calibration identity: bound to its model, its own checksum, verified on every load; O(1) lookup.

The format-level cases use small calibrations; the encode/decode cases use the
real model's cache (a 64-token capture) with a calibration bound to its
fingerprint, so what is refused is exactly what `kvc encode` / a decode would use.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from kvcodec.calibration import record as C_record
from kvcodec.calibration import store as C_store
from kvcodec.errors import KvcError, KvcFormatError, KvcModelMismatchError
from kvcodec.calibration.record import Calibration
from kvcodec.calibration.store import load_calibration, resolve_attachment, save_calibration


pytestmark = pytest.mark.usefixtures("private_calibration_cache")  # tests/calibration/conftest.py


def _cal(L: int = 3, H: int = 2, D: int = 8, seed: int = 0) -> Calibration:
    """A well-formed calibration: orthonormal bases, decreasing eigenvalues, per-layer distinct means."""
    rng = np.random.default_rng(seed)
    q = np.linalg.qr(rng.standard_normal((L, 2, H, D, D)))[0]
    eig = np.sort(rng.random((L, 2, H, D)), axis=-1)[..., ::-1].astype(np.float32)
    mean = (rng.standard_normal((L, 2, H, D)) + np.arange(L)[:, None, None, None]).astype(np.float32)
    sens = (1 + rng.random((L, 2))).astype(np.float32)
    return Calibration(C_record.snap_basis(q), mean, np.ascontiguousarray(eig), sens, {"texts": ["synthetic"]})


FID_A, FID_B = "a" * 32, "b" * 32


def _rewrite(path, mutate_tensors=None, mutate_meta=None, raw=False):
    """Rewrite a calibration file in place with changed tensors/meta (an attacker's or a bug's edit).

    The mutations see the arrays a loaded calibration holds (``pca.basis`` float16, not the v3 file's grid), and
    the result is stored the v3 way again (re-gridded, recompressed): a tamperer who knows the format. ``raw``:
    they see and change the file's own tensors instead (the grid codes' blob, the exponents)."""
    from safetensors.numpy import load_file
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta = json.loads(f.metadata()["kvcodec"])
    t = {k: np.array(v) for k, v in load_file(str(path)).items()}
    if not raw:
        t["pca.basis"] = C_store._basis_of_codes(t, KvcFormatError)
        del t["pca.basis.codes.zst"], t["pca.basis.exp"]
    if mutate_tensors:
        mutate_tensors(t)
    if mutate_meta:
        mutate_meta(meta, t)
    if not raw:
        t.update(C_store._grid_tensors(*C_record.grid_codes(t.pop("pca.basis"))))
    save_file(t, str(path), metadata={"kvcodec": json.dumps(meta, sort_keys=True)})


def test_roundtrip_records_binding_and_checksum():
    save_calibration(_cal(), FID_A)
    cal = load_calibration(FID_A)
    assert cal.meta["fingerprint_id"] == FID_A and len(cal.meta["content_sha256"]) == 64
    assert cal.meta["version"] == C_record.CALIB_VERSION
    sha = cal.meta["sha256.pca.basis"]
    assert np.array_equal(resolve_attachment("pca.basis", sha), cal.attachments["pca.basis"])
    assert resolve_attachment("pca.mean", sha) is None  # name must match too
    assert resolve_attachment("pca.basis", "0" * 64) is None


def test_the_file_stores_the_basis_grid_and_reads_back_every_bit():
    """v3 (issue 38): the basis is stored as 8-bit codes + a power-of-two exponent per column, zstd-compressed, and
    loads back to the very float16 arrays (and attachment sha256) it was saved from; a block-diagonal basis (zeros
    off its blocks) compresses to little more than its blocks. A basis off the grid is refused, not snapped."""
    cal = _cal(L=2, H=2, D=64)
    path = save_calibration(cal, FID_A)
    got = load_calibration(FID_A)
    assert got.basis.dtype == np.float16 and np.array_equal(got.basis.view(np.uint16), cal.basis.view(np.uint16))
    assert got.meta["sha256.pca.basis"] == C_store.array_sha256(cal.attachments["pca.basis"])
    dense = path.stat().st_size
    blocky = _cal(L=2, H=2, D=64, seed=1)
    b = blocky.basis.copy()
    b[..., :32, 32:] = 0
    b[..., 32:, :32] = 0  # two 32-channel blocks, as calibration/fit.py builds for wide heads
    blocky.basis = C_record.snap_basis(b)
    assert save_calibration(blocky, FID_B).stat().st_size < 0.75 * dense
    assert np.array_equal(load_calibration(FID_B).basis, blocky.basis)
    off = _cal(L=2, H=2, D=64)
    off.basis = (off.basis.astype(np.float32) * 1.001).astype(np.float16)  # not on the grid
    with pytest.raises(KvcError, match="grid"):
        C_store.write_calibration_file(off, FID_A, path.with_name("off.safetensors"))


def test_a_version_2_calibration_is_still_read(tmp_path):
    """Calibrations built before v3 (a float16 basis in the file) keep working, found where they were saved, so the
    `.kvc` files written with them still resolve; a v3 one saved later replaces it."""
    from safetensors.numpy import save_file

    cal = _cal()
    t = {"pca.basis": cal.basis, "pca.mean": cal.mean, "pca.eigval": cal.eigval, "sens.kl_per_mse": cal.sensitivity}
    meta = dict(cal.meta, format=C_record.CALIB_FORMAT, version=2, fingerprint_id=FID_A)
    meta.update({"sha256." + k: C_store.array_sha256(v) for k, v in cal.attachments.items()})
    meta["content_sha256"] = C_store.content_sha256(t, meta)
    v2 = C_store.calibration_dir(FID_A) / "calib-v2.safetensors"
    v2.parent.mkdir(parents=True)
    save_file(t, str(v2), metadata={"kvcodec": json.dumps(meta, sort_keys=True)})
    got = load_calibration(FID_A)
    assert got.meta["version"] == 2 and np.array_equal(got.basis, cal.basis)
    save_calibration(_cal(seed=2), FID_A)
    assert not v2.exists() and load_calibration(FID_A).meta["version"] == C_record.CALIB_VERSION


@pytest.mark.parametrize("case", ["bomb", "short_codes", "exp_range", "code_minus_128", "garbage_codes"])
def test_a_hostile_basis_grid_is_one_line(case):
    """The v3 file's own tensors lie: codes that decompress to more (a bomb) or fewer bytes than the exponents'
    shape needs, exponents outside the exact-float16 range, the one int8 code outside [-127, 127], a blob that
    is not zstd. Each is one KvcFormatError line, with bounded work (the blob is never inflated past its size)."""
    import zstandard

    path = save_calibration(_cal(L=2, H=2, D=16), FID_A)
    need = 2 * 2 * 2 * 16 * 16

    def mutate(t):
        if case == "bomb":
            blob = zstandard.ZstdCompressor().compress(bytes(1 << 26))
        elif case == "short_codes":
            blob = zstandard.ZstdCompressor().compress(bytes(need - 1))
        elif case == "code_minus_128":
            blob = zstandard.ZstdCompressor().compress(b"\x80" + bytes(need - 1))
        elif case == "garbage_codes":
            blob = b"\x00" * 64
        else:
            t["pca.basis.exp"][0, 0, 0, 0] = 12
            return
        t["pca.basis.codes.zst"] = np.frombuffer(blob, np.uint8)

    _rewrite(path, mutate, raw=True)
    C_store._memo_clear()
    with pytest.raises(KvcFormatError) as e:
        load_calibration(FID_A)
    assert "\n" not in str(e.value) and "rebuild it" in str(e.value)


def _reverse_layers(t):
    for k in t:
        t[k] = np.ascontiguousarray(t[k][::-1])


@pytest.mark.parametrize("case", ["layer_reversed", "one_value", "layer_reversed_rechecksummed_meta_only",
                                  "truncated", "empty", "version_float", "extra_tensor", "nan", "swapped"])
def test_bad_calibration_is_refused_at_load(case):
    path = save_calibration(_cal(), FID_A)
    save_calibration(_cal(seed=1), FID_B)
    if case == "layer_reversed":
        _rewrite(path, _reverse_layers)
    elif case == "one_value":
        _rewrite(path, lambda t: t["sens.kl_per_mse"].__setitem__((1, 0), 5.0))
    elif case == "layer_reversed_rechecksummed_meta_only":
        # reversed arrays with their attachment sha256 entries recomputed (but not the content checksum)
        def meta(m, t):
            m["sha256.pca.basis"] = C_store.array_sha256(t["pca.basis"].reshape(-1, *t["pca.basis"].shape[2:]))
        _rewrite(path, _reverse_layers, meta)
    elif case == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "version_float":
        _rewrite(path, None, lambda m, t: m.__setitem__("version", 2.0))
    elif case == "extra_tensor":
        _rewrite(path, lambda t: t.__setitem__("extra", np.zeros(3, np.float32)))
    elif case == "nan":
        def nan(t):
            t["pca.mean"][0, 0, 0, 0] = np.nan
        def resum(m, t):
            m["content_sha256"] = C_store.content_sha256(t, m)
        _rewrite(path, nan, resum)
    elif case == "swapped":  # model B's (valid) calibration copied over model A's
        path.write_bytes((path.parents[1] / FID_B / path.name).read_bytes())
    C_store._memo_clear()
    with pytest.raises(KvcError) as e:
        load_calibration(FID_A)
    assert "\n" not in str(e.value)
    if case == "swapped":
        assert isinstance(e.value, KvcModelMismatchError)
    else:
        assert isinstance(e.value, KvcFormatError)


def test_tampered_calibration_raises_at_resolve_instead_of_being_skipped():
    path = save_calibration(_cal(), FID_A)
    sha = load_calibration(FID_A).meta["sha256.pca.mean"]
    _rewrite(path, _reverse_layers)
    C_store._memo_clear()
    with pytest.raises(KvcFormatError, match="content sha256"):
        resolve_attachment("pca.mean", sha)


@pytest.mark.parametrize("n_models", [1, 12])
def test_lookup_work_is_flat_in_the_number_of_calibrated_models(n_models, monkeypatch):
    """Resolving one attachment reads one calibration and hashes it once, whatever is installed."""
    for i in range(n_models):
        save_calibration(_cal(seed=i), f"{i:032x}")
    target = f"{n_models - 1:032x}"  # the last one saved (a scan in name order would read every file first)
    sha = load_calibration(target).meta["sha256.pca.basis"]
    C_store._memo_clear()
    reads, content_hashes = [0], [0]
    real_read, real_hash = C_store._read_calibration, C_store.content_sha256

    def counting_read(*a):
        reads[0] += 1
        return real_read(*a)

    def counting_hash(*a):
        content_hashes[0] += 1
        return real_hash(*a)

    monkeypatch.setattr(C_store, "_read_calibration", counting_read)
    monkeypatch.setattr(C_store, "content_sha256", counting_hash)
    opened = []
    real_open = open

    def counting_open(file, *a, **kw):
        opened.append(str(file))
        return real_open(file, *a, **kw)

    monkeypatch.setattr("builtins.open", counting_open)
    arr = resolve_attachment("pca.basis", sha)
    assert arr is not None
    assert reads[0] == 1 and content_hashes[0] == 1
    assert sum(p.endswith(".safetensors") for p in opened) == 1
    # and a second open of a file needing the same calibration is served from the memo
    resolve_attachment("pca.basis", sha)
    assert reads[0] == 1


def test_pointer_files_are_hints_not_trust():
    save_calibration(_cal(), FID_A)
    save_calibration(_cal(seed=1), FID_B)
    sha_b = load_calibration(FID_B).meta["sha256.pca.basis"]
    ptr = C_store.calibration_root() / "sha256" / f"{sha_b}.json"
    ptr.write_text(json.dumps({"fingerprint_id": FID_A, "name": "pca.basis"}))  # points at the wrong model
    assert resolve_attachment("pca.basis", sha_b) is None
    ptr.write_text(json.dumps({"fingerprint_id": "../../etc", "name": "pca.basis"}))
    assert resolve_attachment("pca.basis", sha_b) is None
    ptr.write_text("{not json")
    assert resolve_attachment("pca.basis", sha_b) is None


# --------------------------------------------------------------------------- with the real model's cache
def _model_cal(fp, seed: int = 0, layers: int | None = None) -> Calibration:
    cal = _cal(L=layers or fp.num_layers, H=fp.num_kv_heads, D=fp.head_dims[0], seed=seed)
    cal.meta["fingerprint_id"] = fp.id
    return cal


@pytest.mark.model
@pytest.mark.parametrize("case", ["layer_reversed", "short", "swapped", "truncated_file"])
def test_encode_refuses_a_bad_calibration(case, small_cache):
    from kvcodec.plan.presets import get_plan

    fp = small_cache.fingerprint
    path = save_calibration(_model_cal(fp), fp.id)
    get_plan("balanced", small_cache)  # the right calibration is accepted (no model needed: it exists)
    if case == "layer_reversed":
        _rewrite(path, _reverse_layers)
    elif case == "short":  # a valid, checksummed calibration with one layer fewer
        save_calibration(_model_cal(fp, layers=fp.num_layers - 1), fp.id)
    elif case == "swapped":
        other = save_calibration(_model_cal(fp, seed=3), FID_B)
        path.write_bytes(other.read_bytes())
    elif case == "truncated_file":
        path.write_bytes(path.read_bytes()[:1000])
    C_store._memo_clear()
    with pytest.raises(KvcError) as e:
        get_plan("balanced", small_cache)
    assert "\n" not in str(e.value)


@pytest.mark.model
def test_encode_refuses_a_calibration_handed_in_for_another_model(small_cache):
    from kvcodec.plan.pipelines import transform_plan

    cal = _model_cal(small_cache.fingerprint)
    cal.meta["fingerprint_id"] = FID_B
    with pytest.raises(KvcModelMismatchError, match="calibration"):
        transform_plan(small_cache, 0.1, cal=cal)


@pytest.mark.model
@pytest.mark.parametrize("case", ["layer_reversed", "swapped", "truncated_file", "short"])
def test_decode_refuses_a_bad_calibration(case, small_cache):
    from kvcodec.format import KvcReader, write_kvc
    from kvcodec.plan.presets import get_plan

    fp = small_cache.fingerprint
    path = save_calibration(_model_cal(fp), fp.id)
    plan = get_plan("balanced", small_cache)
    import io

    buf = io.BytesIO()
    write_kvc(small_cache, buf, plan)
    data = buf.getvalue()
    with KvcReader(data) as r:
        assert r.read_cache().num_tokens == small_cache.num_tokens  # resolves and decodes with the right one
    if case == "layer_reversed":
        _rewrite(path, _reverse_layers)
    elif case == "swapped":
        other = save_calibration(_model_cal(fp, seed=3), FID_B)
        path.write_bytes(other.read_bytes())
    elif case == "truncated_file":
        path.write_bytes(path.read_bytes()[:1000])
    elif case == "short":
        save_calibration(_model_cal(fp, layers=fp.num_layers - 1), fp.id)
    C_store._memo_clear()
    with pytest.raises(KvcError) as e:
        with KvcReader(data) as r:
            r.read_cache()
    assert "\n" not in str(e.value)


def test_calibration_golden_vectors():
    """spec/vectors/calibration: a v3 file (block-diagonal basis on its grid) reads back to the manifest's arrays,
    bit for bit, and re-writing it gives the same arrays; never regenerated (kvcodec/testing/golden.py)."""
    from kvcodec.testing.golden_calibration import check_calibration_vectors

    assert check_calibration_vectors() == []
