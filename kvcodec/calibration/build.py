"""Building a model's calibration: PCA bases of pre-RoPE K/V, each column scaled by its measured Fisher
sensitivity, and per-layer sensitivities.

Computed once per model from a fixed calibration corpus that is disjoint from
the benchmark texts, stored under ``cache_root()/calibration/<fingerprint id>/``
as a safetensors file (format ``kvcodec-calibration`` version 3, see
spec/codec-v1.md section "Calibration file"). ``.kvc`` files reference the
bases by name + sha256 as external attachments; :func:`resolve_attachment`
finds them again through a per-sha256 index (one small pointer file per
attachment), so opening a file reads one calibration, however many models
are calibrated.

A calibration steers every quantizer step and basis, so a wrong one encodes
garbage that still decodes: each file is bound to the fingerprint id of its
model and carries the sha256 of its own content, and every load checks both
plus its shapes against the model (:func:`load_calibration_file`,
:meth:`Calibration.check_for`). A swapped, tampered, layer-reversed or short
calibration is a one-line KvcError at encode and at decode, never used.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from typing import Any, Iterator

import numpy as np

from kvcodec.calibration.fit import COLUMN_WEIGHTING, Moments, compute_pca, fisher_weighted
from kvcodec.calibration.record import (CALIB_CONTEXT, CALIB_FORMAT, CALIB_VERSION, CALIB_TEXTS, DEFAULT_SINK, SENS_CONTINUATION, SENS_SAMPLES, snap_basis, BASIS_GRID,
                                        Calibration)
from kvcodec.calibration.store import load_calibration, save_calibration
from kvcodec.codecs.blocks import channel_blocks
from kvcodec.codecs.rope_tables import layer_rope_config, positions_for
from kvcodec.codecs.rope import RopeStage
from kvcodec.core.stage import ChunkContext
from kvcodec.errors import KvcInputError
from kvcodec.models.layout import ALL_HEADS, PER_HEAD_QKV

log = logging.getLogger("kvcodec.calibration")

MIN_CONTEXT = 256  # tokens of context per calibration text, at least (the floor the builder has always had)


def coded_tensor(cache: Any, layer: int, kind: str, tokens: np.ndarray | None = None) -> np.ndarray:
    """Keys as the plans code them: pre-RoPE, or as they are when the model's RoPE variant has no rope stage.

    ``tokens``: only these of the layer's stored tokens (indices into its T), un-RoPE'd at their own
    positions: the same values as selecting them afterwards, without rotating the tokens a caller drops
    (the rate search reads 512 of a 4K cache's tokens)."""
    t = (cache.keys if kind == "k" else cache.values)[layer]
    if tokens is not None:
        import torch

        t = t.index_select(1, torch.from_numpy(np.asarray(tokens, np.int64)))
    return _coded_frame(t.float().numpy(), cache, layer, kind, tokens)


def _coded_frame(x: np.ndarray, cache: Any, layer: int, kind: str, tokens: np.ndarray | None = None) -> np.ndarray:
    """``x`` [H, T, D] of ``cache``'s (layer, kind) in the frame the plans code: keys un-RoPE'd.
    ``tokens``: ``x`` holds only these of the layer's stored tokens (:func:`coded_tensor`).

    Also right for a gradient with respect to the stored keys: RoPE is a rotation per token, so the
    gradient with respect to the pre-RoPE keys is the same inverse rotation of it."""
    if kind == "k":
        rc = layer_rope_config(cache.fingerprint, layer, x.shape[-1])
        if rc is None:  # transform_plan then codes this layer's post-RoPE keys too
            return x
        # token_start: a sliding-window layer's first stored token is not token 0 (the ragged layout)
        start, positions = cache.layer_offset(layer), cache.positions
        if tokens is not None:
            T = int((cache.keys[layer]).shape[1])
            positions = positions_for(positions, layer, x.shape[0], T, start)[:, np.asarray(tokens, np.int64)]
        x, _ = RopeStage(**rc).encode(np.ascontiguousarray(x, np.float32),
                                      ChunkContext(layer=layer, kind="k", token_start=start, positions=positions))
    return x


class _QueryMoments:
    """Collects E[q^2] of the pre-RoPE queries per (layer, kv head, channel) during any forward pass.

    Hooked into the q projections while the first calibration text is
    captured, so the attention metric costs no forward pass of its own.
    Where the queries are and how they are normalised is the model's layout
    (:meth:`kvcodec.models.layout.ModelLayout.query`). A layer whose query projection kvcodec cannot find (GPT-2,
    Falcon and MPT keep their blocks outside ``.model.layers``; CodeGen's fused projection is not one it reads)
    keeps even weights, 1 per channel: its keys are then fitted by plain squared error. The promises are rate
    control's as on any model (the Fisher sensitivities of the basis's own coefficients are measured on the real model),
    and on SmolLM2 even weights cost no measurable bits at equal KL (benchmarks/results/families/even_weights_cost.py:
    0.99x, 12 points). ``even`` lists those layers.
    """

    def __init__(self, lm: Any, sink: int) -> None:
        lay = lm.layout
        self.nq, self.nkv, self.D = lay.num_heads, lay.num_kv_heads, lay.head_dim
        self.L = lay.num_layers
        self._lm = lm
        self.sink = sink
        self.moments: np.ndarray | None = None
        self.even: list[int] = []
        self._hooks: list[Any] = []

    def __enter__(self) -> "_QueryMoments":
        self.moments = np.ones((self.L, self.nkv, self.D))
        lm = self._lm
        for i in range(self.L):
            # separate q projection (LLaMA, Qwen, Gemma, Mistral), the first nq*D outputs of a fused one (Phi-3), or
            # each head's first D of its [q | k | v] (GPT-NeoX)
            proj, q_norm, scope, order = lm.layout.query(lm.model, i)
            if proj is None:
                self.even.append(i)
                continue
            self._hooks.append(proj.register_forward_hook(self._hook(i, q_norm, scope, order)))
        return self

    def _hook(self, i: int, q_norm: Any, scope: str | None, order: str) -> Any:
        def hook(mod: Any, inp: Any, o: Any) -> None:
            T = o.shape[1]
            if order == PER_HEAD_QKV:
                q = o[0].detach().reshape(T, self.nq, 3 * self.D)[..., : self.D].reshape(T, self.nq * self.D)
            else:
                q = o[0, :, : self.nq * self.D].detach()
            if q_norm is not None:  # the keys meet the normalised queries
                if scope == ALL_HEADS:  # OLMo 2: one norm over all query heads
                    q = q_norm(q)
                else:  # Qwen3, Gemma 3, Phi: each query head normalised on its own
                    q = q_norm(q.reshape(T, self.nq, self.D))
            q = q.reshape(T, self.nq, self.D)
            q = q.double()[self.sink:]
            # HF repeat_kv: kv head h serves q heads h*r..h*r+r-1
            assert self.moments is not None
            self.moments[i] = (q**2).mean(0).reshape(self.nkv, self.nq // self.nkv, self.D).mean(1).numpy()
        return hook

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def attention_metrics(lm: Any, qm: np.ndarray, reg: float = 0.01, even: list[int] | None = None) -> np.ndarray:
    """Distortion metric per (layer, kind, kv head) [L, 2, H, D, D], each normalised to trace D, + reg*I.

    Keys (pre-RoPE): diagonal, channel pair (i, i+D/2) weighted by the mean of the
    queries' E[q_i^2] and E[q_{i+D/2}^2] (``qm`` [L, H, D]; RoPE rotates within pairs).
    Values: W_o^T W_o over the output-projection columns of the query heads that share the KV head, or the
    identity where kvcodec cannot find the output projection (appended to ``even``, when given: see
    :class:`_QueryMoments`).
    """
    L, H, D = qm.shape
    r = lm.layout.num_heads // H
    out = np.zeros((L, 2, H, D, D))
    h2 = D // 2
    for l in range(L):
        o_proj = lm.layout.output_projection(lm.model, l)
        wo = o_proj.weight.detach().double().numpy() if o_proj is not None else None
        if wo is None and even is not None:
            even.append(l)
        for h in range(H):
            d = qm[l, h]
            d = np.concatenate([(d[:h2] + d[h2:]) / 2] * 2)
            mk = np.diag(d)
            if wo is None:
                mv = np.eye(D)
            else:
                blk = wo[:, h * r * D : (h + 1) * r * D]
                mv = sum(blk[:, j * D : (j + 1) * D].T @ blk[:, j * D : (j + 1) * D] for j in range(r))
            for ki, m in enumerate((mk, mv)):
                m = m * (D / np.trace(m))
                out[l, ki, h] = m + reg * np.eye(D)
    return out


@contextmanager
def _grad_mode() -> Iterator[None]:
    """Gradients on, outside inference mode: the Fisher passes' graph and backward passes (and nothing else)."""
    import torch

    with torch.inference_mode(False), torch.enable_grad():
        yield


@contextmanager
def _build_mode() -> Iterator[None]:
    """The autograd mode of a calibration build, whatever its caller's: outside inference mode, no gradients.

    Why: every tensor the build creates and updates in place (the sensitivity accumulators) is then an ordinary
    tensor, the same under ``kvc calibrate`` as under ``KnowledgeBase.ask``'s ``inference_mode`` (issue 59:
    under inference mode the accumulator was an inference tensor, which cannot be updated outside it);
    gradients are on only around the Fisher passes (:func:`_grad_mode`). Entered per call, not per
    generator step: nothing here yields to a caller from inside it.
    """
    import torch

    with torch.inference_mode(False), torch.no_grad():
        yield


def _fisher_gradients(lm: Any, cache: Any, continuation: np.ndarray, samples: int, seed: int) -> Iterator[list[Any]]:
    """Per Hutchinson sample, ``J^T z`` with respect to every stored tensor (keys and values of layer ``l`` at
    ``2l``, ``2l + 1``; each [1, H, T, D]): ``E ||J^T z||^2`` over a block is that block's ``tr(F)``.

    For a small perturbation d of the cache, KL(p || p_d) ~ 1/2 d^T F d with F = J^T H J per continuation
    position (J = d logits / d kv, H = diag(p) - p p^T). With z ~ N(0, H) drawn per position
    (z = sqrt(p) u - p (sqrt(p) . u), u ~ N(0, I)), E[(J^T z)(J^T z)^T] = F: one forward pass, then one backward
    pass per sample gives every block's estimate at once (a noisy forward pass per block would be 2L passes)."""
    import torch

    from kvcodec.models.cachelayout import cache_for

    lm.fingerprint.check_compatible(cache.fingerprint)
    continuation = np.asarray(continuation, np.int64).reshape(-1)
    dtype = next(lm.model.parameters()).dtype
    L = cache.num_layers
    gen = torch.Generator().manual_seed(seed)
    # The graph is built and each backward pass runs with gradients on and outside inference mode (callers, e.g.
    # ask -> deposit -> plan, run under inference_mode), but every yield is outside that `with`: the consumer's
    # loop body runs in its own mode (issue 59: a yield inside the `with` ran the consumer's in-place update on its
    # inference-mode accumulator outside inference mode, which torch refuses).
    with _grad_mode():
        leaves = [t.to(dtype).unsqueeze(0).clone().requires_grad_(True) for pair in zip(cache.keys, cache.values) for t in pair]
        past = cache_for(lm, cache, [(leaves[2 * l], leaves[2 * l + 1]) for l in range(L)])
        ids = torch.as_tensor(continuation)[None]
        pos = torch.arange(cache.next_position, cache.next_position + ids.shape[1])[None]
        logits = lm.model(input_ids=ids, past_key_values=past, position_ids=pos, use_cache=True).logits[0]
        p = torch.softmax(logits.detach().double(), -1)
        sp = p.sqrt()
    for s in range(samples):
        with _grad_mode():
            u = sp * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            z = u - p * u.sum(-1, keepdim=True)
            grads = list(torch.autograd.grad(logits, leaves, grad_outputs=z.to(logits.dtype), retain_graph=s < samples - 1))
        yield grads


def measure_sensitivity(lm: Any, cache: Any, continuation: np.ndarray, sink: int = DEFAULT_SINK,
                        samples: int = SENS_SAMPLES, seed: int = 0, on_sample: Any = None) -> np.ndarray:
    """KL per unit per-element noise power for each (layer, kind) [L, 2] (float32): 1/2 tr(F) of the block.

    Isotropic noise of power s^2 on the tokens >= sink of one (layer, kind) gives E[KL] = 1/2 s^2 tr(F)
    (:func:`_fisher_gradients`), averaged over the continuation positions. ``on_sample(i)`` is called after
    each sample (progress). The calibration weighs each coefficient instead (:func:`coefficient_sensitivity`);
    this is the law's isotropic form, which the tests check against noise actually added.
    """
    acc = np.zeros((cache.num_layers, 2))  # numpy: no autograd mode to match
    for s, grads in enumerate(_fisher_gradients(lm, cache, continuation, samples, seed)):
        for i, g in enumerate(grads):
            acc[i // 2, i % 2] += float((g[0, :, sink:].double() ** 2).sum())
        if on_sample is not None:
            on_sample(s)
    return (0.5 * acc / (samples * len(np.asarray(continuation).reshape(-1)))).astype(np.float32)


def coefficient_sensitivity(lm: Any, cache: Any, continuation: np.ndarray, basis: np.ndarray, sink: int = DEFAULT_SINK,
                            samples: int = SENS_SAMPLES, seed: int = 0, on_sample: Any = None) -> np.ndarray:
    """KL per unit noise power on each coefficient of ``basis`` [L, 2, H, D, K], at every coded token: [L, 2, H, K].

    A coefficient error c_d of the plans' transform is the cache error ``B_d c_d`` in the coded frame (keys
    pre-RoPE), so its KL is ``1/2 c_d^2 B_d^T F B_d``, estimated as ``1/2 E (B_d^T g_t)^2`` summed over the coded
    tokens ``t`` (those the plans do not keep exactly: from ``sink`` on, counted from each layer's first
    stored token) and averaged over the continuation positions (:func:`_fisher_gradients`). This is what
    :func:`kvcodec.calibration.fit.fisher_weighted` scales the basis by.
    """
    import torch

    L, _, H, _, K = basis.shape
    # acc is created and updated in place in one mode, whatever the caller's (issue 59); on_sample, the caller's
    # code, runs in the caller's mode
    with _build_mode():
        b = torch.from_numpy(np.asarray(basis, np.float64))  # torch, not numpy: numpy's BLAS threads spin (plan/ratecontrol.py)
        acc = torch.zeros((L, 2, H, K), dtype=torch.float64)
    for s, grads in enumerate(_fisher_gradients(lm, cache, continuation, samples, seed)):
        with _build_mode():
            for i, g in enumerate(grads):
                l, ki = i // 2, i % 2
                x = torch.from_numpy(_coded_frame(g[0].detach().float().numpy(), cache, l, "kv"[ki])).double()
                x = x[:, max(0, sink - cache.layer_offset(l)):]
                acc[l, ki] += (x @ b[l, ki]).square().sum(dim=1)
        if on_sample is not None:
            on_sample(s)
    return 0.5 * acc.numpy() / (samples * len(np.asarray(continuation).reshape(-1)))


@contextmanager
def _layer_progress(lm: Any, step: Any) -> Iterator[None]:
    """Calls ``step(1 / L)`` after each decoder layer's forward pass (progress within one prefill); ``step(1)`` after
    the whole pass where kvcodec does not find the decoder layers."""
    layers = lm.layout.decoder_layers(lm.model)
    if layers is None:
        yield
        step(1.0)
        return

    def hook(*args: Any) -> None:  # returns None: a forward hook's return value replaces the layer's output
        step(1.0 / len(layers))

    hooks = [layer.register_forward_hook(hook) for layer in layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def _advance(bar: Any, n: float) -> None:
    """``bar.update(n)``, never past its total: the per-layer fractions add up to a hair over it in floating point,
    and tqdm then printed a TqdmWarning (with its source line) into the progress at the end of every build."""
    bar.update(max(0.0, min(n, bar.total - bar.n)))


def _check_finite(lm: Any, arrays: list[tuple[str, Any]]) -> None:
    """Refuse a calibration of a model that computes NaN or inf (a weight that holds one, a config that makes one).

    Why here: such a build finished and was saved, and every later lossy encode then said the file was corrupt and
    to rebuild it (which saved the same), or the first one crashed inverting the NaN basis.
    """
    for what, a in arrays:
        finite = bool(np.isfinite(a).all()) if isinstance(a, np.ndarray) else bool(a.isfinite().all())
        if not finite:
            raise KvcInputError(f"cannot calibrate {lm.name}: {what} hold NaN or inf on the calibration texts (the model "
                                "computes non-finite values: check its weights and config.json); the lossless and "
                                "fp16 presets need no calibration")


def min_calibration_window() -> int:
    """The shortest context window a calibration can be built in: :data:`MIN_CONTEXT` tokens and the continuation."""
    return MIN_CONTEXT + SENS_CONTINUATION


def calibration_context(lm: Any, context: int = CALIB_CONTEXT) -> int:
    """The context (tokens per calibration text) ``lm`` is calibrated at: ``context``, or less where its window
    cannot hold it and the continuation. A model that cannot be calibrated at all (its window too short for
    :data:`MIN_CONTEXT`) is one :class:`KvcInputError` line, before any forward pass."""
    from kvcodec.models.capture import max_context

    window = max_context(lm)
    if window is not None and window - SENS_CONTINUATION < context:
        if window < min_calibration_window():
            raise KvcInputError(f"cannot calibrate {lm.name}: its context window of {window} tokens is shorter than the "
                                f"{MIN_CONTEXT + SENS_CONTINUATION} a calibration reads ({MIN_CONTEXT} of context and "
                                f"{SENS_CONTINUATION} of continuation); the lossless and fp16 presets need none")
        context = window - SENS_CONTINUATION  # past its window a model's K/V and logits mean nothing
    return context


@_build_mode()  # whatever the caller's autograd mode (kvc calibrate, or ask under inference_mode): issue 59
def build_calibration(lm: Any, texts: tuple[str, ...] = CALIB_TEXTS, context: int = CALIB_CONTEXT,
                      sink: int = DEFAULT_SINK, progress: bool = True, timings: dict[str, float] | None = None,
                      full_basis: bool = False) -> Calibration:
    """Capture the calibration corpus, compute PCA and sensitivities, with a progress bar (ETA) on stderr.

    ``full_basis``: one PCA over each whole head instead of the block-diagonal basis of
    head_dim > 64 (:func:`compute_pca`): smaller files, slower decode.
    ``timings``, when given, receives the seconds spent per phase (capture,
    moments, pca, sensitivity, total); they are not part of the file, which
    must be byte-reproducible.

    Cost on a 2-core CPU: per corpus text, one prefill plus one forward and ``SENS_SAMPLES``
    backward passes over its 128-token continuation (see benchmarks/bench_calibration.py for the
    measured split). The coefficient sensitivities average every corpus text: one text's estimate of
    which heads matter correlates only ~0.7 with another's (SmolLM2).

    A model whose context window is shorter than ``context`` plus the continuation is calibrated on contexts
    that fit it; one whose window cannot hold :data:`MIN_CONTEXT` tokens plus the continuation is refused in one
    line, before any forward pass. The build writes nothing: an interrupted one leaves no file behind
    (:func:`ensure_calibration` saves, atomically, only a finished one).
    """
    import sys

    from tqdm import tqdm

    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.compute import compute_dtype_name, onboard_model
    from kvcodec.texts import load_text

    lm = onboard_model(lm)  # bfloat16 where this CPU computes it natively (kvcodec.models.compute)
    t0 = time.time()
    context = calibration_context(lm, context)
    ids_all = []
    for name in texts:
        txt = load_text(name)
        ids = tokenize(lm.tokenizer, txt)
        n = min(context, len(ids) - SENS_CONTINUATION)
        if n < MIN_CONTEXT:
            raise KvcInputError(f"calibration text {name} is too short ({len(ids)} tokens with this model's tokenizer, "
                                f"the calibration needs {MIN_CONTEXT + SENS_CONTINUATION})")
        ids_all.append((ids[:n], ids[n : n + SENS_CONTINUATION]))
    # progress in token-passes: a prefill of n tokens costs n; the sensitivity's forward pass
    # costs ~1 and each backward pass ~2 continuation-lengths (measured, see bench_calibration.py)
    work = [len(c) + SENS_CONTINUATION * (1 + 2 * SENS_SAMPLES) for c, _ in ids_all]
    fp = lm.fingerprint
    D = fp.head_dims[0]
    mom = Moments(fp.num_layers, fp.num_kv_heads, D)
    timings = {} if timings is None else timings
    with tqdm(total=sum(work), desc=f"kvc: calibrating {lm.name}", unit="tok", unit_scale=True, file=sys.stderr,
              disable=not progress, dynamic_ncols=True, leave=False) as bar:
        caches = []
        qm = None
        for i, (ctx, _) in enumerate(ids_all):
            t1 = time.time()
            with _layer_progress(lm, lambda frac, n=len(ctx): _advance(bar, n * frac)):  # noqa: B008 (binds this text's length)
                if i == 0:
                    with _QueryMoments(lm, sink) as qhook:
                        cache = capture(lm, token_ids=ctx)
                    qm, even_k = qhook.moments, qhook.even
                else:
                    cache = capture(lm, token_ids=ctx)
            _check_finite(lm, [(f"layer {l} keys", k) for l, k in enumerate(cache.keys)]
                          + [(f"layer {l} values", v) for l, v in enumerate(cache.values)])
            caches.append(cache)
            timings["capture_s"] = timings.get("capture_s", 0.0) + time.time() - t1
            t1 = time.time()
            for l in range(cache.num_layers):
                for ki, kind in enumerate("kv"):
                    mom.add(l, ki, coded_tensor(cache, l, kind)[:, sink:])
            timings["moments_s"] = timings.get("moments_s", 0.0) + time.time() - t1
        t1 = time.time()
        assert qm is not None
        blocks = [(0, D)] if full_basis else channel_blocks(D)
        even_v: list[int] = []
        basis, mean, eig = compute_pca(mom, attention_metrics(lm, qm, even=even_v), blocks)
        timings["pca_s"] = time.time() - t1
        t1 = time.time()
        csens = np.zeros(eig.shape)
        for cache, (_, cont) in zip(caches, ids_all):
            with _layer_progress(lm, lambda frac: _advance(bar, SENS_CONTINUATION * frac)):  # the forward pass
                csens += coefficient_sensitivity(lm, cache, cont, basis, sink,
                                                 on_sample=lambda s: _advance(bar, 2 * SENS_CONTINUATION)) / len(caches)
        basis, eig, sens = fisher_weighted(basis, eig, csens)
        basis = snap_basis(basis)  # the 8-bit grid the file stores (record.py: why it costs no quality)
        _check_finite(lm, [("its sensitivities", sens), ("its key/value statistics", np.stack([mean, eig]))])
        timings["sensitivity_s"] = time.time() - t1
    timings["total_s"] = time.time() - t0
    meta = {
        "format": CALIB_FORMAT, "version": CALIB_VERSION, "fingerprint_id": lm.fingerprint.id,
        "texts": list(texts), "context": context, "sink": sink, "sens_continuation": SENS_CONTINUATION,
        "sensitivity": f"fisher-coefficient-{SENS_SAMPLES}x{len(texts)}", "tokens": int(sum(len(c) for c, _ in ids_all)),
        "weighting": "attention-v1", "column_weighting": COLUMN_WEIGHTING, "basis_grid": BASIS_GRID,
    }
    if even_k or even_v:  # layers whose attention modules kvcodec cannot read: plain squared error (absent: none)
        meta["even_weights"] = {"k": even_k, "v": even_v}
        log.warning("calibrating %s: kvcodec cannot find the %s of %d of its %d layers (%s); those layers' %s are "
                    "fitted by plain squared error (rate control still measures this model's KL)", lm.name,
                    " and ".join(w for w, e in (("query projection", even_k), ("output projection", even_v)) if e),
                    len(set(even_k) | set(even_v)), fp.num_layers, lm.layout.family,
                    " and ".join(w for w, e in (("keys", even_k), ("values", even_v)) if e))
    if len(blocks) > 1:  # the recipe since the block-diagonal basis (absent: one PCA per head)
        meta["channel_blocks"] = [list(b) for b in blocks]
    if compute_dtype_name(lm) is not None:  # measured in another dtype than the model's own (absent: its own)
        meta["compute_dtype"] = compute_dtype_name(lm)
    return Calibration(basis, mean, eig, sens, meta)


def ensure_calibration(lm: Any, progress: bool = True) -> Calibration:
    """``lm``'s calibration, built (with progress, minutes of forward passes) and saved the first time.

    The one place a calibration is built on demand. Entry points that encode with a model
    (:func:`kvcodec.api.encode`, ``kvc ask``, the demo, the curve, the edits) call it once and pass the
    result down; the planner itself only loads one (:func:`kvcodec.calibration.store.require_calibration`).
    Callable in any autograd mode (:func:`build_calibration`). A model that cannot be calibrated is one
    :class:`KvcInputError` line that says so and names ``kvc calibrate``; only a finished build is saved
    (atomically), so an interrupted or failed one leaves nothing a later run would load.
    """
    import sys

    fid = lm.fingerprint.id
    cal = load_calibration(fid)
    if cal is None:
        try:
            calibration_context(lm)  # a model that cannot be calibrated: refused before announcing a build
            from kvcodec.models.compute import onboard_dtype

            onboard_dtype(lm.weights_dtype)  # and a bad KVCODEC_ONBOARD_DTYPE (it was refused after the notice)
            if progress:  # one line that survives the progress bar (leave=False): what the minutes were spent on
                print(f"kvc: {lm.name} has no calibration yet; building it once (the lossy presets need it; "
                      f"kvc calibrate --model {lm.name} builds it ahead)", file=sys.stderr, flush=True)
            cal = build_calibration(lm, progress=progress)
        except KvcInputError as exc:
            raise KvcInputError(f"{exc} (lossy presets need the model's calibration, built on first use or by "
                                f"kvc calibrate --model {lm.name})") from None
        path = save_calibration(cal, fid)
        if progress:
            print(f"kvc: calibration of {lm.name} saved: {path}", file=sys.stderr, flush=True)
    cal.check_for(lm.fingerprint)
    return cal
