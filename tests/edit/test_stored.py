"""Edits of store entries: the child lands under its own content's key; another tenant's entry is out of reach."""

from __future__ import annotations

import numpy as np
import pytest

from kvcodec.edit.stored import edit_stored, run_edit
from kvcodec.errors import KvcInputError, KvcModelMismatchError
from kvcodec.format import KvcReader
from kvcodec.store import Store, StoreKey
from kvcodec.store.keys import codec_key
from kvcodec.store.tenant import TenantKey
from tests.edit.conftest import EMAIL

pytestmark = pytest.mark.model


@pytest.fixture()
def stores(lm, entry, tmp_path):
    """Tenants A and B on one shared directory; A holds the lossless entry of 160 changelog tokens."""
    cache, data = entry(160)
    a = Store.open(str(tmp_path / "shared"), key=TenantKey(bytes(range(32))))
    b = Store.open(str(tmp_path / "shared"), key=TenantKey(bytes(range(1, 33))))
    key = StoreKey.for_tokens(cache.token_ids, model=lm.fingerprint.id, codec=codec_key("lossless"), namespace="docs")
    a.put(key, data)
    return a, b, key


def test_the_child_is_keyed_by_its_own_tokens_and_the_parent_stays(lm, stores):
    a, _, key = stores
    before = bytes(a.get_entry(key).data)
    child, res = edit_stored(lm, a, key, "redact", {"pattern": EMAIL})
    assert child != key and child.namespace == key.namespace and child.codec == key.codec
    assert child == StoreKey.for_tokens(res.cache.token_ids, model=key.model, codec=key.codec, namespace="docs")
    got = a.get_entry(child)
    assert got is not None and bytes(got.data) == res.data
    with KvcReader(bytes(got.data)) as r:
        assert np.array_equal(r.token_ids, res.cache.token_ids)
    assert bytes(a.get_entry(key).data) == before


def test_another_tenants_entry_is_not_there(lm, stores):
    a, b, key = stores
    with pytest.raises(KvcInputError, match="no entry"):
        edit_stored(lm, b, key, "redact", {"pattern": EMAIL})


def test_refusals(lm, other_lm, stores, entry):
    a, _, key = stores
    with pytest.raises(KvcModelMismatchError):
        edit_stored(other_lm, a, key, "redact", {"pattern": EMAIL})
    _, data = entry(160)
    for op, params, msg in [("rewrite", {}, "unknown edit"), ("redact", {"heads": 3}, "takes no parameter 'heads'"),
                            ("redact", {"token_spans": [[1, "x"]]}, "integer pairs"), ("append", {"text": 7}, "string"),
                            ("redact", {"token_spans": [[1, 3]], "repair": "blend", "recompute_ratio": float("inf")}, "recompute_ratio"),
                                ("redact", {"token_spans": [[1, 3]], "recompute_ratio": 0.1}, "tune repair='blend'"),
                            ("steer", {"token_spans": [[1, 3]], "heads": [[99, 0]]}, "out of range"),
                            ("steer", {"token_spans": [[1, 3]], "heads": [[0, 0]], "alpha": float("nan")}, "finite"),
                            ("steer", {"token_spans": [[1, 3]]}, "heads must be a list")]:
        with pytest.raises(KvcInputError, match=msg):
            run_edit(lm, data, op, params)
