"""Shared pieces of the edit tests: a real held-out text with e-mail addresses, its lossless entry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

EMAIL = r"<[^<>@\s]+@[^<>\s]+>"


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small forward passes on one torch thread (the shared 2-core box: 2 threads under load oversubscribe)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def changelog_ids(lm) -> np.ndarray:
    """The held-out apt changelog (maintainer lines carry e-mail addresses), tokenized."""
    from kvcodec.models.capture import tokenize
    from kvcodec.texts import load_text

    return tokenize(lm.tokenizer, load_text("changelog-apt"))


@pytest.fixture(scope="session")
def entry(lm, changelog_ids):
    """Factory ``entry(n)``: (cache, lossless .kvc bytes) of the first n changelog tokens."""
    from kvcodec.api import encode
    from kvcodec.models.capture import capture

    memo: dict = {}

    def get(n: int):
        if n not in memo:
            c = capture(lm, token_ids=changelog_ids[:n])
            memo[n] = (c, encode(c, None, preset="lossless").data)
        return memo[n]

    return get
