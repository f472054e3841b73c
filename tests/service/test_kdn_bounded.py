"""A shared KDN that strangers cannot knock over (issue 35): one real ``kvc serve`` process with small limits,
attacked class by class over loopback; every attack is bounded in count and time.

Entries are synthetic-model ``.kvc`` files (kvcodec.testing.attacks), so only the text-lookup test needs the
embedded model.  The load-under-attack figures are benchmarks/bench_kdn_attack.py.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import pytest

from kdn_service import Service, path_of
from kvcodec.store import Store
from kvcodec.testing.attacks import (
    amplification_entry,
    chunked,
    costly_entry,
    deep_json,
    honest_entry,
    raw_request,
    request_head,
    slow_head,
)

TOK_A, TOK_A_NS, TOK_B = "tok-a-all-0123456789", "tok-a-ns-a-0123456789", "tok-b-0123456789"
TOKENS = [
    {"token": TOK_A, "tenant": "a", "namespaces": ["a", "a-private"]},
    {"token": TOK_A_NS, "tenant": "a", "namespaces": ["a"]},
    {"token": TOK_B, "tenant": "b", "namespaces": ["b"]},
]
LIMITS = ["--header-timeout", "1", "--body-idle-timeout", "2", "--max-json-body", "1M", "--max-chunked-json", "256K", "--workers", "2",
          "--tenant-queue", "2", "--max-decoded", "16M", "--tenant-decode-rate", "1M"]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    s = Service(tmp_path_factory.mktemp("kdn-bounded"), max_body="16M", extra=LIMITS, tokens=TOKENS)
    yield s
    s.stop()


def _error(body: bytes) -> str:
    obj = json.loads(body)
    assert set(obj) == {"error"} and "\n" not in obj["error"]
    return obj["error"]


def _http_body(resp: bytes) -> bytes:
    return resp.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in resp else b""


def _rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))
    except (OSError, AttributeError):
        return 0


# -- 1. decompression amplification ----------------------------------------------------------------------
def _settled_rss_kb(pids: list[int], limit_s: float = 60.0) -> dict[int, int]:
    """Each process's RSS once none has moved by 2 MB in half a second: the workers warm up (torch, the numba
    kernels: 420-600 MB) in the background after the service answers, so an absolute figure measured the race."""
    last = {p: _rss_kb(p) for p in pids}
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        time.sleep(0.5)
        now = {p: _rss_kb(p) for p in pids}
        if all(abs(now[p] - last[p]) < 2048 for p in pids):
            return now
        last = now
    return last


def test_a_tiny_put_declaring_a_huge_decode_is_refused_before_any_decode(svc):
    key, data = amplification_entry(7, 120, namespace="a")  # ~3 KB declaring 15.7 MB: under --max-decoded 16M
    before = {r.key for r in svc.stored()}
    pids = [svc.proc.pid, *svc.worker_pids()]
    idle = _settled_rss_kb(pids)
    t0 = time.monotonic()
    s, _, body = svc.request("PUT", path_of(key), TOK_A, data)
    assert s == 422 and "its size" in _error(body), body
    assert time.monotonic() - t0 < 10
    assert {r.key for r in svc.stored()} == before
    assert svc.metrics()['kvc_put_total{result="rejected"}'] >= 1
    for pid in pids:  # nobody decoded it: no process grew by the 15.7 MB the entry declares
        assert _rss_kb(pid) - idle[pid] < 8_000, (pid, idle[pid], _rss_kb(pid))
    key, data = amplification_entry(7, 500, namespace="a")  # 65.5 MB: the absolute limit too
    s, _, body = svc.request("PUT", path_of(key), TOK_A, data)
    assert s == 422 and "over the limit of 16,777,216" in _error(body)


def test_cheap_checks_come_before_the_decode(svc):
    key, data = costly_entry(3, 64, namespace="a")
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF  # inside a chunk: only decoding it finds this
    other = key.to_str().replace(key.model, "0" * 32)
    s, _, body = svc.request("PUT", f"/v1/entries/{other}", TOK_A, bytes(bad))
    assert s == 422 and "for model" in _error(body), "the model is checked before any chunk is decoded"
    s, _, body = svc.request("PUT", path_of(key), TOK_A, bytes(bad))
    assert s == 422 and "does not verify" in _error(body)


# -- 2. body limits on the bytes read --------------------------------------------------------------------
def test_body_limits_hold_whatever_the_framing(svc):
    big = b'{"keys": ["' + b"x" * (2 << 20) + b'"]}'  # 2 MiB: over --max-json-body 1M, sent without a length
    head = request_head("POST", "/v1/contains", TOK_A, {"Transfer-Encoding": "chunked"})
    s, resp = raw_request(svc.port, head, chunked(big))
    assert s == 413 and "limit" in _error(_http_body(resp))
    head = request_head("PUT", path_of(honest_entry(1, 64, "a")[0]), TOK_A, {"Transfer-Encoding": "chunked"})
    s, resp = raw_request(svc.port, head, chunked(b"\0" * (17 << 20), 1 << 20))
    assert s == 413
    ok = json.dumps({"keys": [honest_entry(1, 64, "a")[0].to_str()]}).encode()
    s, resp = raw_request(svc.port, request_head("POST", "/v1/contains", TOK_A, {"Transfer-Encoding": "chunked"}),
                          chunked(ok, 7))
    assert s == 200 and json.loads(_http_body(resp)) == {"found": [False]}
    # a JSON body of unknown length has its own, smaller cap (--max-chunked-json 256K): one of 512 KiB is refused
    # sent chunked, and reaches the JSON checks with its length (under --max-json-body 1M)
    mid = json.dumps({"keys": [honest_entry(1, 64, "a")[0].to_str()], "pad": "x" * (512 << 10)}).encode()
    head = request_head("POST", "/v1/contains", TOK_A, {"Transfer-Encoding": "chunked"})
    s, resp = raw_request(svc.port, head, chunked(mid, 64 << 10))
    assert s == 413 and "send Content-Length" in _error(_http_body(resp))
    s, resp = raw_request(svc.port, request_head("POST", "/v1/contains", TOK_A, {"Content-Length": str(len(mid))}), mid)
    assert s != 413, resp[:300]


# -- 3. fairness and quotas ------------------------------------------------------------------------------
def test_one_tenant_over_its_decode_quota_does_not_slow_another(svc):
    """--max-decoded 16M is also the quota's burst, --tenant-decode-rate 1M its refill: 8 MiB decodes spend
    b's balance within a few puts, then b gets 429 with Retry-After, and a's put goes straight through."""
    statuses = []
    for i in range(5):
        key, data = costly_entry(100 + i, 64, namespace="b")
        s, h, body = svc.request("PUT", path_of(key), TOK_B, data)
        statuses.append(s)
        if s == 429:
            break
    assert statuses[:2] == [201, 201] and statuses[-1] == 429, statuses
    assert int(h["Retry-After"]) >= 1 and "quota" in _error(body)
    key, data = costly_entry(200, 64, namespace="a")
    t0 = time.monotonic()
    assert svc.request("PUT", path_of(key), TOK_A, data)[0] == 201
    assert time.monotonic() - t0 < 30
    assert svc.metrics()['kvc_overloaded_total{status="429"}'] >= 1


def test_a_flood_of_one_tenant_gets_429_while_another_is_served(svc):
    """b keeps 12 large lookups (parsed by workers) in flight at once: at most --tenant-workers 1 runs and
    --tenant-queue 2 wait, the rest are 429 at once; a's lookup is answered meanwhile."""
    ids = list(range(120_000))
    body = json.dumps({"model": "m", "codec": "c", "namespace": "b", "token_ids": ids}).encode()
    assert 64 << 10 < len(body) < 1 << 20
    out: list[int] = []

    def flood() -> None:
        out.append(svc.request("POST", "/v1/lookup", TOK_B, body)[0])

    threads = [threading.Thread(target=flood) for _ in range(12)]
    for t in threads:
        t.start()
    q = json.dumps({"model": "m", "codec": "c", "namespace": "a", "token_ids": ids[:1000]}).encode()
    s, _, _ = svc.request("POST", "/v1/lookup", TOK_A, q)
    for t in threads:
        t.join(60)
    assert s == 200
    assert set(out) <= {200, 429} and len(out) == 12, out


