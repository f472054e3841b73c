"""The QA workload behind bench_rag (issue 34): planted facts in real text, segments, retrieval, scoring.

Why planted facts: an extractive question about a license clause has many
near-answers a small model may paraphrase; an invented fact ("The access code
of the Brenvik archive is 4817.") has exactly one answer, written nowhere but
in the knowledge base, so a correct answer proves the knowledge reached the
model (no model knows it from pre-training). Every fact has its own invented
name, so BM25 finds its segment from the question alone.

The question set is a data file (``benchmarks/data/rag_questions.json``,
written by ``python benchmarks/rag_workload.py make``): each fact says where
it goes as a fraction of the knowledge base's characters, so any list of
texts (``--texts``) takes the same questions. The split into held-in and
held-out is in the file (deterministic: every fifth fact is held out).
Nothing reads the held-out facts before the requests: fine-tuning's
training data is the knowledge base text alone, and no prompt wording or
setting was chosen on them.

Importable without bm25s or peft (the tests import it); the retriever is
imported where it is built.
"""

from __future__ import annotations

import json
import random
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

QUESTIONS = Path(__file__).resolve().parent / "data" / "rag_questions.json"
# Knowledge base texts (kvcodec.texts names): licenses, the Python reference, C headers. ~68K tokens on Gemma 3, ~70K on SmolLM2.
KB_TEXTS = ("gpl3", "gpl2", "lgpl21", "gfdl13", "mpl2", "apache2", "pydoc-exec", "c-stdio", "c-stdlib")
# Chat history comes from a text outside the knowledge base (the paper's 20 %: it cannot be pre-cached or pre-learned).
HISTORY_TEXT = "changelog-apt"

_SYL_A = ("Bren", "Quor", "Hal", "Tess", "Varn", "Okon", "Pet", "Mar", "Lind", "Skel", "Ardu", "Fen", "Gral", "Isk",
          "Jov", "Kel")
_SYL_B = ("vik", "ath", "stead", "wick", "holt", "mere", "dale", "ova", "gard", "ton", "by", "rith", "sund", "lowe",
          "berg", "ness")
_THINGS = ("archive", "observatory", "ferry line", "seed vault", "harbour office", "glass works", "library", "mill",
           "lighthouse", "weather station", "printing house", "orchard")
_FIRST = ("Ilsa", "Tomas", "Maren", "Oskar", "Elvira", "Jonah", "Sunniva", "Aurel", "Petra", "Casimir", "Linnea",
          "Bruno")
_LAST = ("Drevanek", "Moltrup", "Haskaria", "Vendelbo", "Quistorp", "Ambrosek", "Tullberg", "Oxenhielm")


@dataclass(frozen=True)
class Fact:
    """One planted fact and its question; ``at`` is where it goes, as a fraction of the knowledge base's characters."""

    id: str
    fact: str
    question: str
    answer: str
    at: float
    split: str  # "held-in" or "held-out"


def make_facts(n: int = 240, seed: int = 34) -> list[Fact]:
    """``n`` facts with unique invented names, four kinds of answer (code, year, person, count), spread evenly."""
    if n > len(_SYL_A) * len(_SYL_B):
        raise ValueError(f"at most {len(_SYL_A) * len(_SYL_B)} facts (one invented name each)")
    rng = random.Random(seed)
    names = [a + b for a in _SYL_A for b in _SYL_B]
    rng.shuffle(names)
    out = []
    for i in range(n):
        name, thing = names[i], _THINGS[rng.randrange(len(_THINGS))]
        kind = i % 4
        if kind == 0:
            ans = str(rng.randint(1000, 9999))
            fact, q = (f"The access code of the {name} {thing} is {ans}.",
                       f"What is the access code of the {name} {thing}?")
        elif kind == 1:
            ans = str(rng.randint(1700, 1989))
            fact, q = f"The {name} {thing} was founded in {ans}.", f"In which year was the {name} {thing} founded?"
        elif kind == 2:
            ans = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
            fact, q = (f"The keeper of the {name} {thing} is {ans}.",
                       f"Who is the keeper of the {name} {thing}?")
        else:
            ans = str(rng.randint(21, 979))
            fact, q = f"The {name} {thing} has exactly {ans} windows.", f"How many windows does the {name} {thing} have?"
        out.append(Fact(id=f"f{i:03d}", fact=fact, question=q, answer=ans, at=(i + rng.random()) / n,
                        split="held-out" if i % 5 == 4 else "held-in"))
    return out


