"""The edit log: what an edited `.kvc` records about how it was made (spec/kvc-v1.md §4.5).

Why a log at all: an edit produces a *new* entry whose K/V no longer come from one plain prefill of its
token ids (an append reuses a stored, possibly lossy, cache; a redaction recomputes only some tokens; a
steered cache was prefilled under an attention bias). Whoever loads it must be able to tell, and to trace
it back to the entry it came from. So every edited file carries, in its header's ``meta.edits``, the list of
edits that led to it, oldest first: one record per edit with the operation, its parameters, and the
SHA-256 of the parent file's bytes and of the parent's token ids -- except after a redaction, whose record
names its parent only by a keyed digest and seals every record before it (:func:`redaction_log`: a plain
digest of content that held a secret lets whoever holds the child test guesses of the secret).

Why ``meta`` and not a new top-level key: the log never changes how a byte decodes (spec §4: readers MUST NOT
interpret ``meta`` for decoding), so every 1.x reader reads an edited file as it is, and a later re-encode of
the edited cache (which carries the header's ``meta``) keeps its provenance. A loader that must understand an
edit (a steering bias) is told so by a required feature bit, not by this log.

Each record written since issue 57 also says what the edited entry **promises** (``promise``): the preset's
promise (mean KL, top-1) on a continuation against an exact prefill of the child's own ids, and on what basis
(a fresh prefill, or an exact parent extended), or ``{"none": why}`` when the child's K/V are not what a prefill
of its ids computes (a lossy parent's decode error carried by an incremental append or a blend repair, a
steering bias). Why in the log: the header's codec names the preset the child was *encoded* with, and without
this field a reader takes that preset's promise for granted where it does not hold (issue 57: 5-7x the KL).

The log is also checked, because it is read from files others wrote: it must be a list of at most
:data:`MAX_EDITS` well-formed records, and no parent may appear twice in it, nor the parent file itself
(either would be a chain that loops: an entry cannot descend from itself).
"""

from __future__ import annotations

import hashlib
import hmac
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvcodec.errors import KvcFormatError, KvcInputError

__all__ = ["EDITS_META_KEY", "EDIT_OPS", "LINEAGE_DOMAIN", "MAX_EDITS", "EditRecord", "check_params", "check_promise",
           "check_room", "entry_promise", "extend_log", "file_sha256", "lineage_mac", "parse_log", "promise_text", "redaction_log"]

EDITS_META_KEY = "edits"
EDIT_OPS = ("append", "redact", "steer")
MAX_EDITS = 64  # a longer chain is refused: re-prefill the text instead of stacking edits on edits
MAX_PARAMS_CHARS = 4096  # a record's parameters as JSON (regexes and spans included)

_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_PROMISE_TEXT = 200  # characters of a promise's preset name, basis or reason


def check_promise(obj: Any, what: str = "promise") -> dict[str, Any]:
    """A record's ``promise`` (spec/kvc-v1.md §4.5), validated: exactly ``{"none": reason}``, or
    ``{"preset": name, "basis": how}`` with the preset's ``kl`` and ``top1`` when it has a quality target."""
    import math

    def text(v: Any) -> bool:
        return isinstance(v, str) and 0 < len(v) <= _PROMISE_TEXT

    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0

    if isinstance(obj, dict) and set(obj) == {"none"} and text(obj["none"]):
        return dict(obj)
    if isinstance(obj, dict) and {"preset", "basis"} <= set(obj) <= {"preset", "basis", "kl", "top1"} \
            and text(obj["preset"]) and text(obj["basis"]) and all(number(obj[k]) for k in ("kl", "top1") if k in obj):
        return dict(obj)
    raise KvcFormatError(f"{what} must be {{\"none\": reason}} or {{\"preset\", \"basis\"[, \"kl\", \"top1\"]}} "
                         f"(texts of at most {_PROMISE_TEXT} characters, non-negative numbers)")


def check_params(params: Mapping[str, Any]) -> None:
    """Refuse (one line) an edit whose log record's ``params`` would be longer than :data:`MAX_PARAMS_CHARS`, before
    the edit's prefill: the record is checked as a reader checks it only when the child is written, so a steer
    of every head over many spans (SmolLM2: 270 heads and 256 spans, about 5,700 characters) ran its whole biased
    prefill and then failed as a malformed log (a KvcFormatError naming record N)."""
    import json

    n = len(json.dumps(dict(params)))
    if n > MAX_PARAMS_CHARS:
        raise KvcInputError(f"the edit's parameters take {n:,} characters in its log record, more than the "
                            f"{MAX_PARAMS_CHARS:,} a record may hold; name fewer spans or heads")


