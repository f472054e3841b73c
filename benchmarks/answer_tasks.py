"""The answer benchmark's questions (issue 53): needles and RULER-style tasks planted in the machine's own texts.

Why these tasks: a knowledge base does not know its future questions, and mean KL over a continuation averages
over easy tokens, so the codec is judged on what users get, answers. Each task has exactly one right answer that
is written nowhere but in the context (invented names, random numbers), so a right answer proves the fact
reached the model through the cache. The families follow RULER (Hsieh et al., 2024), built here from local text
instead of downloaded essays:

* ``needle``     planted facts with invented names (an access code, a keeper's name, a founding year);
* ``multikey``   several needles of one form, "The special magic number for KEY is N.": the others are distractors;
* ``multivalue`` one key with several values; every value must be answered;
* ``vartrack``   variable-assignment chains ("VAR B = VAR A"); every variable holding the value must be named;
* ``cwe``        common-word extraction from a numbered word list drawn from the text's vocabulary.

Contexts are generated deterministically from a seed, for any model (``count_tokens`` is the model's tokenizer),
so both shipped models answer the same questions. The held-out split is fixed by each question's id (two in five):
nothing may be tuned on held-out questions, and the haystacks come from :data:`kvcodec.texts.HELD_OUT` texts
by default. Scoring is RULER's string match: every reference answer must appear in the output, compared after
lower-casing and dropping punctuation. Importable without a model (the tests import it).
"""

from __future__ import annotations

import hashlib
import math
import random
import re
from dataclasses import dataclass
from typing import Callable, Sequence

import rag_workload

FAMILIES = ("needle", "multikey", "multivalue", "vartrack", "cwe")
HELD_OUT_FRACTION = 0.4  # of the questions, by id (hash), never by position or family

# the wording of each family's request, fixed before any run (one wording: prompt tuning on the test is not allowed)
_ASK = {
    "needle": "Answer from the documents above, with the value only. {q}",
    "multikey": "Answer from the documents above, with the number only. {q}",
    "multivalue": "Answer from the documents above, with the numbers only, separated by commas. {q}",
    "vartrack": "Answer from the documents above, with the variable names only, separated by commas. {q}",
    "cwe": "Answer from the list above, with the words only, separated by commas. {q}",
}
# the invented names of bench_rag's planted facts, a few more syllables and names for more facts per context
_SYL_A = rag_workload._SYL_A + ("Rud", "Sab", "Tor", "Ulm")
_SYL_B = rag_workload._SYL_B + ("ric", "mont")
_THINGS = rag_workload._THINGS
_FIRST = rag_workload._FIRST + ("Agnes", "Viggo")
_LAST = rag_workload._LAST + ("Rasmark", "Falkenrud")


@dataclass(frozen=True)
class Question:
    """One question about a context: ``answers`` must all appear in the model's output."""

    id: str
    family: str
    question: str  # the whole user turn (the family's fixed wording around the question)
    answers: tuple[str, ...]
    split: str  # "held-in" or "held-out"


@dataclass(frozen=True)
class Context:
    """One document holding planted facts, and the questions about them."""

    id: str
    family: str
    text: str
    questions: tuple[Question, ...]
    haystack: str  # the text the facts are planted in ("" for cwe, whose list is the document)


def split_of(qid: str) -> str:
    """The question's split, from its id alone (so adding questions never moves an old one)."""
    h = int.from_bytes(hashlib.sha256(qid.encode()).digest()[:8], "big")
    return "held-out" if h % 1000 < HELD_OUT_FRACTION * 1000 else "held-in"


def normalise(s: str) -> str:
    """Lower case, punctuation dropped, whitespace collapsed (numbers and names survive as words)."""
    return " ".join(re.sub(r"[^\w\s]", " ", s.lower()).split())


def score(output: str, answers: Sequence[str]) -> dict[str, float | bool]:
    """RULER's string match: ``exact`` when every reference appears (as whole words) in the output; ``share`` the
    fraction that does."""
    out = f" {normalise(output)} "
    hits = [f" {normalise(a)} " in out for a in answers]
    return {"exact": all(hits), "share": sum(hits) / len(hits)}


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95 % Wilson score interval of a proportion ``k / n`` (good near 0 and 1, unlike the normal one)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    d = 1 + z * z / n
    c = (p + z * z / (2 * n)) / d
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (max(0.0, c - h), min(1.0, c + h))