def load_facts(path: str | Path = QUESTIONS) -> list[Fact]:
    """The question file, checked: a malformed one is a one-line error, not a KeyError deep in a run."""
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        facts = [Fact(id=str(r["id"]), fact=str(r["fact"]), question=str(r["question"]), answer=str(r["answer"]),
                      at=float(r["at"]), split=str(r["split"])) for r in raw["facts"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path}: not a question file ({type(exc).__name__}: {exc})") from None
    bad = [f.id for f in facts if not (0.0 <= f.at < 1.0) or f.split not in ("held-in", "held-out") or not f.answer
           or f.answer not in f.fact]
    if bad or not facts:
        raise ValueError(f"{path}: facts with a bad position, split or answer: {bad[:5] or 'no facts'}")
    return facts


def plant(texts: Sequence[str], facts: Sequence[Fact]) -> list[str]:
    """Paragraphs of the knowledge base with every fact as a paragraph of its own at its place.

    A fact goes at the paragraph boundary nearest its position, so it never
    cuts a sentence of the real text and never straddles a segment boundary.
    """
    paras = [p for t in texts for p in re.split(r"\n\s*\n", t) if p.strip()]
    total = sum(len(p) for p in paras)
    starts, acc = [], 0
    for p in paras:
        starts.append(acc)
        acc += len(p)
    out: list[str] = []
    todo = sorted(facts, key=lambda f: f.at)
    j = 0
    for i, p in enumerate(paras):
        while j < len(todo) and todo[j].at * total <= starts[i]:
            out.append(todo[j].fact)
            j += 1
        out.append(p)
    out.extend(f.fact for f in todo[j:])
    return out


def segments(paras: Sequence[str], count: Callable[[str], int], max_tokens: int) -> list[str]:
    """Consecutive paragraphs packed into segments of at most ``max_tokens`` tokens (``count`` is the model's).

    A paragraph longer than a segment is cut by characters (real text only:
    facts are short paragraphs of their own).
    """
    pieces: list[str] = []
    for p in paras:
        n = count(p)
        if n <= max_tokens // 2:
            pieces.append(p)
            continue
        step = max(1, len(p) * (max_tokens // 2) // n)
        pieces.extend(p[s:s + step] for s in range(0, len(p), step))
    segs: list[str] = []
    cur: list[str] = []
    for p in pieces:
        if cur and count("\n\n".join(cur + [p])) > max_tokens:
            segs.append("\n\n".join(cur))
            cur = []
        cur.append(p)
    if cur:
        segs.append("\n\n".join(cur))
    return segs


def home_segment(segs: Sequence[str], fact: Fact) -> int:
    """Index of the one segment holding ``fact``'s sentence."""
    where = [i for i, s in enumerate(segs) if fact.fact in s]
    if len(where) != 1:
        raise ValueError(f"fact {fact.id} is in {len(where)} segments")
    return where[0]


class Retriever:
    """BM25 (bm25s) over the segments' paragraphs: the segment of the top paragraph is the request's knowledge.

    Paragraphs, not whole segments, are what BM25 scores: a segment of 8K
    tokens holds ~20 facts of the same four kinds, so the question's common
    words ("access code", "founded") outweigh its one rare name in a whole
    segment (measured: 179/240 segments right on Gemma at 8K), and not in a paragraph.
    """

    def __init__(self, segs: Sequence[str]) -> None:
        import bm25s

        self._bm25s = bm25s
        paras = [(i, p) for i, s in enumerate(segs) for p in s.split("\n\n") if p.strip()]
        self.owner = [i for i, _ in paras]
        self.index = bm25s.BM25()
        self.index.index(bm25s.tokenize([p for _, p in paras], stopwords="en", show_progress=False),
                         show_progress=False)

    def top(self, question: str) -> int:
        docs, _ = self.index.retrieve(self._bm25s.tokenize([question], stopwords="en", show_progress=False), k=1,
                                      show_progress=False)
        return self.owner[int(docs[0][0])]


def normalise(s: str) -> str:
    """SQuAD-style: lower case, punctuation and articles dropped, whitespace collapsed."""
    s = re.sub(r"[^\w\s]", " ", s.lower())
    return " ".join(w for w in s.split() if w not in ("a", "an", "the"))


def first_span(output: str) -> str:
    """The answer's first span: up to the first line break or sentence end (a period followed by a space or the end)."""
    line = output.strip().split("\n", 1)[0]
    return re.split(r"\.(?:\s|$)", line, maxsplit=1)[0]


def score(output: str, answer: str, fact: str | None = None) -> dict[str, bool]:
    """Exact match: the first span, normalised, is the answer, or the planted ``fact`` quoted whole; lenient: the
    normalised answer is in the output.

    Why the quoted fact counts as exact: asked for "the value only", SmolLM2
    answers "The access code of the Marberg seed vault is 6236." -- the one
    sentence that states the value and nothing else. Counting it wrong measured
    the model's answer style, not whether the knowledge reached it (every
    SmolLM2 answer scored 0 exact while a quarter held the key). A restatement
    with any other value, or any other sentence, is still not exact.
    """
    key = normalise(answer)
    span = normalise(first_span(output))
    return {"exact": span == key or (fact is not None and span == normalise(fact)),
            "lenient": f" {key} " in f" {normalise(output)} "}


def prompt(history: str, question: str) -> str:
    """The user turn after the knowledge: chat history, then the question (one wording, fixed before any run)."""
    return (f"Earlier in this conversation:\n{history}\n\n"
            f"Answer from the documents above, with the value only. {question}")


def main(argv: list[str] | None = None) -> None:
    """``make [N]``: write the question file (deterministic)."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "make":
        raise SystemExit("usage: python benchmarks/rag_workload.py make [N]")
    facts = make_facts(int(args[1]) if len(args) > 1 else 240)
    doc: dict[str, Any] = {"about": "Planted facts for benchmarks/bench_rag.py (issue 34); 'at' = fraction of the "
                                    "knowledge base's characters; written by `python benchmarks/rag_workload.py make`.",
                           "facts": [f.__dict__ for f in facts]}
    QUESTIONS.parent.mkdir(parents=True, exist_ok=True)
    QUESTIONS.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"{len(facts)} facts -> {QUESTIONS}")


if __name__ == "__main__":
    main()