# -- 5. slow clients -------------------------------------------------------------------------------------
def test_a_slow_request_head_is_cut_at_the_header_timeout(svc):
    held = slow_head(svc.port, interval=0.25, limit_s=20)
    assert held < 5, f"a byte-a-quarter-second request head held its connection {held:.1f} s (header timeout 1 s)"


def test_a_stalled_body_is_cut_at_the_idle_timeout(svc):
    key = honest_entry(2, 64, "a")[0]
    with socket.create_connection(("127.0.0.1", svc.port), timeout=15) as sock:
        sock.sendall(request_head("PUT", path_of(key), TOK_A, {"Content-Length": "100000"}) + b"x" * 10)
        t0 = time.monotonic()
        resp = sock.recv(65536)
    assert resp.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 10, resp[:200]


# -- 6. malformed JSON -----------------------------------------------------------------------------------
def test_deep_or_malformed_json_is_a_one_line_json_400(svc):
    for path in ("/v1/contains", "/v1/lookup"):
        s, _, body = svc.request("POST", path, TOK_A, deep_json())
        assert s == 400 and "nests too deeply" in _error(body)
    big_bad = b'{"keys": [' + b'"x",' * 40_000 + b"]}"  # > 64 KiB: parsed by a worker
    s, _, body = svc.request("POST", "/v1/contains", TOK_A, big_bad)
    assert s == 400 and "not JSON" in _error(body)
    s, _, body = svc.request("POST", "/v1/lookup", TOK_A, b"\xff" * 100)
    assert s == 400 and "not JSON" in _error(body)
    assert "Traceback" not in svc.log()


