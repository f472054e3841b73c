"""The LMCache serde ``kvcodec``: LMCache's multiprocess-mode ``Serializer`` / ``Deserializer``, wrapped by its
``AsyncSerdeProcessor`` and registered under the type name ``kvcodec`` (needs ``pip install kvcodec[lmcache]``).

Selected per L2 adapter in LMCache's config::

    {"type": "fs", "base_path": "/var/cache/lmcache",
     "serde": {"type": "kvcodec", "preset": "lossless",
               "models": {"HuggingFaceTB/SmolLM2-135M": "smollm2"}}}

Options (the ``serde`` dict, all checked when LMCache builds the adapter, before the first store):

* ``preset``: a kvcodec preset (``lossless`` default; ``near-lossless`` / ``balanced`` / ``small`` need the
  model's calibration on this machine: ``kvc calibrate --model DIR`` once; refused at configuration otherwise).
* ``models``: LMCache model name (the ``ObjectKey``'s) -> kvcodec model (a shipped name or an HF directory);
  a name not listed is itself tried as one. Every listed model's fingerprint (and calibration, for a lossy
  preset) is resolved at configuration: a missing one is refused then, in one line.
* ``overrides``: the preset's settings to change, as ``kvcodec.encode(overrides=...)`` and ``kvc encode --config``
  take them (e.g. ``{"step0": 0.12}``: a fixed step between ``faithful``'s 0.065 and ``balanced``'s 0.33; the
  keys a preset takes are in docs/guide/presets.md). Checked at configuration by kvcodec's one validator
  (:func:`kvcodec.api.check_overrides`): an unknown key or a bad value is one line then. Why it matters here: the
  server has no model, so a lossy preset runs at its fixed step, and ``step0`` is the only way to choose the
  bits-for-quality point between two presets (benchmarks/BENCHMARKS.md, "LMCache serdes").
* ``pad``: true (default) pads every object to ``estimate_serialized_size``: LMCache's ``fs`` adapter (0.5.6)
  reads a stored object back into a buffer of exactly that size and counts a shorter file as a miss. So over
  ``fs`` the bytes on disk do not shrink; they do with the kvcodec L2 adapter (:mod:`.adapter`), which stores the
  `.kvc` itself. ``pad: false`` is for adapters that read back what was stored.
* ``rope_offset``: ``"search"`` (default) or ``"zero"``. A lossy preset stores keys un-rotated (pre-RoPE), but a
  chunk does not say at which position it starts. ``"search"`` estimates that offset from the keys and the
  calibration's key means (:func:`.chunks.estimate_offset`), re-bases the chunk to position 0 before encoding,
  records the offset in the `.kvc` (meta ``rope_offset``) and rotates the keys back at deserialize; a chunk found
  at an offset above 0 is then encoded with ``sink: 0`` (its first tokens are not the model's attention sinks)
  unless ``overrides`` sets ``sink``. ``"zero"`` encodes every chunk as if it started at position 0 (before
  2026-12-07: 13 % more bytes on SmolLM2's 256-token chunks). Lossless presets do neither.
* ``verify``: the writer's read-back (``"file"`` default, ``"off"``); ``max_workers``: the processor's threads.

What the serde refuses, as :class:`~kvcodec.errors.KvcError` (LMCache logs it: a failed store, or a load counted
as a miss): a layout other than one KV_2LTD tensor (:mod:`.chunks`), a chunk whose shape is not its model's,
a model it cannot resolve, and at deserialize anything that is not this key's chunk of this model: another
model's or codec's object, a renamed file, hostile bytes. Nothing is ever decoded into the wrong cache.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Mapping

import torch
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, Serializer
from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory

import kvcodec
from kvcodec.errors import KvcError, KvcInputError, KvcModelNotFoundError
from kvcodec.integrations.buffers import check_buffer
from kvcodec.integrations.fidelity import layer_steps_of, with_fallback
from kvcodec.integrations.lmcache.chunks import (
    check_entry, check_model_layout, chunk_layout, estimate_offset, frame, key_meta, layer_ropes, shift_cache,
    to_cache, unframe, upper_bound, write_chunk,
)

log = logging.getLogger("kvcodec.integrations.lmcache")
SERDE_NAME = "kvcodec"
_OPTIONS = frozenset({"preset", "overrides", "models", "pad", "verify", "max_workers", "rope_offset"})


class ModelResolver:
    """LMCache model name -> kvcodec fingerprint (and calibration), resolved once per name.

    Why a fingerprint and not the model: the serde only needs the cache's identity (layers, heads, RoPE, the
    weights' digest) to write and check `.kvc` headers; loading weights in LMCache's server would cost seconds
    and memory per model for nothing. The fingerprint of an HF directory is the one ``load_model`` gives.
    """

    def __init__(self, preset: str, models: Mapping[str, str] | None = None,
                 overrides: Mapping[str, Any] | None = None) -> None:
        from kvcodec.api import check_overrides, preset_info

        self.info = preset_info(preset, "kvcodec serde: preset")
        if self.info.name.startswith("baseline:"):
            raise KvcInputError("kvcodec serde: baselines are not stored formats")
        if overrides is not None and not isinstance(overrides, Mapping):
            raise KvcInputError(f"kvcodec serde: overrides must be an object of preset settings, e.g. "
                                f"{{\"step0\": 0.12}}; got {type(overrides).__name__}")
        self.overrides = check_overrides(self.info.name, dict(overrides or {}), "kvcodec serde: overrides")
        if models is not None and (not isinstance(models, Mapping) or
                                   not all(isinstance(k, str) and isinstance(v, str) for k, v in models.items())):
            raise KvcInputError("kvcodec serde: models must map LMCache model names to kvcodec models (strings)")
        self.models = dict(models or {})
        self._fps: dict[str, Any] = {}
        self._cals: dict[str, Any] = {}
        self._ropes: dict[str, Any] = {}
        self._lock = threading.Lock()

    def fingerprint(self, model_name: str) -> Any:
        """The fingerprint of ``model_name``'s kvcodec model, or one KvcModelNotFoundError line."""
        with self._lock:
            fp = self._fps.get(model_name)
        if fp is not None:
            return fp
        from kvcodec.models.fingerprint import fingerprint_dir
        from kvcodec.models.load import resolve_model_dir

        target = self.models.get(model_name, model_name)
        try:
            fp = fingerprint_dir(resolve_model_dir(target))
        except KvcModelNotFoundError as e:
            raise KvcModelNotFoundError(f"kvcodec serde: LMCache model {model_name!r}: {e}; map it with the serde "
                                        "option models: {NAME: shipped model or HF directory}") from None
        with self._lock:
            self._fps[model_name] = fp
        return fp

    def ropes(self, model_name: str) -> list[Any]:
        """Each layer's (theta, rotary dim) of ``model_name``'s model, None where it has no plain RoPE."""
        fp = self.fingerprint(model_name)
        with self._lock:
            r = self._ropes.get(fp.id)
        if r is None:
            r = layer_ropes(fp)
            with self._lock:
                self._ropes[fp.id] = r
        return r

    def calibration(self, model_name: str) -> Any:
        """The model's calibration for a lossy preset (None for the lossless ones), or one line how to build it.

        Why not build it here: building runs the model's forward and backward passes for minutes, which a cache
        server must not start on its own in the middle of a store."""
        if not self.info.lossy:
            return None
        fp = self.fingerprint(model_name)
        with self._lock:
            cal = self._cals.get(fp.id)
        if cal is not None:
            return cal
        from kvcodec.calibration.store import load_calibration

        cal = load_calibration(fp.id)
        if cal is None:
            raise KvcInputError(f"kvcodec serde: preset {self.info.name!r} needs the calibration of LMCache model "
                                f"{model_name!r}, which this machine does not have; build it once with kvc calibrate "
                                f"--model {self.models.get(model_name, model_name)} (or use the lossless preset)")
        with self._lock:
            self._cals[fp.id] = cal
        return cal


