"""Parent in, child out: what every edit shares (opening the stored entry, writing the edited one).

An edit never happens in place: it reads a parent `.kvc` (a path or its bytes), checks it belongs to the
model at hand (a cache never loads into a different model), decodes it, and writes a *new* `.kvc` whose
token ids are the edited context's and whose header carries the edit log (:mod:`kvcodec.edit.log`). The
child is encoded with the parent's preset unless the caller names another, through the one encode path
(:func:`kvcodec.api.encode`: plan, quality check, atomic write with read-back).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from kvcodec.core.kvcache import KVCache
from kvcodec.digest import token_ids_sha256
from kvcodec.edit.log import EDITS_META_KEY, extend_log, file_sha256, parse_log, redaction_log
from kvcodec.errors import KvcInputError
from kvcodec.format import KvcReader

__all__ = ["EditResult", "Parent", "check_dest", "check_token_ids", "child_meta", "open_parent", "write_child"]

# meta keys that describe how the parent's K/V were made (or its tokens, one score each) and stop being true
# of the child
_STALE_META = ("blend", "target", "config", "h2o_scores")
# measured on the parent's token ids: stale in a child whose ids differ (append's answers reported their speed-up
# against the parent's shorter prefill; no prefill of the child's own ids is measured). A steered child has the same ids.
_STALE_WITH_NEW_IDS = ("prefill_ttft_s",)
# the only parent meta a redacted child keeps (spec/kvc-v1.md §4.5): the model's name says nothing of the text
_REDACT_KEEPS_META = ("model",)


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

    def decode(self, lm: Any) -> KVCache:
        """The parent's cache, checked against ``lm`` before anything is decoded (the model's device and dtype
        are the caller's business: the tensors come back as the file stores them, on the host)."""
        self.reader.check_model(lm)
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
    parse_log(reader.header.meta, own_sha256=digest)  # a hostile or looping log is refused before any work
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


def child_meta(parent: Parent, op: str, params: Mapping[str, Any], lineage_key: bytes | None = None) -> dict[str, Any]:
    """The child's header meta: the parent's (minus what no longer holds) with the edit log extended.

    A redaction keeps only the model's name of the parent's meta, and its log is :func:`redaction_log`'s (no
    plain digest of the parent, earlier records sealed): whatever else the parent's meta held was written
    about content that included what is being removed."""
    if op == "redact":
        meta: dict[str, Any] = {k: v for k, v in parent.meta.items() if k in _REDACT_KEEPS_META and isinstance(v, str)}
        meta[EDITS_META_KEY] = redaction_log(parent.meta, parent.sha256, params, lineage_key)
        return meta
    stale = _STALE_META + (_STALE_WITH_NEW_IDS if op == "append" else ())
    meta = {k: v for k, v in parent.meta.items() if k not in stale}
    meta[EDITS_META_KEY] = extend_log(parent.meta, parent.sha256, parent.reader.header.token_ids_sha256, op, params)
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
                             "timings": {k: round(v, 6) for k, v in self.timings.items()}, **self.info}
        if self.op == "redact":
            log = self.cache.meta.get(EDITS_META_KEY) or [{}]
            if log[-1].get("parent_mac") is not None:
                d["parent_mac"] = log[-1]["parent_mac"]
        else:
            d["parent_sha256"] = self.parent_sha256
        return d


def _child_preset(parent: Parent, preset: str | None) -> str:
    from kvcodec.plan.presets import PRESETS

    if preset is not None:
        return preset
    if parent.preset in PRESETS:
        return str(parent.preset)
    raise KvcInputError(f"the entry was written with codec {parent.preset!r}, which is not a preset; "
                        "name the edited entry's preset (--preset)")


def write_child(lm: Any, parent: Parent, cache: KVCache, op: str, params: Mapping[str, Any], dest: Any = None,
                preset: str | None = None, progress: Callable[[str], None] | None = None,
                timings: dict[str, float] | None = None, info: dict[str, Any] | None = None,
                attention_bias: Any = None, lineage_key: bytes | None = None) -> EditResult:
    """Encode the edited ``cache`` as a new entry (``dest`` a path, or None for bytes) carrying the edit log
    (and ``attention_bias``, spec/kvc-v1.md 4.6, for a steered cache)."""
    from kvcodec.api import encode

    t0 = time.perf_counter()
    name = _child_preset(parent, preset)
    child = KVCache([k.detach().cpu() for k in cache.keys], [v.detach().cpu() for v in cache.values],
                    np.asarray(cache.token_ids, np.int64), cache.fingerprint, None,
                    child_meta(parent, op, params, lineage_key))
    dtype = parent.reader.header.dtype
    import torch

    want = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    if child.dtype != want:  # the parent's element type: an edit does not widen or narrow the entry
        child = child.to(want)
    t = dict(timings or {})
    if attention_bias is None:
        enc = encode(child, dest, preset=name, model=lm, progress=progress)
        t["encode_s"] = time.perf_counter() - t0
        return EditResult(cache=child, op=op, params=dict(params), parent_sha256=parent.sha256, size=enc.size,
                          output=enc.output, data=enc.data, preset=enc.preset, timings=t, info=dict(info or {}))
    # A steered cache: the writer must store its bias. The plan is made without the model: its quality check
    # would continue the cache *without* the bias and measure the wrong thing (a lossy preset then uses
    # uniform steps, as without a model).
    from kvcodec.format import encode_kvc_bytes, write_kvc
    from kvcodec.plan.presets import get_plan, preset_info

    cal = None
    if preset_info(name).lossy:
        from kvcodec.calibration.build import ensure_calibration

        cal = ensure_calibration(lm)
    plan = get_plan(name, child, cal=cal)
    data = None
    if dest is None:
        data = encode_kvc_bytes(child, plan, attention_bias=attention_bias)
        size = len(data)
    else:
        size = write_kvc(child, dest, plan, attention_bias=attention_bias)
    t["encode_s"] = time.perf_counter() - t0
    return EditResult(cache=child, op=op, params=dict(params), parent_sha256=parent.sha256, size=size,
                      output=None if dest is None else os.fspath(dest), data=data, preset=plan.preset, timings=t,
                      info=dict(info or {}))
