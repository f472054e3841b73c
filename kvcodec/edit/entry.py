"""Parent in, child out: what every edit shares (opening the stored entry, writing the edited one).

An edit never happens in place: it reads a parent `.kvc` (a path or its bytes), checks it belongs to the
model at hand (a cache never loads into a different model), decodes it, and writes a *new* `.kvc` whose
token ids are the edited context's and whose header carries the edit log (:mod:`kvcodec.edit.log`). The
child is encoded with the parent's preset unless the caller names another, through the one encode path
(:func:`kvcodec.api.encode`: plan, quality check, atomic write with read-back).

What the child promises (issue 57). A preset's promise (balanced: mean KL <= 0.01, top-1 >= 0.93) is measured
against an exact prefill of the file's token ids. The encode keeps it for the K/V it is handed, so it holds for
the child only when those K/V are a prefill of the child's ids (to float rounding): a fresh prefill, or an
exact (lossless) parent extended by a prefill of the new tokens. A lossy parent's decode error cannot be
budgeted away inside the child's encode: a parent written at its promise already spends the whole budget (the
child measured 5-7x balanced's KL). So each edit says which case it is, and the log records it
(``promise``, :func:`kvcodec.edit.log.check_promise`): :func:`keeps` with the basis, or :func:`breaks` with
the reason. A child that keeps its preset's promise is encoded with the quality check
(:mod:`kvcodec.plan.check`), which confirms the step on the child's own tail: the promise is then written
into its log on a measurement, not on rate control's prediction alone.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from kvcodec.core.kvcache import KVCache
from kvcodec.digest import token_ids_sha256
from kvcodec.edit.log import EDITS_META_KEY, check_room, entry_promise, extend_log, file_sha256, redaction_log
from kvcodec.errors import KvcInputError
from kvcodec.format import KvcReader

__all__ = ["EXACT_CODECS", "EditResult", "Parent", "breaks", "check_dest", "check_token_ids", "child_meta", "keeps",
           "open_parent", "write_child"]

# meta keys that describe how the parent's K/V were made (or its tokens, one score each) and stop being true
# of the child
_STALE_META = ("blend", "target", "config", "h2o_scores")
# measured on the parent's token ids: stale in a child whose ids differ (append's answers reported their speed-up
# against the parent's shorter prefill; no prefill of the child's own ids is measured). A steered child has the same ids.
_STALE_WITH_NEW_IDS = ("prefill_ttft_s",)
# the only parent meta a redacted child keeps (spec/kvc-v1.md §4.5): the model's name says nothing of the text
_REDACT_KEEPS_META = ("model",)
#: codecs whose decode is the encoded cache bit for bit (kvcodec.plan.presets): every other codec (the lossy
#: presets, ``fp16``'s cast, a baseline) is lossy for what an edit carries over
EXACT_CODECS = ("lossless", "zstd", "raw")


def keeps(basis: str) -> dict[str, str]:
    """An edit whose child's K/V are a prefill of its ids (``basis`` says how): the child's preset promise holds."""
    return {"basis": basis}


def breaks(reason: str) -> dict[str, str]:
    """An edit whose child's K/V are not a prefill of its ids (``reason`` says why): the child promises nothing."""
    return {"none": reason}


@dataclass
class Parent:
    """A stored entry about to be edited: its bytes' digest, its header, and (decoded on demand) its cache."""

    sha256: str
    reader: KvcReader
    size: int

    @property
    def meta(self) -> dict[str, Any]:
        return dict(self.reader.header.meta)

    @property
    def preset(self) -> str | None:
        return self.reader.header.codec

    @property
    def carried(self) -> str | None:
        """Why the parent's decoded K/V are *not* an exact prefill of its ids (None: they are). An edit that reuses
        them (an incremental append, a blend repair) carries that error into the child."""
        if self.reader.header.codec not in EXACT_CODECS:
            return f"the parent is lossy ({self.reader.header.codec}): its decode error is carried"
        edited, promise = entry_promise(self.reader.header.meta)
        if edited and (promise is None or "none" in promise):
            return "the parent has no promise (an edit left its K/V off a prefill of its ids): that error is carried"
        if self.reader.header.attention_bias is not None:
            return "the parent is steered"
        return None

    def token_ids(self, lm: Any, op: str = "an edit") -> np.ndarray:
        """The parent's stored token ids (int64), checked against ``lm`` before any work: its model, ids stored (not
        only their hash), and every id inside the model's vocabulary.

        Why the vocabulary: a file names its model by fingerprint, yet its ids are whatever its writer put there; an
        id past the embedding reached steer's prefill as an IndexError (a device-side assert on a GPU), and an
        incremental append copied it into the child unchecked."""
        from kvcodec.errors import KvcFormatError

        self.reader.check_model(lm)
        ids = self.reader.token_ids
        if ids is None:
            raise KvcInputError(f"the entry stores only the hash of its token ids; {op} needs the ids")
        ids = np.asarray(ids, np.int64)
        vocab = int(lm.model.config.get_text_config().vocab_size)
        if ids.size and (ids.min() < 0 or ids.max() >= vocab):
            raise KvcFormatError(f"the entry's token ids lie outside the model's vocabulary [0, {vocab}): it holds "
                                 f"{int(ids.min()) if ids.min() < 0 else int(ids.max())}")
        return ids

    def decode(self, lm: Any) -> KVCache:
        """The parent's cache, checked against ``lm`` before anything is decoded (:meth:`token_ids`; the model's
        device and dtype are the caller's business: the tensors come back as the file stores them, on the host)."""
        self.token_ids(lm)
        cache = self.reader.read_cache()
        if cache.positions is not None:
            raise KvcInputError("the entry is a pruned cache (its tokens are not all stored); edits need a full cache")
        return cache