class KvcodecSerializer(Serializer):
    """LMCache ``Serializer``: one KV_2LTD chunk -> a framed `.kvc` (:func:`chunks.frame`) in ``dst``."""

    def __init__(self, resolver: ModelResolver, pad: bool = True, verify: str = "file",
                 rope_offset: str = "search") -> None:
        self.resolver, self.pad, self.verify, self.rope_offset = resolver, pad, verify, rope_offset

    def meta(self, key: Any) -> dict[str, Any]:
        """What every object records: its key (:func:`chunks.key_meta`) and this serde's preset (checked at
        deserialize: :func:`chunks.check_preset`)."""
        return {**key_meta(key), "serde_preset": self.resolver.info.name}

    def encode(self, tensor: torch.Tensor, key: Any) -> bytes:
        """The `.kvc` of one chunk (no frame), through kvcodec's public encode; the adapter stores these as is."""
        name = str(key.model_name)
        fp = self.resolver.fingerprint(name)
        cache = to_cache(tensor, fp, self.meta(key))
        cal = self.resolver.calibration(name)
        over = dict(self.resolver.overrides)
        if self.rope_offset == "search" and cal is not None and self.resolver.info.lossy:
            ropes = self.resolver.ropes(name)
            off = estimate_offset(cache.keys, ropes, cal.mean[:, 0])
            if off:
                cache = shift_cache(cache, -off, ropes)
                over.setdefault("sink", 0)
        preset = self.resolver.info.name

        def encode() -> Any:  # a kvcodec.api.Encoded
            return kvcodec.encode(cache, None, preset=preset, overrides=over or None, calibration=cal,
                                  verify=self.verify)

        if not self.resolver.info.lossy:
            return encode().data or b""

        def lossless(meta: dict[str, Any]) -> bytes:  # the chunk as handed over (not re-based), bit-exact
            plain = to_cache(tensor, fp, {**self.meta(key), **meta})
            return kvcodec.encode(plain, None, preset="lossless", verify=self.verify).data or b""

        steps = layer_steps_of(preset, self.resolver.overrides, cal)
        return with_fallback(cache, encode, preset, steps, lossless, "kvcodec serde")

    def serialize(self, src: Any, dst: Any, key: Any) -> int:
        tensor, out = src.tensor, dst.tensor
        if tensor is None or out is None:
            raise KvcInputError("kvcodec serde: source and destination must hold tensors")
        check_buffer(tensor, "kvcodec serde: the chunk to serialize", write=False)
        if not check_buffer(out, "kvcodec serde: the destination buffer").is_contiguous():  # written as flat bytes
            raise KvcInputError("kvcodec serde: the destination buffer must be contiguous (the object is written as "
                                "its flat bytes)")
        lay = chunk_layout([tensor.shape], [tensor.dtype])
        capacity = int(out.numel() * out.element_size())
        data = self.encode(tensor, key)
        if len(data) + 16 > capacity:  # never past the estimate: the raw preset's payload is the raw values
            fp = self.resolver.fingerprint(str(key.model_name))
            data = kvcodec.encode(to_cache(tensor, fp, self.meta(key)), None, preset="raw", verify=self.verify).data or b""
        del lay  # checked: a layout LMCache should never have sized a buffer for is refused before any work
        blob = frame(data, capacity, self.pad)  # padded to the buffer LMCache reads back into (fs: exactly that)
        flat = out.reshape(-1).view(torch.uint8)
        flat[:len(blob)].copy_(torch.frombuffer(bytearray(blob), dtype=torch.uint8))
        return len(blob)

    def estimate_serialized_size(self, layout_desc: Any) -> int:
        """A true upper bound for any chunk of this layout (:func:`chunks.upper_bound`); an unsupported layout is
        refused here, at LMCache's first allocation, when no model name is at hand yet."""
        lay = chunk_layout(layout_desc.shapes, layout_desc.dtypes)
        return upper_bound(lay, self._any_fingerprint())

    def _any_fingerprint(self) -> Any:
        # the bound allows for the largest fingerprint record among the configured models (or a generous default)
        fps = [self.resolver.fingerprint(m) for m in self.resolver.models]
        return max(fps, key=lambda f: len(f.rope)) if fps else None


