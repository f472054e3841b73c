"""Build the embedded model's calibration that ships inside the package (issue 21).

    .venv/bin/python scripts/build_calibration.py            # writes kvcodec/data/calibration/<fingerprint id>.safetensors
    .venv/bin/python scripts/build_calibration.py --from OLD  # re-stores OLD (e.g. a version 2 file) in the current format
    .venv/bin/python scripts/build_calibration.py --model gemma3-270m --from OLD --out NEW   # another model's, elsewhere

The file is named by the model's fingerprint id (how ``load_calibration`` finds
it) and pinned by the sha256 of its bytes in
``kvcodec.calibration.store.SHIPPED_SHA256``: the script prints the line to put
there. Rebuild after any change of the calibration algorithm or of the
fingerprint; the build is deterministic for a given torch/numpy and thread
count (``--threads``, default 2, is part of the recipe).

``--from`` keeps an existing calibration's statistics (means, eigenvalues, sensitivities) exactly and snaps its
basis to the grid of calibration v3 (``kvcodec.calibration.record.snap_basis``): what a rebuild gives, less the
float noise of rebuilding on another machine or thread count, so the change of format is all that changes.
Before replacing a shipped file, copy it to ``<fingerprint id>.<first 8 hex of its sha256>.safetensors`` and pin
that too (``SHIPPED_SHA256``): files encoded against it then still decode. A new file's rate
model must be fitted afterwards (it is bound to the calibration's content sha256): run
``KVCODEC_ONBOARD_DTYPE=float32 kvc calibrate --thorough`` on the model, then copy the fitted ``ratemodel-v*.json`` over
``<fingerprint id>.ratemodel.json``.

A shipped file is built in the model's own float32 (this script sets ``KVCODEC_ONBOARD_DTYPE=float32`` unless told
otherwise): the bfloat16 prefills of :mod:`kvcodec.models.compute` buy a first use minutes, which a file built once
and shipped does not need, and a shipped file should not depend on the CPU that built it.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcodec.models.load import DEFAULT_MODEL, load_model  # noqa: E402
from kvcodec.calibration import build as C_build
from kvcodec.calibration import store as C_store
from kvcodec.calibration.record import BASIS_GRID, snap_basis


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--from", dest="source", type=Path, help="re-store this calibration file instead of building one")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="the model (default: the embedded one, whose file ships)")
    ap.add_argument("--out", type=Path, help="write here instead of the package's data directory")
    args = ap.parse_args()
    os.environ.setdefault("KVCODEC_ONBOARD_DTYPE", "float32")  # module docstring: shipped files in the model's own dtype
    torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    timings: dict[str, float] = {"total_s": 0.0}
    if args.source is not None:
        old = C_store.load_calibration_file(args.source, lm.fingerprint.id)  # the loader's shared copy: not changed
        cal = dataclasses.replace(old, basis=snap_basis(old.basis), meta=dict(old.meta, basis_grid=BASIS_GRID))
    else:
        cal = C_build.build_calibration(lm, timings=timings)
    for stale in C_store.SHIPPED_DIR.glob("*.safetensors"):
        if args.out is None and stale.name.split(".")[0] != lm.fingerprint.id:
            print(f"note: {stale} belongs to another fingerprint; delete it and its pin if it is stale", file=sys.stderr)
    out = args.out or C_store.SHIPPED_DIR / f"{lm.fingerprint.id}.safetensors"
    path = C_store.write_calibration_file(cal, lm.fingerprint.id, out)
    print(f"wrote {path} ({path.stat().st_size:,} bytes) in {timings['total_s']:.0f} s")
    if args.out is None:
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        print(f'pin it in kvcodec/calibration/store.py: SHIPPED_SHA256 = {{"{path.name}": "{sha}"}}')


if __name__ == "__main__":
    main()
