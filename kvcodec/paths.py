"""Where kvcodec keeps its per-user state (converted models, calibrations, fingerprint cache).

Its own module so that every layer (fingerprint, model, calibration, store) can
find the cache dir without importing each other.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """$KVCODEC_CACHE, else $XDG_CACHE_HOME/kvcodec, else ~/.cache/kvcodec."""
    env = os.environ.get("KVCODEC_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvcodec"