def _paragraphs(text: str) -> list[str]:
    paras = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    return [p for p in paras if len(p) < 4000]  # a huge block (a generated table) would swallow the budget


def _haystack(texts: Sequence[str], load: Callable[[str], str], rng: random.Random, budget: int,
              count: Callable[[str], int]) -> list[str]:
    """Paragraphs of one of ``texts`` (chosen by ``rng``), from a random start, wrapping around, until ``budget``
    tokens; paragraphs are counted one by one, so no whole document is tokenized."""
    name = texts[rng.randrange(len(texts))]
    paras = _paragraphs(load(name))
    if not paras:
        raise ValueError(f"text {name!r} has no paragraphs")
    i, out, used = rng.randrange(len(paras)), [], 0
    while used < budget and len(out) < 20 * len(paras):
        p = paras[i % len(paras)]
        n = count(p + "\n\n")
        if used + n > budget and out:
            break
        out.append(p)
        used += n
        i += 1
    return out


def _plant(paras: list[str], needles: Sequence[str], rng: random.Random) -> str:
    """``needles`` inserted between paragraphs at random depths (each its own paragraph)."""
    slots = sorted(rng.randrange(len(paras) + 1) for _ in needles)
    out, j = [], 0
    order = list(needles)
    rng.shuffle(order)
    for i in range(len(paras) + 1):
        while j < len(slots) and slots[j] == i:
            out.append(order[j])
            j += 1
        if i < len(paras):
            out.append(paras[i])
    return "\n\n".join(out)


def _name(rng: random.Random, used: set[str]) -> str:
    while True:
        n = rng.choice(_SYL_A) + rng.choice(_SYL_B)
        if n not in used:
            used.add(n)
            return n


def _number(rng: random.Random, digits: int, used: set[str]) -> str:
    while True:
        n = str(rng.randrange(10 ** (digits - 1), 10 ** digits))
        if n not in used:
            used.add(n)
            return n


def _questions(cid: str, family: str, pairs: Sequence[tuple[str, tuple[str, ...]]]) -> tuple[Question, ...]:
    out = []
    for i, (q, answers) in enumerate(pairs):
        qid = f"{cid}/q{i}"
        out.append(Question(qid, family, _ASK[family].format(q=q), answers, split_of(qid)))
    return tuple(out)


