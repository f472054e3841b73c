"""Real peer libraries in the rate/quality curve: HF transformers' QuantizedCache (quanto, HQQ backends) and NVIDIA kvpress.

Unlike :mod:`kvcodec.plan.baselines` (reimplementations of codecs that ship no
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

kvpress (NVIDIA's KV-cache pruning "presses") pins an older transformers, so
it runs in its own venv (``.ci/kvpress.sh`` builds ``.venv-kvpress``) as a
subprocess (``kvcodec/eval/kvpress_runner.py``) that prefills the context under
each press with kvpress's own hooks and hands back the indices each press
kept per layer and KV head. The kept entries are the prefill's own K/V, so
:func:`kvpress_roundtrip` gathers kvcodec's exact capture at those indices:
the same cache and evaluator as every other row. Bits: kept fraction x 16
(fp16 storage; the indices themselves are not charged, in the peer's favour),
or, combined with a QuantizedCache setting (``+quanto4-g32-kivi``), that
library's stored bits for the kept entries (what a ``QuantizedCache`` holds
after a press ran on it: kvpress re-quantizes the pruned keys and values).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvcodec.errors import KvcCodecError

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
    from kvcodec.models.hfimport import cache_utils, hqq_quantizer

    if spec.backend == "hqq":
        hqq_quantizer()
    HQQQuantizedLayer, QuantoQuantizedLayer = cache_utils().HQQQuantizedLayer, cache_utils().QuantoQuantizedLayer
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
    from kvcodec.core.kvcache import KVCache

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


# -- kvpress (own venv, subprocess) -------------------------------------------------------
KVPRESS_VENV = Path(__file__).resolve().parents[2] / ".venv-kvpress"  # the repository root: built by .ci/kvpress.sh
KVPRESS_RUNNER = Path(__file__).resolve().parent / "kvpress_runner.py"
KVPRESS_PRESSES = ("expected_attention", "snapkv", "observed_attention", "knorm", "tova", "streaming_llm")
KVPRESS_RATIOS = (0.1, 0.25, 0.5)  # compression_ratio: the fraction of KV entries a press removes
KVPRESS_TIMEOUT_S = 1800


def kvpress_python() -> Path:
    """The kvpress venv's interpreter ($KVCODEC_KVPRESS_PYTHON overrides)."""
    return Path(os.environ.get("KVCODEC_KVPRESS_PYTHON") or KVPRESS_VENV / "bin" / "python")


def kvpress_available() -> str | None:
    """None when the kvpress venv exists, else the reason kvpress rows are skipped."""
    if not kvpress_python().is_file():
        return f"kvpress venv not found at {kvpress_python()} (run: bash .ci/kvpress.sh)"
    return None


@dataclass(frozen=True)
class KvpressSpec:
    """One kvpress setting: press, compression ratio, and optionally a QuantizedCache setting on the kept entries."""

    press: str
    ratio: float
    quant: str | None = None  # an HFQuantSpec name, e.g. quanto4-g32-kivi

    @property
    def name(self) -> str:
        return f"{self.press}-{self.ratio:g}" + (f"+{self.quant}" if self.quant else "")

    @property
    def runner_key(self) -> str:
        return f"{self.press}:{self.ratio:g}"

    @classmethod
    def parse(cls, name: str) -> "KvpressSpec":
        """Inverse of :attr:`name` (``expected_attention-0.25+quanto4-g32-kivi``)."""
        head, _, quant = name.partition("+")
        press, _, ratio = head.rpartition("-")
        try:
            r = float(ratio)
        except ValueError:
            r = -1.0
        if press not in KVPRESS_PRESSES or not 0.0 < r < 1.0:
            raise KvcCodecError(f"bad kvpress setting {name!r}: PRESS-RATIO[+QUANT], press one of "
                                f"{', '.join(KVPRESS_PRESSES)}, 0 < ratio < 1 (e.g. snapkv-0.25+quanto4-g32-kivi)")
        if quant:
            HFQuantSpec.parse(quant)
        return cls(press, r, quant or None)


