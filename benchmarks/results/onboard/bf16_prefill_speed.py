"""A 1,024-token prefill in float32 and in bfloat16, side by side on this CPU (issue 54: does onboarding's bfloat16
twin pay here?). ``kvcodec.models.compute.native_bf16`` picks bfloat16 where the CPU has AMX tiles or AVX512-BF16.

Usage: ``OMP_NUM_THREADS=1 python bf16_prefill_speed.py [MODEL ...] > OUT.json`` (default: both shipped models). One
thread; the two dtypes alternate, ``REPEATS`` times each, and the least CPU-s (``time.process_time``) of each is
reported, with a 1,024 x 896 x 4,864 matrix product (a 0.5B model's MLP shape) for scale.
"""

import copy
import json
import platform
import sys
import time

import torch

from kvcodec.models.compute import native_bf16
from kvcodec.models.load import load_model

REPEATS = 3
torch.set_num_threads(1)


def cpu_s(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        info = {k.strip(): v for k, v in (line.split(":", 1) for line in f if ":" in line)}
    return " ".join(info.get(k, "?").strip() for k in ("model name", "cpu family", "model"))


out = {"cpu": cpu_name(), "machine": platform.machine(), "torch": torch.__version__, "native_bf16": native_bf16(),
       "amx": torch.cpu._is_amx_tile_supported(), "avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "models": {}}
for name in sys.argv[1:] or ["smollm2", "gemma3-270m"]:
    lm = load_model(name)
    models = {"float32": lm.model, "bfloat16": copy.deepcopy(lm.model).to(torch.bfloat16)}
    ids = torch.as_tensor(lm.tokenizer(open(__file__).read() * 20)["input_ids"][:1024]).unsqueeze(0)
    best = {k: float("inf") for k in models}
    with torch.inference_mode():
        for m in models.values():
            m(input_ids=ids[:, :32])  # warm-up
        for _ in range(REPEATS):
            for k, m in models.items():
                best[k] = min(best[k], cpu_s(lambda: m(input_ids=ids, use_cache=True, logits_to_keep=1)))
    out["models"][name] = {"tokens": int(ids.shape[1]), "cpu_s": best, "float32_over_bfloat16": best["float32"] / best["bfloat16"]}
x, w = torch.randn(1024, 896), torch.randn(4864, 896)
mm = {}
for dt in (torch.float32, torch.bfloat16):
    xx, ww = x.to(dt), w.to(dt)
    mm[str(dt).removeprefix("torch.")] = min(cpu_s(lambda: [xx @ ww.T for _ in range(10)]) for _ in range(REPEATS))
out["matmul_1024x896x4864_x10_cpu_s"] = mm
print(json.dumps(out, indent=1))
