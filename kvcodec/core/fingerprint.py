"""The model fingerprint a cache carries: the record, its strict JSON parsing and the compatibility check.

Why in core: every `.kvc` header and capture holds one, so the container parses it without
knowing how it is computed. Computing a fingerprint from a model's config, tokenizer and weights
is the models package's job (:mod:`kvcodec.models.fingerprint`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, fields
from typing import Any

from kvcodec.errors import KvcCodecError, KvcFormatError, KvcModelMismatchError, is_int, json_loads, want

FINGERPRINT_VERSION = 2
READABLE_VERSIONS = (1, 2)

#: a sha256 hex digest as fingerprints and calibrations write it
HEX64 = re.compile(r"[0-9a-f]{64}\Z")
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,128}\Z")
_MAX_ROPE_CHARS = 1 << 16


@dataclass(frozen=True)
class ModelFingerprint:
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dims: tuple[int, ...]
    rope: str  # canonical JSON of the RoPE parameters
    tokenizer_sha256: str
    weights_sha256: str
    dtype: str = "float32"
    version: int = FINGERPRINT_VERSION
    config_sha256: str = ""  # version 2 only: sha256 of the canonical cache-relevant config

    def _identity(self) -> tuple[str, ...]:
        base = ("architecture", "num_layers", "num_kv_heads", "head_dims", "rope", "tokenizer_sha256", "weights_sha256")
        return (*base, "version") if self.version == 1 else (*base, "config_sha256", "version")

    @property
    def id(self) -> str:
        """Short stable hex id over the identity fields (used in store keys)."""
        ident = {k: getattr(self, k) for k in self._identity()}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["head_dims"] = list(self.head_dims)
        if self.version == 1:  # byte-identical to what v1 writers wrote
            del d["config_sha256"]
        return d

    @classmethod
    def from_json(cls, obj: Any) -> "ModelFingerprint":
        """Parse strictly: exact types (no 64.0 or true for ints), known version, hex digests in v2."""
        if not isinstance(obj, dict):
            raise KvcFormatError("model fingerprint must be a JSON object")
        version = obj.get("version")
        if not is_int(version) or version not in READABLE_VERSIONS:
            raise KvcFormatError(f"unsupported model fingerprint version {str(version)[:20]!r} (this kvcodec reads {READABLE_VERSIONS})")
        required = {f.name for f in fields(cls)} - {"dtype"} - ({"config_sha256"} if version == 1 else set())
        missing = required - set(obj)
        if missing:
            raise KvcFormatError(f"model fingerprint lacks {sorted(missing)}")
        kw = {f.name: obj[f.name] for f in fields(cls) if f.name in obj}
        hd = kw["head_dims"]
        strs = ("architecture", "rope", "tokenizer_sha256", "weights_sha256", "dtype", "config_sha256")
        ok = (
            is_int(kw["num_layers"]) and 0 < kw["num_layers"] <= 4096
            and is_int(kw["num_kv_heads"]) and 0 < kw["num_kv_heads"] <= 4096
            and isinstance(hd, list) and len(hd) == kw["num_layers"] and all(is_int(d) and 0 < d <= 65536 for d in hd)
            and all(isinstance(kw.get(k, ""), str) for k in strs)
        )
        if not ok:
            raise KvcFormatError("model fingerprint fields have wrong types or are out of range")
        if not _NAME.match(kw["architecture"]) or not _NAME.match(kw.get("dtype", "float32")):
            raise KvcFormatError("model fingerprint architecture/dtype must be 1-128 chars of [A-Za-z0-9_.-]")
        if len(kw["rope"]) > _MAX_ROPE_CHARS or not kw["rope"].isascii():
            raise KvcFormatError("model fingerprint rope must be ASCII JSON of at most 64 KiB")
        if version >= 2:
            if not all(HEX64.match(kw[k]) for k in ("tokenizer_sha256", "weights_sha256", "config_sha256")):
                raise KvcFormatError("model fingerprint v2 digests must be 64 lowercase hex digits")
            try:
                rope_ok = isinstance(json_loads(kw["rope"]), dict)
            except ValueError:
                rope_ok = False
            if not rope_ok:
                raise KvcFormatError("model fingerprint rope must be a JSON object")
        kw["head_dims"] = tuple(hd)
        return cls(**kw)

    def same_model(self, other: "ModelFingerprint") -> bool:
        return self.version == other.version and all(getattr(self, k) == getattr(other, k) for k in self._identity())

    def check_compatible(self, other: "ModelFingerprint", what: str = "cache") -> None:
        """Raise KvcModelMismatchError unless ``other`` (the cache's) is provably this model (``self``)."""
        if other.version != FINGERPRINT_VERSION or self.version != FINGERPRINT_VERSION:
            raise KvcModelMismatchError(
                f"this {what} carries a version-{other.version} model fingerprint, which cannot prove which weights "
                f"it belongs to; re-encode it from the model with this kvcodec (fingerprint version {FINGERPRINT_VERSION})"
            )
        for k in self._identity():
            a, b = getattr(self, k), getattr(other, k)
            if a != b:
                raise KvcModelMismatchError(
                    f"this {what} belongs to a different model ({k}: {_short(b)} in the {what}, {_short(a)} in the model)"
                )


def _short(v: Any) -> str:
    s = str(v)
    return s if len(s) <= 40 else s[:37] + "..."


def check_fingerprint_json(m: Any, max_version: int) -> None:
    """Type-check the header's ``model`` object (spec 4.1) exactly: ints are JSON integers (not 64.0,
    not true), strings are strings, ``version`` is a known fingerprint scheme (1 .. ``max_version``)."""
    want(isinstance(m, dict), "header: 'model' must be an object")
    for k in ("architecture", "rope", "tokenizer_sha256", "weights_sha256", "dtype"):
        want(isinstance(m.get(k), str), f"header: model.{k} must be a string")
    want(is_int(m.get("num_layers"), 1, 4096), "header: model.num_layers must be an int in [1, 4096]")
    want(is_int(m.get("num_kv_heads"), 1, 4096), "header: model.num_kv_heads must be an int in [1, 4096]")
    hd = m.get("head_dims")
    want(isinstance(hd, list) and len(hd) == m["num_layers"] and all(is_int(d, 1, 65536) for d in hd),
         "header: model.head_dims must be num_layers ints in [1, 65536]")
    v = m.get("version")
    want(is_int(v), "header: model.version (fingerprint scheme) must be an int")
    want(1 <= v <= max_version,
         f"header: model fingerprint version {v} is not one this reader knows (1..{max_version}); upgrade kvcodec")


def layer_applies_rope(rope: dict[str, Any] | str, layer: int | None) -> bool:
    """Whether ``layer`` rotates its keys at all, from a fingerprint's RoPE (dict or its JSON): the one reader of
    ``no_rope_layers``, shared by the rope stage's tables (codecs) and the model layout (models).

    False only for a NoPE layer of a model with ``no_rope_layers`` (per layer 1 = RoPE, 0 = none, as
    transformers' SmolLM3 and Llama 4 read it). A list that does not name the layer is an error, not
    a guess: a wrong answer would silently mis-rotate that layer's keys.
    """
    r = json_loads(rope) if isinstance(rope, str) else rope
    flags = r.get("no_rope_layers") if isinstance(r, dict) else None
    if flags is None:
        return True
    if layer is None:
        raise KvcCodecError("a model with no_rope_layers: whether keys are rotated depends on the layer")
    if not isinstance(flags, list) or not 0 <= layer < len(flags) or flags[layer] not in (0, 1, True, False):
        raise KvcFormatError(f"no_rope_layers in the fingerprint does not say whether layer {layer} applies RoPE")
    return bool(flags[layer])
