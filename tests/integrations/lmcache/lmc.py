"""Helpers for the LMCache tests: real SmolLM2 KV chunks, and LMCache's own L1 manager, L2 adapter factory,
config parser and serde wrapper, driven the way its storage manager drives them (lmcache 0.5.6).

Nothing here re-implements LMCache: the adapters are built from the same ``--l2-adapter`` JSON LMCache parses
(``parse_args_to_l2_adapters_config``), wrapped as ``StorageManager`` wraps them (``SerdeL2AdapterWrapper`` around
``create_l2_adapter`` with ``create_serde_processor``), and fed ``MemoryObj`` buffers from a real ``L1Manager``.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
from lmcache.v1.distributed.error import L1Error
from lmcache.v1.distributed.l1_manager import L1Manager
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import add_l2_adapters_args, parse_args_to_l2_adapters_config
from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
from lmcache.v1.distributed.serde import create_serde_processor

MODEL_NAME = "HuggingFaceTB/SmolLM2-135M"  # what LMCache's ObjectKey carries; the serde maps it to "smollm2"
TAG = "test"
CHUNK = 32  # tokens per LMCache chunk in these tests


def real_chunks(lm: Any, n_chunks: int, chunk_tokens: int, dtype: torch.dtype = torch.bfloat16) -> tuple[Any, list[torch.Tensor]]:
    """The model's KV of a real text, cut into LMCache KV_2LTD chunks [2, L, T, H*D] (as vLLM hands them)."""
    from kvcodec.models.capture import capture
    from kvcodec.texts import load_text

    cache = capture(lm, text=load_text("gpl3"), max_tokens=n_chunks * chunk_tokens)
    fp = lm.fingerprint
    h, d = fp.num_kv_heads, fp.head_dims[0]
    out = []
    for c in range(n_chunks):
        s = slice(c * chunk_tokens, (c + 1) * chunk_tokens)
        k = torch.stack([x[:, s].transpose(0, 1).reshape(chunk_tokens, h * d) for x in cache.keys])
        v = torch.stack([x[:, s].transpose(0, 1).reshape(chunk_tokens, h * d) for x in cache.values])
        out.append(torch.stack([k, v]).to(dtype).contiguous())
    return cache, out


def key(i: int, model: str = MODEL_NAME, salt: str = "") -> ObjectKey:
    return ObjectKey(chunk_hash=i.to_bytes(8, "big") + b"chunkhash", model_name=model, kv_rank=0, cache_salt=salt)


def l1_manager(size: int = 512 << 20) -> L1Manager:
    mem = L1MemoryManagerConfig(size_in_bytes=size, use_lazy=False, shm_name="")
    return L1Manager(L1ManagerConfig(memory_config=mem))


def adapter(spec: dict[str, Any], l1: L1Manager) -> Any:
    """The L2 adapter LMCache's storage manager builds from one ``--l2-adapter`` JSON spec (serde-wrapped if the
    spec has a ``serde`` dict)."""
    parser = add_l2_adapters_args(argparse.ArgumentParser())
    cfg = parse_args_to_l2_adapters_config(parser.parse_args(["--l2-adapter", json.dumps(spec)])).adapters[0]
    inner = create_l2_adapter(cfg)
    if cfg.serde_config is None:
        return inner
    return SerdeL2AdapterWrapper(inner=inner, serde=create_serde_processor(cfg.serde_config), l1_manager=l1)


def layout(t: torch.Tensor) -> MemoryLayoutDesc:
    return MemoryLayoutDesc(shapes=[t.shape], dtypes=[t.dtype])


def l1_objects(l1: L1Manager, keys: list[ObjectKey], lay: MemoryLayoutDesc) -> list[Any]:
    got = l1.reserve_write(keys, [False] * len(keys), lay, tag=TAG)
    objs = []
    for k in keys:
        err, obj = got[k]
        assert err == L1Error.SUCCESS, err
        objs.append(obj)
    return objs


def wait(poll: Any, timeout: float = 120.0) -> Any:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        r = poll()
        if r is not None:
            return r
        time.sleep(0.01)
    raise AssertionError("LMCache task did not complete")


def store(ad: Any, l1: L1Manager, keys: list[ObjectKey], tensors: list[torch.Tensor]) -> bool:
    """Store chunks through ``ad`` from L1 buffers; True if LMCache reports the task successful."""
    objs = l1_objects(l1, keys, layout(tensors[0]))
    for o, t in zip(objs, tensors):
        o.tensor.copy_(t)
    l1.finish_write(keys, tag=TAG)
    tid = ad.submit_store_task(keys, objs)
    res = wait(lambda: ad.pop_completed_store_tasks().get(tid))
    l1.delete(keys, force=True)
    return bool(res.is_successful())


def lookup(ad: Any, keys: list[ObjectKey], lay: MemoryLayoutDesc) -> list[bool]:
    tid = ad.submit_lookup_and_lock_task(keys, {0: lay})
    bm = wait(lambda: ad.query_lookup_and_lock_result(tid))
    ad.submit_unlock(keys)
    return [bm.test(i) for i in range(len(keys))]


def load(ad: Any, l1: L1Manager, keys: list[ObjectKey], like: torch.Tensor) -> tuple[list[bool], list[torch.Tensor]]:
    """Load ``keys`` through ``ad`` into fresh L1 buffers (NaN-filled first); the hit bitmap and the tensors."""
    objs = l1_objects(l1, keys, layout(like))
    for o in objs:
        o.tensor.fill_(float("nan"))
    tid = ad.submit_load_task(keys, objs)
    bm = wait(lambda: ad.query_load_result(tid))
    out = [o.tensor.clone() for o in objs]
    l1.finish_write(keys, tag=TAG)
    l1.delete(keys, force=True)
    return [bm.test(i) for i in range(len(keys))], out
