"""Build the embedded model's calibration that ships inside the package (issue 21).

    .venv/bin/python scripts/build_calibration.py            # writes kvcodec/data/calibration/<fingerprint id>.safetensors

The file is named by the model's fingerprint id (how ``load_calibration`` finds
it) and pinned by the sha256 of its bytes in
``kvcodec.calibration.store.SHIPPED_SHA256``: the script prints the line to put
there. Rebuild after any change of the calibration algorithm or of the
fingerprint; the build is deterministic for a given torch/numpy and thread
count (``--threads``, default 2, is part of the recipe).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcodec.models.load import DEFAULT_MODEL, load_model  # noqa: E402
from kvcodec.calibration import build as C_build
from kvcodec.calibration import store as C_store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lm = load_model(DEFAULT_MODEL)
    timings: dict[str, float] = {}
    cal = C_build.build_calibration(lm, timings=timings)
    for old in C_store.SHIPPED_DIR.glob("*.safetensors"):
        if old.name != f"{lm.fingerprint.id}.safetensors":
            print(f"note: {old} belongs to another fingerprint; delete it and its pin if it is stale", file=sys.stderr)
    path = C_store.write_calibration_file(cal, lm.fingerprint.id, C_store.SHIPPED_DIR / f"{lm.fingerprint.id}.safetensors")
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    print(f"wrote {path} ({path.stat().st_size:,} bytes) in {timings['total_s']:.0f} s")
    print(f'pin it in kvcodec/calibration/store.py: SHIPPED_SHA256 = {{"{path.name}": "{sha}"}}')


if __name__ == "__main__":
    main()