def make_context(family: str, index: int, tokens: int, count: Callable[[str], int], load: Callable[[str], str],
                 texts: Sequence[str], seed: int = 53) -> Context:
    """Context ``index`` of ``family`` at about ``tokens`` tokens (as ``count`` tokenizes), deterministic in
    (family, index, tokens, seed, the texts)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; one of {', '.join(FAMILIES)}")
    cid = f"{family}-{tokens}-{index}"
    rng = random.Random(f"{seed}/{cid}")
    used: set[str] = set()
    if family == "cwe":
        return _cwe(cid, rng, tokens, count, load, texts)
    pairs: list[tuple[str, tuple[str, ...]]] = []
    needles: list[str] = []
    if family == "needle":
        for kind in ("code", "keeper", "year", "code"):
            place = f"{_name(rng, used)} {rng.choice(_THINGS)}"
            if kind == "code":
                v = _number(rng, 4, used)
                needles.append(f"The access code of the {place} is {v}.")
                pairs.append((f"What is the access code of the {place}?", (v,)))
            elif kind == "keeper":
                v = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
                needles.append(f"The keeper of the {place} is {v}.")
                pairs.append((f"Who is the keeper of the {place}?", (v,)))
            else:
                v = str(rng.randrange(1703, 1899))
                needles.append(f"The {place} was founded in the year {v}.")
                pairs.append((f"In which year was the {place} founded?", (v,)))
    elif family == "multikey":
        keys = [f"{_name(rng, used).lower()}-{_name(rng, used).lower()}" for _ in range(6)]
        vals = [_number(rng, 7, used) for _ in keys]
        needles = [f"The special magic number for {k} is {v}." for k, v in zip(keys, vals)]
        pairs = [(f"What is the special magic number for {k}?", (v,)) for k, v in zip(keys[:3], vals[:3])]
    elif family == "multivalue":
        for _ in range(2):
            k = f"{_name(rng, used).lower()}-{_name(rng, used).lower()}"
            vals = tuple(_number(rng, 7, used) for _ in range(3))
            needles += [f"One of the special magic numbers for {k} is {v}." for v in vals]
            pairs.append((f"What are all the special magic numbers for {k}?", vals))
    elif family == "vartrack":
        for _ in range(2):
            names = []
            while len(names) < 4:
                n = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
                if n not in used:
                    used.add(n)
                    names.append(n)
            v = _number(rng, 5, used)
            needles += [f"VAR {names[0]} = {v}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
            pairs.append((f"Find all variables that are assigned the value {v}.", tuple(names)))
    budget = max(64, tokens - sum(count(n + "\n\n") for n in needles))
    paras = _haystack(texts, load, rng, budget, count)
    if family == "vartrack":  # a chain's links go in order, each after the one it reads
        text = _plant_in_order(paras, needles, rng)
    else:
        text = _plant(paras, needles, rng)
    return Context(cid, family, text, _questions(cid, family, pairs), "\n\n".join(paras))


def _plant_in_order(paras: list[str], needles: Sequence[str], rng: random.Random) -> str:
    """Each chain's statements at increasing depths (two chains interleave), so every VAR is defined before use."""
    chains: list[list[str]] = []
    for n in needles:
        if "= VAR " not in n:
            chains.append([])
        chains[-1].append(n)
    placed: dict[int, list[str]] = {}
    for chain in chains:
        for s, n in zip(sorted(rng.randrange(len(paras) + 1) for _ in chain), chain):
            placed.setdefault(s, []).append(n)
    out: list[str] = []
    for i in range(len(paras) + 1):
        out += placed.get(i, [])
        if i < len(paras):
            out.append(paras[i])
    return "\n\n".join(out)


def _cwe(cid: str, rng: random.Random, tokens: int, count: Callable[[str], int], load: Callable[[str], str],
         texts: Sequence[str]) -> Context:
    """A numbered list of words from a text's vocabulary: three words 20x as often as the rest (RULER's cwe,
    three common words instead of ten: the shipped models are small)."""
    vocab: list[str] = []
    seen: set[str] = set()
    for name in texts:
        for w in re.findall(r"\b[a-z]{5,10}\b", load(name)):
            if w not in seen:
                seen.add(w)
                vocab.append(w)
    rng.shuffle(vocab)
    common, rare = vocab[:3], vocab[3:]
    sample = "\n".join(f"{100 + i}. {w}" for i, w in enumerate(rare[:50]))
    per_item = max(1.0, count(sample) / 50)  # tokens per list item, as this tokenizer counts them
    n_items = max(60, int(tokens / per_item))
    n_common = max(1, n_items // 30)  # each common word: 1/30 of the list; each rare word at most a few times
    words = [w for w in common for _ in range(n_common)]
    words += [rare[i % len(rare)] for i in range(n_items - len(words))]
    if -(-(n_items - 3 * n_common) // len(rare)) >= n_common:
        raise ValueError(f"the texts' vocabulary ({len(vocab)} words) is too small for a {n_items}-item list")
    rng.shuffle(words)
    text = "Below is a numbered list of words.\n" + "\n".join(f"{i + 1}. {w}" for i, w in enumerate(words))
    q = "What are the 3 most common words in the numbered list above?"
    return Context(cid, "cwe", text, _questions(cid, "cwe", [(q, tuple(common))]), "")


def make_contexts(families: Sequence[str], per_family: int, tokens: int, count: Callable[[str], int],
                  load: Callable[[str], str], texts: Sequence[str], seed: int = 53) -> list[Context]:
    """``per_family`` contexts of each family at ``tokens`` tokens."""
    return [make_context(f, i, tokens, count, load, texts, seed) for f in families for i in range(per_family)]
