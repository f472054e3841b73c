"""The vLLM connector's process-wide state and plain records, apart from vLLM's classes (issue 56: the connector
module held its counters, shared stores, specs and the connector itself in 667 lines).

Why a module of its own: the scheduler and worker roles may share a process, so the counters, the stores opened
per (URL, memory size) and the model fingerprints are per process, not per connector; and the load/save specs are
plain records the scheduler hands the worker. Nothing here imports vLLM.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcodec.errors import KvcError, KvcInputError
from kvcodec.integrations.vllm.config import ConnectorConfig, fingerprint_from_dir

# Process-wide counters (scheduler and worker may share a process); tests and
# the benchmark read them. Keys: lookups, matched_tokens, loaded_tokens,
# loaded_chunks, rejected_chunks, load_errors, saved_chunks, save_errors,
# save_bytes, load_s, save_s.
STATS: dict[str, float] = {}
_STATS_LOCK = threading.Lock()


def _count(name: str, n: float = 1) -> None:
    with _STATS_LOCK:
        STATS[name] = STATS.get(name, 0) + n


def reset_stats() -> None:
    with _STATS_LOCK:
        STATS.clear()


_STORES: dict[tuple[str, Any], Any] = {}
_FPS: dict[str, Any] = {}
_SHARED_LOCK = threading.Lock()


def _open_store(cfg: ConnectorConfig) -> Any:
    """One Store per (URL, memory size) per process, shared by the scheduler and worker roles."""
    from kvcodec.store import Store

    k = (cfg.store_url, cfg.memory_bytes)
    with _SHARED_LOCK:
        st = _STORES.get(k)
        if st is None:
            try:
                st = Store.open(cfg.store_url, memory_bytes=cfg.memory_bytes)
            except KvcError as e:
                raise KvcInputError(f"kvcodec connector: cannot open store_url {cfg.store_url!r}: {e}") from None
            _STORES[k] = st
        return st


def _model_fingerprint(model_dir: str) -> Any:
    with _SHARED_LOCK:
        fp = _FPS.get(model_dir)
        if fp is None:
            fp = fingerprint_from_dir(model_dir)
            _FPS[model_dir] = fp
        return fp


@dataclass
class LoadSpec:
    req_id: str
    token_ids: list[int]      # prompt ids up to `end`
    keys: list[Any]           # StoreKey of every chunk covering [0, end)
    start: int                # first token to write (vLLM computed the ones before)
    end: int                  # one past the last token to write (chunk multiple)
    slots: torch.Tensor       # slot ids of tokens [start, end)


@dataclass
class SaveSpec:
    req_id: str
    token_ids: list[int]      # prompt ids up to `end`
    key: Any                  # StoreKey of chunk [start, end)
    start: int
    end: int
    slots: torch.Tensor       # slot ids of tokens [start, end)


@dataclass
class _ReqState:
    prompt: list[int]
    block_ids: list[int]
    saved_upto: int = 0       # prompt tokens known stored (or handed to the worker to store)


def _slots(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    t = np.arange(start, end, dtype=np.int64)
    b = np.asarray(block_ids, dtype=np.int64)
    if end > len(block_ids) * block_size:
        raise KvcInputError(f"kvcodec connector: tokens up to {end} need {-(-end // block_size)} blocks, "
                            f"the request has {len(block_ids)}")
    return torch.from_numpy(b[t // block_size] * block_size + t % block_size)


