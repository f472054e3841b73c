"""kvcodec: compress, store and deliver LLM KV caches.

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

__version__ = "0.1.0"
__all__ = [
    "KvcError", "KvcInputError", "KvcFormatError", "KvcModelMismatchError",
    "KvcModelNotFoundError", "KvcCodecError", "KvcBackendError", "KvcStoreError", "__version__",
]
