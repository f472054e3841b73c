"""One exception hierarchy for everything kvcodec refuses to do.

The CLI catches :class:`KvcError` and prints its message on one line with a
non-zero exit code; anything else escaping is a bug.
"""

from __future__ import annotations

import json
from typing import Any


class KvcError(Exception):
    """Base class of every error kvcodec raises on purpose."""

    exit_code = 1

    def cli_message(self) -> str:
        """The message as ``kvc`` shows it: the same, unless the error names Python arguments that the command
        line spells as flags (:class:`kvcodec.models.capture.KvcWindowError`)."""
        return str(self)


class KvcInputError(KvcError):
    """Bad user input: missing file, empty text, impossible budget, bad option."""

    exit_code = 2


class KvcFormatError(KvcError):
    """A file or byte stream is malformed, truncated, corrupt or unsupported."""

    exit_code = 3


class KvcModelMismatchError(KvcError):
    """A cache was offered to a model it does not belong to."""

    exit_code = 4


class KvcModelNotFoundError(KvcError):
    """The requested model is not installed or not a readable HF directory."""

    exit_code = 5


class KvcCodecError(KvcError):
    """A codec stage is unknown or was configured in a way it cannot honour."""

    exit_code = 6


class KvcBackendError(KvcError):
    """A decode backend (e.g. the GPU one) was requested but is unavailable."""

    exit_code = 7


class KvcStoreError(KvcError):
    """A store operation failed (unreachable tier, bad URL, corrupt entry)."""

    exit_code = 8


class KvcQuotaError(KvcStoreError):
    """A store refused a write for a tenant's bound (an entry larger than its quota, one namespace too many):
    permanent until the tenant's own entries change, so a retry as for an outage would fail the same way
    (the KDN service answers 507)."""


class KvcIOError(KvcError):
    """The system refused an I/O operation: disk full, read-only filesystem, permission denied."""

    exit_code = 9


def want(cond: bool, msg: str) -> None:
    """Raise :class:`KvcFormatError` ``msg`` unless ``cond`` (the header/field checks of every reader)."""
    if not cond:
        raise KvcFormatError(msg)


def is_int(x: Any, lo: int = 0, hi: int = (1 << 63) - 1) -> bool:
    """``x`` is a JSON integer (not a bool, not 3.0) in [lo, hi]."""
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


class KvcUnknownCodecError(KvcFormatError, KvcCodecError):
    """A file names a codec stage this installation does not know (both a format and a codec error)."""


def json_loads(text: str | bytes | bytearray, **kw: Any) -> Any:
    """``json.loads`` for text a user or a file controls: JSON nested deeper than the json module recurses
    (thousands of ``[`` or ``{``: its RecursionError, a traceback out of every ``except ValueError``) is raised
    as the :class:`json.JSONDecodeError` (a ValueError) that malformed JSON raises, so a caller's one check
    of malformed JSON covers it too."""
    try:
        return json.loads(text, **kw)
    except RecursionError:
        doc = text if isinstance(text, str) else ""
        raise json.JSONDecodeError("nested too deep", doc, 0) from None