def open_parent(source: Any) -> Parent:
    """The parent entry: a path or the bytes of a `.kvc` (read whole: its digest names it in the edit log)."""
    if isinstance(source, (str, os.PathLike)):
        from kvcodec.atomic import check_input, io_error

        path = check_input(source)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise io_error(exc, f"reading {path}") from None
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    else:
        raise KvcInputError(f"the entry to edit must be a .kvc path or its bytes, got {type(source).__name__}")
    digest = file_sha256(data)
    reader = KvcReader(data)
    check_room(reader.header.meta, digest)  # a hostile, looping or full log is refused before any work
    return Parent(digest, reader, len(data))


def check_token_ids(ids: Any) -> np.ndarray:
    """Token ids given by a caller as int64, refused in one line unless they are integers (never coerced from
    floats, strings or bools) that int64 holds (``[2**63]`` raised a raw OverflowError, issue 55)."""
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise KvcInputError(f"token ids must be integers, got an array of {ids.dtype}")
        items = ids.reshape(-1).tolist()
    elif isinstance(ids, (list, tuple)):
        items = list(ids)
    else:
        raise KvcInputError(f"token ids must be a list of integers, got {type(ids).__name__}")
    for x in items:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or not 0 <= int(x) < 1 << 63:
            raise KvcInputError(f"token ids must be non-negative integers below 2**63, got {x!r:.40}")
    return np.asarray(items, dtype=np.int64)


def check_dest(source: Any, dest: Any) -> None:
    """Refuse (one line) a destination path that is the parent's own file, before any work: an edit never
    replaces its parent (issue 55: ``append(lm, p, dest=p)`` did), nor writes over a non-regular file."""
    if isinstance(dest, (str, os.PathLike)):
        from kvcodec.atomic import check_output

        check_output(dest, inputs=[source] if isinstance(source, (str, os.PathLike)) else [])


def child_meta(parent: Parent, op: str, params: Mapping[str, Any], lineage_key: bytes | None = None,
               promise: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The child's header meta: the parent's (minus what no longer holds) with the edit log extended by a record
    carrying the child's ``promise``.

    A redaction keeps only the model's name of the parent's meta, and its log is :func:`redaction_log`'s (no
    plain digest of the parent, earlier records sealed): whatever else the parent's meta held was written
    about content that included what is being removed."""
    if op == "redact":
        meta: dict[str, Any] = {k: v for k, v in parent.meta.items() if k in _REDACT_KEEPS_META and isinstance(v, str)}
        meta[EDITS_META_KEY] = redaction_log(parent.meta, parent.sha256, params, lineage_key, promise)
        return meta
    stale = _STALE_META + (_STALE_WITH_NEW_IDS if op == "append" else ())
    meta = {k: v for k, v in parent.meta.items() if k not in stale}
    meta[EDITS_META_KEY] = extend_log(parent.meta, parent.sha256, parent.reader.header.token_ids_sha256, op, params,
                                      promise)
    return meta


@dataclass
class EditResult:
    """An edited entry: its cache, its `.kvc` (``data`` when no destination was given), the edit log record it
    added, and where the time went (seconds)."""

    cache: KVCache
    op: str
    params: dict[str, Any]
    parent_sha256: str
    size: int
    output: str | None = None
    data: bytes | None = None
    preset: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)
    promise: dict[str, Any] | None = None  # the log record's (kvcodec.edit.log.check_promise)

    @property
    def sha256(self) -> str | None:
        """Digest of the child's bytes (None when it was written to a path: read the file)."""
        return None if self.data is None else file_sha256(self.data)

    def to_json(self) -> dict[str, Any]:
        """What the CLI prints and the service answers. A redaction's names its parent only as its log does
        (``parent_mac``, when a lineage key was given): a plain digest would be the leak the log avoids."""
        d: dict[str, Any] = {"op": self.op, "params": self.params, "output": self.output,
                             "size": self.size, "preset": self.preset, "tokens": int(self.cache.num_context_tokens),
                             "token_ids_sha256": token_ids_sha256(self.cache.token_ids),
                             "timings": {k: round(v, 6) for k, v in self.timings.items()}, **self.info,
                             "promise": self.promise}
        if self.op == "redact":
            log = self.cache.meta.get(EDITS_META_KEY) or [{}]
            if log[-1].get("parent_mac") is not None:
                d["parent_mac"] = log[-1]["parent_mac"]
        else:
            d["parent_sha256"] = self.parent_sha256
        return d