def promise_text(promise: Mapping[str, Any] | None) -> str:
    """One line for people (``kvc info``, ``kvc edit``): what an edited entry's promise is."""
    if promise is None:
        return "not recorded (the edit predates promise records): assume none"
    if "none" in promise:
        return f"none: {promise['none']}"
    bounds = ", ".join(f"{op} {promise[k]:g}" for k, op in (("kl", "mean KL <="), ("top1", "top-1 >=")) if k in promise)
    return f"{promise['preset']}{f' ({bounds})' if bounds else ''} against an exact prefill of its ids; {promise['basis']}"


def file_sha256(data: bytes | memoryview) -> str:
    """SHA-256 (lowercase hex) of a parent file's bytes: the identity an edit record names its parent by."""
    return hashlib.sha256(data).hexdigest()


#: the HMAC domain of a redacted child's ``parent_mac`` (what a lineage key signs: the parent file's digest)
LINEAGE_DOMAIN = b"kvcodec edit lineage v1\x00"


def lineage_mac(key: bytes, parent_sha256: str) -> str:
    """``parent_mac`` of a redacted child: HMAC-SHA256 under ``key`` of the parent file's SHA-256 (hex).

    Why keyed: a plain digest of the parent (its bytes or its token ids) lets anyone holding the child test
    guesses of what was removed, by rebuilding the parent with each guess and comparing digests (issue 55:
    a 4-digit code in under a second). Under a key only the parent's holder has, the link is checkable by
    them and by nobody else."""
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        raise KvcInputError("a lineage key must be bytes, at least 16 of them")
    return hmac.new(bytes(key), LINEAGE_DOMAIN + parent_sha256.encode(), hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class EditRecord:
    """One edit: ``op`` applied with ``params`` to the file whose bytes hash to ``parent_sha256`` (its token ids
    hashing to ``parent_token_ids_sha256``).

    Two more shapes exist since issue 55 (spec/kvc-v1.md §4.5): a **redaction record** names no parent in
    clear (``parent_sha256`` and ``parent_token_ids_sha256`` are None; ``parent_mac`` is the keyed link, or
    None when no lineage key was given), and every record before a redaction is **sealed**: only its ``op``
    is kept, because its digests and parameters describe content that held what was removed.
    """

    op: str
    parent_sha256: str | None
    parent_token_ids_sha256: str | None
    params: dict[str, Any] = field(default_factory=dict)
    parent_mac: str | None = None
    sealed: bool = False
    promise: dict[str, Any] | None = None  # what the child promises (check_promise); None in records before issue 57

    @property
    def redaction(self) -> bool:
        """A redaction record of the keyed shape (no parent in clear)."""
        return self.op == "redact" and self.parent_sha256 is None and not self.sealed

    def to_json(self) -> dict[str, Any]:
        if self.sealed:
            return {"op": self.op, "sealed": True}
        if self.parent_sha256 is None:
            d: dict[str, Any] = {"op": self.op, "params": dict(self.params)}
            if self.parent_mac is not None:
                d["parent_mac"] = self.parent_mac
        else:
            d = {"op": self.op, "params": dict(self.params), "parent_sha256": self.parent_sha256,
                 "parent_token_ids_sha256": self.parent_token_ids_sha256}
        if self.promise is not None:
            d["promise"] = dict(self.promise)
        return d

    @classmethod
    def from_json(cls, obj: Any, i: int) -> "EditRecord":
        import json

        what = f"edit log record {i}"
        if not isinstance(obj, dict):
            raise KvcFormatError(f"{what} must be an object")
        op = obj.get("op")
        if op not in EDIT_OPS:
            raise KvcFormatError(f"{what}: op {op!r:.40} is not one of {', '.join(EDIT_OPS)}")
        if "sealed" in obj:
            if obj.get("sealed") is not True or set(obj) != {"op", "sealed"}:
                raise KvcFormatError(f"{what}: a sealed record is exactly {{\"op\", \"sealed\": true}}")
            return cls(str(op), None, None, {}, sealed=True)
        params = obj.get("params", {})
        if not isinstance(params, dict) or len(json.dumps(params)) > MAX_PARAMS_CHARS:
            raise KvcFormatError(f"{what}: params must be an object of at most {MAX_PARAMS_CHARS} JSON characters")
        promise = None if obj.get("promise") is None else check_promise(obj["promise"], f"{what}: promise")
        if "parent_sha256" not in obj and "parent_token_ids_sha256" not in obj:
            if op != "redact" or not set(obj) <= {"op", "params", "parent_mac", "promise"}:
                raise KvcFormatError(f"{what}: only a redaction names its parent by a keyed digest (parent_mac)")
            mac = obj.get("parent_mac")
            if mac is not None and (not isinstance(mac, str) or not _HEX64.match(mac)):
                raise KvcFormatError(f"{what}: parent_mac must be 64 lowercase hex digits")
            return cls("redact", None, None, params, parent_mac=mac, promise=promise)
        p, t = obj.get("parent_sha256"), obj.get("parent_token_ids_sha256")
        for name, v in (("parent_sha256", p), ("parent_token_ids_sha256", t)):
            if not isinstance(v, str) or not _HEX64.match(v):
                raise KvcFormatError(f"{what}: {name} must be 64 lowercase hex digits")
        return cls(str(op), str(p), str(t), params, promise=promise)


def parse_log(meta: Mapping[str, Any], own_sha256: str | None = None) -> list[EditRecord]:
    """The validated edit log of a file's header ``meta`` ([] for a file never edited).

    ``own_sha256`` is the digest of the file the log came from: it must not name itself as an ancestor.
    Sealed records must be followed by a redaction record (only a redaction seals what came before it).
    """
    raw = meta.get(EDITS_META_KEY)
    if raw is None:
        return []
    if not isinstance(raw, list) or len(raw) > MAX_EDITS:
        raise KvcFormatError(f"the edit log (meta.{EDITS_META_KEY}) must be a list of at most {MAX_EDITS} records")
    log = [EditRecord.from_json(r, i) for i, r in enumerate(raw)]
    seen: set[str] = set()
    for i, r in enumerate(log):
        if r.parent_sha256 is None:
            if r.sealed and not any(x.redaction for x in log[i + 1:]):
                raise KvcFormatError(f"edit log record {i} is sealed, but no redaction follows it")
            continue
        if r.parent_sha256 in seen or r.parent_sha256 == own_sha256:
            raise KvcFormatError(f"the edit log loops: record {i} names parent {r.parent_sha256[:12]}… which is already "
                                 "in its chain")
        seen.add(r.parent_sha256)
    return log


def extend_log(parent_meta: Mapping[str, Any], parent_sha256: str, parent_token_ids_sha256: str, op: str,
               params: Mapping[str, Any], promise: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The child's edit log: the parent's (validated) plus one record for this edit (and the child's
    ``promise``), as header JSON.

    This is the plain record (append, steer): it names the parent by its digests. A redaction's log is
    :func:`redaction_log`'s."""
    log = check_room(parent_meta, parent_sha256)
    rec = EditRecord(op, parent_sha256, parent_token_ids_sha256, dict(params),
                     promise=None if promise is None else dict(promise))
    EditRecord.from_json(rec.to_json(), len(log))  # the same checks a reader applies
    return [r.to_json() for r in log] + [rec.to_json()]


def redaction_log(parent_meta: Mapping[str, Any], parent_sha256: str, params: Mapping[str, Any],
                  lineage_key: bytes | None = None, promise: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """A redacted child's edit log: every earlier record sealed (its op only), then the redaction's record with
    ``params``, the child's ``promise`` (a function of the preset and the repair alone, never of what was
    removed) and, when ``lineage_key`` is given, ``parent_mac`` (:func:`lineage_mac`); nothing else."""
    log = check_room(parent_meta, parent_sha256)
    mac = None if lineage_key is None else lineage_mac(lineage_key, parent_sha256)
    rec = EditRecord("redact", None, None, dict(params), parent_mac=mac, promise=None if promise is None else dict(promise))
    EditRecord.from_json(rec.to_json(), len(log))
    return [EditRecord(r.op, None, None, {}, sealed=True).to_json() for r in log] + [rec.to_json()]


def entry_promise(meta: Mapping[str, Any]) -> tuple[bool, dict[str, Any] | None]:
    """(edited?, promise) of an entry's header ``meta``: an entry never edited is (False, None) and promises what
    its preset promises for any encode; an edited one promises what its last record says (None: the record
    predates the field, so nothing is claimed). A malformed log is refused (:func:`parse_log`)."""
    log = parse_log(meta)
    if not log:
        return False, None
    return True, log[-1].promise


def check_room(parent_meta: Mapping[str, Any], parent_sha256: str) -> list[EditRecord]:
    """The validated log of a parent about to be edited (its file's digest ``parent_sha256``), refused in one line when
    it has no room for one more record: checked when the parent is opened, before any decode or prefill (the
    limit was found only when the child was written, after the edit's whole work)."""
    log = parse_log(parent_meta, own_sha256=parent_sha256)
    if len(log) >= MAX_EDITS:
        raise KvcInputError(f"the entry has already been edited {len(log)} times (limit {MAX_EDITS}); "
                            "re-prefill its text instead")
    return log
