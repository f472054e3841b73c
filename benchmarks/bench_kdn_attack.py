"""A shared KDN under attack (issue 35): N honest engines keep working while a stranger runs each attack class.

    python benchmarks/bench_kdn_attack.py [--engines 4] [--phase-s 15] [--backend kdn,cluster,s3]
                                          [--attackers 4] [--think-ms 20] [--attacker-nice 19]

Loopback only; every phase is bounded in time (``--phase-s``) and every request has a timeout.

Honest engines are separate processes, each a :class:`~kvcodec.store.Store` client of the backend (no
in-process cache), looping: a prefix lookup (``contains_many`` of four candidate keys) and a read of one
of ``--docs`` stored entries (sound ``.kvc`` files of a synthetic model, ~130 KB), then ``--think-ms`` of
"compute"; one request in ten on the KDN is a put of a new entry.  Per phase they report latency p50 / p99
(lookup + read, or put), errors (an exception, or bytes that differ from what was stored) and misses of
entries the attacker overwrote (remote tiers).

Backends and attack classes (one phase each, after a no-attack baseline; the attacker is one process of
``--attackers`` threads, a tenant of its own on the KDN):

* ``kdn`` -- ``kvc serve`` (default limits) over a directory store:
  ``amplify`` valid ~9 KB puts declaring 65 MB of decoded K/V; ``costly`` valid puts that each decode
  8 MiB (the most expensive legal put); ``chunked`` JSON bodies twice the JSON limit with no
  Content-Length; ``deep`` 100,000-deep JSON; ``lookups`` ~1 MB lookups (parsed and hashed by workers);
  ``keylists`` /v1/contains of 600 keys (~58 KB: parsed on the event loop, probed in store threads, no worker);
  ``slowloris`` 200 connections sending their request head a byte at a time; ``stalled`` bodies that
  stop after 10 bytes; ``junk`` unauthenticated requests: malformed HTTP and bad tokens, as fast as it can;
  ``editregex`` (issue 55) redact edits of the attacker's own entry (the text ``a`` x 400 then ``!``) with the
  catastrophic pattern ``(a|aa)+$``, which ran for ever and froze the service before the pattern bound; with
  this class the service runs with ``--model smollm2`` and one honest engine, in every phase (the baseline
  too), also edits every 2 s: a redact of tokens [2, 4) of a real 96-token entry of its tenant, reported apart
  (``edit_p99_ms``; the model is loaded, and one edit made, before the baseline);
* ``cluster`` -- the Redis Cluster tier (3 masters), and ``s3`` -- the S3 tier (moto): ``oversized`` the
  attacker, who can write the shared tier, replaces half of the honest entries with 32 MiB values (intact
  envelopes of another key, so readers keep them); the engines run with ``max_bytes=8M`` (their entries
  are ~130 KB) and again with the tier's default cap (``oversized-default``: the value is under the cap, so
  only its head, read first, refuses it); ``forged-default``: 32 MiB envelopes of the asked key itself
  without a valid seal, which only the reader's Store can refuse, after reading each whole.

The attacker is a stranger on another machine, which one loopback box can only approximate. It connects from its
own address (``127.0.0.2``; the honest engines from ``127.0.0.1``), so per-address defences see two clients, and
its process runs at ``--attacker-nice`` (default 19): its *own* client work (building requests, a thread per
connection) then takes only the CPU the server and the engines leave, as it would on its own machine, while every
byte of work it causes the server is the server's. ``--attacker-nice 0`` lets the load generator compete for the
same cores (on a 2-core box that alone moves the honest p99; the attacker's CPU-seconds are reported either way).

Reported per phase: honest p50 / p99 (ms), requests, errors, misses; the attacker's request count and
answers; the server's peak RSS (``kvc serve`` with its worker processes; the three redis-server nodes;
moto) and the honest engines' peak RSS, sampled every 100 ms.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import harness

ROOT = Path(__file__).resolve().parents[1]
TOK_HONEST = "bench-attack-honest-0001"
TOK_MALLORY = "bench-attack-mallory-01"
STORE_KEY = "5a" * 32
KDN_CLASSES = ("amplify", "costly", "chunked", "deep", "lookups", "keylists", "slowloris", "stalled", "junk", "editregex")
EDIT_CLASSES = ("editregex",)  # classes that need the service's model, and honest engines that edit
EDIT_MODEL = "smollm2"
EVIL_PATTERN = "(a|aa)+$"
EDIT_EVERY_S = 2.0  # engine 0's honest edits: one every 2 s (the service runs one model edit at a time)
REMOTE_CLASSES = ("oversized", "forged")
BIG = 32 << 20
ATTACKER_ADDR = "127.0.0.2"  # the stranger's own address (any of 127/8 is this machine)


# ----------------------------------------------------------------------------------------------- memory
def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (``/proc/PID/stat``; 0 for a process gone)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat(5))
        except (OSError, IndexError, ValueError):
            pass
    return total / tick


def tree(roots: list[int]) -> list[int]:
    out = []
    for r in roots:
        out.append(r)
        out.extend(children(r))
    return out


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


class RssSampler:
    """Peak summed RSS of process trees (``roots()`` and their children), sampled every 100 ms."""

    def __init__(self, roots: Callable[[], list[int]]) -> None:
        self.roots = roots
        self.peak_kb = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = set()
            for r in self.roots():
                pids.add(r)
                pids.update(children(r))
            self.peak_kb = max(self.peak_kb, sum(rss_kb(p) for p in pids))
            self._stop.wait(0.1)

    def __enter__(self) -> "RssSampler":
        self._t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._t.join(5)


# ----------------------------------------------------------------------------------------------- honest engines
def _entries(n_docs: int, tokens: int) -> list[tuple[Any, bytes]]:
    from kvcodec.testing.attacks import honest_entry

    return [honest_entry(10_000 * (i + 1), tokens, "honest") for i in range(n_docs)]


def _post_edit(port: int, token: str, key: str, body: dict[str, Any], timeout: float = 120) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/entries/{key}/edit", data=json.dumps(body).encode(),
                                 method="POST", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def engine(url: str, n_docs: int, tokens: int, think_s: float, seed: int, cmds: Any, results: Any,
           edit: dict[str, Any] | None = None) -> None:
    """One honest engine: runs phases on command, returns each phase's latencies, errors and misses.
    ``edit`` ({"port", "key"}): engine 0 also edits that entry every EDIT_EVERY_S seconds (the editregex class)."""
    os.environ["KVC_STORE_KEY"] = STORE_KEY
    from kvcodec.store import Store, StoreKey
    from kvcodec.store.keys import prefix_keys
    from kvcodec.testing.attacks import honest_entry

    docs = _entries(n_docs, tokens)
    st = Store.open(url, memory_bytes=0)
    rng = random.Random(seed)
    puts = 0
    while True:
        cmd = cmds.get()
        if cmd is None:
            break
        phase, seconds, can_put = cmd
        lat: list[float] = []
        put_lat: list[float] = []
        edit_lat: list[float] = []
        errors: list[str] = []
        misses = 0
        end = time.monotonic() + seconds
        next_edit = time.monotonic() + rng.uniform(0, EDIT_EVERY_S)
        while time.monotonic() < end:
            if edit is not None and seed == 0 and time.monotonic() >= next_edit:
                next_edit = time.monotonic() + EDIT_EVERY_S
                t0 = time.perf_counter()
                try:
                    status, body = _post_edit(edit["port"], TOK_HONEST, edit["key"],
                                              {"op": "redact", "params": {"token_spans": [[2, 4]]}})
                    if status != 201:
                        errors.append(f"edit: {status} {body[:120]!r}")
                except Exception as e:  # noqa: BLE001 - every failure is an honest error, reported
                    errors.append(f"edit {type(e).__name__}: {str(e)[:200]}")
                edit_lat.append(time.perf_counter() - t0)
                time.sleep(think_s)
                continue
            i = rng.randrange(n_docs)
            key, data = docs[i]
            is_put = can_put and rng.random() < 0.1
            if is_put:  # the engine's own encode of its new entry is not the store's latency: made before the clock
                puts += 1
                k, d = honest_entry(1_000_000 * (seed + 1) + 1000 * puts, 64, "honest")
            t0 = time.perf_counter()
            try:
                if is_put:
                    res = st.put(k, d)
                    if res.failed:
                        errors.append(f"put: {res.failed}")
                else:
                    ids = list(range(10_000 * (i + 1), 10_000 * (i + 1) + tokens))
                    cands: list[StoreKey] = prefix_keys(ids, model=key.model, codec=key.codec, namespace="honest")[:4]
                    st.contains_many(cands)
                    got = st.get(key)
                    if got is None:
                        misses += 1
                    elif got != data:
                        errors.append("read returned other bytes")
            except Exception as e:  # noqa: BLE001 - every failure is an honest error, reported
                errors.append(f"{type(e).__name__}: {str(e)[:200]}")
            (put_lat if is_put else lat).append(time.perf_counter() - t0)
            time.sleep(think_s)
        import resource

        results.put({"phase": phase, "lat": lat + put_lat, "read_lat": lat, "put_lat": put_lat, "edit_lat": edit_lat,
                     "errors": errors, "misses": misses,
                     "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


# ----------------------------------------------------------------------------------------------- attacks
class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.n = 0
        self.status: dict[str, int] = {}

    def add(self, what: Any) -> None:
        with self.lock:
            self.n += 1
            self.status[str(what)] = self.status.get(str(what), 0) + 1


def _kdn_attack(kind: str, port: int, seconds: float, threads: int, ready: Callable[[], None],
                evil: dict[str, Any] | None = None) -> dict[str, Any]:
    from kvcodec.store import StoreKey
    from kvcodec.testing.attacks import (
        amplification_entry, chunked, costly_entry, deep_json, raw_request, request_head, slow_head,
    )

    tally = Tally()
    edit_s: list[float] = []  # editregex: seconds from the edit's request to its answer
    amp = amplification_entry(7, 500, "mallory")
    costly = [costly_entry(100 + i, 64, "mallory") for i in range(8)] if kind == "costly" else []
    big_json = b'{"keys": ["' + b"x" * (32 << 20) + b'"]}' if kind == "chunked" else b""
    lookup = json.dumps({"model": "m", "codec": "c", "namespace": "mallory",
                         "token_ids": list(range(120_000))}).encode()
    keylist = json.dumps({"keys": [StoreKey.for_tokens([i, i + 1], model="m", codec="c", namespace="mallory").to_str()
                                   for i in range(600)]}).encode() if kind == "keylists" else b""
    ready()
    end = time.monotonic() + seconds

    def one(i: int) -> None:
        if kind == "amplify":
            key, data = amp
            head = request_head("PUT", f"/v1/entries/{key.to_str()}", TOK_MALLORY, {"Content-Length": len(data)})
            tally.add(raw_request(port, head, data, timeout=30, source=ATTACKER_ADDR)[0])
        elif kind == "costly":
            key, data = costly[i % len(costly)]
            head = request_head("PUT", f"/v1/entries/{key.to_str()}", TOK_MALLORY, {"Content-Length": len(data)})
            tally.add(raw_request(port, head, data, timeout=60, source=ATTACKER_ADDR)[0])
        elif kind == "chunked":
            head = request_head("POST", "/v1/contains", TOK_MALLORY, {"Transfer-Encoding": "chunked"})
            tally.add(raw_request(port, head, chunked(big_json, 1 << 20), timeout=30, source=ATTACKER_ADDR)[0])
        elif kind == "deep":
            body = deep_json()
            head = request_head("POST", "/v1/lookup", TOK_MALLORY, {"Content-Length": len(body)})
            tally.add(raw_request(port, head, body, timeout=30, source=ATTACKER_ADDR)[0])
        elif kind == "lookups":
            head = request_head("POST", "/v1/lookup", TOK_MALLORY, {"Content-Length": len(lookup)})
            tally.add(raw_request(port, head, lookup, timeout=60, source=ATTACKER_ADDR)[0])
        elif kind == "keylists":
            head = request_head("POST", "/v1/contains", TOK_MALLORY, {"Content-Length": len(keylist)})
            tally.add(raw_request(port, head, keylist, timeout=60, source=ATTACKER_ADDR)[0])
        elif kind == "stalled":
            with socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(ATTACKER_ADDR, 0)) as s:
                s.sendall(request_head("PUT", f"/v1/entries/{amp[0].to_str()}", TOK_MALLORY,
                                       {"Content-Length": 1 << 20}) + b"x" * 10)
                try:
                    tally.add(s.recv(64).split(b" ", 2)[1].decode(errors="replace"))
                except (OSError, IndexError):
                    tally.add("closed")
        elif kind == "junk":
            if i % 2:
                tally.add(raw_request(port, b"GET /v1/whoami HTTP/1.1\r\nHost: x\r\nContent-Length: zz\r\n\r\n",
                                      timeout=10, source=ATTACKER_ADDR)[0])
            else:
                tally.add(raw_request(port, request_head("GET", "/v1/whoami", f"not-a-token-{i}"), timeout=10,
                                      source=ATTACKER_ADDR)[0])
        elif kind == "editregex":
            assert evil is not None
            t0 = time.monotonic()
            status, body = _post_edit(port, TOK_MALLORY, evil["key"],
                                      {"op": "redact", "params": {"pattern": EVIL_PATTERN}}, timeout=120)
            took = time.monotonic() - t0
            with tally.lock:
                edit_s.append(took)
            msg = ""
            try:
                msg = json.loads(body).get("error", "")
            except ValueError:
                pass
            tally.add(f"{status} {'bound' if 'did not finish within' in msg else msg[:60]}")
        elif kind == "slowloris":
            held = slow_head(port, interval=0.5, limit_s=max(0.5, end - time.monotonic()), source=ATTACKER_ADDR)
            tally.add(f"held {int(held)} s")

    def worker(w: int) -> None:
        i = w
        while time.monotonic() < end:
            try:
                one(i)
            except OSError as e:
                tally.add(type(e).__name__)
            i += threads

    n = 200 if kind == "slowloris" else threads
    ts = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(seconds + 90)
    out: dict[str, Any] = {"requests": tally.n, "answers": dict(sorted(tally.status.items()))}
    if edit_s:
        out["edit_answer_s"] = {"min": round(min(edit_s), 2), "max": round(max(edit_s), 2)}
    return out


def _remote_attack(kind: str, url: str, seconds: float, raw: Any, ready: Callable[[], None]) -> dict[str, Any]:
    """Overwrite half of the honest entries (every other name on the tier) with 32 MiB values, then hold.

    ``oversized``: the value is an intact envelope (the public format of spec/store-keys.md §6) of *another*
    key: a reader treats it as a miss and, rightly, never deletes it (it may be someone's), so every read meets
    it again.  ``forged``: an intact envelope of the very name's key with a 32 MiB payload and no valid seal
    (the attacker cannot make one): only the reader's Store can refuse it, after reading it whole.
    """
    from kvcodec.store.keys import StoreKey
    from kvcodec.store.tiers.base import encode_envelope

    other = encode_envelope(StoreKey.for_tokens([0], model="mallory", codec="x"), b"\0" * BIG, {}, None)
    names = raw["names"]()
    victims = names[::2]
    for n in victims:
        if kind == "forged":
            text = n.decode() if isinstance(n, bytes) else str(n)
            key = StoreKey.from_str(text[text.index("kvc", 1 if text.startswith("kvc:") else 0):].rsplit("/", 1)[-1])
            raw["set"](n, encode_envelope(key, b"\0" * BIG, {}, None))
        else:
            raw["set"](n, other)
    ready()
    time.sleep(seconds)
    return {"overwritten": len(victims), "value_bytes": BIG}


def attacker_main(kind: str, target: dict[str, Any], seconds: float, threads: int, out: Any, nice: int = 19) -> None:
    """Prepare, say "ready" on ``out``, attack for ``seconds``, then put the tally on ``out``; at ``nice`` (module
    docstring: the attacker's own client work stands for another machine's)."""
    import resource

    os.nice(nice)

    def used() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    start: list[float] = []

    def ready() -> None:
        start.append(used())
        out.put("ready")

    if target["kind"] == "kdn":
        res = _kdn_attack(kind, target["port"], seconds, threads, ready, target.get("evil"))
    else:
        res = _remote_attack(kind, target["url"], seconds, _raw_access(target), ready)
    res["cpu_s"] = round(used() - start[0], 2)  # the attacker's own CPU during the attack: it shares the cores
    out.put(res)


def _raw_access(target: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """What a writer of the shared tier can do without kvcodec: list names, set any value."""
    if target["kind"] == "cluster":
        from redis.cluster import RedisCluster

        rc = RedisCluster(host="127.0.0.1", port=target["ports"][0])
        return {"names": lambda: sorted(rc.scan_iter(match="kvc:*", count=1000, target_nodes=rc.PRIMARIES)),
                "set": lambda n, v: rc.set(n, v)}
    import boto3

    s3 = boto3.session.Session().client("s3", endpoint_url=target["endpoint"], region_name="us-east-1")
    return {"names": lambda: sorted(o["Key"] for o in s3.list_objects_v2(Bucket=target["bucket"]).get("Contents", [])),
            "set": lambda n, v: s3.put_object(Bucket=target["bucket"], Key=n, Body=v)}


# ----------------------------------------------------------------------------------------------- backends
class Backend:
    kind: str

    def url(self, cap: str | None) -> str:
        raise NotImplementedError

    def server_pids(self) -> list[int]:
        raise NotImplementedError

    def target(self) -> dict[str, Any]:
        raise NotImplementedError

    def restore(self, entries: list[tuple[Any, bytes]]) -> None:
        """Put every honest entry back (after an overwrite phase)."""
        from kvcodec.store import Store

        os.environ["KVC_STORE_KEY"] = STORE_KEY
        st = Store.open(self.url(None), memory_bytes=0)
        for k, d in entries:
            st.put(k, d)
        st.close()

    def stop(self) -> None:
        raise NotImplementedError


class KdnBackend(Backend):
    kind = "kdn"

    def __init__(self, tmp: Path, model: str | None = None) -> None:
        from kvcodec.testing.servers import free_port, subprocess_env, wait_port

        self.port = free_port()
        self.evil: dict[str, Any] | None = None
        tokens = tmp / "tokens.json"
        tokens.write_text(json.dumps({"tokens": [{"token": TOK_HONEST, "tenant": "honest"},
                                                 {"token": TOK_MALLORY, "tenant": "mallory"}]}))
        self.log = open(tmp / "serve.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "kvcodec", "serve", "--store", str(tmp / "kdn-store"),
                                      "--port", str(self.port), "--tokens", str(tokens),
                                      *(["--model", model] if model else [])],
                                     env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=self.log)
        wait_port(self.port, timeout=120, proc=self.proc)
        time.sleep(1.0)  # the worker processes start after the port opens

    def url(self, cap: str | None) -> str:
        return f"kvc+http://:{TOK_HONEST}@127.0.0.1:{self.port}?timeout=30"

    def server_pids(self) -> list[int]:
        return [self.proc.pid]

    def target(self) -> dict[str, Any]:
        return {"kind": "kdn", "port": self.port, "evil": self.evil}

    def edit_entries(self, model: str) -> dict[str, Any]:
        """Put the editregex class's entries: each honest tenant's real 96-token entry to edit, and the
        attacker's own entry of ``a`` x 400 then ``!`` (its catastrophic pattern's text). Returns the honest
        engines' edit target."""
        from kvcodec.api import encode
        from kvcodec.models.capture import capture, tokenize
        from kvcodec.models.load import load_model
        import urllib.request

        from kvcodec.store import StoreKey
        from kvcodec.store.keys import codec_key
        from kvcodec.texts import load_text

        lm = load_model(model)
        out = {}
        for who, token, text, ns in (("honest", TOK_HONEST, None, "honest"), ("evil", TOK_MALLORY, "a" * 400 + "!", "mallory")):
            ids = tokenize(lm.tokenizer, text) if text is not None else tokenize(lm.tokenizer, load_text("apache2"))[:96]
            data = encode(capture(lm, token_ids=ids), None, preset="lossless").data
            key = StoreKey.for_tokens(ids, model=lm.fingerprint.id, codec=codec_key("lossless"), namespace=ns)
            # a PUT with the key in clear (as curl would send it): an edit names the entry by its logical key
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/entries/{key.to_str()}", data=data,
                                         method="PUT", headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(req, timeout=60) as r:
                if r.status not in (200, 201):
                    raise SystemExit(f"could not store the {who} entry to edit: HTTP {r.status}")
            out[who] = {"port": self.port, "key": key.to_str()}
        # the service loads the model on its first edit: that happens here, not in the baseline phase
        status, body = _post_edit(self.port, TOK_HONEST, out["honest"]["key"],
                                  {"op": "redact", "params": {"token_spans": [[2, 4]]}}, timeout=600)
        if status != 201:
            raise SystemExit(f"the warm-up edit failed: HTTP {status} {body[:200]!r}")
        self.evil = out["evil"]
        return out["honest"]

    def stop(self) -> None:
        from kvcodec.testing.servers import stop_process

        stop_process(self.proc)
        self.log.close()


