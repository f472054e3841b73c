"""kvcodec: compress, store and deliver LLM KV caches.

The public API is three calls, in the spirit of safetensors' two:

* ``kvcodec.encode(cache_or_capture, "doc.kvc", preset="balanced", model=...)``: write a `.kvc` file
  (:func:`kvcodec.api.encode`);
* ``kvcodec.open("doc.kvc", model=...)``: its reader, checked against the model (:func:`kvcodec.api.open`);
* ``kvcodec.load_into("doc.kvc", lm)``: a transformers cache ready for ``generate``
  (:func:`kvcodec.integrations.hf.load_cache`).

Importing kvcodec is cheap and never needs a GPU, Triton or transformers;
heavy modules load on first use.
"""

from kvcodec.errors import (
    KvcBackendError,
    KvcCodecError,
    KvcError,
    KvcFormatError,
    KvcInputError,
    KvcModelMismatchError,
    KvcModelNotFoundError,
    KvcStoreError,
)

from kvcodec.version import __version__
from kvcodec import plugins as _plugins  # noqa: F401  (declares kvcodec's own stages, decoders and tiers; imports none)

__all__ = [
    "encode", "open", "load_into",
    "KvcError", "KvcInputError", "KvcFormatError", "KvcModelMismatchError",
    "KvcModelNotFoundError", "KvcCodecError", "KvcBackendError", "KvcStoreError", "__version__",
]


def __getattr__(name: str):  # the API loads on first use: `import kvcodec` stays light
    if name in ("encode", "open"):
        from kvcodec import api

        return getattr(api, name)
    if name == "load_into":
        from kvcodec.integrations.hf import load_cache

        return load_cache
    raise AttributeError(f"module 'kvcodec' has no attribute {name!r}")
