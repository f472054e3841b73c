"""kvcodec's own plugins: its codec stages, decoders and store tiers, declared to the one registry (:mod:`kvcodec.registry`).

Written as entry points are written, ``group -> name -> "module:attr"``; a package outside kvcodec
declares its own the same way in its ``pyproject.toml`` (``[project.entry-points."kvcodec.stages"]``,
docs/extending.md). Nothing here is imported until a name is looked up.

Why in code and not in kvcodec's own ``pyproject.toml`` ``[project.entry-points]``:

* installed metadata goes stale: an editable install (the development venv, the vLLM and LMCache
  side venvs that .ci/ keeps between runs) sees a new or moved built-in only after a reinstall, and
  a checkout on ``PYTHONPATH`` has no metadata at all; a missing built-in would make every file that
  uses it unreadable;
* a built-in lookup reads no metadata (no pass over site-packages when a file is opened);
* a built-in name cannot be taken over: an installed package that declares ``rans`` is ignored, so a
  file's built-in stages always decode as the spec says.

Why this module: ``kvcodec/__init__.py`` imports it and nothing else in kvcodec does, so the names
below (the codec, decoder and tier modules, which import the registry) close no import circle, by
``import`` or by name (tests/core/test_imports.py).
"""

from __future__ import annotations

from kvcodec.registry import DECODERS_GROUP, STAGES_GROUP, TIERS_GROUP, declare_builtins

_LOSSLESS = "kvcodec.codecs.lossless"
_BASELINES = "kvcodec.codecs.baselines"
_REDIS = "kvcodec.store.tiers.redis:RedisTier"
_CLUSTER = "kvcodec.store.tiers.redis_cluster:RedisClusterTier"
_KDN = "kvcodec.store.tiers.kdn:KdnTier"
_HTTP = "kvcodec.store.tiers.http:HttpTier"

BUILTINS: dict[str, dict[str, str]] = {
    # a stage's module registers its versions (@register); a file's header names the stage, which imports its
    # module then, so opening a lossless file imports no lossy codec
    STAGES_GROUP: {
        "cast": _LOSSLESS, "raw": _LOSSLESS, "shuffle": _LOSSLESS, "zstd": _LOSSLESS,
        "rans": "kvcodec.codecs.rans",
        "rope": "kvcodec.codecs.rope", "keep": "kvcodec.codecs.keep", "transform": "kvcodec.codecs.transform",
        "quantize": "kvcodec.codecs.quantize", "tokenscale": "kvcodec.codecs.tokenscale",
        "bl_int8_token": _BASELINES, "bl_kivi": _BASELINES, "bl_cachegen": _BASELINES,
    },
    # a Backend names its implementation's module by string: the pick imports numba or Triton only for a chunk it decodes
    DECODERS_GROUP: {
        "reference": "kvcodec.decode.registry:REFERENCE",
        "numba-fused": "kvcodec.decode.registry:NUMBA_FUSED",
        "triton-stages": "kvcodec.decode.registry:TRITON_STAGES",
        "triton-fused": "kvcodec.decode.registry:TRITON_FUSED",
    },
    # one name per URL scheme; "file" is also what a plain directory path opens
    TIERS_GROUP: {
        "mem": "kvcodec.store.tiers.base:MemoryTier",  # the Store's in-process LRU: mem:// sets its size
        "file": "kvcodec.store.tiers.directory:DirectoryTier",
        "redis": _REDIS, "rediss": _REDIS, "unix": _REDIS,
        "redis+cluster": _CLUSTER, "rediss+cluster": _CLUSTER,
        "s3": "kvcodec.store.tiers.s3:S3Tier",
        "kvc+http": _KDN, "kvc+https": _KDN,
        "http": _HTTP, "https": _HTTP,
    },
}

declare_builtins(BUILTINS)
