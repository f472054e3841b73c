"""kvcodec inside LMCache (issue 54): the serde ``kvcodec`` and an L2 adapter backed by a kvcodec store.

* :mod:`.serde` -- LMCache's multiprocess-mode ``Serializer`` / ``Deserializer`` pair, registered as
  ``{"serde": {"type": "kvcodec", ...}}`` on any L2 adapter by :func:`register` (needs ``kvcodec[lmcache]``).
* :mod:`.adapter` -- ``{"type": "plugin", "module_path": "kvcodec.integrations.lmcache.adapter",
  "class_name": "KvcodecStoreL2Adapter", "adapter_params": {"store_url": ..., ...}}``: chunks stored as `.kvc`
  entries of a kvcodec store (directory, Redis, S3, the KDN service), in the store's tenancy.
* :mod:`.chunks` -- the chunk <-> `.kvc` conversion, the frame and the size bound, without LMCache.

Importing this package imports nothing from LMCache; docs/guide/engines.md shows the whole setup.
"""

from __future__ import annotations


def register() -> bool:
    """Register the ``kvcodec`` serde with LMCache's serde factory (idempotent): the one call a launcher makes
    before LMCache parses its L2 adapter configs. True if this call registered it."""
    try:
        import lmcache.v1.distributed.serde  # noqa: F401
    except ImportError:  # a ModuleNotFoundError traceback before
        from kvcodec.errors import KvcInputError

        raise KvcInputError("lmcache is not installed (pip install 'kvcodec[lmcache]'): the kvcodec serde cannot be "
                            "registered") from None
    from kvcodec.integrations.lmcache.serde import register as _register

    return _register()
