"""The attention bias a `.kvc` may carry (spec/kvc-v1.md §4.6, required feature bit 1).

Why a file carries one: attention steering (PASTA; issue 37's ``kvc edit steer``) adds a constant to the
pre-softmax attention logits of chosen (layer, head) pairs for chosen key tokens. It applies during the
context's own prefill (so the stored K/V already reflect it) *and* to every later query over the cache, so
the cache alone is not the edit: an engine that loads the K/V but not the bias computes something the edit
never meant. Hence a **required** feature bit: a reader that does not implement it refuses the file, and
kvcodec's own reader refuses to hand out the tensors (:meth:`kvcodec.format.reader.KvcReader.read_layer`)
unless the caller says it applies the bias (the HF loader does; vLLM and llama.cpp cannot, and refuse).

The header form is run-length over key tokens: per (layer, head), one value added to the logits of the
keys in a list of token ranges of the stored context; every other (layer, head, key) gets 0, and so do
keys after the context (the query and generated tokens). That is a per-(layer, head, key token) bias,
exactly, at the size of its structure rather than ``layers x heads x tokens`` floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvcodec.errors import KvcFormatError, is_int

__all__ = ["AttentionBias", "BiasEntry", "MAX_BIAS", "MAX_BIAS_RANGES"]

MAX_BIAS = 1.0e4  # |value|: log(1e-4343) is far below any useful steering and far above fp16's range
MAX_BIAS_RANGES = 65536  # token ranges over all entries


@dataclass(frozen=True)
class BiasEntry:
    """``value`` added to head ``head`` of layer ``layer``'s logits for the keys in ``keys`` ([a, b) ranges)."""

    layer: int
    head: int
    value: float
    keys: tuple[tuple[int, int], ...]

    def to_json(self) -> dict[str, Any]:
        return {"layer": self.layer, "head": self.head, "value": self.value, "keys": [list(r) for r in self.keys]}


@dataclass(frozen=True)
class AttentionBias:
    """The header's ``attention_bias``: the model's query heads per layer and the biased (layer, head) pairs."""

    attention_heads: int
    entries: tuple[BiasEntry, ...]

    def to_json(self) -> dict[str, Any]:
        return {"attention_heads": self.attention_heads, "entries": [e.to_json() for e in self.entries]}

    @classmethod
    def from_json(cls, obj: Any, num_layers: int, context_tokens: int) -> "AttentionBias":
        """Validate the header object (spec §4.6); every problem is one :class:`KvcFormatError` line."""
        w = "header: attention_bias"
        if not isinstance(obj, dict):
            raise KvcFormatError(f"{w} must be an object")
        heads: Any = obj.get("attention_heads")
        entries: Any = obj.get("entries")
        if not is_int(heads, 1, 4096):
            raise KvcFormatError(f"{w}.attention_heads must be an int in [1, 4096]")
        if not isinstance(entries, list) or not 1 <= len(entries) <= num_layers * heads:
            raise KvcFormatError(f"{w}.entries must be a list of 1 to layers x attention_heads entries")
        out, seen, n_ranges = [], set(), 0
        for i, e in enumerate(entries):
            we = f"{w}.entries[{i}]"
            if not isinstance(e, dict):
                raise KvcFormatError(f"{we} must be an object")
            layer: Any = e.get("layer")
            head: Any = e.get("head")
            value: Any = e.get("value")
            keys: Any = e.get("keys")
            if not is_int(layer, 0, num_layers - 1) or not is_int(head, 0, heads - 1):
                raise KvcFormatError(f"{we}: layer must be in [0, {num_layers}) and head in [0, {heads})")
            if (layer, head) in seen:
                raise KvcFormatError(f"{we}: layer {layer} head {head} appears twice")
            seen.add((layer, head))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or abs(value) > MAX_BIAS:
                raise KvcFormatError(f"{we}: value must be a finite number of magnitude at most {MAX_BIAS:g}")
            if not isinstance(keys, list) or not keys:
                raise KvcFormatError(f"{we}: keys must be a non-empty list of [start, end) token ranges")
            n_ranges += len(keys)
            if n_ranges > MAX_BIAS_RANGES:
                raise KvcFormatError(f"{w}: more than {MAX_BIAS_RANGES} token ranges")
            at, rs = 0, []
            for r in keys:
                if not (isinstance(r, list) and len(r) == 2 and is_int(r[0]) and is_int(r[1])
                        and at <= r[0] < r[1] <= context_tokens):
                    raise KvcFormatError(f"{we}: key ranges must be sorted, disjoint, non-empty [start, end) within "
                                         f"the {context_tokens} context tokens")
                at = r[1]
                rs.append((r[0], r[1]))
            out.append(BiasEntry(layer, head, float(value), tuple(rs)))
        return cls(int(heads), tuple(out))

    @classmethod
    def outside(cls, attention_heads: int, heads: Sequence[tuple[int, int]], value: float,
                spans: Sequence[tuple[int, int]], context_tokens: int) -> "AttentionBias":
        """PASTA's bias: ``value`` on every context key *outside* the sorted, disjoint ``spans``, for ``heads``."""
        rest, at = [], 0
        for a, b in spans:
            if a > at:
                rest.append((at, a))
            at = b
        if at < context_tokens:
            rest.append((at, context_tokens))
        entries = tuple(BiasEntry(int(layer), int(h), float(value), tuple(rest)) for layer, h in sorted(set(heads)))
        return cls(attention_heads, entries)

    def layers(self) -> list[int]:
        return sorted({e.layer for e in self.entries})

    def dense(self, layer: int, context_tokens: int) -> np.ndarray:
        """Layer ``layer``'s bias, float32 [attention_heads, context_tokens] (zeros where unbiased)."""
        out = np.zeros((self.attention_heads, context_tokens), np.float32)
        for e in self.entries:
            if e.layer == layer:
                for a, b in e.keys:
                    out[e.head, a:b] = e.value
        return out
