"""GGUF -> HF conversion of the embedded model, with and without parsing the GGUF once (issue 21).

transformers' GGUF loading builds a ``gguf.GGUFReader`` (every metadata field,
the whole vocabulary) for the config, the weights and the tokenizer separately,
and rebuilds gguf's tensor-name map per module; ``kvcodec.models.load._gguf_parsed_once``
shares one of each within a conversion. This script converts the embedded
SmolLM2 GGUF into temporary directories alternately without (``plain``) and with
(``once``) that, in the same process, checks that every output file is
byte-identical, and prints the seconds of each run and the median ratio.

    python benchmarks/bench_convert.py --repeats 2
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import statistics
import tempfile
from pathlib import Path

import harness
from kvcodec.models import load as M


def digest(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir())}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    run = harness.cli(ap, argv, case="convert")
    args = run.args
    gguf, once = M._gguf_path(), M._gguf_parsed_once
    times: dict[str, list[float]] = {"plain": [], "once": []}
    outputs: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as work:
        for i in range(args.repeats):
            for mode in ("plain", "once"):
                M._gguf_parsed_once = once if mode == "once" else contextlib.nullcontext  # type: ignore[assignment]
                dest = Path(work) / f"{mode}-{i}"
                with harness.stopwatch(cpu=None) as sw:  # alternating modes: one call at a time
                    M._convert_gguf(gguf, dest)
                times[mode].append(sw.wall)
                outputs[mode] = digest(dest)
                print(f"{mode}: {times[mode][-1]:.1f} s", flush=True)
    M._gguf_parsed_once = once
    same = outputs["plain"] == outputs["once"]
    print(f"median plain {statistics.median(times['plain']):.1f} s, once {statistics.median(times['once']):.1f} s: "
          f"{statistics.median(times['plain']) / statistics.median(times['once']):.2f}x faster; "
          f"outputs byte-identical: {same}")
    if not same:
        raise SystemExit("outputs differ")
    run.emit({"seconds": times, "median_plain_s": statistics.median(times["plain"]),
              "median_once_s": statistics.median(times["once"]), "outputs_identical": same})


if __name__ == "__main__":
    main()