# -- 9. ranges, namespaces, logs ---------------------------------------------------------------------------
def test_range_edge_cases_over_http(svc):
    key, data = honest_entry(3, 64, "a")
    assert svc.put_raw(key, data, token=TOK_A) == 201
    s, h, body = svc.request("GET", path_of(key), TOK_A, headers={"Range": "bytes=-0"})
    assert s == 416 and h["Content-Range"] == f"bytes */{len(data)}"
    s, h, body = svc.request("GET", path_of(key), TOK_A, headers={"Range": "bytes=0-0"})
    assert s == 206 and body == data[:1]
    for junk in ("bytes=9-3", "bytes=0-1,4-5", "lines=0-1", "bytes=0-" + "9" * 5000):
        s, _, body = svc.request("GET", path_of(key), TOK_A, headers={"Range": junk})
        assert (s, body) in ((200, data), (206, data)), (junk, s)
    s, _, _ = svc.request("GET", path_of(key), TOK_A, headers={"Range": "bytes=" + "9" * 30 + "-"})
    assert s == 416


def test_a_namespace_limited_token_sees_only_its_namespaces(svc):
    pub, pub_data = honest_entry(10, 64, "a")
    priv, priv_data = honest_entry(11, 64, "a-private")
    assert svc.put_raw(pub, pub_data, token=TOK_A) == 201 and svc.put_raw(priv, priv_data, token=TOK_A) == 201
    s, _, body = svc.request("GET", "/v1/entries", TOK_A_NS)
    keys = {e["key"] for e in json.loads(body)["entries"]}
    assert s == 200 and pub.to_str() in keys and priv.to_str() not in keys
    assert svc.request("GET", "/v1/entries?namespace=a-private", TOK_A_NS)[0] == 403
    # store clients: sealed entries under physical names, the namespace named by the seal
    full = Store.open(svc.url(TOK_A), memory_bytes=0)
    limited = Store.open(svc.url(TOK_A_NS), memory_bytes=0)
    sk, sd = honest_entry(12, 64, "a-private")
    assert full.put(sk, sd).ok and full.get(sk) == sd
    assert limited.ls() == [] or all(r.key.namespace == "a" for r in limited.ls())
    assert limited.get(sk) is None, "a sealed entry of another namespace is not readable with this token"
    assert full.get(sk) == sd
    s, _, body = svc.request("GET", "/v1/entries", TOK_A)
    assert priv.to_str() in {e["key"] for e in json.loads(body)["entries"]}


def test_bad_requests_are_one_rate_limited_line_each(svc):
    before = svc.log().count("\n")
    t0 = time.monotonic()
    for i in range(150):
        raw_request(svc.port, b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", timeout=5)
        raw_request(svc.port, request_head("GET", "/v1/whoami", "not-a-token-%d" % i), timeout=5)
    elapsed = time.monotonic() - t0
    time.sleep(0.2)
    log = svc.log()
    lines = log.count("\n") - before
    assert "Traceback" not in log
    assert lines <= 20 + 10 * elapsed + 2, f"{lines} log lines for 300 bad requests in {elapsed:.1f} s"
    time.sleep(1.5)
    raw_request(svc.port, request_head("GET", "/v1/whoami", "not-a-token-x"), timeout=5)
    time.sleep(0.2)
    assert "bad requests not logged" in svc.log()


# -- 4. tokenization off the event loop --------------------------------------------------------------------
@pytest.mark.model
def test_text_lookups_are_tokenized_by_a_worker(tmp_path, lm):
    from kvcodec.models.capture import tokenize
    from kvcodec.models.load import resolve_model_dir

    s = Service(tmp_path, extra=["--model", "smollm2"], tokens=TOKENS)
    try:
        text = "The GNU General Public License is a free, copyleft license. " * 20
        q = {"model": lm.fingerprint.id, "codec": "c", "namespace": "a"}
        st, _, by_text = s.request("POST", "/v1/lookup", TOK_A, json.dumps({**q, "text": text}).encode())
        ids = [int(x) for x in tokenize(lm.tokenizer, text)]
        st2, _, by_ids = s.request("POST", "/v1/lookup", TOK_A, json.dumps({**q, "token_ids": ids}).encode())
        assert st == st2 == 200 and json.loads(by_text) == json.loads(by_ids)
        m = s.metrics()
        assert m['kvc_worker_jobs_total{op="lookup",result="ok"}'] == 1
        st, _, body = s.request("POST", "/v1/lookup", TOK_A, json.dumps({**q, "text": "x" * (5 << 20)}).encode())
        assert st == 413 or (st == 400 and "limit" in _error(body))
        with open(f"/proc/{s.proc.pid}/status") as f:  # the service's peak: it never loaded the model's weights
            peak_kb = int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1))
        weights_kb = sum(p.stat().st_size for p in resolve_model_dir("smollm2").glob("*.safetensors")) // 1024
        assert peak_kb < weights_kb, (peak_kb, weights_kb)
    finally:
        s.stop()


