"""``demo-xor``: a CPU decoder for the pipeline ``raw -> xor_demo`` that undoes both stages in one step.

It counts the chunks it decodes (CALLS), so a test can tell it was the decoder picked."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcodec.core.stage import ArraySpec, ChunkContext, Pipeline, SideData
from kvcodec.decode.registry import Backend

CALLS: list[str] = []


def supports(pipeline: Pipeline, spec: ArraySpec) -> bool:
    return [s.name for s in pipeline.stages] == ["raw", "xor_demo"] and not pipeline.bytes_stage.get_config()


def decode(pipeline: Pipeline, payload: Any, sides: list[SideData], sizes: list[int], spec: ArraySpec,
           ctx: ChunkContext) -> np.ndarray:
    key = pipeline.stages[1].get_config()["key"]
    raw = np.frombuffer(payload, dtype=np.uint8) ^ np.uint8(key)
    CALLS.append(f"layer {ctx.layer} {ctx.kind}")
    return raw.view(np.dtype(spec.dtype).newbyteorder("<")).astype(spec.dtype).reshape(spec.shape)


BACKEND = Backend("demo-xor", "cpu", 50, __name__, "supports", "decode",
                  summary="raw -> xor_demo (kvc-demo-plugin): one XOR and a view")
