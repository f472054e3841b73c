"""The kvcodec HiCache backend (kvcodec.integrations.sglang) against SGLang's ``HiCacheStorage`` contract, on real
SmolLM2 KV pages.

Where SGLang is importable (``bash .ci/sglang.sh``: the sglang 0.5.23 wheel without its GPU stack, over the main
venv), the backend is built by SGLang's own ``StorageBackendFactory.create_backend("dynamic", ...)`` and checked
against its ABC. Elsewhere (the main suite), against ``_AbcCopy`` below: the five abstract methods' signatures as
sglang 0.5.23's hicache_storage.py declares them, nothing more. HiCache itself is CUDA-gated: the end-to-end run is
benchmarks/gpu_check.py's SGLang step.
"""

from __future__ import annotations

import inspect
import os

import pytest
import torch

from kvcodec.errors import KvcError
from kvcodec.store import Store, TenantKey

try:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    REAL = True
except ImportError:
    REAL = False

pytestmark = pytest.mark.model
PAGE = 16


class _AbcCopy:
    """sglang 0.5.23's abstract HiCacheStorage methods (signatures only), for a venv without SGLang."""

    def get(self, key, target_location=None, target_sizes=None): ...
    def batch_get(self, keys, target_locations=None, target_sizes=None): ...
    def set(self, key, value=None, target_location=None, target_sizes=None): ...
    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None): ...
    def exists(self, key): ...


class _Config:
    """The HiCacheStorageConfig fields the backend reads (the real dataclass where SGLang is installed)."""

    def __init__(self, **kw):
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = 0, 1, 0, 1
        self.is_mla_model, self.model_name, self.extra_config = False, None, None
        self.__dict__.update(kw)


def config(extra, **kw):
    ex = {"backend_name": "kvcodec", "module_path": "kvcodec.integrations.sglang", "class_name": "KvcodecHiCacheStorage",
          **extra}
    if REAL:
        base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                    enable_storage_metrics=False, is_page_first_layout=False, model_name="smollm2", extra_config=ex)
        base.update(kw)
        return HiCacheStorageConfig(**base)
    return _Config(model_name="smollm2", extra_config=ex, **kw)


def backend(extra, **kw):
    if REAL:
        return StorageBackendFactory.create_backend("dynamic", config(extra, **kw), None)
    from kvcodec.integrations.sglang import KvcodecHiCacheStorage

    return KvcodecHiCacheStorage(config(extra, **kw), {})


@pytest.fixture(scope="module")
def pages(lm):
    """Real KV of the model, as flat bf16 pages of PAGE tokens ([2, L, T, H*D] flattened)."""
    from kvcodec.models.capture import capture
    from kvcodec.texts import load_text

    cache = capture(lm, text=load_text("gpl3"), max_tokens=3 * PAGE)
    fp = lm.fingerprint
    out = []
    for p in range(3):
        s = slice(p * PAGE, (p + 1) * PAGE)
        k = torch.stack([x[:, s].transpose(0, 1).reshape(PAGE, -1) for x in cache.keys])
        v = torch.stack([x[:, s].transpose(0, 1).reshape(PAGE, -1) for x in cache.values])
        out.append(torch.stack([k, v]).to(torch.bfloat16).flatten())
    assert out[0].numel() == 2 * fp.num_layers * PAGE * fp.num_kv_heads * fp.head_dims[0]
    return out


@pytest.fixture
def key_file(tmp_path):
    TenantKey.generate(tmp_path / "t.key")
    return str(tmp_path / "t.key")


def test_implements_the_abc(tmp_path, key_file):
    from kvcodec.integrations.sglang import KvcodecHiCacheStorage

    abc = HiCacheStorage if REAL else _AbcCopy
    if REAL:
        assert issubclass(KvcodecHiCacheStorage, HiCacheStorage)
        assert not KvcodecHiCacheStorage.__abstractmethods__
    for name in ("get", "batch_get", "set", "batch_set", "exists"):
        want = list(inspect.signature(getattr(abc, name)).parameters)
        got = list(inspect.signature(getattr(KvcodecHiCacheStorage, name)).parameters)
        assert got == want, name
    b = backend({"store_url": str(tmp_path / "s"), "key_file": key_file})
    assert isinstance(b, KvcodecHiCacheStorage)  # SGLang's factory built ours (no failure-injector wrapper)
    b.close()