def test_a_tenant_whose_requests_keep_being_refused_is_throttled_before_any_work(tmp_path):
    """--tenant-refusal-rate 1 (burst 5): after a handful of refused puts, b's next ones are 429 before their
    body is read or a worker is asked; a is not affected."""
    s = Service(tmp_path, extra=["--tenant-refusal-rate", "1"], tokens=TOKENS)
    try:
        key, data = amplification_entry(7, 120, namespace="b")
        got = [s.request("PUT", path_of(key), TOK_B, data)[0] for _ in range(10)]
        # each refusal costs 1 plus its ~3 KB body's share of a MiB: the burst of 5 lasts four puts
        assert got[:4] == [422] * 4 and got.count(429) >= 3, got
        jobs = s.metrics()['kvc_worker_jobs_total{op="check",result="refused"}']
        assert jobs <= 7, "throttled puts never reach a worker"
        assert s.request("GET", "/v1/whoami", TOK_A)[0] == 200
    finally:
        s.stop()


def test_refusals_that_made_us_read_a_body_cost_more_and_throttled_answers_are_held_back(tmp_path):
    """--tenant-refusal-rate 1 (burst 5), --max-json-body 4M: an 8 MiB chunked body refused after ~4 MiB read
    costs 1 + 4 refusals, so the very next request is 429 before its body (it would be the sixth otherwise),
    and that 429 comes after a pause (up to 1 s) instead of at once."""
    s = Service(tmp_path, extra=["--tenant-refusal-rate", "1", "--max-json-body", "4M", "--max-chunked-json", "4M"],
                tokens=TOKENS)
    try:
        head = request_head("POST", "/v1/contains", TOK_B, {"Transfer-Encoding": "chunked"})
        body = chunked(b'{"keys": ["' + b"x" * (8 << 20) + b'"]}', 1 << 20)
        assert raw_request(s.port, head, body)[0] == 413
        t0 = time.monotonic()
        st, resp = raw_request(s.port, head, body)
        assert st == 429 and "refused" in _error(_http_body(resp)), resp[:300]
        assert time.monotonic() - t0 >= 0.5, "a throttled tenant's 429 is held back, not answered at once"
        assert s.request("GET", "/v1/whoami", TOK_A)[0] == 200, "another tenant is not throttled"
    finally:
        s.stop()


def test_an_address_whose_requests_keep_failing_is_throttled_and_other_addresses_are_not(tmp_path):
    """--peer-refusal-rate 1 (burst 5). Unauthenticated refusals have no tenant to charge, so the client address
    pays: from 127.0.0.2, bad tokens get five 401s, then 429s held back first; malformed HTTP from 127.0.0.3 a
    whole burst into debt has its next connections held, then refused, before anything is parsed. The tenant on 127.0.0.1
    keeps its 200s throughout (any 127/8 address is this machine: three clients)."""
    s = Service(tmp_path, extra=["--peer-refusal-rate", "1"], tokens=TOKENS)
    try:
        bad = request_head("GET", "/v1/whoami", "not-a-token")
        t0 = time.monotonic()
        got = [raw_request(s.port, bad, source="127.0.0.2", timeout=10)[0] for _ in range(5)]
        t1 = time.monotonic()
        st, resp = raw_request(s.port, bad, source="127.0.0.2", timeout=10)
        assert got == [401] * 5 and st == 429 and "unauthenticated" in _error(_http_body(resp)), (got, resp[:300])
        assert time.monotonic() - t1 >= 0.5, "a throttled address's 429 is held back, not answered at once"
        got += [st] + [raw_request(s.port, bad, source="127.0.0.2", timeout=10)[0] for _ in range(4)]
        assert got.count(401) <= 5 + (time.monotonic() - t0) * 1 + 1, got  # the burst, then the rate
        assert s.request("GET", "/v1/whoami", TOK_A)[0] == 200, "another address is not throttled"

        junk = b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n"
        got = [raw_request(s.port, junk, source="127.0.0.3", timeout=10)[0] for _ in range(11)]
        assert got == [400] * 11, got
        t0 = time.monotonic()
        st, resp = raw_request(s.port, junk, source="127.0.0.3", timeout=10)
        assert st == 429 and "keeps sending requests that are refused" in _error(_http_body(resp)), resp[:300]
        assert time.monotonic() - t0 >= 0.5, "held before its 429: a refused client cannot just ask again at once"
        assert s.request("GET", "/v1/whoami", TOK_A)[0] == 200
        assert "Traceback" not in s.log()
    finally:
        s.stop()


