"""Multi-level entries (spec/levels-v1.md): keys, manifest, golden vectors, tenant isolation per level."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from kvcodec.errors import KvcFormatError, KvcInputError
from kvcodec.store import Store, StoreKey, TenantKey
from kvcodec.store.levels import (
    LEVELS_CODEC,
    ChunkLevels,
    LevelManifest,
    level_keys,
    level_meta,
    manifest_key,
    parse_levels,
)

ROOT = Path(__file__).resolve().parents[2]
VEC = ROOT / "spec" / "vectors" / "levels"


def _script():
    spec = importlib.util.spec_from_file_location("make_level_vectors", ROOT / "scripts" / "make_level_vectors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_golden_vectors_recompute_bit_exactly():
    for name, data in _script().vectors().items():
        assert (VEC / name).read_bytes() == data, name


def test_vector_keys_follow_the_spec_definition():
    """Level keys are the ordinary chained prefix keys under codec levels-v1.<level> (spec §2)."""
    rows = json.loads((VEC / "keys-600.json").read_text())
    ids = list(range(600))
    for lv, ks in rows["level_keys"].items():
        for r in ks:
            want = StoreKey.for_tokens(ids[:r["end"]], model="smol-fp", codec=f"levels-v1.{lv}", namespace="tenant-a")
            assert r["key"] == want.to_str()
    assert rows["manifest_key"] == StoreKey.for_tokens(ids, model="smol-fp", codec="levels-v1",
                                                       namespace="tenant-a").to_str()
    man = LevelManifest.from_bytes((VEC / "manifest-600.json").read_bytes(), StoreKey.from_str(rows["manifest_key"]))
    assert man.levels == ["small", "near-lossless"] and [c.end for c in man.chunks] == [512, 600]
    assert [k.to_str() for k in man.level_keys(ids, "small")] == [r["key"] for r in rows["level_keys"]["small"]]


def test_parse_levels_orders_and_refuses():
    assert parse_levels("near-lossless, small") == ["small", "near-lossless"]
    assert parse_levels(["lossless", "balanced"]) == ["balanced", "lossless"]
    for bad in ("", "small,small", "tiny", "small,,bogus"):
        with pytest.raises(KvcInputError):
            parse_levels(bad)


def _manifest(n=600, c=512, levels=("small", "near-lossless")):
    k = manifest_key(list(range(n)), model="m", namespace="ns")
    chunks = [ChunkLevels(s, min(s + c, n), {lv: 10 + i for i, lv in enumerate(levels)}) for s in range(0, n, c)]
    return k, LevelManifest(k, c, list(levels), chunks)


def test_manifest_round_trip_and_refusals():
    k, m = _manifest()
    assert LevelManifest.from_bytes(m.to_bytes(), k).to_bytes() == m.to_bytes()
    other = manifest_key(list(range(1, 601)), model="m", namespace="ns")
    body = json.loads(m.to_bytes())
    cases = {
        "another key": (m.to_bytes(), other),
        "not canonical": (json.dumps(body, indent=1).encode(), k),
        "extra field": (json.dumps(dict(body, x=1), sort_keys=True, separators=(",", ":")).encode(), k),
        "off the grid": (m.to_bytes().replace(b'"end":512', b'"end":500'), k),
        "unsorted levels": (m.to_bytes().replace(b'"levels":["small","near-lossless"]',
                                                  b'"levels":["near-lossless","small"]'), k),
        "zero size": (m.to_bytes().replace(b'"small":10', b'"small":0'), k),
        "not json": (b"\xff" * 10, k),
        "huge": (b" " * (2 << 20), k),
    }
    for what, (data, key) in cases.items():
        with pytest.raises(KvcFormatError):
            LevelManifest.from_bytes(data, key)
        assert what


def test_chunk_tokens_must_follow_the_key_chain():
    with pytest.raises(KvcFormatError):
        _manifest(c=300)
    with pytest.raises(KvcInputError):
        level_keys(list(range(600)), "small", [300], model="m")
    with pytest.raises(KvcInputError):
        level_keys(list(range(10)), "bogus", [10], model="m")
    k, m = _manifest()
    with pytest.raises(KvcFormatError):  # a manifest under a key that is not a multi-level key
        LevelManifest.from_bytes(m.to_bytes(), StoreKey.from_str(k.to_str().replace(LEVELS_CODEC, "balanced")))


def test_every_level_is_sealed_and_tenant_isolated(tmp_path):
    """Tenant B can neither read A's manifest nor any of its level chunks, even with A's physical objects copied
    under B's names; a tampered level chunk is a miss; A reads everything."""
    ids = list(range(600))
    k, m = _manifest()
    a = Store.open(str(tmp_path / "shared"), key=TenantKey(bytes(range(32))))
    b = Store.open(str(tmp_path / "shared"), key=TenantKey(bytes(range(1, 33))))
    keys = [x for lv in m.levels for x in m.level_keys(ids, lv)]
    for i, x in enumerate(keys):
        a.put(x, b"chunk-%d" % i, level_meta("small", 0, x.n_tokens))
    a.put(k, m.to_bytes())
    assert LevelManifest.from_bytes(a.get(k), k).to_bytes() == m.to_bytes()
    assert all(a.get(x) == b"chunk-%d" % i for i, x in enumerate(keys))
    assert b.get(k) is None and all(b.get(x) is None for x in keys)
    assert b.ls() == [] and len(a.ls()) == len(keys) + 1
    # a writer of the shared tier copies A's objects under B's physical names: B refuses every one
    tier_a, tier_b = a.tier(a.tiers[-1].name), b.tier(b.tiers[-1].name)
    for x in [k] + keys:
        e = tier_a.get_entry(a.physical(x))
        tier_b.put(b.physical(x), e.data, e.meta)
    assert b.get(k) is None and all(b.get(x) is None for x in keys)
    # tampering with one level chunk of A: a miss for A, the other levels unaffected
    e = tier_a.get_entry(a.physical(keys[1]))
    tier_a.put(a.physical(keys[1]), b"X" + e.data[1:], e.meta)
    a.memory.delete(a.physical(keys[1]))
    assert a.get(keys[1]) is None and a.get(keys[0]) == b"chunk-0"


@pytest.mark.parametrize("args, msg", [
    (["encode", "--levels", "tiny", "--text", "gpl3"], "unknown level"),
    (["encode", "--levels", "small", "--text", "gpl3", "-o", "x.kvc"], "--levels encodes --text"),
    (["encode", "--levels", "small", "--text", "gpl3", "--level-chunk-tokens", "300"], "multiple of 256"),
    (["encode", "--text", "gpl3"], "give -o"),
    (["encode", "--text", "gpl3", "-o", "x.kvc", "--store", "/tmp/x"], "apply to --levels"),
    (["ask", "--doc", "gpl3", "--ttft-budget", "0", "q"], "--ttft-budget must be positive"),
    (["ask", "--doc", "gpl3", "--ttft-budget", "1", "--blend", "q"], "neither --blend"),
])
def test_cli_refuses_bad_level_arguments_in_one_line(args, msg, capsys, tmp_path, monkeypatch):
    from cliutil import run_kvc

    monkeypatch.chdir(tmp_path)
    code, out, err = run_kvc(args, capsys)
    assert code == 2 and msg in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.kvc").exists()