def check_child_preset(parent: Parent, preset: str | None) -> str:
    """The child's preset, checked right after the parent is opened: an unknown ``preset`` was refused only
    after the edit's prefill (seconds to minutes of work) had run."""
    from kvcodec.api import preset_info

    name = _child_preset(parent, preset)
    preset_info(name)
    return name


def _child_preset(parent: Parent, preset: str | None) -> str:
    from kvcodec.api import PRESETS

    if preset is not None:
        return preset
    if parent.preset in PRESETS:
        return str(parent.preset)
    raise KvcInputError(f"the entry was written with codec {parent.preset!r}, which is not a preset; "
                        "name the edited entry's preset (--preset)")


def _promise(name: str, how: Mapping[str, str]) -> dict[str, Any]:
    """The log's ``promise`` of a child encoded with preset ``name``: ``how`` is :func:`keeps` or :func:`breaks`."""
    from kvcodec.api import preset_info

    if "none" in how:
        return {"none": how["none"]}
    target = preset_info(name).target
    bounds = {} if target is None else {"kl": float(target.kl), "top1": float(target.top1)}
    return {"preset": name, **bounds, "basis": how["basis"]}


def write_child(lm: Any, parent: Parent, cache: KVCache, op: str, params: Mapping[str, Any], dest: Any = None,
                preset: str | None = None, progress: Callable[[str], None] | None = None,
                timings: dict[str, float] | None = None, info: dict[str, Any] | None = None,
                attention_bias: Any = None, lineage_key: bytes | None = None,
                promise: Mapping[str, str] | None = None) -> EditResult:
    """Encode the edited ``cache`` as a new entry (``dest`` a path, or None for bytes) carrying the edit log
    (and ``attention_bias``, spec/kvc-v1.md 4.6, for a steered cache).

    ``promise`` is :func:`keeps` or :func:`breaks` (the edit knows which); a steered cache promises nothing (its
    bias changes the outputs by design, and its encode runs without the model's quality check)."""
    from kvcodec.api import encode, encode_cache, preset_info

    t0 = time.perf_counter()
    name = _child_preset(parent, preset)
    if attention_bias is not None:
        promise = breaks("steered: the attention bias changes the outputs by design (encoded without the quality check)")
    if promise is None:
        raise ValueError("write_child needs the edit's promise (keeps or breaks)")
    said = _promise(name, promise)
    child = KVCache([k.detach().cpu() for k in cache.keys], [v.detach().cpu() for v in cache.values],
                    np.asarray(cache.token_ids, np.int64), cache.fingerprint, None,
                    child_meta(parent, op, params, lineage_key, said))
    dtype = parent.reader.header.dtype
    import torch

    want = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    if child.dtype != want:  # the parent's element type: an edit does not widen or narrow the entry
        child = child.to(want)
    t = dict(timings or {})
    if attention_bias is None:
        # A child that records its preset's promise is encoded with the quality check (kvcodec.plan.check): rate
        # control alone missed on a fresh prefill of an appended child (SmolLM2, apache2, 1,152 tokens: KL 0.0115
        # for balanced's 0.01; checked 0.0080 at 1.78 instead of 1.38 bits/element, BENCHMARKS.md "Offline
        # editing"). The edit has the model and the exact K/V at hand, and it writes the promise into the log.
        check = "basis" in said and preset_info(name).lossy
        enc = encode(child, dest, preset=name, model=lm, progress=progress, check=check)
        t["encode_s"] = time.perf_counter() - t0
        out = dict(info or {})
        rec = enc.plan.params.get("check")
        if isinstance(rec, dict):
            out["quality_check"] = {"met": rec.get("met"), "tries": len(rec.get("tries") or [])}
        return EditResult(cache=child, op=op, params=dict(params), parent_sha256=parent.sha256, size=enc.size,
                          output=enc.output, data=enc.data, preset=enc.preset, timings=t, info=out, promise=said)
    # A steered cache: the writer must store its bias. encode_cache plans it without the model (its quality check
    # would continue the cache *without* the bias and measure the wrong thing: a lossy preset then uses uniform
    # steps, as without a model) and with the model's calibration.
    enc = encode_cache(child, name, dest, model=lm, attention_bias=attention_bias)
    t["encode_s"] = time.perf_counter() - t0
    return EditResult(cache=child, op=op, params=dict(params), parent_sha256=parent.sha256, size=enc.size,
                      output=enc.output, data=enc.data, preset=enc.plan.preset, timings=t, info=dict(info or {}),
                      promise=said)
