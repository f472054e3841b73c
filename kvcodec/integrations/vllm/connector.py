"""``KvcodecConnector``: vLLM V1 KV connector backed by `.kvc` files in a kvcodec store.

Enable with::

    vllm serve MODEL_DIR --kv-transfer-config '{"kv_connector": "KvcodecConnector",
        "kv_connector_module_path": "kvcodec.integrations.vllm.connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"store_url": "/var/cache/kvc", "preset": "lossless"}}'

(``kvcodec/integrations/vllm/config.py`` documents every option and the store layout.)

Scheduler side: ``get_num_new_matched_tokens`` looks up the longest run of
stored chunks at the start of the prompt (whole chunks, a multiple of the
block size, leaving at least one prompt token to compute), re-checks each
chunk's `.kvc` header by a ranged read (model fingerprint, token ids,
positions, shapes) and reports the tokens beyond vLLM's own prefix-cache
hit. ``build_connector_meta`` hands the worker what to load (keys, token
range, slots) and which newly computed whole chunks to save.

Worker side: ``start_load_kv`` fetches the entries and starts a background
thread that decodes them layer by layer, on the paged cache's device
(the GPU decoders on a GPU engine, the CPU ones on vLLM-CPU). Where the
attention backend keeps vLLM's standard layout (``entries.paged_views``
proves it through the backend's own op: FlashAttention, Triton attention),
each chunk is decoded **straight into the request's blocks**
(``entries.write_paged_layer``, ``decode_chunk_into``) on a side CUDA stream,
and ``wait_for_layer_load`` (called by each attention layer before it runs)
only makes the forward's stream wait for that layer. Otherwise (vLLM-CPU)
``wait_for_layer_load`` writes the decoded K/V into the paged cache **through
the attention backend's own cache-update op** (``impl.do_kv_cache_update``;
on CPU that is ``cpu_attn_reshape_and_cache``, which packs tiles inside each
block).
``save_kv_layer`` copies the K/V of chunks to save out of the paged cache
(through a gather map learnt from the same op, so any block layout works)
and ``wait_for_save`` encodes each chunk with the configured preset and puts
it into the store. A stored chunk that cannot be used (corrupt, vanished,
undecodable, another model's, or needing a calibration this machine lacks)
is a miss: the scheduler's header check skips it, and the worker reports
one that fails to load through ``get_block_ids_with_load_errors`` (vLLM
then recomputes or fails the request, per ``kv_load_failure_policy``); either
way it is evicted with one warning, so the next request with that prefix
computes it and the connector saves a good entry in its place. A chunk that
fails to save is logged and simply stays a miss.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcodec.errors import KvcError, KvcInputError
from kvcodec.integrations.vllm.config import ConnectorConfig, LAYOUT, chunk_keys, config_digest, matchable_tokens, savable_tokens
from kvcodec.integrations.vllm.config import _natural, leading_run
from kvcodec.integrations.hf import decode_device, device_scope
from kvcodec.integrations.vllm.entries import (
    ChunkUnreadable, block_table, decode_chunk_layers, encode_chunk, evict_unreadable, fetch_chunk, for_cache, learn_gather_map,
    next_layer, paged_views, resolve_save_preset, usable_run, write_paged_layer,
)

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

from kvcodec.integrations.vllm.state import (  # noqa: F401  (STATS, reset_stats, _FPS: read by tests and bench_vllm)
    _FPS, STATS, LoadSpec, SaveSpec, _count, _model_fingerprint, _open_store, _ReqState, _slots, reset_stats,
)

log = logging.getLogger("kvcodec.integrations.vllm")

@dataclass
class KvcodecConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


# --------------------------------------------------------------------------- the connector
class KvcodecConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = getattr(self._kv_transfer_config, "kv_connector_extra_config", None) or {}
        self.cfg = ConnectorConfig.from_extra(extra)
        self.block_size = int(vllm_config.cache_config.block_size)
        self.cfg.check_block_size(self.block_size)
        kv_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
        if kv_dtype != "auto":
            raise KvcInputError(f"kvcodec connector: kv_cache_dtype={kv_dtype!r} is not supported (use 'auto'); "
                                "a quantized paged cache cannot be filled bit-exactly from decoded KV")
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None and len(groups) != 1:
            raise KvcInputError(f"kvcodec connector: models with {len(groups)} KV cache groups (hybrid/sliding "
                                "window mixes) are not supported; only one full-attention group")
        model_dir = str(vllm_config.model_config.model)
        if not Path(model_dir).is_dir():
            raise KvcInputError(f"kvcodec connector: model {model_dir!r} is not a local HF directory; the store "
                                "key needs the model fingerprint computed from its files")
        self.fingerprint = _model_fingerprint(model_dir)
        # the preset named (a lossy one without a calibration: refused here, not once per chunk, issue 59), or the
        # default: faithful where the model has a calibration, else lossless with a warning (issue 53)
        self.preset: str = resolve_save_preset(self.fingerprint, self.cfg.preset, model_dir, self.cfg.save)
        self.cfg = replace(self.cfg, preset=self.preset)
        self.model_id = self.cfg.model_id or self.fingerprint.id
        self.codec = self.cfg.codec_id
        self.store = _open_store(self.cfg)
        try:  # fail at startup, not at the first request, when a tier is unreachable
            self.store.contains_many(chunk_keys([0] * self.cfg.chunk_tokens, self.cfg.chunk_tokens, model=self.model_id,
                                                codec=self.codec, namespace=self.cfg.namespace,
                                                chunk_tokens=self.cfg.chunk_tokens))
        except KvcError as e:
            raise KvcInputError(f"kvcodec connector: store {self.cfg.store_url!r} is not usable: {e}") from None
        log.info("kvcodec connector (%s): store=%s preset=%s namespace=%s chunk=%d block=%d model=%s config=%s",
                 role.name, self.cfg.store_url, self.cfg.preset, self.cfg.namespace, self.cfg.chunk_tokens,
                 self.block_size, self.model_id, config_digest(self.cfg))
        # scheduler state
        self._lookups: dict[str, tuple[int, list[Any]]] = {}
        self._pending_loads: dict[str, tuple[int, int]] = {}  # req -> (start, end)
        self._reqs: dict[str, _ReqState] = {}
        # worker state
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layer_names: list[str] = []
        self._layer_index: dict[str, int] = {}
        self._layers: dict[str, Any] = {}
        self._loader: _LayerLoader | None = None
        self._gather_maps: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._captured: dict[tuple[str, int], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self._load_errors: set[int] = set()

    # ------------------------------------------------------------------ scheduler side
    def _key_args(self) -> dict[str, Any]:
        return dict(model=self.model_id, codec=self.codec, namespace=self.cfg.namespace, chunk_tokens=self.cfg.chunk_tokens)

    def _lookup(self, ids: list[int]) -> tuple[int, list[Any]]:
        """Stored, header-checked chunks covering the start of ``ids`` (whole chunks, < len(ids))."""
        limit = matchable_tokens(len(ids), self.cfg.chunk_tokens)
        keys = chunk_keys(ids, limit, **self._key_args())
        if not keys:
            return 0, []
        try:
            n = leading_run(self.store.contains_many(keys))
        except KvcError as e:
            log.warning("kvcodec connector: store lookup failed (%s); treating as a miss", e)
            return 0, []
        good = usable_run(self.store, keys[:n], self.fingerprint, ids, self.cfg.chunk_tokens)  # evicts a bad one
        if good < n:
            _count("rejected_chunks")
        return good * self.cfg.chunk_tokens, keys[:good]

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.cfg.load:
            return 0, False
        ids = list(request.prompt_token_ids or [])
        if getattr(request, "mm_features", None):
            return 0, False  # multimodal prompts: placeholder ids do not identify the KV
        _count("lookups")
        matched, keys = self._lookup(ids)
        self._lookups[request.request_id] = (matched, keys)
        if matched < max(self.cfg.min_load_tokens, 1) or matched <= num_computed_tokens:
            return 0, False
        _count("matched_tokens", matched - num_computed_tokens)
        return matched - num_computed_tokens, False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        matched, _ = self._lookups.get(request.request_id, (0, []))
        if matched <= 0 or num_external_tokens > matched:
            log.warning("kvcodec connector: asked to load %d tokens for %s without a lookup; ignoring",
                        num_external_tokens, request.request_id)
            return
        self._pending_loads[request.request_id] = (matched - num_external_tokens, matched)

    def _take_load(self, req_id: str, ids: list[int], block_ids: list[int]) -> LoadSpec | None:
        rng = self._pending_loads.pop(req_id, None)
        if rng is None:
            return None
        start, end = rng
        _, keys = self._lookups.get(req_id, (0, []))
        keys = keys[: end // self.cfg.chunk_tokens]
        return LoadSpec(req_id, ids[:end], keys, start, end, _slots(block_ids, start, end, self.block_size))

    def _saves_for(self, req_id: str, st: _ReqState, computed: int) -> list[SaveSpec]:
        if not self.cfg.save:
            return []
        C = self.cfg.chunk_tokens
        upto = min(savable_tokens(len(st.prompt), C), (computed // C) * C)
        if upto <= st.saved_upto:
            return []
        keys = chunk_keys(st.prompt, upto, **self._key_args())
        todo = list(range(st.saved_upto // C, upto // C))
        try:
            have = self.store.contains_many([keys[i] for i in todo])
        except KvcError:
            have = [False] * len(todo)
        out = []
        for i, h in zip(todo, have):
            if not h:
                out.append(SaveSpec(req_id, st.prompt[: (i + 1) * C], keys[i], i * C, (i + 1) * C,
                                    _slots(st.block_ids, i * C, (i + 1) * C, self.block_size)))
        st.saved_upto = upto
        return out

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KvcodecConnectorMetadata()
        nsched = scheduler_output.num_scheduled_tokens
        for nr in scheduler_output.scheduled_new_reqs:
            ids = list(nr.prompt_token_ids or [])
            st = _ReqState(ids, list(nr.block_ids[0]) if nr.block_ids else [])
            self._reqs[nr.req_id] = st
            ld = self._take_load(nr.req_id, ids, st.block_ids)
            if ld is not None:
                meta.loads.append(ld)
            matched, _ = self._lookups.pop(nr.req_id, (0, []))
            st.saved_upto = matched  # those chunks are in the store already
            if not getattr(nr, "mm_features", None):
                meta.saves += self._saves_for(nr.req_id, st, nr.num_computed_tokens + nsched.get(nr.req_id, 0))
        cr = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cr.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            nb = cr.new_block_ids[i]
            if nb is not None:
                if req_id in cr.resumed_req_ids:
                    st.block_ids = list(nb[0])
                else:
                    st.block_ids += list(nb[0])
            ld = self._take_load(req_id, st.prompt, st.block_ids)
            if ld is not None:
                meta.loads.append(ld)
            self._lookups.pop(req_id, None)
            meta.saves += self._saves_for(req_id, st, cr.num_computed_tokens[i] + nsched.get(req_id, 0))
        for req_id in scheduler_output.finished_req_ids:
            self._forget(req_id)
        return meta

    def _forget(self, req_id: str) -> None:
        self._reqs.pop(req_id, None)
        self._lookups.pop(req_id, None)
        self._pending_loads.pop(req_id, None)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None  # saves are copied out synchronously: blocks may be freed now

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = dict(kv_caches)
        self._layer_names = sorted(kv_caches, key=_natural)
        if len(self._layer_names) != self.fingerprint.num_layers:
            raise KvcInputError(f"kvcodec connector: vLLM has {len(self._layer_names)} attention KV caches, the model "
                                f"fingerprint {self.fingerprint.num_layers} layers (shared-KV layers are not supported)")
        self._layer_index = {n: i for i, n in enumerate(self._layer_names)}

    def _layer(self, name: str, forward_context: Any = None) -> Any:
        lay = self._layers.get(name)
        if lay is None:
            ctx = getattr(forward_context, "no_compile_layers", None) or \
                self._vllm_config.compilation_config.static_forward_context
            lay = ctx[name]
            if not hasattr(getattr(lay, "impl", None), "do_kv_cache_update"):
                raise KvcInputError(f"kvcodec connector: the attention backend of {name} has no do_kv_cache_update op; "
                                    "cannot write KV through the backend")
            self._layers[name] = lay
        return lay

    def _kv_cache(self, name: str) -> torch.Tensor:
        lay = self._layers.get(name)
        kv = getattr(lay, "kv_cache", None) if lay is not None else None
        if isinstance(kv, (list, tuple)):
            kv = kv[0]
        return kv if isinstance(kv, torch.Tensor) else self._kv_caches[name]

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvcodecConnectorMetadata)
        if self._loader is not None:  # a previous step's loader not fully consumed
            self._loader.close()
            self._loader = None
        if not meta.loads:
            return
        for n in self._layer_names:
            self._layer(n, forward_context)
        self._loader = _LayerLoader(self, meta.loads)

    def wait_for_layer_load(self, layer_name: str) -> None:
        ld = self._loader
        if ld is None:
            return
        i = self._layer_index.get(layer_name)
        if i is not None:
            ld.write_layer(i)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvcodecConnectorMetadata) or not meta.saves:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        try:
            views = self._paged_views(layer_name, kv_layer)
            if views is None:
                gk, gv = self._gather_map(layer_name, kv_layer)
                flat = kv_layer.reshape(kv_layer.shape[0], -1)
            for s in meta.saves:
                slots = s.slots.to(kv_layer.device)
                b = slots // self.block_size
                o = slots % self.block_size
                if views is not None:  # the standard layout: K/V of token t at views[0|1][block, offset]
                    k, v = views[0][b, o], views[1][b, o]  # [T, H, D]
                else:
                    k = flat[b[:, None, None], gk[o]]  # [T, H, D]
                    v = flat[b[:, None, None], gv[o]]
                # the encoder runs on the host: a saved chunk is copied there once
                self._captured.setdefault((s.req_id, s.start), {})[i] = (k.transpose(0, 1).contiguous().cpu(),
                                                                        v.transpose(0, 1).contiguous().cpu())
        except Exception as e:  # saving is best effort: never break the forward
            _count("save_errors")
            log.warning("kvcodec connector: cannot capture layer %s for saving: %s", layer_name, e)
            for s in meta.saves:
                self._captured.pop((s.req_id, s.start), None)

    def wait_for_save(self) -> None:
        if self._loader is not None:
            self._loader.finish()  # layers whose wait_for_layer_load never came (should not happen)
            self._load_errors |= self._loader.failed_blocks
            self._loader = None
        if not self.has_connector_metadata():
            self._captured.clear()
            return
        meta = self._get_connector_metadata()
        saves = meta.saves if isinstance(meta, KvcodecConnectorMetadata) else []
        for s in saves:
            layers = self._captured.pop((s.req_id, s.start), None)
            if layers is None or len(layers) != len(self._layer_names):
                continue
            t0 = time.perf_counter()
            try:
                data = encode_chunk(self.fingerprint, self.preset, s.token_ids, s.start, s.end,
                                    [layers[i][0] for i in range(len(layers))], [layers[i][1] for i in range(len(layers))])
                self.store.put(s.key, data, {"layout": LAYOUT, "start": s.start, "end": s.end,
                                             "preset": self.preset})
                _count("saved_chunks")
                _count("save_bytes", len(data))
            except Exception as e:
                _count("save_errors")
                log.warning("kvcodec connector: saving chunk %s failed: %s", s.key, e)
            _count("save_s", time.perf_counter() - t0)
        self._captured.clear()

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.close()
            self._loader = None

    # ------------------------------------------------------------------ layout via the backend op
    def _paged_views(self, name: str, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``kv``'s K/V as (num_blocks, block_size, H, D) views when the backend keeps vLLM's standard layout
        (probed once per layer through its own op, :func:`entries.paged_views`), else None."""
        if name not in self._views:
            self._views[name] = paged_views(self._layer(name), kv, self.block_size, self.fingerprint.num_kv_heads,
                                            self.fingerprint.head_dims[0])
        got = self._views[name]
        if got is not None and got[0].data_ptr() != kv[0].data_ptr():  # vLLM handed another tensor: re-view it
            got = (kv[0], kv[1])
        return got

    def _gather_map(self, name: str, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per block offset o: flat indices (within one block) of K[o, h, d] and V[o, h, d].

        Learnt by running the backend's own cache-update op on a one-block
        scratch cache with K/V holding their own indices (in digits exact in
        the cache dtype), so packed/tiled block layouts need no knowledge here.
        """
        lay = self._layer(name)
        key = (tuple(kv.shape[1:]), kv.dtype, str(getattr(lay, "isa", "")), type(lay.impl).__name__)
        m = self._gather_maps.get(key)
        if m is None:
            m = learn_gather_map(lay, kv, self.block_size, self.fingerprint.num_kv_heads, self.fingerprint.head_dims[0])
            self._gather_maps[key] = m
        return m


class _LayerLoader:
    """Fetches and decodes the step's loads in a background thread, layer by layer."""

    def __init__(self, conn: KvcodecConnector, loads: list[LoadSpec]) -> None:
        self.conn = conn
        self.loads = loads
        self.n_layers = len(conn._layer_names)
        names = conn._layer_names
        kv0 = conn._kv_cache(names[0])
        self.device = kv0.device
        self.backend = decode_device(self.device, None)  # decode where the paged cache is
        # straight into the blocks: GPU decoders, the standard layout, on every layer
        views = [conn._paged_views(n, conn._kv_cache(n)) for n in names] if self.backend == "gpu" else []
        self.views: list[tuple[torch.Tensor, torch.Tensor]] | None = \
            [v for v in views if v is not None] if views and all(v is not None for v in views) else None
        self.kv_dtype = str(kv0.dtype).removeprefix("torch.")
        # a side stream for the background decode, ordered after everything the forward queued so far (the
        # blocks it fills may have been read by an earlier step); each layer's event orders the forward after it
        self.stream = None
        if self.device.type == "cuda":
            self.stream = torch.cuda.Stream(self.device)
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        self.events: dict[int, Any] = {}
        self.ready: dict[int, list[tuple[LoadSpec, torch.Tensor, torch.Tensor]]] = {}
        self.failed: set[str] = set()       # req ids whose load failed
        self.failed_blocks: set[int] = set()
        self.written: set[int] = set()
        self.done_upto = -1
        self.cv = threading.Condition()
        self.stop = False
        self.t0 = time.perf_counter()
        self.thread = threading.Thread(target=self._run, name="kvcodec-load", daemon=True)
        self.thread.start()

    def _fail(self, ld: LoadSpec, why: str) -> None:
        log.error("kvcodec connector: loading %d tokens for request %s failed (%s); reporting the blocks to vLLM",
                  ld.end - ld.start, ld.req_id, why)
        _count("load_errors")
        self.failed.add(ld.req_id)
        bs = self.conn.block_size
        self.failed_blocks |= {int(s) // bs for s in ld.slots.tolist()}

    def _run(self) -> None:
        stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        with device_scope(self.device), stream:
            self._decode_all()

    def _direct(self, parts: list[tuple[Any, int, int, Any]]) -> bool:
        """Whether a load's entries go straight into the paged blocks (else through staging tensors)."""
        return self.views is not None and all(r.header.dtype == self.kv_dtype for r, _, _, _ in parts)

    def _decode_all(self) -> None:
        C = self.conn.cfg.chunk_tokens
        store = self.conn.store
        per_req: list[tuple[LoadSpec, list[tuple[Any, int, int, Any]]]] = []
        try:
            for ld in self.loads:
                parts = []
                try:
                    for j, key in enumerate(ld.keys):
                        cs, ce = j * C, (j + 1) * C
                        if ce <= ld.start:
                            continue
                        parts.append((fetch_chunk(store, key, self.conn.fingerprint, ld.token_ids, cs, ce), cs, ce, key))
                except ChunkUnreadable as e:  # corrupt, vanished, another model's or prefix's: evict, vLLM recomputes
                    evict_unreadable(store, e)
                    self._fail(ld, str(e))
                    continue
                except Exception as e:
                    self._fail(ld, str(e))
                    continue
                per_req.append((ld, parts))
            direct = {ld.req_id: (block_table(ld.slots, ld.start, ld.end, self.conn.block_size, self.device), parts)
                      for ld, parts in per_req if self._direct(parts)}
            iters = [(ld, [(decode_chunk_layers(r, cs, ce, self.backend), cs, key) for r, cs, ce, key in parts])
                     for ld, parts in per_req if ld.req_id not in direct]
            for layer in range(self.n_layers):
                out = []
                for ld, _parts in per_req:
                    if ld.req_id not in direct or ld.req_id in self.failed:
                        continue
                    table, parts = direct[ld.req_id]
                    try:
                        assert self.views is not None
                        for r, cs, ce, key in parts:
                            try:
                                write_paged_layer(r, layer, self.views[layer], table, cs, ce, ld.start)
                            except KvcInputError:  # this side's fault (a block table), not the entry's: no eviction
                                raise
                            except KvcError as e:  # undecodable (corrupt chunk, calibration missing here)
                                raise ChunkUnreadable(key, f"layer {layer} undecodable: {e}") from None
                    except ChunkUnreadable as e:
                        evict_unreadable(store, e)
                        self._fail(ld, str(e))
                    except Exception as e:
                        self._fail(ld, str(e))
                for ld, its in iters:
                    if ld.req_id in self.failed:
                        continue
                    try:
                        ks, vs = [], []
                        for it, cs, key in its:
                            k, v = next_layer(it, key, layer)
                            lo = max(ld.start - cs, 0)
                            ks.append(k[lo:])
                            vs.append(v[lo:])
                        out.append((ld, torch.cat(ks), torch.cat(vs)))
                    except ChunkUnreadable as e:  # undecodable (corrupt chunk, calibration missing here)
                        evict_unreadable(store, e)
                        self._fail(ld, str(e))
                    except Exception as e:
                        self._fail(ld, str(e))
                event = None
                if self.stream is not None:
                    event = torch.cuda.Event()
                    event.record(self.stream)
                with self.cv:
                    if self.stop:
                        return
                    self.ready[layer] = out
                    self.events[layer] = event
                    self.done_upto = layer
                    self.cv.notify_all()
        except Exception as e:  # pragma: no cover - defensive
            for ld in self.loads:
                self._fail(ld, f"loader crashed: {e}")
        finally:
            with self.cv:
                self.done_upto = self.n_layers
                self.cv.notify_all()

    def write_layer(self, layer: int) -> None:
        if layer in self.written:
            return
        with self.cv:
            while self.done_upto < layer and layer not in self.ready:
                self.cv.wait()
            items = self.ready.pop(layer, [])
            event = self.events.pop(layer, None)
        self.written.add(layer)
        main = None
        if event is not None:  # the layer's direct writes and staged tensors come from the side stream
            main = torch.cuda.current_stream(self.device)
            main.wait_event(event)
        name = self.conn._layer_names[layer]
        lay = self.conn._layer(name)
        kv = self.conn._kv_cache(name)
        for ld, k, v in items:
            if ld.req_id in self.failed:
                continue
            try:
                if main is not None and k.is_cuda:  # made on the side stream, read on the forward's: kept until it has
                    k.record_stream(main)
                    v.record_stream(main)
                k, v = for_cache(k, kv), for_cache(v, kv)  # refuses values past the engine dtype's range
                lay.impl.do_kv_cache_update(lay, k, v, kv, ld.slots.to(kv.device))
            except Exception as e:
                self._fail(ld, f"cache update of layer {layer}: {e}")
        if layer == self.n_layers - 1:
            self._finish_stats()

    def _finish_stats(self) -> None:
        for ld in self.loads:
            if ld.req_id not in self.failed:
                _count("loaded_tokens", ld.end - ld.start)
                _count("loaded_requests")
        _count("load_s", time.perf_counter() - self.t0)

    def finish(self) -> None:
        for layer in range(self.n_layers):
            if layer not in self.written:
                self.write_layer(layer)
        self.thread.join()

    def close(self) -> None:
        with self.cv:
            self.stop = True
            self.cv.notify_all()
        self.thread.join(timeout=5)
