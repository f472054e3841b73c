"""Real peer libraries in the rate/quality curve: HF transformers' QuantizedCache (quanto, HQQ backends).

Unlike :mod:`kvcodec.baselines` (reimplementations of codecs that ship no
installable library), these run the peers' *own code*: a
``transformers.cache_utils.QuantoQuantizedLayer`` / ``HQQQuantizedLayer`` is
fed the whole context exactly as HF's ``QuantizedCache`` is during prefill
(after prefill it holds every context token quantized and an empty
full-precision residual), and its own ``_dequantize`` gives the cache the
model then attends to.

Bits are counted from what the library stores, honestly and in the peer's
favour where a choice exists:

* the codes: ``nbits`` per element (both libraries bit-pack them);
* every scale and zero point / shift the library keeps, at 16 bits each (what
  an fp16/bf16 deployment stores; on this fp32 CPU cache the libraries hold
  them in fp32, which would charge them double);
* nothing for tensor headers or Python objects.

Axes ``hf``: what HF's KV-cache documentation recommends, quanto
``axis_key=axis_value=0`` and HQQ ``axis_key=axis_value=1`` (both: groups of
``group`` consecutive channels of one token; HQQ's constructor default 0
groups elements strided across the tensor, a weaker setting we do not use).
Axes ``kivi``: KIVI's (keys per channel, values per token): quanto
``axis_key=-1, axis_value=0`` (key groups of ``group`` consecutive tokens of
one channel), HQQ ``axis_key=0, axis_value=1``.

A missing library is reported with a reason (:func:`available`), never faked.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .errors import KvcCodecError

BACKENDS = ("quanto", "hqq")
# (axis_key, axis_value) per backend for HF's default axes and for KIVI's axes.
AXES: dict[str, dict[str, tuple[int, int]]] = {
    "quanto": {"hf": (0, 0), "kivi": (-1, 0)},
    "hqq": {"hf": (1, 1), "kivi": (0, 1)},
}
PACKAGE = {"quanto": "optimum.quanto", "hqq": "hqq"}
PIP = {"quanto": "optimum-quanto==0.2.7", "hqq": "hqq==0.2.8.post1"}
SIDE_BITS = 16  # bits charged per scale and per zero point


@dataclass(frozen=True)
class HFQuantSpec:
    """One HF QuantizedCache setting: backend, bits, group size, axes ('hf' or 'kivi')."""

    backend: str
    nbits: int
    group: int
    axes: str = "hf"

    @property
    def name(self) -> str:
        return f"{self.backend}{self.nbits}-g{self.group}-{self.axes}"

    @classmethod
    def parse(cls, name: str) -> "HFQuantSpec":
        """Inverse of :attr:`name` (``quanto4-g32-kivi``)."""
        try:
            head, g, axes = name.split("-")
            backend = head.rstrip("0123456789")
            spec = cls(backend, int(head[len(backend):]), int(g.removeprefix("g")), axes)
        except ValueError:
            raise KvcCodecError(f"bad HF QuantizedCache setting {name!r} (e.g. quanto4-g32-kivi)") from None
        if spec.backend not in BACKENDS or spec.axes not in ("hf", "kivi") or spec.nbits not in (2, 4):
            raise KvcCodecError(f"bad HF QuantizedCache setting {name!r}: backend quanto|hqq, 2 or 4 bits, axes hf|kivi")
        return spec


DEFAULT_SPECS: tuple[HFQuantSpec, ...] = tuple(
    HFQuantSpec(b, n, g, a) for b in BACKENDS for n in (2, 4) for g in (32, 64) for a in ("hf", "kivi"))


def available(backend: str) -> str | None:
    """None when ``backend``'s library is importable, else the reason it is skipped."""
    if importlib.util.find_spec(PACKAGE[backend].split(".")[0]) is None or importlib.util.find_spec(PACKAGE[backend]) is None:
        return f"{PACKAGE[backend]} is not installed (pip install '{PIP[backend]}', or kvcodec[peers])"
    return None


def _layer(spec: HFQuantSpec) -> Any:
    from transformers.cache_utils import HQQQuantizedLayer, QuantoQuantizedLayer

    ak, av = AXES[spec.backend][spec.axes]
    cls = QuantoQuantizedLayer if spec.backend == "quanto" else HQQQuantizedLayer
    return cls(nbits=spec.nbits, axis_key=ak, axis_value=av, q_group_size=spec.group, residual_length=128)


def _stored_bits(q: Any, spec: HFQuantSpec) -> int:
    """Bits of one quantized tensor as the library holds it: codes + 16-bit scales and zero points."""
    if isinstance(q, tuple):  # HQQ: (packed codes, meta with scale and zero)
        _, meta = q
        n = int(np.prod(meta["shape"]))
        side = int(meta["scale"].numel()) + int(meta["zero"].numel())
    else:  # quanto WeightQBitsTensor: _data (PackedTensor), _scale, _shift
        n = int(q.numel())
        side = int(q._scale.numel()) + int(q._shift.numel())
    return n * spec.nbits + side * SIDE_BITS


@torch.inference_mode()
def hf_quantized_roundtrip(cache: Any, spec: HFQuantSpec) -> tuple[Any, int]:
    """(the cache HF's QuantizedCache attends to after prefilling ``cache``, bits it stores)."""
    from .kvcache import KVCache

    reason = available(spec.backend)
    if reason is not None:
        raise KvcCodecError(reason)
    keys, values, bits = [], [], 0
    for k, v in zip(cache.keys, cache.values):
        layer = _layer(spec)
        try:
            layer.update(k[None].contiguous(), v[None].contiguous())
        except ValueError as exc:  # e.g. quanto: group size must divide the grouped axis
            raise KvcCodecError(f"{spec.name}: {exc}") from None
        qk, qv = layer._quantized_keys, layer._quantized_values
        bits += _stored_bits(qk, spec) + _stored_bits(qv, spec)
        keys.append(layer._dequantize(qk)[0].to(k.dtype).contiguous())
        values.append(layer._dequantize(qv)[0].to(v.dtype).contiguous())
    return KVCache(keys, values, cache.token_ids, cache.fingerprint, cache.positions, dict(cache.meta)), bits