class ClusterBackend(Backend):
    kind = "cluster"

    def __init__(self, tmp: Path) -> None:
        from kvcodec.testing.servers import RedisCluster, find_binary

        server, cli = find_binary("redis-server"), find_binary("redis-cli")
        if server is None or cli is None:
            raise SystemExit("redis-server / redis-cli not found (bash .ci/services.sh)")
        self.c = RedisCluster(server, cli, tmp / "cluster")
        self.c.start()

    def url(self, cap: str | None) -> str:
        return self.c.url + (f"&max_bytes={cap}" if cap else "")

    def server_pids(self) -> list[int]:
        return [p.pid for p in self.c.procs.values()]

    def target(self) -> dict[str, Any]:
        return {"kind": "cluster", "url": self.c.url, "ports": list(self.c.ports)}

    def stop(self) -> None:
        self.c.stop()


class S3Backend(Backend):
    kind = "s3"

    def __init__(self, tmp: Path) -> None:
        from kvcodec.testing.servers import S3_ENV, S3Server, find_moto

        binary = find_moto()
        if binary is None:
            raise SystemExit("moto_server not found (pip install 'moto[server]')")
        os.environ.update(S3_ENV)
        self.s = S3Server(binary)
        self.s.start()

    def url(self, cap: str | None) -> str:
        return self.s.url("attack", **({"max_bytes": cap} if cap else {}))

    def server_pids(self) -> list[int]:
        return [self.s.proc.pid] if self.s.proc is not None else []

    def target(self) -> dict[str, Any]:
        return {"kind": "s3", "url": self.s.url("attack"), "endpoint": self.s.endpoint, "bucket": self.s.bucket}

    def stop(self) -> None:
        self.s.stop()