def test_pages_round_trip_bit_exact(tmp_path, pages, key_file):
    url = str(tmp_path / "s")
    b = backend({"store_url": url, "key_file": key_file})
    keys = ["a" * 64, "b" * 64, "c" * 64]
    try:
        assert not b.exists(keys[0]) and b.batch_exists(keys) == 0
        assert b.set(keys[0], pages[0])
        assert b.batch_set(keys[1:], pages[1:])
        assert b.batch_exists(keys) == 3 and b.exists(keys[2])
        outs = [torch.full_like(p, float("nan")) for p in pages]
        got = b.batch_get(keys, outs)
        assert all(g is o for g, o in zip(got, outs))
        for p, o in zip(pages, outs):
            assert torch.equal(p.view(torch.int16), o.view(torch.int16))
        assert b.get("d" * 64, torch.empty_like(pages[0])) is None  # a miss
    finally:
        b.close()
    with Store.open(url, key=TenantKey.load(key_file)) as st:  # each page is a .kvc entry, smaller than the page
        sizes = [e.size for e in st.ls()]
        assert len(sizes) == 3 and max(sizes) < pages[0].numel() * 2


def test_wrong_page_model_or_bytes_is_a_miss(tmp_path, pages, key_file):
    url = str(tmp_path / "s")
    b = backend({"store_url": url, "key_file": key_file})
    try:
        assert b.set("a" * 64, pages[0])
        with Store.open(url, key=TenantKey.load(key_file)) as st:
            good = st.get(b._key("a" * 64))
            for data in (good, b"\0" * 64, good[: len(good) // 2], os.urandom(len(good))):
                st.put(b._key("b" * 64), data)  # page a's entry (then garbage) under page b's key
                out = torch.full_like(pages[0], float("nan"))
                assert b.get("b" * 64, out) is None
        assert not b.set("x" * 64, pages[0][:-7])  # not whole tokens of this model: refused, False
    finally:
        b.close()


def test_other_dtype_page_and_odd_keys(tmp_path, pages, key_file):
    """A bfloat16 page read into another pool's dtype is a miss: before, it was cast (bfloat16 past 65504 came back
    inf in float16; an int8 buffer took truncated values). A bytes or None key is refused, a lone surrogate is a key
    like any other: before, an AttributeError / UnicodeEncodeError traceback out of set, get and exists."""
    b = backend({"store_url": str(tmp_path / "s"), "key_file": key_file})
    try:
        page = pages[0].clone()
        page[0] = 1e30  # in bfloat16's range, not float16's
        assert b.set("a" * 64, page)
        for dt in (torch.float16, torch.float32, torch.int8):
            assert b.get("a" * 64, torch.zeros(page.shape, dtype=dt)) is None
        out = torch.empty_like(page)
        assert b.get("a" * 64, out) is out and torch.equal(out.view(torch.int16), page.view(torch.int16))
        for k in (b"a" * 64, None, 7):
            assert not b.set(k, page) and b.get(k, torch.empty_like(page)) is None and not b.exists(k)
            assert b.batch_exists([k]) == 0
        assert b.set("\udc80", page) and b.exists("\udc80") and b.get("\udc80", out) is out
        # one result per key, as for batch_set: before, zip() returned 1 for 2 keys and 1 page
        assert b.batch_get(["a" * 64, "\udc80"], [out]) == [None, None]
    finally:
        b.close()
    for ns in (None, 5):  # before, taken as the namespaces "None" and "5"
        with pytest.raises(KvcError, match="namespace"):
            backend({"store_url": str(tmp_path / "s"), "namespace": ns})


@pytest.mark.parametrize("bad", [{"preset": "balanced"}, {"colour": 1}, {}, {"store_url": "/tmp", "namespace": "a b"},
                                 {"store_url": "/tmp", "model": "no-such-model"}])
def test_bad_config_refused_in_one_line(bad):
    with pytest.raises((KvcError, ValueError)) as e:
        backend(bad)
    assert "\n" not in str(e.value)


def test_mla_and_sharded_refused(tmp_path):
    with pytest.raises(KvcError):
        backend({"store_url": str(tmp_path)}, is_mla_model=True)
    with pytest.raises(KvcError):
        backend({"store_url": str(tmp_path)}, tp_size=2, tp_rank=0)


def test_objects_built_the_way_sglang_builds_them_wrong_are_one_line(tmp_path, pages, key_file):
    """Pages, batches, keys and configs as SGLang's types allow them, wrong: each is a miss / False / one KvcError
    line. Before: a target page whose elements share memory (expand) and a list target escaped get as RuntimeError /
    AttributeError; a meta target "loaded" nothing and returned it as a hit; a meta page escaped set as
    NotImplementedError; a tensor of target pages escaped batch_get as RuntimeError (its truth value), a generator
    of pages batch_set as TypeError, None keys every batch call as TypeError, and a str of keys was iterated as
    one-character keys (one answer per character); an extra config left as a JSON string or a tp_size of 'x' escaped
    as ValueError, a tp_rank of '0/..' went into every key."""
    b = backend({"store_url": str(tmp_path / "s"), "key_file": key_file})
    page = pages[0]
    n = page.numel()
    try:
        assert b.set("a" * 64, page)
        for bad in (torch.zeros(1, dtype=page.dtype).expand(n), [0.0] * 4,
                    torch.empty(n, dtype=page.dtype, device="meta")):
            assert b.get("a" * 64, bad) is None
        assert not b.set("m" * 64, torch.empty(n, dtype=page.dtype, device="meta"))
        strided = torch.zeros(2 * n, dtype=page.dtype)[::2]  # distinct elements: written in place, correctly
        assert b.get("a" * 64, strided) is strided and torch.equal(strided.view(torch.int16), page.view(torch.int16))
        rows = torch.zeros(2, n, dtype=page.dtype)  # one page per row: the rows are filled
        got = b.batch_get(["a" * 64, "z" * 64], rows)
        assert got[0] is not None and got[1] is None and torch.equal(rows[0].view(torch.int16), page.view(torch.int16))
        assert b.batch_set(["b" * 64, "c" * 64], torch.stack([pages[1], pages[2]])) and b.batch_exists(["b" * 64, "c" * 64]) == 2
        for call in (lambda: b.batch_get(None), lambda: b.batch_get("a" * 64), lambda: b.batch_set(None, [page]),
                     lambda: b.batch_set(["d" * 64], (p for p in [page])), lambda: b.batch_exists(None),
                     lambda: b.batch_exists("a" * 64)):
            with pytest.raises(KvcError) as e:
                call()
            assert "\n" not in str(e.value)
    finally:
        b.close()
    for bad in ({"extra_config": '{"store_url": "/tmp"}'}, {"tp_size": "x"}, {"tp_rank": "0/../x"}, {"pp_rank": -1}):
        cfg = _Config(model_name="smollm2", **{"extra_config": {"store_url": str(tmp_path / "s")}, **bad})
        from kvcodec.integrations.sglang import KvcodecHiCacheStorage

        with pytest.raises(KvcError) as e:
            KvcodecHiCacheStorage(cfg, {})
        assert "\n" not in str(e.value)


def test_a_page_of_zeros_loads(tmp_path, key_file, lm):
    """A lossless page of zeros is a few KB for megabytes of K/V: the reader's ratio limit (256x the file) refused
    it at every get, a miss for ever. The target page bounds what the entry may declare instead."""
    fp = lm.fingerprint
    page = torch.zeros(2 * fp.num_layers * 256 * fp.num_kv_heads * fp.head_dims[0], dtype=torch.bfloat16)
    b = backend({"store_url": str(tmp_path / "s"), "key_file": key_file})
    try:
        assert b.set("0" * 64, page)
        out = torch.full_like(page, 7.0)
        assert b.get("0" * 64, out) is out and not out.any()
    finally:
        b.close()