def test_a_tenant_s_bodies_are_read_at_its_ingest_rate_and_another_s_are_not(tmp_path):
    """--tenant-ingest-rate 1M (burst 1 MiB): b's 3 MiB body is read over about two seconds (the service stops
    reading; TCP pushes back), and stored whole; a's small request meanwhile is answered at once."""
    s = Service(tmp_path, extra=["--tenant-ingest-rate", "1M"], tokens=TOKENS)
    try:
        key, data = costly_entry(11, 32, "b")
        assert len(data) > 2_500_000, len(data)
        got: list[int] = []
        t0 = time.monotonic()
        th = threading.Thread(target=lambda: got.append(s.request("PUT", path_of(key), TOK_B, data)[0]))
        th.start()
        time.sleep(0.3)
        t1 = time.monotonic()
        assert s.request("GET", "/v1/whoami", TOK_A)[0] == 200
        assert time.monotonic() - t1 < 1.0, "another tenant is not slowed"
        th.join(60)
        took = time.monotonic() - t0
        assert got == [201] and took >= (len(data) - (1 << 20)) / (1 << 20) * 0.8, (got, took)
    finally:
        s.stop()


def test_malformed_http_is_a_one_line_json_400(svc):
    for raw in (b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n",
                b"\x16\x03\x01\x02\x00 not HTTP at all\r\n\r\n",
                b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
        st, resp = raw_request(svc.port, raw, timeout=10)
        head = resp.split(b"\r\n\r\n", 1)[0].lower()
        assert st == 400 and b"content-type: application/json" in head, resp[:300]
        assert "malformed HTTP request" in _error(_http_body(resp))
    assert "Traceback" not in svc.log()


def test_connections_per_address_are_capped(tmp_path):
    s = Service(tmp_path, extra=["--peer-connections", "4"], tokens=TOKENS)
    try:
        time.sleep(1.0)  # the start-up check's connection (wait_port) is closed on the server's side by now
        held = [socket.create_connection(("127.0.0.1", s.port)) for _ in range(4)]
        try:
            time.sleep(0.3)
            st, resp = raw_request(s.port, request_head("GET", "/v1/whoami", TOK_A), timeout=10)
            assert st == 429 and "too many connections" in _error(_http_body(resp)), resp[:300]
        finally:
            for c in held:
                c.close()
        deadline = time.monotonic() + 20  # the closes reach the server's loop in their own time on a busy box
        while (st := raw_request(s.port, request_head("GET", "/v1/whoami", TOK_A), timeout=10)[0]) == 429 \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert st == 200
        assert s.metrics()["kvc_peer_refused_total"] >= 1
    finally:
        s.stop()


def _held_open(port: int, head: bytes, piece: bytes, limit_s: float = 15.0) -> tuple[bytes, float]:
    """Send ``head``, then ``piece`` over and over until the server closes; (its answer, seconds after it).

    A send that fails (the server closed: EPIPE, or ECONNRESET once its close met unread bytes) stops the sending,
    not the reading: the answer the server sent before closing is still in this socket's queue, and a recv returns
    it before the error. Breaking out at the failed send lost it whenever the reset arrived between a recv and the
    next send (a clean-clone CI run, 2026-12-07: an empty answer 0.67 s after the 413 was sent)."""
    with socket.create_connection(("127.0.0.1", port), timeout=limit_s) as s:
        s.sendall(head)
        answer, answered_at, t0 = b"", None, time.monotonic()
        s.setblocking(False)
        sending = True
        while time.monotonic() - t0 < limit_s:
            if sending:
                try:
                    s.send(piece)
                except BlockingIOError:
                    pass
                except OSError:
                    sending = False
            try:
                got = s.recv(65536)
                if not got:
                    break
                answer += got
                answered_at = answered_at or time.monotonic()
            except BlockingIOError:
                pass
            except OSError:
                break
            time.sleep(0.01)
    return answer, time.monotonic() - (answered_at or t0)


def test_a_refused_request_s_endless_body_is_not_read_for_long(svc):
    """After a refusal the rest of a body is drained for at most 1 s (aiohttp would drain it for 10 s), and not
    at all after a 413: a client that keeps sending cannot keep the server reading."""
    key = honest_entry(4, 64, "a")[0]
    head = request_head("PUT", path_of(key), TOK_A_NS.replace("ns-a", "ns-x"), {"Content-Length": 1 << 30})
    answer, after = _held_open(svc.port, head, b"x" * 4096)  # a bad token: 401 before any body is read
    assert answer.startswith(b"HTTP/1.1 401") and after < 5, (answer[:80], after)
    head = request_head("POST", "/v1/contains", TOK_A, {"Transfer-Encoding": "chunked"})
    answer, after = _held_open(svc.port, head, b"1000\r\n" + b"x" * 4096 + b"\r\n")  # endless, over 1M
    assert answer.startswith(b"HTTP/1.1 413") and after < 5, (answer[:80], after)


def test_large_lookups_and_key_lists_are_probed_in_slices_with_the_same_answer(svc):
    """Lookups and /v1/contains probe their keys PROBE_SLICE at a time (the GIL is released between turns, issue 35):
    entries found in any slice are all reported, and a key of a namespace the token may not use is refused with
    403 wherever it sits in the list, whether the body is parsed here (<= 64 KiB) or by a worker."""
    from kvcodec.service.config import INLINE_JSON, PROBE_SLICE
    from kvcodec.store import StoreKey
    from kvcodec.testing.attacks import SMALL_FP

    first = 200  # token ids of 3-5 digits: 40 chunks of them stay under INLINE_JSON, 90 do not
    short, short_data = honest_entry(first, 3 * 256, "a")
    deep, deep_data = honest_entry(first, 37 * 256, "a")
    assert svc.put_raw(short, short_data, token=TOK_A) == 201 and svc.put_raw(deep, deep_data, token=TOK_A) == 201
    for n_chunks in (40, 90):  # 40 chunks: a body parsed on the event loop; 90: one parsed by a worker
        assert n_chunks > 2 * PROBE_SLICE
        q = {"model": SMALL_FP.id, "codec": "c", "namespace": "a", "token_ids": list(range(first, first + 256 * n_chunks))}
        body = json.dumps(q).encode()
        assert (len(body) > INLINE_JSON) == (n_chunks == 90)
        s, _, b = svc.request("POST", "/v1/lookup", TOK_A, body=body)
        ans = json.loads(b)
        assert s == 200 and ans["n_tokens"] == deep.n_tokens and ans["key"] == deep.to_str()
        assert [e["n_tokens"] for e in ans["entries"]] == [deep.n_tokens, short.n_tokens]
    absent = [StoreKey.for_tokens(list(range(i, i + 5)), model=SMALL_FP.id, codec="c", namespace="a") for i in range(800)]
    keys = [k.to_str() for k in absent[:300]] + [deep.to_str()] + [k.to_str() for k in absent[300:]] + [short.to_str()]
    for n in (40, len(keys)):  # 40 keys inline; all 802 (> 64 KiB) through a worker
        ks = keys[:n - 1] + [short.to_str()] if n < len(keys) else keys
        body = json.dumps({"keys": ks}).encode()
        assert (len(body) > INLINE_JSON) == (n == len(keys))
        s, _, b = svc.request("POST", "/v1/contains", TOK_A, body=body)
        found = json.loads(b)["found"]
        assert s == 200 and [i for i, f in enumerate(found) if f] == [i for i, k in enumerate(ks) if k in
                                                                     (deep.to_str(), short.to_str())]
        foreign = StoreKey.for_tokens([1, 2, 3], model=SMALL_FP.id, codec="c", namespace="a-private").to_str()
        late = ks[:-1] + [foreign]  # the refused key sits in the last slice
        s, _, b = svc.request("POST", "/v1/contains", TOK_A_NS, body=json.dumps({"keys": late}).encode())
        assert s == 403 and "a-private" in _error(b)


def test_a_token_never_reaches_the_log_or_an_error_and_odd_bytes_in_it_are_a_401(svc):
    """aiohttp's parser errors quote the request's bytes: a head with bare-LF line ends quoted the whole head,
    a refused byte or an overlong Authorization header quoted its line, so the bearer token went to the log and
    back in the answer. And a token of bytes that are not UTF-8 was a 500 (hashing a surrogate), not a 401."""
    secret = "tok-leaked-secret-0123456789"
    heads = [
        b"GET /v1/whoami HTTP/1.1\nHost: x\nConnection: close\nAuthorization: Bearer " + secret.encode() + b"\n\n",
        b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + secret.encode() + b"\x01\r\n\r\n",
        b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + secret.encode() + b"x" * 70_000 + b"\r\n\r\n",
    ]
    for head in heads:
        st, resp = raw_request(svc.port, head, timeout=10, source="127.0.0.21")
        assert st == 400 and "malformed HTTP request" in _error(_http_body(resp)), resp[:300]
        assert secret.encode() not in resp, resp[:300]
    st, resp = raw_request(svc.port, b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                           b"Authorization: Bearer \xff\xfe-not-utf8-token\r\n\r\n", timeout=10, source="127.0.0.21")
    assert st == 401 and _error(_http_body(resp)) == "invalid token", resp[:300]
    time.sleep(0.2)
    log = svc.log()
    assert secret not in log and "Traceback" not in log


def test_100_continue_is_sent_only_once_the_body_is_wanted(svc):
    """aiohttp sent "100 Continue" before any check, so a bad token's, a read-only token's or an oversized
    upload's client was invited to send its body and got its refusal only after we had read and dropped it; an
    unknown expectation was a plain-text 417. Now: refusals come instead of the 100, the 100 comes when the body
    is about to be read, and anything but 100-continue is a one-line JSON 417."""
    key, data = honest_entry(40, 64, "a")
    refused = [(TOK_A_NS.replace("ns-a", "ns-x"), 1 << 30, 401), (TOK_A, 1 << 30, 413), (TOK_B, len(data), 403)]
    for token, length, status in refused:
        head = request_head("PUT", path_of(key), token, {"Expect": "100-continue", "Content-Length": length})
        with socket.create_connection(("127.0.0.1", svc.port), timeout=10, source_address=("127.0.0.22", 0)) as s:
            s.sendall(head)
            first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 %d" % status), (status, first[:120])
    head = request_head("PUT", path_of(key), TOK_A, {"Expect": "100-continue", "Content-Length": len(data)})
    with socket.create_connection(("127.0.0.1", svc.port), timeout=10) as s:
        s.sendall(head)
        assert s.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(data)
        assert s.recv(65536).startswith(b"HTTP/1.1 201")
    st, resp = raw_request(svc.port, request_head("PUT", path_of(key), TOK_A, {"Expect": "200-ok",
                                                                                "Content-Length": 1}) + b"x")
    assert st == 417 and "Expect" in _error(_http_body(resp)), resp[:300]


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    """A service that cuts unread answers after 1 s and lets a tenant hold 10 MB of bodies at once, with a 7 MB
    entry of tenant a's (more than the kernel's socket buffers hold)."""
    s = Service(tmp_path_factory.mktemp("kdn-tight"), max_body="16M", tokens=TOKENS,
                extra=["--body-idle-timeout", "1", "--tenant-inflight-body", "10M"])
    key, data = costly_entry(300, 64, "a")
    assert s.put_raw(key, data, token=TOK_A) == 201
    yield s, key, data
    s.stop()


def _unread_get(port: int, key) -> socket.socket:
    """A GET of ``key`` whose client never reads (a 4 KiB receive window)."""
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    c.connect(("127.0.0.1", port))
    c.sendall(request_head("GET", path_of(key), TOK_A))
    return c


def test_an_answer_its_client_does_not_read_is_cut_after_the_idle_timeout(tight):
    """aiohttp waits for a reader without end: GETs of a 7 MB entry whose client never read held the entry's
    bytes, the connection and the handler for good. Now an answer that drains by less than 64 KiB for
    --body-idle-timeout has its connection aborted; a slow reader that keeps reading is not cut."""
    s, key, data = tight
    c = _unread_get(s.port, key)
    time.sleep(4)
    c.settimeout(10)
    got = 0
    try:
        while d := c.recv(1 << 20):
            got += len(d)
    except OSError:
        pass
    c.close()
    assert got < len(data), "an answer nobody read for 4 s was still being held"
    st, _, body = s.request("GET", path_of(key), TOK_A)
    assert st == 200 and body == data
    assert "Traceback" not in s.log() and "not read for 1 s" in s.log()


def test_an_entry_being_sent_is_held_against_the_tenant_s_body_budget(tight):
    """An entry's answer was sent after its handler returned, counted nowhere: a tenant's concurrent GETs of a
    large entry each held a copy until their clients read it, a term of the memory bound no limit enforced. Now
    it is held against --tenant-inflight-body until written: a second 7 MB GET under a 10 MB budget is a 429
    while the first is being sent (a HEAD sends no body: not counted), and is served once the first is done."""
    s, key, data = tight
    c = _unread_get(s.port, key)
    try:
        time.sleep(0.5)
        st, _, body = s.request("GET", path_of(key), TOK_A)
        assert st == 429 and "at once" in _error(body), (st, body[:200])
        assert s.request("HEAD", path_of(key), TOK_A)[0] == 200
    finally:
        c.close()
    deadline = time.monotonic() + 10
    while (got := s.request("GET", path_of(key), TOK_A))[0] == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert got[0] == 200 and got[2] == data


def test_two_authorization_headers_are_a_400_whichever_comes_first(svc):
    """The first of two Authorization headers was used: a request carrying tenant a's token then tenant b's was
    tenant a's, though a proxy in front that checks the last one saw tenant b. Now neither is used."""
    for first, second in ((TOK_A, TOK_B), (TOK_B, TOK_A), ("not-a-token-0000", TOK_A)):
        head = request_head("GET", "/v1/whoami", first, {"Authorization": f"Bearer {second}"})
        st, resp = raw_request(svc.port, head, timeout=10, source="127.0.0.23")
        assert st == 400 and "Authorization headers" in _error(_http_body(resp)), resp[:300]


def test_a_body_s_framing_is_bounded_by_its_bytes(svc):
    """The parser reads and drops a body's framing without end and without a byte of body (an endless chunk
    extension, a chunk size of endless zeros), so neither the ingest rate nor the body limits saw it: the event
    loop read it at line rate until --body-idle-timeout (then a 408). Now framing past 64 KiB + 8 bytes per body
    byte is a one-line 400 at once; a body in one-byte chunks (6 wire bytes each) is still served."""
    head = request_head("POST", "/v1/contains", TOK_B, {"Transfer-Encoding": "chunked"})
    for start, piece in ((b"c;", b"x" * 4096), (b"", b"0" * 4096)):
        answer, after = _held_open(svc.port, head + start, piece, limit_s=15)
        assert answer.startswith(b"HTTP/1.1 400") and "framing" in _error(_http_body(answer)), answer[:300]
    body = b'{"keys": []}'
    st, resp = raw_request(svc.port, head, b"".join(b"1\r\n" + bytes([c]) + b"\r\n" for c in body) + b"0\r\n\r\n")
    assert st == 200 and json.loads(_http_body(resp)) == {"found": []}, resp[:300]


def test_a_request_head_is_bounded_in_size(svc):
    """aiohttp bounds each header line (62 KiB) and their count, not their sum, and holds a head whole until it
    ends: 200 connections of one address with 6 MB heads took the service from 54 MB to 2.4 GB. Now a head past
    the metadata header's 60 KiB plus 64 KiB is a one-line 431 and the connection closes; one 60 KiB header
    (the largest the protocol uses) still passes."""
    from kvcodec.service.server import MAX_HEAD

    with socket.create_connection(("127.0.0.1", svc.port), timeout=10, source_address=("127.0.0.24", 0)) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
        answer = b""
        try:
            for i in range(2 * MAX_HEAD // 60_000):
                s.sendall(b"X-Big-%d: " % i + b"v" * 60_000 + b"\r\n")
                time.sleep(0.05)  # separate reads: the head grows on the server, one header at a time
            s.sendall(b"\r\n")
        except OSError:
            pass
        try:
            while d := s.recv(65536):
                answer += d
        except OSError:
            pass
    assert answer.startswith(b"HTTP/1.1 431") and "request head larger" in _error(_http_body(answer)), answer[:300]
    st, resp = raw_request(svc.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: "
                           + b"v" * 60_000 + b"\r\n\r\n", source="127.0.0.24")
    assert st == 200, resp[:300]


def test_connections_in_all_are_capped_below_the_descriptor_limit(tmp_path):
    """Only connections per address were capped: many addresses' idle connections took every descriptor, so
    accepting failed (asyncio logged a traceback per try) and every tenant's requests waited until the holders
    timed out. Now past --max-connections (and what the descriptor limit leaves room for) a new connection is
    a one-line 503 at once, and the connections already open are served."""
    from kvcodec.service.config import CONNECTION_BYTES, ServiceConfig
    from kvcodec.service.server import descriptor_room

    assert ServiceConfig(max_connections=2000).memory_bound(1) - ServiceConfig(max_connections=1000).memory_bound(1) \
        == 1000 * CONNECTION_BYTES
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    assert soft == resource.RLIM_INFINITY or descriptor_room() <= soft - 256
    s = Service(tmp_path, extra=["--max-connections", "12"], tokens=TOKENS)
    try:
        time.sleep(1.0)  # the start-up check's connection is closed on the server's side by now
        held = [socket.create_connection(("127.0.0.1", s.port), source_address=(f"127.0.0.{40 + i % 2}", 0))
                for i in range(11)]
        try:
            time.sleep(0.3)
            mine = socket.create_connection(("127.0.0.1", s.port), source_address=("127.0.0.44", 0))
            time.sleep(0.3)
            st, resp = raw_request(s.port, request_head("GET", "/v1/whoami", TOK_A), timeout=10, source="127.0.0.45")
            assert st == 503 and "too many connections" in _error(_http_body(resp)), resp[:300]
            mine.sendall(request_head("GET", "/v1/whoami", TOK_A))
            assert mine.recv(65536).startswith(b"HTTP/1.1 200"), "a connection already open is served"
            mine.close()
        finally:
            for c in held:
                c.close()
        deadline = time.monotonic() + 20
        while (st := raw_request(s.port, request_head("GET", "/v1/whoami", TOK_A), timeout=10)[0]) == 503 \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert st == 200 and "Traceback" not in s.log()
    finally:
        s.stop()


def test_a_request_no_route_serves_gets_no_100_continue_and_a_json_417(svc):
    """A path or method no route serves was answered by aiohttp's own "no route" match, whose Expect handler
    sent "100 Continue" first (inviting the body, then read and dropped for LINGER before the 404/405) and an
    unknown expectation as a plain-text 417. Now such requests pass through the same expect handler."""
    for method, path, status in (("PUT", "/nothing", 404), ("POST", "/healthz", 405)):
        head = request_head(method, path, TOK_A, {"Expect": "100-continue", "Content-Length": 1 << 30})
        with socket.create_connection(("127.0.0.1", svc.port), timeout=10, source_address=("127.0.0.25", 0)) as s:
            s.sendall(head)
            first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 %d" % status), (path, first[:120])
        assert (b"Allow: GET,HEAD" in first) == (status == 405) and "error" in json.loads(_http_body(first))
    st, resp = raw_request(svc.port, request_head("PUT", "/nothing", None, {"Expect": "x", "Content-Length": 1}) + b"x")
    assert st == 417 and "Expect" in _error(_http_body(resp)), resp[:300]