def run_backend(kind: str, a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    (tmp / kind).mkdir(parents=True, exist_ok=True)
    entries = _entries(a.docs, a.doc_tokens)  # before any server starts: a failure here leaves none behind
    edits = kind == "kdn" and any(c in a.classes for c in EDIT_CLASSES)
    be: Backend = KdnBackend(tmp / kind, EDIT_MODEL if edits else None) if kind == "kdn" else \
        {"cluster": ClusterBackend, "s3": S3Backend}[kind](tmp / kind)
    ctx = mp.get_context("spawn")
    out: dict[str, Any] = {"backend": kind, "engines": a.engines, "phases": []}
    try:
        be.restore(entries)
        edit_target = be.edit_entries(EDIT_MODEL) if edits and isinstance(be, KdnBackend) else None
        phases: list[tuple[str, str | None]] = [("baseline", None)]
        if kind == "kdn":
            phases += [(c, c) for c in KDN_CLASSES if c in a.classes]
        else:
            if "oversized" in a.classes:
                phases += [("baseline-default", None), ("oversized", "oversized"), ("oversized-default", "oversized")]
            if "forged" in a.classes:
                phases += [("forged-default", "forged")]
        engines: dict[str, tuple[list[Any], list[Any], Any]] = {}

        def start_engines(cap: str | None) -> tuple[list[Any], list[Any], Any]:
            res = ctx.Queue()
            cmds, procs = [], []
            for e in range(a.engines):
                q = ctx.Queue()
                p = ctx.Process(target=engine, args=(be.url(cap), a.docs, a.doc_tokens, a.think_ms / 1000, e, q, res,
                                                     edit_target), daemon=True)
                p.start()
                cmds.append(q)
                procs.append(p)
            return cmds, procs, res

        for phase, attack in phases:
            cap = None if kind == "kdn" or phase.endswith("-default") else "8M"  # None: the tier's default
            group = engines.get(cap or "-")
            if group is None:
                group = engines[cap or "-"] = start_engines(cap)
            cmds, procs, res = group
            if attack in REMOTE_CLASSES:
                be.restore(entries)
            att_q = ctx.Queue()
            att = None
            cpu0 = cpu_s(tree(be.server_pids()))
            t_phase = time.monotonic()
            with RssSampler(be.server_pids) as srv_rss, RssSampler(lambda: [p.pid for p in procs]) as eng_rss:
                if attack is not None:
                    att = ctx.Process(target=attacker_main,
                                      args=(attack, be.target(), a.phase_s + 1, a.attackers, att_q, a.attacker_nice),
                                      daemon=True)
                    att.start()
                    if att_q.get(timeout=600) != "ready":  # its payloads built (and the overwrite done)
                        raise SystemExit("the attacker did not start")
                    time.sleep(0.5)  # the attack ramps up before the honest engines' phase starts
                for q in cmds:
                    q.put((phase, a.phase_s, kind == "kdn"))
                rows = [res.get(timeout=a.phase_s + 180) for _ in cmds]
                attack_out = att_q.get(timeout=a.phase_s + 180) if att is not None else None
                if att is not None:
                    att.join(30)
                    if att.is_alive():
                        att.kill()
            server_cpu = cpu_s(tree(be.server_pids())) - cpu0
            wall = time.monotonic() - t_phase
            lat = [x for r in rows for x in r["lat"]]
            reads = [x for r in rows for x in r["read_lat"]]
            puts = [x for r in rows for x in r["put_lat"]]
            edit_lat = [x for r in rows for x in r["edit_lat"]]
            errs = [e for r in rows for e in r["errors"]]
            row = {
                "phase": phase, "attack": attack, "max_bytes": cap, "requests": len(lat),
                "p50_ms": round(1000 * pct(lat, 0.5), 2) if lat else None,
                "p99_ms": round(1000 * pct(lat, 0.99), 2) if lat else None,
                "mean_ms": round(1000 * statistics.fmean(lat), 2) if lat else None,
                # the same requests split by kind: where a tail comes from (a read is a lookup + a get)
                "read_p99_ms": round(1000 * pct(reads, 0.99), 2) if reads else None,
                "put_p99_ms": round(1000 * pct(puts, 0.99), 2) if puts else None, "puts": len(puts),
                "edit_p99_ms": round(1000 * pct(edit_lat, 0.99), 2) if edit_lat else None, "edits": len(edit_lat),
                "errors": len(errs), "error_examples": sorted(set(errs))[:3], "misses": sum(r["misses"] for r in rows),
                "server_peak_rss_mb": round(srv_rss.peak_kb / 1024, 1),
                "engines_peak_rss_mb": round(eng_rss.peak_kb / 1024, 1),
                "attacker": attack_out,
                # CPU-s of the server tree during the phase (live processes only: a replaced worker's is lost)
                "server_cpu_s": round(server_cpu, 1), "phase_wall_s": round(wall, 1),
            }
            out["phases"].append(row)
            print(render_row(kind, row), flush=True)
        for cmds, procs, _ in engines.values():
            for q in cmds:
                q.put(None)
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
    finally:
        be.stop()
    base = {r["phase"]: r for r in out["phases"] if r["attack"] is None}
    for r in out["phases"]:
        ref = base.get("baseline-default" if r["phase"].endswith("-default") else "baseline")
        if ref and r["p99_ms"] and ref["p99_ms"]:
            r["p99_vs_baseline"] = round(r["p99_ms"] / ref["p99_ms"], 2)
        for k in ("read_p99_ms", "edit_p99_ms"):
            if ref and r.get(k) and ref.get(k):
                r[k.replace("_ms", "_vs_baseline")] = round(r[k] / ref[k], 2)
    return out


def render_row(kind: str, r: dict[str, Any]) -> str:
    att = r["attacker"] or {}
    seen = att.get("answers") or ({"overwritten": att.get("overwritten")} if att else {})
    return (f"{kind:<8} {r['phase']:<13} n={r['requests']:<5} p50 {r['p50_ms']} ms  p99 {r['p99_ms']} ms "
            f"(reads {r['read_p99_ms']}, puts {r['put_p99_ms']}, edits {r.get('edit_p99_ms')} n={r.get('edits')})  "
            f"errors {r['errors']}  misses {r['misses']}  server RSS {r['server_peak_rss_mb']} MB  "
            f"engines RSS {r['engines_peak_rss_mb']} MB  server CPU {r['server_cpu_s']} s / {r['phase_wall_s']} s  "
            f"attacker CPU {att.get('cpu_s', '-')} s  attacker {att.get('requests', '')} {seen}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=15.0, help="seconds per phase (each phase is bounded by it)")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=1024, help="tokens per honest entry (1024: ~130 KB)")
    ap.add_argument("--think-ms", type=float, default=20.0, help="an engine's compute between two store requests")
    ap.add_argument("--attackers", type=int, default=4, help="attacker threads (slowloris: 200 connections)")
    ap.add_argument("--attacker-nice", type=int, default=19, choices=range(0, 20), metavar="0-19",
                    help="niceness of the attacker's process (module docstring; 0: it competes for the cores)")
    ap.add_argument("--backend", default="kdn,cluster,s3")
    ap.add_argument("--classes", default=",".join(KDN_CLASSES + REMOTE_CLASSES),
                    help="attack classes to run (" + ", ".join(KDN_CLASSES + REMOTE_CLASSES) + ")")
    ap.add_argument("--json", default=None)
    run = harness.cli(ap, argv, case="kdn_attack")
    a = run.args
    a.classes = [c.strip() for c in a.classes.split(",") if c.strip()]
    if a.engines < 1 or a.phase_s <= 0:
        raise SystemExit("--engines must be >= 1 and --phase-s > 0")
    os.environ["KVC_STORE_KEY"] = STORE_KEY
    print(f"{a.engines} honest engines, {a.docs} entries of {a.doc_tokens} tokens, {a.phase_s:g} s per phase, "
          f"{os.cpu_count()} CPU cores shared by engines, attacker and servers\n", flush=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="kvc-attack-") as d:
        for kind in [k.strip() for k in a.backend.split(",") if k.strip()]:
            results.append(run_backend(kind, a, Path(d)))
            print()
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=2, default=str))
    run.emit({"results": results})


if __name__ == "__main__":
    main()
