"""Configuration of the kvcodec vLLM connector and its pure-python helpers.

Nothing here imports vLLM, so the key computation, block alignment and the
model fingerprint are testable in kvcodec's main venv.

vLLM side (``--kv-transfer-config``)::

    {"kv_connector": "KvcodecConnector",
     "kv_connector_module_path": "kvcodec.integrations.vllm.connector",
     "kv_role": "kv_both",
     "kv_connector_extra_config": {
         "store_url": "/var/cache/kvc",       # required: any kvcodec.store URL
         "preset": "faithful",                # any kvcodec preset; default: faithful where the model has a
                                              # calibration here, else lossless (one warning line at start-up)
         "namespace": "default",              # tenant / salt; part of every key
         "chunk_tokens": 256,                 # store chunk; a multiple of vLLM's block size
         "save": true,                        # save new prefixes (false: load only)
         "load": true,                        # load stored prefixes (false: save only)
         "min_load_tokens": 0                 # don't load matches shorter than this
     }}

Store layout (one entry per chunk, so prompts that share only part of a
prefix still hit): chunk ``i`` (tokens ``[(i-1)*C, i*C)``) is stored under
``StoreKey(model=<fingerprint id>, codec=<preset>, namespace, n_tokens=i*C,
digest=h_i)`` — the ordinary kvcodec store key of the prefix ``ids[:i*C]``.
The entry is a ``.kvc`` file holding the K/V of that chunk's tokens only,
i.e. a "pruned" cache of the prefix ``ids[:i*C]`` whose ``positions`` are
``[(i-1)*C, i*C)``. A whole-prefix ``.kvc`` (positions absent, ``i*C``
tokens) stored under the same key by another kvcodec tool is accepted too:
the connector slices its last chunk out of it.

Model identity: ``model`` is :class:`kvcodec.core.fingerprint.ModelFingerprint`'s
``id``, computed from the HF model directory vLLM serves
(:func:`fingerprint_from_dir`: every weight tensor, config, tokenizer), equal
to ``load_model(dir).fingerprint``. Every loaded entry is re-checked: its
``.kvc`` fingerprint, token ids and positions must match the request, else
the chunk counts as a miss (logged), never as KV.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from kvcodec.errors import KvcInputError, KvcModelNotFoundError

DEFAULT_PRESET = None  # not named: resolved at start-up (entries.resolve_save_preset: faithful, or lossless + a warning)
DEFAULT_CHUNK_TOKENS = 256
LAYOUT = "vllm-chunk-v1"  # recorded in each entry's metadata

_KNOWN = {"store_url", "preset", "namespace", "chunk_tokens", "save", "load", "min_load_tokens",
          "memory_bytes", "model_id"}


def _as_bool(name: str, v: Any) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return v.lower() in ("1", "true", "yes", "on")
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise KvcInputError(f"kvcodec connector: {name} must be a boolean, got {v!r}")


MAX_CHUNK_TOKENS = 1 << 20  # past any context: start-up probes one chunk of zero ids ([0] * chunk_tokens)


def _as_int(name: str, v: Any, lo: int, hi: int = (1 << 63) - 1) -> int:
    try:
        i = int(v)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an infinite float (JSON's 1e999)
        raise KvcInputError(f"kvcodec connector: {name} must be an integer, got {v!r:.40}") from None
    if isinstance(v, bool) or i != v and not isinstance(v, str) or not lo <= i <= hi:
        rng = f">= {lo}" if hi == (1 << 63) - 1 else f"in [{lo}, {hi}]"
        raise KvcInputError(f"kvcodec connector: {name} must be an integer {rng}, got {v!r:.40}")
    return i


def _as_size(name: str, v: Any) -> int | None:
    """A byte size (``512M``, ``1000``), checked now: a list or a dict reached the store cache's dict key at
    start-up as an unhashable-type TypeError traceback; a bad string was reported only when the store opened."""
    from kvcodec.store.options import parse_size

    if v is None:
        return None
    try:
        return parse_size(v)
    except KvcInputError as e:
        raise KvcInputError(f"kvcodec connector: {name}: {e}") from None


@dataclass(frozen=True)
class ConnectorConfig:
    store_url: str
    preset: str | None = DEFAULT_PRESET
    namespace: str = "default"
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    save: bool = True
    load: bool = True
    min_load_tokens: int = 0
    memory_bytes: str | int | None = None
    model_id: str | None = None  # override of the fingerprint id (documented escape hatch)

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> "ConnectorConfig":
        """Parse ``kv_connector_extra_config``; every mistake is a KvcInputError naming the key."""
        if extra is not None and not isinstance(extra, Mapping):  # a JSON string left unparsed: dict() escaped as
            # ValueError, a number as TypeError, and a list of pairs was taken as the config
            raise KvcInputError(f"kvcodec connector: kv_connector_extra_config must be an object, got "
                                f"{type(extra).__name__}")
        extra = dict(extra or {})
        unknown = set(extra) - _KNOWN
        if unknown:
            raise KvcInputError(f"kvcodec connector: unknown kv_connector_extra_config keys {sorted(unknown)} "
                                f"(known: {sorted(_KNOWN)})")
        url = extra.get("store_url")
        if not isinstance(url, str) or not url.strip():
            raise KvcInputError("kvcodec connector: kv_connector_extra_config.store_url is required "
                                "(a directory, file://, redis://, http(s):// or mem:// store URL)")
        preset = extra.get("preset", DEFAULT_PRESET)
        if preset is not None:
            if not isinstance(preset, str) or not preset:
                raise KvcInputError(f"kvcodec connector: preset must be a preset name, got {preset!r}")
            from kvcodec.api import preset_info

            preset_info(preset, "kvcodec connector")  # the one preset table (the connector has no model: fixed step0)
        ns = extra.get("namespace", "default")
        from kvcodec.store.keys import check_id

        check_id("namespace", ns)
        model_id = extra.get("model_id")
        if model_id is not None:
            check_id("model", model_id)
        return cls(
            store_url=url.strip(), preset=preset, namespace=ns,
            # bounded: a chunk of 10**12 tokens (a multiple of any block size) made the start-up probe allocate
            # a list of 10**12 ids (MemoryError after minutes of swapping)
            chunk_tokens=_as_int("chunk_tokens", extra.get("chunk_tokens", DEFAULT_CHUNK_TOKENS), 1, MAX_CHUNK_TOKENS),
            save=_as_bool("save", extra.get("save", True)), load=_as_bool("load", extra.get("load", True)),
            min_load_tokens=_as_int("min_load_tokens", extra.get("min_load_tokens", 0), 0),
            memory_bytes=_as_size("memory_bytes", extra.get("memory_bytes")), model_id=model_id,
        )

    @property
    def codec_id(self) -> str:
        """The store key's ``codec`` part: :func:`kvcodec.store.keys.codec_key` of the preset, as every other writer."""
        from kvcodec.store.keys import codec_key

        if self.preset is None:
            raise KvcInputError("kvcodec connector: the default preset is chosen at start-up, from the model "
                                "(entries.resolve_save_preset); no codec before that")
        return codec_key(self.preset)

    def check_block_size(self, block_size: int) -> None:
        if block_size <= 0 or self.chunk_tokens % block_size:
            raise KvcInputError(
                f"kvcodec connector: chunk_tokens={self.chunk_tokens} must be a multiple of vLLM's block size "
                f"({block_size}); set kv_connector_extra_config.chunk_tokens accordingly")


