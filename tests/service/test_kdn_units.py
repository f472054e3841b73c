"""KDN service pieces that need no model or server: token files, URL parsing, ranges, chunk sizes, CLI errors."""

from __future__ import annotations

import json
import socket

import pytest

from cliutil import run_kvc
from kvcodec.errors import KvcInputError
from kvcodec.service.auth import TokenTable, token_hash
from kvcodec.service.checks import chunk_candidates
from kvcodec.service.httputil import resolve_range
from kvcodec.store import Store, StoreKey
from kvcodec.store.keys import chunk_hashes


def test_token_file(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"tokens": [
        {"token": "alpha-token-1", "tenant": "a"},
        {"token_sha256": token_hash("beta-token-22"), "tenant": "b", "namespaces": ["b", "shared"], "write": False},
    ]}))
    t = TokenTable.from_file(f)
    a, b = t.lookup("alpha-token-1"), t.lookup("beta-token-22")
    assert a.tenant == "a" and a.namespaces == ("a",) and a.write
    assert b.namespaces == ("b", "shared") and not b.write and b.may_use("shared") and not b.may_use("a")
    assert t.lookup("alpha-token-2") is None
    for bad in ({"tokens": [{"token": "short", "tenant": "a"}]},
                {"tokens": [{"token": "alpha-token-1", "token_sha256": "0" * 64, "tenant": "a"}]},
                {"tokens": [{"token": "alpha-token-1", "tenant": "a/b"}]},
                {"tokens": [{"token": "alpha-token-1", "tenant": "a", "write": "yes"}]},
                {"tokens": [{"token": "alpha-token-1", "tenant": "a", "extra": 1}]},
                {"tokens": [{"token": "alpha-token-1", "tenant": "a"}, {"token": "alpha-token-1", "tenant": "b"}]},
                {"tokens": []}, [], "x"):
        f.write_text(json.dumps(bad))
        with pytest.raises(KvcInputError):
            TokenTable.from_file(f)
    for text in ("{not json", "[" * 100_000 + "]" * 100_000):  # nested that deep escaped as RecursionError
        f.write_text(text)
        with pytest.raises(KvcInputError, match="JSON"):
            TokenTable.from_file(f)


def test_a_token_file_that_is_not_a_regular_file_is_refused_at_once(tmp_path):
    """`kvc serve --tokens FIFO` blocked for good, `--tokens /dev/zero` read without end."""
    import os

    from kvcodec.service import auth

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for p in (fifo, "/dev/zero"):
        with pytest.raises(KvcInputError, match="not a regular file"):
            TokenTable.from_file(p)
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (auth.MAX_TOKEN_FILE + 1))
    with pytest.raises(KvcInputError, match="larger than"):
        TokenTable.from_file(big)


def test_kdn_urls_never_show_the_token():
    st = Store.open("kvc+http://:s3cret-token@127.0.0.1:9/?timeout=0.2")
    assert "s3cret" not in st.url and "s3cret" not in str(st.stats())
    assert st.tier("kdn").token == "s3cret-token"
    for bad in ("kvc+http://:s3cret-token@/x", "kvc+http://127.0.0.1:9/path", "kvc+http://127.0.0.1:9?bogus=1",
                "kvc+http://127.0.0.1:99999", "kvc+http://127.0.0.1:9?timeout=nan"):
        with pytest.raises(KvcInputError) as e:
            Store.open(bad)
        assert "s3cret" not in str(e.value)


def test_kdn_down_is_a_miss_and_a_reported_put(tmp_path):
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    p = port.getsockname()[1]
    port.close()  # nothing listens there
    st = Store.open(f"{tmp_path}/local,kvc+http://127.0.0.1:{p}?timeout=0.5&retry_interval=5")
    k = StoreKey.for_tokens([1, 2, 3], model="m", codec="c")
    assert st.get(k) is None and st.contains_many([k]) == [False]
    res = st.put(k, b"payload")
    assert res.tiers["directory"] == "ok" and "unreachable" in res.failed["kdn"]
    assert st.get(k) == b"payload"


def test_range_resolution():
    assert resolve_range(slice(0, 10), 100) == (0, 10)
    assert resolve_range(slice(90, None), 100) == (90, 100)
    assert resolve_range(slice(90, 500), 100) == (90, 100)
    assert resolve_range(slice(-10, None), 100) == (90, 100)
    assert resolve_range(slice(-500, None), 100) == (0, 100)
    assert resolve_range(slice(100, None), 100)[0] is None
    assert resolve_range(slice(0, None), 0)[0] is None


