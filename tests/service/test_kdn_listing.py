"""GET /v1/entries: what the listing costs the event loop. In process, a mocked request against a directory store."""

from __future__ import annotations

import asyncio
import json
import threading
import time

from aiohttp.test_utils import make_mocked_request

from kvcodec.service.admission import DEADLINE, PRINCIPAL
from kvcodec.service.app import KdnService
from kvcodec.service.auth import Principal, TokenTable, token_hash
from kvcodec.service.config import ServiceConfig
from kvcodec.store import Store
from kvcodec.testing.attacks import honest_entry


def test_a_listing_is_built_and_encoded_off_the_event_loop(tmp_path, monkeypatch):
    """The rows of a listing were filtered and encoded on the event loop (some 2.3 s per million entries, during
    which no other tenant's request moved). Now they are in a store thread, and the answer is the same."""
    a = Principal("a", ("a",))
    svc = KdnService(Store.open(str(tmp_path / "store"), memory_bytes=0), TokenTable({token_hash("tok-a-0123456789"): a}),
                     ServiceConfig(workers=1))
    try:
        keys = []
        for i in range(3):
            key, data = honest_entry(500 + i, 64, "a")
            assert svc.store_for(a).put(key, data, {"n": i}).ok
            keys.append(key.to_str())
        encoded_on: list[str] = []
        dumps = json.dumps

        def spy(obj, *args, **kw):
            if isinstance(obj, dict) and "entries" in obj:
                encoded_on.append(threading.current_thread().name)
            return dumps(obj, *args, **kw)

        monkeypatch.setattr(json, "dumps", spy)

        async def listing() -> bytes:
            req = make_mocked_request("GET", "/v1/entries?meta=1")
            req[PRINCIPAL] = a
            req[DEADLINE] = time.monotonic() + 60
            resp = await svc.ls(req)
            return bytes(resp.body)  # type: ignore[arg-type]

        body = json.loads(asyncio.run(listing()))
        assert sorted(e["key"] for e in body["entries"]) == sorted(keys)
        assert {e["meta"]["n"] for e in body["entries"]} == {0, 1, 2}
        assert encoded_on and all(name.startswith("kvc-store") for name in encoded_on), encoded_on
    finally:
        svc._io.shutdown(wait=False)
        svc.store.close()