# --------------------------------------------------------------------------- matching
def matchable_tokens(num_prompt_tokens: int, chunk_tokens: int) -> int:
    """Most prompt tokens a stored prefix may cover: whole chunks, leaving >= 1 token to compute.

    vLLM must run the model on at least the last prompt token to get logits,
    so a prompt of exactly k chunks can load at most k-1 of them.
    """
    if num_prompt_tokens <= 1:
        return 0
    return ((num_prompt_tokens - 1) // chunk_tokens) * chunk_tokens


def savable_tokens(num_prompt_tokens: int, chunk_tokens: int) -> int:
    """Prompt tokens whose KV is saved: the whole chunks of the prompt."""
    return (num_prompt_tokens // chunk_tokens) * chunk_tokens


def chunk_keys(token_ids: Sequence[int] | Any, n_tokens: int, *, model: str, codec: str, namespace: str,
               chunk_tokens: int) -> list[Any]:
    """StoreKeys of chunks 1..n_tokens/chunk_tokens of ``token_ids`` (n_tokens a chunk multiple)."""
    from kvcodec.store.keys import StoreKey, chunk_hashes

    if n_tokens % chunk_tokens:
        raise KvcInputError(f"{n_tokens} is not a multiple of chunk_tokens={chunk_tokens}")
    n = n_tokens // chunk_tokens
    if n == 0:
        return []
    hs = chunk_hashes(list(token_ids[:n_tokens]), chunk_tokens, model=model, codec=codec, namespace=namespace)
    return [StoreKey(model, codec, namespace, (i + 1) * chunk_tokens, h.hex()) for i, h in enumerate(hs[:n])]


def leading_run(found: Sequence[bool]) -> int:
    """Length of the run of True at the start of ``found``."""
    n = 0
    for f in found:
        if not f:
            break
        n += 1
    return n


def lookup_prefix(store: Any, token_ids: Sequence[int], *, model: str, codec: str, namespace: str,
                  chunk_tokens: int, max_tokens: int) -> tuple[int, list[Any]]:
    """(tokens, keys) of the longest run of stored chunks from the start, capped at ``max_tokens``."""
    limit = (max_tokens // chunk_tokens) * chunk_tokens
    keys = chunk_keys(token_ids, limit, model=model, codec=codec, namespace=namespace, chunk_tokens=chunk_tokens)
    if not keys:
        return 0, []
    n = leading_run(store.contains_many(keys))
    return n * chunk_tokens, keys[:n]


# --------------------------------------------------------------------------- model identity
_NUM_RE = re.compile(r"(\d+)")


def _natural(name: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in _NUM_RE.split(name))


def fingerprint_from_dir(path: str | Path, tokenizer: Any = None) -> Any:
    """``ModelFingerprint`` of the HF model directory vLLM serves, without loading the model.

    The one directory fingerprint (:func:`kvcodec.models.fingerprint.fingerprint_dir`):
    every safetensors tensor, the cache-relevant config and the tokenizer, so it
    equals ``load_model(path).fingerprint`` and a fine-tuned look-alike differs.
    """
    from kvcodec.models.fingerprint import fingerprint_dir

    path = Path(path)
    if not (path / "config.json").is_file():
        raise KvcModelNotFoundError(f"{path} is not an HF model directory (no config.json)")
    return fingerprint_dir(path, tokenizer)


def config_digest(cfg: ConnectorConfig) -> str:
    """Short hash of the settings that change stored bytes (for logs and metadata)."""
    d = {"preset": cfg.preset, "chunk_tokens": cfg.chunk_tokens, "layout": LAYOUT}
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]