def test_chunk_candidates_cover_every_chunking_that_keys_use():
    ids = list(range(1000, 1768))
    assert chunk_candidates(768)[0] == 256
    for chunk in (256, 48, 96, 768, 16):
        digest = chunk_hashes(ids, chunk, model="m", codec="c", namespace="n")[-1]
        assert chunk in chunk_candidates(len(ids)) and digest
    assert 100 not in chunk_candidates(768)


def test_serve_cli_errors(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("KVC_SERVE_TOKEN", raising=False)
    code, _, err = run_kvc(["serve", "--store", str(tmp_path / "s")], capsys)
    assert code == 2 and "KVC_SERVE_TOKEN" in err and len(err.strip().splitlines()) == 1
    (tmp_path / "t.json").write_text('{"tokens": [{"token": "short", "tenant": "a"}]}')
    code, _, err = run_kvc(["serve", "--store", str(tmp_path / "s"), "--tokens", str(tmp_path / "t.json")], capsys)
    assert code == 2 and "8-512" in err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        monkeypatch.setenv("KVC_SERVE_TOKEN", "long-enough-token")
        code, _, err = run_kvc(["serve", "--store", str(tmp_path / "s"), "--port", str(s.getsockname()[1])], capsys)
    assert code == 2 and "cannot listen" in err
    code, _, err = run_kvc(["serve", "--store", "kvc+http://127.0.0.1:1"], capsys)
    assert code == 2 and "another kvc+http service" in err


def test_a_model_load_is_charged_to_nobody_an_edit_to_its_tenant(tmp_path):
    """An edit's model work is charged to the tenant's CPU share; loading the model it needs is not (the service
    loads each --model once, for everyone): a tenant whose first edit triggers a slow load keeps its share. Both
    run one at a time and free their slot."""
    import asyncio
    import time

    from kvcodec.service import edit
    from kvcodec.service.admission import DEADLINE, PRINCIPAL
    from kvcodec.service.app import KdnService
    from kvcodec.service.config import ServiceConfig
    from kvcodec.service.auth import Principal, TokenTable

    def burn(seconds: float) -> str:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        return "done"

    svc = KdnService(Store.open(str(tmp_path / "s")), TokenTable.single("tok-0123456789abcdef"),
                     ServiceConfig(tenant_worker_cpu=0.5))
    request = {PRINCIPAL: Principal("t", ("default",)), DEADLINE: time.monotonic() + 60}

    async def main() -> None:
        full = svc.workers.cpu.balance("t")
        assert await edit._model_work(svc, request, "t", burn, 0.3, charge=False) == "done"
        await asyncio.sleep(0.05)  # charges are made on the loop when the thread's future completes
        assert svc.workers.cpu.balance("t") == pytest.approx(full, abs=0.05)  # the load: nobody's
        assert await edit._model_work(svc, request, "t", burn, 0.3) == "done"
        await asyncio.sleep(0.05)
        assert svc.workers.cpu.balance("t") < full - 0.2  # the edit: its tenant's
        assert svc.edit_sched.free == 1  # nothing held
        await svc._close(None)

    asyncio.run(main())


def test_store_thread_cpu_is_charged_to_the_tenant(tmp_path):
    """A store-thread call's CPU time counts against the tenant's CPU share, which paces its next worker job (a
    large lookup builds and probes its candidates there); a caller that charges by itself passes charge=False."""
    import asyncio
    import time

    from kvcodec.service.admission import DEADLINE, PRINCIPAL
    from kvcodec.service.app import KdnService
    from kvcodec.service.config import SERVICE_CPU_WEIGHT, ServiceConfig
    from kvcodec.service.auth import Principal, TokenTable

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    svc = KdnService(Store.open(str(tmp_path / "s")), TokenTable.single("tok-0123456789abcdef"),
                     ServiceConfig(tenant_worker_cpu=0.5))
    request = {PRINCIPAL: Principal("t", ("default",)), DEADLINE: time.monotonic() + 60}

    async def main() -> None:
        full = svc.workers.cpu.balance("t")
        await svc._run(request, burn, 0.3, charge=False)
        assert svc.workers.cpu.balance("t") == pytest.approx(full)
        await svc._run(request, burn, 0.3)
        await asyncio.sleep(0.05)  # the charge is made when the thread's future completes, on the loop
        # weighted: the service process's CPU counts SERVICE_CPU_WEIGHT (its one interpreter lock is everyone's)
        assert svc.workers.cpu.balance("t") < full - SERVICE_CPU_WEIGHT * 0.3 + 0.1
        await svc._close(None)

    asyncio.run(main())


def test_key_probes_wait_while_the_tenant_is_over_its_cpu_share(tmp_path):
    """Lookups and key lists are probed in store-thread turns (KdnService._probe); each turn waits while its tenant
    is over its CPU share, so a key list parsed on the event loop (no worker job) is paced too: a turn that would
    wait past the request's deadline is a 429, and another tenant's probe runs at once."""
    import asyncio
    import time

    from kvcodec.service.admission import DEADLINE, PRINCIPAL
    from kvcodec.service.app import KdnService
    from kvcodec.service.config import ServiceConfig
    from kvcodec.service.auth import Principal, TokenTable
    from kvcodec.service.fair import Overloaded
    from kvcodec.store import StoreKey

    st = Store.open(str(tmp_path / "s"))
    svc = KdnService(st, TokenTable.single("tok-0123456789abcdef"), ServiceConfig(tenant_worker_cpu=0.5))
    keys = [StoreKey.for_tokens([i, i + 1], model="m", codec="c") for i in range(40)]

    def request(tenant: str, seconds: float) -> dict:
        return {PRINCIPAL: Principal(tenant, ("default",)), DEADLINE: time.monotonic() + seconds}

    async def main() -> None:
        svc.workers.cpu.charge("b", svc.workers.cpu.balance("b") + 0.75)  # 0.75 CPU-s into debt: 1.5 s to refill
        with pytest.raises(Overloaded) as e:
            await svc._probe(request("b", 0.05), svc.store_for(Principal("b", ("default",))), keys)
        assert e.value.status == 429 and "CPU share" in str(e.value)
        t0 = time.monotonic()
        _, found = await svc._probe(request("a", 60), svc.store_for(Principal("a", ("default",))), keys)
        assert found == [False] * 40 and time.monotonic() - t0 < 0.75, "another tenant is not paced"  # ~10 ms idle
        t0 = time.monotonic()
        _, found = await svc._probe(request("b", 60), svc.store_for(Principal("b", ("default",))), keys)
        assert found == [False] * 40 and time.monotonic() - t0 >= 1.0, "b waited for its share to refill"
        await svc._close(None)

    asyncio.run(main())


def test_an_entrys_checksum_and_etag_are_never_another_tenants(tmp_path, monkeypatch):
    """The ETag/checksum memo was keyed by (key, created, size): two tenants' versions of one logical key put in
    the same millisecond with the same size shared the first one's crc32c, so the second tenant's client failed
    every read of it (checksum mismatch: a miss for good) and was answered the other's ETag."""
    from kvcodec.service.app import KdnService
    from kvcodec.service.auth import Principal
    from kvcodec.service.config import ServiceConfig
    from kvcodec.store.tiers import base
    from kvcodec.store.tiers.base import crc32c

    svc = KdnService(Store.open(str(tmp_path / "s")), TokenTable.single("tok-0123456789abcdef"), ServiceConfig())
    monkeypatch.setattr(base.time, "time", lambda: 1_700_000_000.0)  # both puts in one millisecond
    k = StoreKey.for_tokens(list(range(16)), model="m", codec="c")
    tags = []
    for tenant, data in (("a", b"a" * 100), ("b", b"b" * 100)):
        st = svc.store_for(Principal(tenant, ("default",)))
        st.put(k, data)
        _, etag, crc = svc._entry_and_tag(st, k)
        assert crc == f"{crc32c(data):08x}"
        tags.append(etag)
    assert tags[0] != tags[1]


def test_a_new_version_put_in_the_same_millisecond_gets_its_own_checksum(tmp_path, monkeypatch):
    """The ETag memo was keyed by (tenant, key, created, size): one tenant's second version of a key put in the
    same millisecond with the same size was answered with the first version's crc32c and ETag."""
    from kvcodec.service.app import KdnService
    from kvcodec.service.auth import Principal
    from kvcodec.service.config import ServiceConfig
    from kvcodec.store.tiers import base
    from kvcodec.store.tiers.base import crc32c

    svc = KdnService(Store.open(str(tmp_path / "s")), TokenTable.single("tok-0123456789abcdef"), ServiceConfig())
    monkeypatch.setattr(base.time, "time", lambda: 1_700_000_000.0)
    st = svc.store_for(Principal("default", ("default",)))
    k = StoreKey.for_tokens(list(range(16)), model="m", codec="c")
    tags = set()
    for data in (b"1" * 100, b"2" * 100):
        st.put(k, data)
        _, etag, crc = svc._entry_and_tag(st, k)
        assert crc == f"{crc32c(data):08x}"
        tags.add(etag)
    assert len(tags) == 2