class KvcodecDeserializer(Deserializer):
    """LMCache ``Deserializer``: a framed `.kvc` -> the chunk, after checking it is this key's chunk of this model.

    Everything wrong raises KvcError, which LMCache's processor reports as a failed task and its serde wrapper
    as a miss for the whole load: the tokens are computed again, never taken from a wrong cache.
    """

    def __init__(self, resolver: ModelResolver) -> None:
        self.resolver = resolver

    def decode_into(self, data: bytes, dst: torch.Tensor, key: Any) -> None:
        # a view whose K and V planes share memory (expand) got V written over K, silently: refused before any work
        check_buffer(dst, "kvcodec serde: the destination chunk")
        lay = chunk_layout([dst.shape], [dst.dtype])
        fp = self.resolver.fingerprint(str(key.model_name))
        check_model_layout(lay, fp)
        # The buffer bounds what the object may declare (its values as float32, as the reader counts them); the
        # reader's ratio to the file's size would refuse a lossless chunk of zeros (a few KB for megabytes of K/V)
        with kvcodec.open(data, max_decoded_bytes=lay.nbytes // lay.dtype.itemsize * 4, max_decoded_ratio=0) as r:
            check_entry(r, fp, key, lay, self.resolver.info.name)
            write_chunk(r, dst, lay, self.resolver.ropes(str(key.model_name)))

    def deserialize(self, src: Any, dst: Any, key: Any) -> None:
        if src.tensor is None or dst.tensor is None:
            raise KvcInputError("kvcodec serde: source and destination must hold tensors")
        check_buffer(src.tensor, "kvcodec serde: the serialized object", write=False)
        raw = src.tensor.detach().to("cpu").contiguous().view(-1).view(torch.uint8)  # its bytes in element order
        self.decode_into(unframe(raw.numpy().tobytes()), dst.tensor, key)


def parse_options(kwargs: Mapping[str, object]) -> dict[str, Any]:
    """The serde dict's options, checked (one KvcInputError line for the first bad one)."""
    if not isinstance(kwargs, Mapping):  # a JSON string: set() of its characters named them unknown options
        raise KvcInputError(f"kvcodec serde: the serde options must be an object, got {type(kwargs).__name__}")
    extra = set(kwargs) - _OPTIONS
    if extra:
        raise KvcInputError(f"kvcodec serde: unknown option(s) {sorted(extra)} (known: {sorted(_OPTIONS)})")
    opts: dict[str, Any] = {"preset": kwargs.get("preset", "lossless"), "overrides": kwargs.get("overrides"),
                            "models": kwargs.get("models"),
                            "pad": kwargs.get("pad", True), "verify": kwargs.get("verify", "file"),
                            "max_workers": kwargs.get("max_workers", 1), "rope_offset": kwargs.get("rope_offset", "search")}
    if not isinstance(opts["pad"], bool):
        raise KvcInputError("kvcodec serde: pad must be true or false")
    if opts["verify"] not in ("file", "off"):
        raise KvcInputError("kvcodec serde: verify must be \"file\" or \"off\"")
    if opts["rope_offset"] not in ("search", "zero"):
        raise KvcInputError("kvcodec serde: rope_offset must be \"search\" or \"zero\"")
    w = opts["max_workers"]
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= 64:
        raise KvcInputError("kvcodec serde: max_workers must be an integer in [1, 64]")
    return opts


def make_codec(kwargs: Mapping[str, object]) -> tuple[KvcodecSerializer, KvcodecDeserializer]:
    """The serializer and deserializer for a serde dict, with every configured model resolved now."""
    opts = parse_options(kwargs)
    resolver = ModelResolver(opts["preset"], opts["models"], opts["overrides"])
    for name in resolver.models:  # at configuration: a missing model or calibration is one line now
        resolver.fingerprint(name)
        resolver.calibration(name)
    return KvcodecSerializer(resolver, opts["pad"], opts["verify"], opts["rope_offset"]), KvcodecDeserializer(resolver)


def create_serde(kwargs: dict[str, object]) -> Any:
    """LMCache's serde factory for ``{"type": "kvcodec", ...}``: an ``AsyncSerdeProcessor``.

    LMCache's config parser turns a ValueError into its own one-line refusal; KvcError is raised as is."""
    ser, de = make_codec(kwargs)
    return AsyncSerdeProcessor(ser, de, max_workers=int(parse_options(kwargs)["max_workers"]))


def register() -> bool:
    """Register the ``kvcodec`` serde with LMCache (idempotent); True if this call registered it."""
    if SERDE_NAME in get_registered_serde_types():
        return False
    try:
        register_serde_factory(SERDE_NAME, create_serde)
    except ValueError:  # a concurrent register won
        return False
    return True


__all__ = ["SERDE_NAME", "KvcodecSerializer", "KvcodecDeserializer", "ModelResolver", "create_serde", "make_codec",
           "register", "KvcError"]
