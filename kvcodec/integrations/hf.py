"""Load `.kvc` caches into HF transformers, decoding layer by layer.

:func:`load_cache` returns a ``DynamicCache`` whose layers are
:class:`LazyKvcLayer` objects (:class:`LazyKvcSlidingLayer`, transformers'
sliding-window layer class, for a model's sliding-window layers: the cache is
the one a fresh prefill leaves, :mod:`kvcodec.models.cachelayout`): each knows its
sequence length up front (so masks can be built before anything is decoded)
and decodes its K/V on first use. A background thread decodes layers in order ahead of the model, so
decoding layer i overlaps computing layer i-1 (the decoders spend their time
in numpy/numba/zstd code that releases the GIL).

The device contract: the cache lands on one device, the model's unless ``device=`` names
another, and layers are decoded there (:func:`decode_device`): on a CUDA model the Triton
kernels decode each layer on the GPU and the tensors never pass through the host; on a CPU model
the CPU decoders run, as they always have. Only an explicit ``backend`` that differs from the
device (``"cpu"`` for a CUDA model: one host-to-device copy per layer) crosses between them.

One line around ``generate``::

    out = kvcodec.integrations.hf.generate(lm, "doc.kvc", question_ids, max_new_tokens=32)
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np
import torch

from kvcodec.models.cachelayout import DynamicCache, LazyKvcLayer, LazyKvcSlidingLayer, cache_windows, check_layer_tokens, hf_cache
from kvcodec.errors import KvcInputError
from kvcodec.models.load import LoadedModel
from kvcodec.models.sdpa_schedule import fast_sdpa

__all__ = ["LazyKvcLayer", "LazyKvcSlidingLayer", "LoadedKvc", "decode_device", "device_scope", "generate", "greedy_from",
           "land", "load_cache", "model_device", "target_device"]


# --------------------------------------------------------------------------- the device contract
def model_device(lm: Any) -> torch.device:
    """Where ``lm`` (a LoadedModel, or anything with ``.model``) takes its inputs: its input embeddings' device
    (the first parameter's for a model without them; the CPU for one without parameters)."""
    model = getattr(lm, "model", lm)
    emb = getattr(model, "get_input_embeddings", None)
    try:
        w = getattr(emb(), "weight", None) if callable(emb) else None
        if isinstance(w, torch.Tensor):
            return w.device
    except Exception:  # noqa: BLE001 - a model without input embeddings: its parameters say
        pass
    p = next(iter(model.parameters()), None) if hasattr(model, "parameters") else None
    return p.device if p is not None else torch.device("cpu")


def decode_device(target: torch.device | str, backend: str | None = None) -> str:
    """The decoder (``"cpu"`` or ``"gpu"``, :mod:`kvcodec.decode.registry`) for a cache that must land on ``target``.

    ``backend`` (else ``$KVCODEC_BACKEND``) names one: it is used as given. ``None``/``"auto"`` decode where the
    cache lands: on the GPU for a CUDA target when Triton is present, on the CPU for a CPU target (never a
    device round trip for a CPU model, never a host round trip for a CUDA one).
    """
    from kvcodec.decode.device import ENV_VAR, resolve_device

    if backend is not None and not isinstance(backend, str):  # backend=3 escaped as AttributeError
        return resolve_device(backend)  # raises: one KvcInputError line
    b = (backend or os.environ.get(ENV_VAR) or "auto").strip().lower()
    if b != "auto":
        return resolve_device(b)
    return resolve_device("auto") if torch.device(target).type == "cuda" else "cpu"


@contextlib.contextmanager
def device_scope(target: torch.device | str) -> Iterator[None]:
    """Make ``target`` the current CUDA device (the GPU decoders allocate on the current device; a worker
    thread starts on device 0). A no-op for a CPU target."""
    dev = torch.device(target)
    if dev.type != "cuda":
        yield
        return
    with torch.cuda.device(dev):
        yield


def target_device(device: torch.device | str | None, lm: Any = None) -> torch.device:
    """``device`` (default: ``lm``'s, :func:`model_device`) with a CUDA device's index made explicit.

    A device that cannot hold the cache is one line: an unknown name ("tpu", 3) escaped as RuntimeError, "cuda"
    without CUDA as AssertionError, and "meta" (no data) or a CUDA index past the last device were accepted."""
    if device is None:
        dev = model_device(lm) if lm is not None else torch.device("cpu")
    else:
        from kvcodec.errors import KvcBackendError, KvcInputError

        try:
            dev = torch.device(device) if isinstance(device, (str, torch.device)) else None
        except (RuntimeError, ValueError, TypeError):
            dev = None
        own = model_device(lm).type if lm is not None else "cpu"
        if dev is None or dev.type not in ("cpu", "cuda", own):
            raise KvcInputError(f"device must be 'cpu', 'cuda[:N]' or the model's own device type, got {device!r}")
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise KvcBackendError(f"device {device!r}: no CUDA device is available")
            if dev.index is not None and not 0 <= dev.index < torch.cuda.device_count():
                raise KvcInputError(f"device {device!r}: there are {torch.cuda.device_count()} CUDA devices")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def land(x: torch.Tensor, target: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` on ``target`` in ``dtype``: no copy where it is already there (a device-decoded layer stays put). A
    value past ``dtype``'s range (a float32 file into a float16 model) is one error line, never an inf in the cache."""
    from kvcodec.core.dtypes import cast_in_range

    if x.device != target:
        x = x.to(target)
    return x if dtype is None or x.dtype == dtype else cast_in_range(x, dtype)


@dataclass
class LoadedKvc:
    """A cache ready for ``model(...)``/``generate`` plus what the caller needs to continue it."""

    cache: DynamicCache
    token_ids: np.ndarray  # the context the cache encodes
    next_position: int  # position id of the first token after the context
    reader: Any
    attention_bias: Any = None  # the file's attention bias (spec/kvc-v1.md 4.6): apply it with steering()

    def steering(self, lm: LoadedModel) -> Any:
        """Context manager applying the file's attention bias to ``lm``'s attention (a no-op without one):
        every forward over this cache must run inside it, or it computes what the file does not describe."""
        from kvcodec.integrations.attn_bias import biased_attention

        return biased_attention(lm, self.attention_bias, int(self.next_position))


def load_cache(source: Any, lm: LoadedModel, backend: str | None = None, prefetch: bool = True,
               device: torch.device | str | None = None) -> LoadedKvc:
    """Open a `.kvc` (path, bytes, file object or ranged source) for ``lm``.

    Refuses a file of another model before decoding anything. The cache lands on ``device`` (default: the
    model's, :func:`model_device`) and is decoded there unless ``backend`` names another decoder
    (:func:`decode_device`).
    """
    from kvcodec.api import open as open_kvc
    from kvcodec.errors import KvcInputError
    from kvcodec.format import KvcReader

    if not (hasattr(lm, "model") and hasattr(lm, "fingerprint")):  # None, a fingerprint, a name: AttributeError
        raise KvcInputError(f"load_into needs a loaded model (kvcodec.models.load.load_model), got {type(lm).__name__}")
    if isinstance(source, KvcReader):
        reader = source
        reader.check_model(lm)
    else:  # kvcodec.open: the reader, checked against the model before anything is decoded
        reader = open_kvc(source, model=lm)
    dtype = next(lm.model.parameters()).dtype
    target = target_device(device, lm)
    where = decode_device(target, backend)
    n_layers = reader.fingerprint.num_layers
    seq_len = reader.header.num_tokens
    windows = cache_windows(lm.model.config)
    check_layer_tokens(windows, reader.header.layer_tokens, seq_len, "the .kvc file")

    def decode(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        with device_scope(target):
            k, v = reader.read_layer(i, backend=where, apply_bias=True)  # LoadedKvc.steering applies it
            return land(k, target, dtype).unsqueeze(0), land(v, target, dtype).unsqueeze(0)

    futures: list[Future] = []
    if prefetch:
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvc-decode")
        futures = [pool.submit(decode, i) for i in range(n_layers)]
        pool.shutdown(wait=False)
        fetchers = [f.result for f in futures]
    else:
        lock = threading.Lock()

        def make(i: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
            def fetch() -> tuple[torch.Tensor, torch.Tensor]:
                with lock:
                    return decode(i)
            return fetch

        fetchers = [make(i) for i in range(n_layers)]
    cache = hf_cache(windows, fetchers, seq_len)
    if reader.header.attention_bias is not None:  # refused here, before any forward, if the model cannot take it
        from kvcodec.errors import KvcModelMismatchError
        from kvcodec.integrations.attn_bias import model_attention_heads

        if reader.header.attention_bias.attention_heads != model_attention_heads(lm):
            raise KvcModelMismatchError("the file's attention bias is for another number of attention heads than the model's")
    return LoadedKvc(
        cache=cache, token_ids=reader.token_ids, next_position=reader.header.num_context_tokens, reader=reader,
        attention_bias=reader.header.attention_bias,
    )


@torch.inference_mode()
def generate(
    lm: LoadedModel, source: Any, input_ids: np.ndarray | list[int], max_new_tokens: int = 32, backend: str | None = None
) -> list[int]:
    """Greedy continuation of a cached context followed by ``input_ids`` (e.g. a question), on the model's device.

    The ids and ``max_new_tokens`` are checked before the cache is read (``input_ids="x"`` escaped as ValueError)."""
    _new_token_ids(lm, input_ids, max_new_tokens)
    loaded = load_cache(source, lm, backend=backend)
    with loaded.steering(lm):  # a steered file's attention bias (spec/kvc-v1.md 4.6)
        return greedy_from(lm, loaded.cache, loaded.next_position, input_ids, max_new_tokens)[0]


def _new_token_ids(lm: LoadedModel, ids: Any, max_new_tokens: Any) -> np.ndarray:
    """The tokens fed after a cached context, as int64, or one :class:`KvcInputError` line: integers the model's
    embedding has (an id past it escaped as IndexError from the embedding), at least one, and a whole number of
    new tokens to decode."""
    from kvcodec.core.kvcache import as_token_ids

    arr = as_token_ids(ids, "the tokens after the cached context")
    if arr.size == 0:
        raise KvcInputError("need at least one token after the cached context")
    try:
        emb = lm.model.get_input_embeddings()
    except (AttributeError, NotImplementedError):  # a stand-in model, or one that does not say
        emb = None
    vocab = int(getattr(emb, "num_embeddings", 0) or getattr(getattr(lm.model, "config", None), "vocab_size", 0) or 0)
    if vocab and (int(arr.min()) < 0 or int(arr.max()) >= vocab):
        bad = int(arr.min()) if int(arr.min()) < 0 else int(arr.max())
        raise KvcInputError(f"token id {bad} is outside the model's vocabulary [0, {vocab})")
    check_answer_length(max_new_tokens)
    return arr


def check_answer_length(max_new_tokens: Any, lo: int = 1) -> None:
    """The one check of an answer's length (``max_new_tokens``): an integer >= ``lo`` (numpy's too), or one
    :class:`KvcInputError` line, made before any work (``"x"`` and None escaped as TypeError after a whole load or
    blend, 2.5 was taken)."""
    if not isinstance(max_new_tokens, (int, np.integer)) or isinstance(max_new_tokens, bool) or max_new_tokens < lo:
        raise KvcInputError(f"max_new_tokens must be an integer >= {lo}, got {max_new_tokens!r:.40}")


@torch.inference_mode()
def greedy_from(
    lm: LoadedModel, cache: Any, next_position: int, ids: np.ndarray | list[int], max_new_tokens: int
) -> tuple[list[int], float]:
    """Feed ``ids`` after ``cache`` (at ``next_position``) and decode greedily.

    Returns the tokens and the ``time.perf_counter()`` instant the first one
    was known (for time-to-first-token). Inputs go to the model's device (:func:`model_device`).
    """
    dev = model_device(lm)
    ids = _new_token_ids(lm, ids, max_new_tokens)
    held = int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0
    if held > next_position:  # a cache a continuation already ran on (reused): its tokens would be attended again
        raise KvcInputError(f"the cache holds {held} tokens, past its context's {next_position}: a continuation "
                            "already ran on it; load the context again for another one")
    eos = getattr(lm.tokenizer, "eos_token_id", None)
    pos = torch.arange(next_position, next_position + len(ids), device=dev).unsqueeze(0)
    with fast_sdpa(lm):  # the new tokens over the cached ones as two fast SDPA calls (the module says why)
        logits = lm.model(input_ids=torch.as_tensor(ids, device=dev).unsqueeze(0), past_key_values=cache,
                          position_ids=pos, use_cache=True, logits_to_keep=1).logits
    out: list[int] = []
    first_at = 0.0
    nxt = next_position + len(ids)
    for i in range(max_new_tokens):
        tok = int(logits[0, -1].argmax())
        if i == 0:
            first_at = time.perf_counter()
        out.append(tok)
        if tok == eos or i == max_new_tokens - 1:
            break
        logits = lm.model(
            input_ids=torch.tensor([[tok]], device=dev), past_key_values=cache, position_ids=torch.tensor([[nxt]], device=dev),
            use_cache=True).logits
        nxt += 1
    return out, first_at