DEFAULT_KVPRESS_SPECS: tuple[KvpressSpec, ...] = tuple(
    [KvpressSpec(p, r) for p in ("expected_attention", "snapkv", "observed_attention") for r in KVPRESS_RATIOS]
    + [KvpressSpec(p, r) for p in ("knorm", "tova", "streaming_llm") for r in (0.25,)]
    # with a 4-bit QuantizedCache on the kept entries (KIVI axes group keys along tokens: 32 | kept count)
    + [KvpressSpec(p, r, q) for p in ("expected_attention", "snapkv") for r in (0.25, 0.5)
       for q in ("quanto4-g32-kivi", "quanto4-g32-hf")])


def kvpress_indices(lm: Any, cache: Any, specs: list[KvpressSpec]) -> dict[str, np.ndarray]:
    """Run the presses of ``specs`` on ``cache``'s context in the kvpress venv: runner key -> kept indices [L, H, kept]."""
    reason = kvpress_available()
    if reason is not None:
        raise KvcCodecError(reason)
    keys = list(dict.fromkeys(s.runner_key for s in specs))
    with tempfile.TemporaryDirectory(prefix="kvc-kvpress-") as d:
        ids, out = Path(d) / "ids.npy", Path(d) / "kept.npz"
        np.save(ids, np.asarray(cache.token_ids, np.int64))
        try:
            p = subprocess.run([str(kvpress_python()), str(KVPRESS_RUNNER), str(lm.path), str(ids), str(out), *keys],
                               capture_output=True, text=True, timeout=KVPRESS_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise KvcCodecError(f"kvpress runner took over {KVPRESS_TIMEOUT_S} s") from None
        if p.returncode != 0 or not out.is_file():
            tail = (p.stderr.strip().splitlines() or ["no output"])[-1]
            raise KvcCodecError(f"kvpress runner failed (exit {p.returncode}): {tail}")
        with np.load(out, allow_pickle=False) as z:
            got = {k: np.asarray(z[k]) for k in z.files}
    L, H, T = cache.fingerprint.num_layers, cache.fingerprint.num_kv_heads, int(cache.num_tokens)
    for k in keys:
        a = got.get(k)
        if a is None or a.ndim != 3 or a.shape[:2] != (L, H) or a.size == 0 or a.min() < 0 or a.max() >= T:
            raise KvcCodecError(f"kvpress runner returned no valid indices for {k}")
    return {k: got[k] for k in keys}


@torch.inference_mode()
def kvpress_roundtrip(cache: Any, kept: np.ndarray, spec: KvpressSpec) -> tuple[Any, int]:
    """(the cache a model attends to after the press kept ``kept`` [L, H, n] of ``cache``, bits it stores)."""
    from kvcodec.core.kvcache import KVCache

    if cache.positions is not None:
        raise KvcCodecError("kvpress runs on a full (unpruned) context")
    if cache.ragged:
        raise KvcCodecError("kvpress pruning of a cache with sliding-window layers (ragged layout) is not supported")
    idx = torch.as_tensor(np.asarray(kept, np.int64))
    keys = [k.gather(1, idx[l][..., None].expand(-1, -1, k.shape[-1])).contiguous() for l, k in enumerate(cache.keys)]
    values = [v.gather(1, idx[l][..., None].expand(-1, -1, v.shape[-1])).contiguous() for l, v in enumerate(cache.values)]
    pruned = KVCache(keys, values, cache.token_ids, cache.fingerprint, np.asarray(kept, np.int64), dict(cache.meta))
    if spec.quant is None:
        return pruned, 16 * sum(k.numel() + v.numel() for k, v in zip(keys, values))
    return hf_quantized_roundtrip(pruned, HFQuantSpec.parse(spec.quant))
