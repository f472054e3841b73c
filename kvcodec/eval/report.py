"""Reporting a rate-quality sweep's rows: CSV, Pareto frontiers and interpolated bits at a KL, the plot, and a
Markdown table.

Why a module of its own: these read finished rows only (``kvc curve``'s JSON, or a benchmark's), so they are
used without a model or a sweep (benchmarks/bench_curve.py, bench_calibration.py); the sweep
(:mod:`kvcodec.eval.curve`) writes its outputs through them.
"""

from __future__ import annotations

import csv
import io
import math
import os
from pathlib import Path
from typing import Any

from kvcodec.atomic import atomic_path, atomic_write_text

PLOT_FORMATS = (".png", ".svg", ".pdf")  # what --plot writes (matplotlib backends without extra deps)
CSV_FIELDS = (
    "text", "family", "method", "bits_per_element", "ratio_vs_fp16", "file_bytes", "kl_mean", "dppl_percent",
    "top1_agreement", "greedy_match", "ppl_exact", "ppl_decoded", "context_tokens", "stored_tokens",
    "continuation_tokens", "external_bytes", "encode_s", "decode_s", "eval_s", "error",
)


def write_csv(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(CSV_FIELDS), extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    atomic_write_text(path, buf.getvalue())


# -- plotting -----------------------------------------------------------------------------
KL_FLOOR = 1e-7


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated (fewer-or-equal bits and lower KL), sorted by bits."""
    front: list[tuple[float, float]] = []
    for b, k in sorted(points, key=lambda p: (p[0], p[1])):
        if not front or k < front[-1][1]:
            front.append((b, k))
    return front


def bits_at_kl(front: list[tuple[float, float]], kl: float) -> float | None:
    """Bits of a Pareto frontier of (bits, KL) points at ``kl``, log-log interpolated; None outside its KL range."""
    pts = sorted(front, key=lambda p: p[1])  # increasing KL = decreasing bits
    for (b0, k0), (b1, k1) in zip(pts, pts[1:]):
        if k0 <= kl <= k1:
            if k1 == k0:
                return min(b0, b1)
            t = (math.log(kl) - math.log(k0)) / (math.log(k1) - math.log(k0))
            return math.exp(math.log(b0) + t * (math.log(b1) - math.log(b0)))
    return pts[0][0] if pts and kl == pts[0][1] else None


def plot_curve(result: dict[str, Any], out: str | os.PathLike) -> None:
    """One subplot per text: x = bits/element (log), y = mean KL (log); a line per family (its Pareto frontier)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if not r.get("error") and r.get("bits_per_element")]
    texts = list(dict.fromkeys(r["text"] for r in rows)) or ["(no data)"]
    families = list(dict.fromkeys(r["family"] for r in rows))
    colors = {f: plt.cm.tab10(i % 10) for i, f in enumerate(families)}
    markers = "osD^v<>PX*hp"
    fig, axes = plt.subplots(1, len(texts), figsize=(6.2 * len(texts), 5.2), squeeze=False)
    for ax, text in zip(axes[0], texts):
        for fam in families:
            fr = [r for r in rows if r["text"] == text and r["family"] == fam]
            if not fr:
                continue
            pts = [(float(r["bits_per_element"]), max(float(r["kl_mean"]), KL_FLOOR)) for r in fr]
            front = pareto(pts)
            ax.plot([p[0] for p in front], [p[1] for p in front], "-", color=colors[fam], lw=1.6, alpha=0.85, label=fam)
            for i, (r, (b, k)) in enumerate(zip(fr, pts)):
                on = (b, k) in front
                ax.plot([b], [k], markers[i % len(markers)], color=colors[fam], ms=6,
                        mfc=colors[fam] if on else "none")
                ax.annotate(str(r["method"]), (b, k), textcoords="offset points", xytext=(4, 3), fontsize=6, color=colors[fam])
        ax.set_xscale("log")
        ax.set_yscale("log")
        from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 4.0, 6.0)))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.axhline(KL_FLOOR, color="0.7", lw=0.6, ls=":")
        ax.set_xlabel("bits per KV element (real .kvc file bytes; log)")
        ax.set_ylabel(f"mean KL(exact || decoded), nats (log; 0 drawn at {KL_FLOOR:g})")
        ax.set_title(f"{text}: {result['settings'].get('max_tokens')} ctx, {result['settings'].get('continuation')} cont. tokens",
                     fontsize=10)
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
        ax.legend(fontsize=7, loc="best", title="family (line = Pareto frontier;\nfilled = on frontier)", title_fontsize=6)
    fig.suptitle(f"kvcodec rate vs. quality, model {result.get('model')} (one panel per text)", fontsize=11)
    fig.tight_layout()
    try:
        with atomic_path(out) as tmp:  # the temp name has no image suffix: name the format
            fig.savefig(tmp, dpi=130, format=Path(out).suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table (text x method) of the measured rows."""
    head = "| text | family | method | bits/elem | ratio vs fp16 | KL (nats) | ΔPPL % | top-1 | greedy |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['text']} | {r['family']} | {r['method']} | error: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['text']} | {r['family']} | {r['method']} | {r['bits_per_element']:.3f} | {r['ratio_vs_fp16']:.2f}x | "
            f"{r['kl_mean']:.2e} | {r['dppl_percent']:+.3f} | {r['top1_agreement']:.3f} | {r['greedy_match']:.3f} |"
        )
    return "\n".join(lines)

