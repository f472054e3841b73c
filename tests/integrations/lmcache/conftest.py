"""Fixtures both LMCache test files use: two real SmolLM2 KV chunks and LMCache's own L1 manager.

The LMCache helpers (``lmc``) import lmcache, which only ``.venv-lmcache`` has: they are imported inside the
fixtures, so collecting this folder in the main venv (where its tests skip) imports nothing of lmcache.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def chunks(lm):
    from lmc import CHUNK, real_chunks

    return real_chunks(lm, 2, CHUNK)


@pytest.fixture(scope="module")
def l1():
    from lmc import l1_manager

    m = l1_manager()
    yield m
    m.close()
