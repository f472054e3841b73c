"""CPU encode / decode throughput of `.kvc` files on a real cache (issue 4 speed targets).

    python benchmarks/bench_speed.py                      # 4096-token gpl3 SmolLM2 cache, all presets
    python benchmarks/bench_speed.py --tokens 2048 --presets balanced --repeat 5 --json
    python benchmarks/bench_speed.py --lm gemma3-270m --tokens 1024      # another shipped model (head_dim 256)

Single thread (``torch.set_num_threads(1)``, ``NUMBA_NUM_THREADS=1``). Throughput
is MB/s of fp16 K/V (the cache as float16: layers x K/V x heads x tokens x
head_dim x 2 bytes), measured in the same run against two baselines:

* ``raw_read``: reading the same cache from a plain fp16 ``.npy`` on disk (page
  cache warm) into torch tensors -- what the codec is compared with;
* ``memcpy``: ``torch.from_numpy(arr).clone()`` of the in-memory fp16 cache
  (the memory-bandwidth floor).

Each measurement is the best of ``--repeat`` runs; ratios (``decode_vs_raw`` =
decode time / raw-read time) are what to compare on a loaded machine. Decode is
``KvcReader(path).read_cache()`` (CRC checks, header, attachments, every chunk,
torch tensors); encode is ``write_kvc`` to memory with a prepared plan.
Targets: decode >= 200 MB/s, encode >= 30 MB/s on one core.

``--target avx2`` compiles the numba kernels for an AVX2-only CPU (Haswell:
AVX2, FMA, F16C, BMI2; every AVX-512 feature off) through ``NUMBA_CPU_NAME`` /
``NUMBA_CPU_FEATURES``, so an AVX-512 machine measures what an AVX2-only one
runs; the JIT cache keys on the target, so both builds coexist. The script
checks the decode kernel's assembly and reports whether it uses any 512-bit
(zmm) register.
"""

from __future__ import annotations

import os
import sys

# The numba target must be chosen before numba is imported (argparse runs later).
TARGETS = {"host": None, "avx2": ("haswell", "+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+lzcnt,+popcnt,+movbe,+sse4.2,"
                                   "-avx512f,-avx512bw,-avx512cd,-avx512dq,-avx512vl,-avx512vbmi,-avx512vnni")}
_target = sys.argv[sys.argv.index("--target") + 1] if "--target" in sys.argv[:-1] else "host"
if _target not in TARGETS:
    raise SystemExit(f"--target must be one of {', '.join(TARGETS)}")
if TARGETS[_target] is not None:
    os.environ["NUMBA_CPU_NAME"], os.environ["NUMBA_CPU_FEATURES"] = TARGETS[_target]
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import harness  # noqa: E402
from common import get_cache  # noqa: E402  (the cache on disk: $KVC_BENCH_CACHE/speed-<text>-<tokens>.h5)
from kvcodec.calibration.store import default_resolver, load_calibration  # noqa: E402
from kvcodec.format.reader import KvcReader  # noqa: E402
from kvcodec.format.writer import write_kvc  # noqa: E402
from kvcodec.api import make_plan  # noqa: E402
from kvcodec.plan.presets import preset_info  # noqa: E402


def kernel_uses_zmm() -> bool | None:
    """Whether the compiled fused decode kernel touches any 512-bit register.

    None when numba cannot tell: the kernel was not compiled in this process, or
    it was loaded from numba's on-disk cache, whose code numba does not disassemble
    (set NUMBA_CACHE_DIR to an empty directory to force a compile and get an answer).
    """
    import warnings

    from kvcodec.decode.cpu.fused import _decode_kernel

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asm = _decode_kernel.inspect_asm()
    if not asm or any("cached code" in str(w.message) for w in caught):
        return None
    return any("zmm" in a for a in asm.values())


def host_simd_flags() -> str:
    flags = harness.machine()["simd"]
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vbmi2")
    return " ".join(f for f in flags if f in wanted) or "unknown"


def needs_calibration(preset: str) -> bool:
    """A lossy preset plans with the model's calibration; the lossless ones and ``baseline:NAME`` do not."""
    return not preset.startswith("baseline:") and preset_info(preset).lossy


