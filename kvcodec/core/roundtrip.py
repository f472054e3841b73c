"""The round-trip probe: a cache encoded under a plan and decoded again, with no container.

Quality checks and target searches measure a plan by decoding right away and storing nothing; the
probe chunks and encodes each tensor the way :func:`kvcodec.format.writer.write_kvc` does (the plan's
attachments, layout and encoder inputs, the same pipeline table and chunk ranges) and decodes it with the
pipeline's normative decode, but writes no header, index or file.

Why in core, below the planner and the container: it needs only the plan and the pipelines (both core), and the
planner's check and target searches call it; in the container package the planner's probes went down into the
writer's package and back (issue 56).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvcodec.core.dtypes import f32_to_bf16, is_bf16, tensor_dtype
from kvcodec.core.stage import (
    MAX_PIPELINES, MAX_STAGES, ArraySpec, ExternalAttachment, PipelineSpec, Plan, chunk_context, chunk_ranges, pipeline_table,
)

if TYPE_CHECKING:  # importing the probe must not import torch
    from kvcodec.core.kvcache import KVCache


def roundtrip(cache: KVCache, plan: Plan | PipelineSpec) -> tuple[KVCache, int]:
    """``cache`` encoded under ``plan`` and decoded again, with no container: (decoded cache, payload bytes).

    For measurements that decode right away and store nothing (the quality check's probes, target
    searches). Each tensor is chunked as :func:`write_kvc` chunks it by default (the plan's
    ``chunk_tokens``, all heads per chunk), encoded with the same chunk contexts, and decoded by
    the pipeline's normative stage-by-stage decode, which every decoder a reader may pick matches
    bit for bit; so the decoded cache is the one a file of this plan would read back as. The byte
    count is the chunks' payloads and side data, without the header, index and padding.
    """
    import torch

    from kvcodec.core.kvcache import KVCache

    if not isinstance(plan, Plan):  # a bare pipeline is the plan of just that pipeline, as the writer takes it
        plan = Plan(plan)
    cache.validate()
    fp = cache.fingerprint
    T, L = cache.num_tokens, fp.num_layers
    table, pid = pipeline_table(plan.pipelines, L, max_stages=MAX_STAGES, max_pipelines=MAX_PIPELINES)
    positions = None if cache.positions is None else np.asarray(cache.positions, dtype=np.int64)
    arrays: dict[str, np.ndarray] = {}
    for name, a in (plan.attachments or {}).items():
        arr = a.array if isinstance(a, ExternalAttachment) else a
        if arr is not None:
            arrays[name] = arr
    tdtype = tensor_dtype(cache)
    nbytes, j = 0, 0
    out: dict[str, list[Any]] = {"k": [], "v": []}
    for layer in range(L):
        off = cache.layer_offset(layer)
        for kind, tensor in (("k", cache.keys[layer]), ("v", cache.values[layer])):
            p = table[pid[(layer, kind)]]
            inputs = plan.encoder_inputs(layer, kind) if plan.encoder_inputs is not None else {}
            t = tensor.detach().cpu()
            full = (t.float() if is_bf16(t) else t).contiguous().numpy()
            rows = []
            for t0, t1 in chunk_ranges(T - off, plan.chunk_tokens):
                arr = np.ascontiguousarray(full[:, t0:t1, :])
                ctx = chunk_context(layer, kind, t0 + off, t1 + off, 0, fp.num_kv_heads, positions, arrays, j, inputs)
                payload, sides, sizes = p.encode(arr, ctx)
                nbytes += len(payload) + sum(a.nbytes for side in sides for a in side.values())
                rows.append(np.ascontiguousarray(p.decode(payload, sides, sizes, ArraySpec(tuple(arr.shape), arr.dtype.name), ctx)))
                j += 1
            dec = torch.from_numpy(np.ascontiguousarray(rows[0] if len(rows) == 1 else np.concatenate(rows, axis=1)))
            out[kind].append(f32_to_bf16(dec) if tdtype == "bfloat16" else dec)
    return KVCache(out["k"], out["v"], cache.token_ids, fp, cache.positions, dict(cache.meta)), nbytes
