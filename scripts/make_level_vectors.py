"""Golden vectors of spec/levels-v1.md (multi-level entries) in spec/vectors/levels/.

    python scripts/make_level_vectors.py          # write the vectors that do not exist yet
    python scripts/make_level_vectors.py --check  # recompute and compare; exit 1 on any difference

Never overwrites an existing vector: a file that exists with other bytes is a
failure (a change of the spec needs a new version and new file names).
Everything is derived from fixed inputs (the worked example of
spec/store-keys.md §5 and the tenant key 00 01 .. 1f), no model needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvcodec.store.keys import StoreKey  # noqa: E402
from kvcodec.store.levels import ChunkLevels, LevelManifest, level_keys, manifest_key  # noqa: E402
from kvcodec.store.tenant import TenantKey  # noqa: E402

OUT = ROOT / "spec" / "vectors" / "levels"


def vectors() -> dict[str, bytes]:
    """File name -> exact bytes."""
    ids = list(range(600))  # 600 tokens: chunks [0, 512) and [512, 600) of 512 tokens
    model, ns = "smol-fp", "tenant-a"
    k = manifest_key(ids, model=model, namespace=ns)
    levels = ["small", "near-lossless"]
    chunks = [ChunkLevels(0, 512, {"small": 1000, "near-lossless": 3000}),
              ChunkLevels(512, 600, {"small": 200, "near-lossless": 700})]
    man = LevelManifest(k, 512, levels, chunks)
    tenant = TenantKey(bytes(range(32)))
    rows = {"tokens": "0, 1, ..., 599", "model": model, "namespace": ns, "tenant_key": bytes(range(32)).hex(),
            "manifest_key": k.to_str(), "manifest_physical": tenant.namespace(ns).physical(k).to_str(),
            "level_keys": {}}
    for lv in levels:
        ks = level_keys(ids, lv, [c.end for c in chunks], model=model, namespace=ns)
        rows["level_keys"][lv] = [{"end": x.n_tokens, "key": x.to_str(),
                                   "physical": tenant.namespace(ns).physical(x).to_str()} for x in ks]
    assert StoreKey.from_str(rows["manifest_key"]) == k
    return {"manifest-600.json": man.to_bytes(),
            "keys-600.json": (json.dumps(rows, indent=2, sort_keys=True) + "\n").encode()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args()
    bad = 0
    for name, data in vectors().items():
        p = OUT / name
        if p.exists():
            if p.read_bytes() != data:
                print(f"DIFFERS {p} (never overwritten: a spec change needs new vectors)")
                bad += 1
            else:
                print(f"ok      {p}")
        elif a.check:
            print(f"MISSING {p}")
            bad += 1
        else:
            OUT.mkdir(parents=True, exist_ok=True)
            p.write_bytes(data)
            print(f"wrote   {p}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