def best(fn, repeat: int) -> float:
    """Best wall seconds of ``repeat`` runs (harness.timeit)."""
    return harness.timeit(fn, repeat, cpu=None).min


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="gpl3")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--presets", default="lossless,near-lossless,balanced,small")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--encode-repeat", type=int, default=1)
    ap.add_argument("--model", action="store_true",
                    help="plan with the model as `kvc encode --model` does: token-importance classes (tokenscale) "
                         "for balanced/small; the scoring pass runs before the timed encode")
    ap.add_argument("--lm", default="smollm2", help="the model whose cache is coded: a shipped model's name or a local HF dir")
    ap.add_argument("--target", choices=list(TARGETS), default="host",
                    help="numba target: host (this CPU) or avx2 (an AVX2-only Haswell-class CPU)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    run = harness.cli(ap, argv, case="speed")
    args = run.args
    if args.target != _target:
        raise SystemExit("--target must be given on the command line (numba reads it at import), not as a default")
    torch.set_num_threads(1)

    cache = get_cache(args.text, args.tokens, args.lm).to(torch.float16)
    arrays = [t.numpy() for t in cache.keys] + [t.numpy() for t in cache.values]
    nbytes = sum(a.nbytes for a in arrays)
    mb = nbytes / 1e6
    tmp = Path(tempfile.mkdtemp(prefix="kvc-speed-"))
    raw = tmp / "cache.npy"
    np.save(raw, np.concatenate([a.ravel() for a in arrays]))  # flat: a ragged cache's layers differ in length
    offs = np.cumsum([0] + [a.size for a in arrays])
    L = cache.fingerprint.num_layers
    presets = [p for p in args.presets.split(",") if p]
    lm = None
    if args.model:
        from kvcodec.models.load import load_model

        lm = load_model(args.lm)
    # The lossy presets need the model's calibration. get_plan only loads one (never builds), so a model this
    # machine has not calibrated (a local HF dir of an unseen model) crashed here; `kvc encode` builds it on first
    # use, and so does this benchmark now: before any timing, once, with progress.
    cal = None
    if any(needs_calibration(p) for p in presets):
        cal = load_calibration(cache.fingerprint.id)
        if cal is None:
            from kvcodec.calibration.build import ensure_calibration
            from kvcodec.models.load import load_model

            cal = ensure_calibration(lm or load_model(args.lm))

    def raw_read():
        a = np.load(raw)
        return [torch.from_numpy(a[offs[i]:offs[i + 1]].reshape(arrays[i].shape)) for i in range(2 * L)]

    raw_read()  # page cache warm
    t_raw = best(raw_read, max(3, args.repeat))
    t_mem = best(lambda: [torch.from_numpy(a).clone() for a in arrays], max(3, args.repeat))

    res: dict = {"lm": args.lm, "text": args.text, "tokens": args.tokens, "model_plan": bool(args.model), "fp16_mb": mb, "loadavg_start": os.getloadavg()[0],
                 "raw_read_s": t_raw, "raw_read_mb_s": mb / t_raw, "memcpy_s": t_mem, "memcpy_mb_s": mb / t_mem, "presets": {}}
    for name in presets:
        plan = make_plan(cache, name, model=lm, calibration=cal if needs_calibration(name) else None)
        buf = io.BytesIO()

        def enc():
            buf.seek(0)
            buf.truncate()
            write_kvc(cache, buf, plan)

        enc()  # warm (numba JIT / cache load)
        t_enc = best(enc, args.encode_repeat)
        path = tmp / f"{name}.kvc"
        path.write_bytes(buf.getvalue())

        def dec():
            with KvcReader(path, attachment_resolver=default_resolver) as r:
                return r.read_cache(backend="cpu")

        dec()  # warm: JIT, page cache, calibration attachments
        t_dec = best(dec, args.repeat)
        # baseline again, right after, to bracket load changes
        t_raw2 = best(raw_read, 3)
        t_raw_b = min(t_raw, t_raw2)
        res["presets"][name] = {
            "kvc_bytes": path.stat().st_size, "bits_per_element": path.stat().st_size * 8 / (nbytes / 2),
            "encode_s": t_enc, "encode_mb_s": mb / t_enc, "decode_s": t_dec, "decode_mb_s": mb / t_dec,
            "decode_vs_raw": t_dec / t_raw_b, "encode_vs_raw": t_enc / t_raw_b, "raw_read_s_after": t_raw2,
        }
    res["loadavg_end"] = os.getloadavg()[0]
    res["target"] = {"name": args.target, "numba_cpu": os.environ.get("NUMBA_CPU_NAME", "host"),
                     "decode_kernel_uses_zmm": kernel_uses_zmm(), "host_flags": host_simd_flags()}
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    run.emit(res)
    if args.json:
        print(json.dumps(res, indent=2))
        return
    print(f"numba target {args.target} ({res['target']['numba_cpu']}); decode kernel uses zmm (AVX-512) registers: "
          f"{res['target']['decode_kernel_uses_zmm']}; host CPU flags: {res['target']['host_flags']}")
    print(f"cache: {args.text} {args.tokens} tokens, {mb:.1f} MB fp16; load average {res['loadavg_start']:.1f} -> {res['loadavg_end']:.1f}")
    print(f"baselines: raw fp16 .npy read {res['raw_read_mb_s']:.0f} MB/s ({t_raw * 1e3:.1f} ms), "
          f"in-memory from_numpy+clone {res['memcpy_mb_s']:.0f} MB/s")
    print(f"{'preset':14s} {'bits/el':>7s} {'enc MB/s':>9s} {'dec MB/s':>9s} {'dec/raw':>8s} {'enc/raw':>8s}")
    for name, r in res["presets"].items():
        print(f"{name:14s} {r['bits_per_element']:7.2f} {r['encode_mb_s']:9.1f} {r['decode_mb_s']:9.1f} "
              f"{r['decode_vs_raw']:8.1f} {r['encode_vs_raw']:8.1f}")


if __name__ == "__main__":
    main()
