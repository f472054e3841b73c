"""The chat factor: rate control's prediction on the contexts a KDN stores (issue 57).

Why a factor of its own: the rate model (:mod:`kvcodec.onboard.ratefit`) is fitted on plain text continued by the
text that follows it. A ``kvc ask`` context is the model's chat prefix and a document, and what follows it is a
question turn and the model's answer, which reads the document far more than a continuation of prose does.
Measured on SmolLM2 (``balanced``, held-out texts, ``benchmarks/bench_rate.py --chat``): measured over predicted
KL of 1.3-2.7x on such contexts, where plain text's geometric mean is 1.09; files missed the KL promise by up to
1.6x. Protecting the template's tokens does not close it (the chat prefix kept raw moved KL by -7 % and +20 % on
two texts): the error is not in the template, it is in what the answer reads.

What it measures, once per model with its rate model (``kvc calibrate``, or the first fit): the answer probe's
contexts (:func:`kvcodec.onboard.answercheck.probe_contexts`: tuning texts in the model's chat format, never the
held-out set), each continued by :data:`CHAT_QUESTION` and the model's own greedy answer from the exact cache
(:data:`ANSWER_TOKENS` tokens). Each lossy preset is planned by rate control as it would be for that context, the
decoded cache continued, and the preset's factor is the geometric mean of measured over predicted KL, at least 1
(:data:`~kvcodec.calibration.ratemodel.CHAT_FACTOR_RANGE`). Rate control multiplies its prediction by it for a
context that opens with the model's chat prefix (:func:`kvcodec.models.chat.is_chat_context`), so such a context gets a smaller
step; plain text is planned as before.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np

CHAT_QUESTION = "What does the document above say? Answer in detail, point by point."
ANSWER_TOKENS = 128  # the answer's greedy tokens in each continuation (not stopped at EOS)
VERSION = 1


def chat_continuation(lm: Any, ids: np.ndarray, n: int = ANSWER_TOKENS, cache: Any = None) -> np.ndarray:
    """What follows the chat context ``ids`` when it is used: the question turn of :data:`CHAT_QUESTION` and the
    model's ``n`` greedy answer tokens, fed after the exact cache of ``ids`` as ``kvc ask`` feeds a question after a
    stored context. ``cache``: that cache when the caller has it (the chat factors' probe contexts), else prefilled."""
    import torch

    from kvcodec.models.capture import capture

    with torch.inference_mode():
        cache = capture(lm, token_ids=np.asarray(ids, np.int64)) if cache is None else cache
    return chat_continuations(lm, [cache], n)[0]  # one row: greedy_answers is greedy_answer itself


def chat_continuations(lm: Any, caches: list[Any], n: int = ANSWER_TOKENS) -> list[np.ndarray]:
    """:func:`chat_continuation` of each of the exact ``caches`` (the probe contexts'), their greedy answers batched
    (:func:`kvcodec.models.quality.greedy_answers`: each step reads the model's weights once for all of them)."""
    from kvcodec.errors import KvcInputError
    from kvcodec.models.capture import max_context
    from kvcodec.models.chat import ChatFormat
    from kvcodec.models.quality import greedy_answers

    if not caches:  # a window too short for any probe context: nothing to continue
        return []
    q = ChatFormat.for_tokenizer(lm.tokenizer).question_ids(CHAT_QUESTION)
    window = max_context(lm)
    if window is not None:  # never past the model's window: learned positions (OPT, GPT-2) fail in their embedding
        longest = max(int(c.num_tokens) for c in caches)
        n = min(n, window - len(q) - longest)
        if n < 1:
            raise KvcInputError(f"a chat context of {longest} tokens leaves no room for an answer in {lm.name}'s "
                                f"context window of {window}")
    answers = greedy_answers(lm, list(caches), [q] * len(caches), n, stop_at_eos=False)
    return [np.asarray(np.concatenate([q, np.asarray(a, np.int64)]), np.int64) for a in answers]


def measure_chat_factor(lm: Any, cal: Any, presets: Mapping[str, tuple[Mapping[str, Any], Any]], rm: Any,
                        progress: bool = True, probe: Any = None) -> dict[str, dict[str, Any]]:
    """Per preset of ``presets`` (name -> (its table settings, its target)): ``{"factor", "rows", "version"}``
    (module docstring), with ``rm``'s other constants as they are (its chat factors ignored while measuring).
    ``probe``: the fit's :class:`~kvcodec.onboard.answercheck.Probe` (its contexts and caches, shared with the answer
    probe); None makes one."""
    import torch
    from tqdm import tqdm

    from kvcodec.core.roundtrip import roundtrip
    from kvcodec.models.quality import ExactSide, continue_logits
    from kvcodec.onboard.answercheck import Probe
    from kvcodec.plan.ratecontrol import controlled_plan

    probe = Probe(lm) if probe is None else probe
    contexts = probe.contexts
    bare = replace(rm, chat_factor={})
    rows: dict[str, list[dict[str, Any]]] = {n: [] for n in presets}
    with tqdm(total=len(contexts) * (1 + len(presets)), desc=f"kvc: measuring {lm.name}'s rate on chat contexts",
              file=sys.stderr, disable=not progress, leave=False, dynamic_ncols=True) as bar, torch.inference_mode():
        # the answers generated on the prefilling model (bfloat16 where onboarding runs so): any of the model's own
        # greedy answers is a chat continuation to score; the KLs are read in ``lm``'s own dtype
        conts = chat_continuations(probe.fast, probe.caches)
        for c, cache, cont in zip(contexts, probe.caches, conts):
            side = ExactSide(continue_logits(lm, cache, cont))
            bar.update(1)
            for name, (table, target) in presets.items():
                args = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in table.items()}
                plan = controlled_plan(cache, lm, name, {**args, "cal": cal}, target, bare,
                                       importance=probe.importance(cache, args.get("tokenscale")))
                pred = float(plan.params["rate"]["predicted_kl"])
                dec, _ = roundtrip(cache, plan)
                kl = side.compare(continue_logits(lm, dec, cont))["kl"]
                rows[name].append({"text": c.text, "tokens": int(len(c.ids)), "kl": kl, "predicted": pred})
                bar.update(1)
    from kvcodec.calibration.ratemodel import CHAT_FACTOR_RANGE

    out: dict[str, dict[str, Any]] = {}
    for name, rs in rows.items():
        logs = [math.log(r["kl"] / r["predicted"]) for r in rs if r["kl"] > 0 and r["predicted"] > 0]
        if logs:
            f = float(np.clip(math.exp(float(np.mean(logs))), *CHAT_FACTOR_RANGE))
            out[name] = {"factor": f, "rows": rs, "version": VERSION}
    return out
