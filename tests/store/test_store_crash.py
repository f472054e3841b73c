"""Directory tier under SIGKILL and under concurrent writer/reader processes."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import time

from kvcodec.store.tiers.directory import DirectoryTier, TMP_SUFFIX
from kvcodec.store.tiers.base import decode_envelope
from store_crash_worker import crash_payload_valid, crash_writer
from store_fixtures import PY, subprocess_env

# Payloads are self-verifying (a header naming their size, then a prefix of a
# fixed pseudo-random buffer), so a reader can tell a complete payload from a
# torn one independently of the store's own checksum.
WORKER = r'''
import os, random, struct, sys, time
from kvcodec.store import StoreKey
from kvcodec.store.tiers.directory import DirectoryTier

BASE = random.Random(42).randbytes(4 << 20)

def key(i):
    return StoreKey.for_tokens([i] * 3, model="m", codec="c", namespace="crash")

def make(seed, n, size):
    head = struct.pack("<QQQ", seed, n, size)
    return head + BASE[:size]

def check(b):
    if len(b) < 24:
        return False
    seed, n, size = struct.unpack_from("<QQQ", b)
    return len(b) == 24 + size and b[24:] == BASE[:size]

mode, root, seed, nkeys, lo, hi, seconds, cap = sys.argv[1:9]
seed, nkeys, lo, hi, seconds = int(seed), int(nkeys), int(lo), int(hi), float(seconds)
cap = None if cap == "none" else int(cap)
rng = random.Random(seed)
tier = DirectoryTier(root, fsync=True, max_bytes=cap)
end = time.monotonic() + seconds
n = bad = hits = 0
while time.monotonic() < end:
    i = rng.randrange(nkeys)
    if mode == "write":
        n += 1
        tier.put(key(i), make(seed, n, rng.randrange(lo, hi)), {"i": i, "w": seed})
        print(n, flush=True)
    else:
        b = tier.get(key(i))
        n += 1
        if b is not None:
            hits += 1
            if not check(b):
                bad += 1
print("done", n, hits, bad, flush=True)
sys.exit(3 if bad else 0)
'''


def _tmp_files(root) -> list[str]:
    out = []
    for dp, _, names in os.walk(root):
        out += [os.path.join(dp, n) for n in names if n.endswith(TMP_SUFFIX)]
    return out


def test_sigkill_during_writes_leaves_only_complete_entries(tmp_path):
    """Writers (two at a time, overlapping keys) SIGKILLed at random moments, 22 kills.

    Writers are forked from a multiprocessing forkserver that has the store
    imported, so a kill round costs milliseconds rather than an interpreter start.
    """
    root = str(tmp_path / "s")
    DirectoryTier(root)  # create
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["store_crash_worker", "kvcodec.store.tiers.directory"])
    rng = random.Random(1234)
    kills = 0
    tmp_seen: set[str] = set()
    t0 = time.monotonic()
    for round_ in range(11):
        counters = [ctx.Value("q", 0, lock=False) for _ in range(2)]
        procs = [ctx.Process(target=crash_writer, daemon=True,
                             args=(root, 2 * round_ + j, 6, 512 << 10, 2 << 20, counters[j]))
                 for j in range(2)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + 30
        while any(c.value == 0 for c in counters):  # both inside their put loops
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "writer died"
            time.sleep(0.002)
        for p in procs:
            time.sleep(rng.uniform(0.0, 0.04))
            p.kill()  # SIGKILL
        for p in procs:
            p.join()
            assert p.exitcode == -signal.SIGKILL
            kills += 1
        tmp_seen.update(_tmp_files(root))
        # after every kill: every entry that is visible is complete and valid
        tier = DirectoryTier(root)
        for info in tier.ls():
            b = tier.get(info.key)
            assert b is not None and crash_payload_valid(b), f"round {round_}: torn entry {info.key}"
    assert kills >= 20
    tier = DirectoryTier(root)
    entries = list(tier.ls(with_meta=True))
    assert entries, "the writers stored nothing"
    # every file under objects/ decodes on its own (nothing half-renamed)
    for path, _st in tier._entry_files():
        with open(path, "rb") as f:
            e = decode_envelope(f.read())
        assert crash_payload_valid(e.data)
    r = tier.gc(grace_s=0)
    assert _tmp_files(root) == []
    assert r["tmp_removed"] == len(tmp_seen)
    assert r["corrupt_removed"] == 0 and tier.stats()["corrupt"] == 0
    print(f"\n{kills} kills in {time.monotonic() - t0:.1f} s, {len(entries)} entries, "
          f"{r['tmp_removed']} temp files left by killed writers removed by gc")


def test_concurrent_writers_and_readers_one_directory(tmp_path):
    root = str(tmp_path / "s")
    DirectoryTier(root)
    seconds = "1.5"
    # small cap so that eviction races with reads and writes too
    cap = str(3 << 20)
    procs = [subprocess.Popen([PY, "-c", WORKER, mode, root, str(seed), "8", str(20_000), str(400_000),
                               seconds, cap], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=subprocess_env(), text=True)
             for mode, seed in (("write", 1), ("write", 2), ("read", 3), ("read", 4))]
    outs = [p.communicate(timeout=60) for p in procs]
    for p, (_out, err) in zip(procs, outs):
        assert p.returncode == 0, f"worker failed (3 = torn read): {p.returncode}\n{err[-2000:]}"
        assert "corrupt" not in err, err[-2000:]
    reads = [o.strip().splitlines()[-1].split() for o, _ in outs[2:]]
    total_reads = sum(int(r[1]) for r in reads)
    total_hits = sum(int(r[2]) for r in reads)
    assert total_hits > 0, "readers never saw an entry"
    tier = DirectoryTier(root)
    for info in tier.ls():
        b = tier.get(info.key)
        assert b is None or crash_payload_valid(b)
    assert tier.gc(grace_s=0)["corrupt_removed"] == 0
    assert not os.listdir(os.path.join(root, "quarantine"))
    print(f"\n{total_reads} reads ({total_hits} hits) against 2 writers, no torn or corrupt read",
          file=sys.stderr)
