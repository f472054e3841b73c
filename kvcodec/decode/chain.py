"""The transform-codec pipeline shape that the fused decoders (CPU and GPU) run in one pass.

    [rope] -> [keep] -> transform -> [tokenscale] -> quantize(step; v1, or v2's 16-bit codes) -> rans (v1 or v2)

(array stages in encode order; bracketed ones optional). Every lossy preset
builds this shape (kvcodec/plan/presets.py). A pipeline of any other shape is
decoded stage by stage, which is the normative definition anyway; the fused
decoders only reorganise the same operations.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvcodec.codecs.rans import RansBankStage, RansStage
from kvcodec.core.stage import Pipeline
from kvcodec.codecs.keep import KeepStage
from kvcodec.codecs.quantize import QuantizeStage, WideQuantizeStage
from kvcodec.codecs.rope import RopeStage
from kvcodec.codecs.transform import TransformStage
from kvcodec.codecs.tokenscale import TokenScaleStage

__all__ = ["TransformChain", "match_chain"]


@dataclass(frozen=True)
class TransformChain:
    """The stages of a fusable pipeline, by role."""

    rope: RopeStage | None
    keep: KeepStage | None
    transform: TransformStage
    tokenscale: TokenScaleStage | None
    quantize: QuantizeStage
    rans: RansStage

    def index(self) -> dict[str, int]:
        """Position in the pipeline (= in a chunk's side-data list) of each present role."""
        roles = ("rope", "keep", "transform", "tokenscale", "quantize", "rans")
        return {r: i for i, r in enumerate(r for r in roles if getattr(self, r) is not None)}


def match_chain(pipeline: Pipeline) -> TransformChain | None:
    """The pipeline's :class:`TransformChain`, or None when it has another shape."""
    st = list(pipeline.stages)
    if len(st) < 3:
        return None
    r, q = st[-1], st[-2]
    if (not isinstance(q, QuantizeStage) or type(q) not in (QuantizeStage, WideQuantizeStage) or q.mode != "step"
            or not isinstance(r, RansStage) or type(r) not in (RansStage, RansBankStage)):
        return None
    del st[-2:]
    ts = st.pop() if st and type(st[-1]) is TokenScaleStage else None
    tr = st.pop() if st else None
    if not isinstance(tr, TransformStage) or type(tr) is not TransformStage:
        return None
    rope = st.pop(0) if st and type(st[0]) is RopeStage else None
    keep = st.pop(0) if st and type(st[0]) is KeepStage else None
    if st:
        return None
    assert (rope is None or isinstance(rope, RopeStage)) and (keep is None or isinstance(keep, KeepStage))
    assert ts is None or isinstance(ts, TokenScaleStage)
    return TransformChain(rope, keep, tr, ts, q, r)
