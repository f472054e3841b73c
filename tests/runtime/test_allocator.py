"""kvcodec.runtime.allocator: a process reuses freed tensor memory instead of faulting it in again."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PROBE = """
import resource, sys
import numpy as np
if sys.argv[1] == "tuned":
    from kvcodec.runtime.allocator import tune_allocator
    assert tune_allocator()
def faults_of_one_request():
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bufs = [np.ones(2 << 20, np.float32) for _ in range(16)]  # 16 x 8 MiB tensors, like a layer's decoded K/V
    del bufs
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
faults_of_one_request()
print(faults_of_one_request())
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_second_request_reuses_faulted_memory():
    def second(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    # 128 MiB = 32,768 pages: untuned glibc returns freed memory beyond its (dynamic, 2 x 8 MiB) trim threshold
    # to the kernel, so each request faults part of it in again (~8,000 pages here)
    assert second("default") > 4_000
    assert second("tuned") < 1_000


def test_kvc_command_tunes_the_allocator(monkeypatch):
    import kvcodec.runtime.allocator as al
    from kvcodec.cli.main import main

    calls = []
    monkeypatch.setattr(al, "tune_allocator", lambda: calls.append(1) or True)
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code in (0, None) and calls == [1]


FIRST = """
import resource, sys, threading
import numpy as np
from kvcodec.runtime.allocator import prefault, tune_allocator
assert tune_allocator()
if sys.argv[1] == "prefault":  # in another thread, as kvcodec.runtime.warmup.prewarm runs it while the model loads
    t = threading.Thread(target=prefault, args=(160 << 20,))
    t.start()
    t.join()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
bufs = [np.ones(2 << 20, np.float32) for _ in range(16)]  # a fresh process's first request: 128 MiB
del bufs
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_prefault_in_another_thread_serves_the_first_request():
    """The pages a background thread faulted in and freed serve the main thread's first request: one
    arena (tune_allocator), so they are not stranded in the thread's own."""
    def first(mode: str) -> int:
        out = subprocess.run([sys.executable, "-c", FIRST, mode], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    cold = first("none")  # up to 32,768 pages of first touch (fewer where the kernel backs the heap with huge pages)
    assert cold > 2_000
    assert first("prefault") < cold // 4


def test_prefault_is_bounded():
    from kvcodec.runtime.allocator import PREFAULT_MAX, prefault

    assert prefault(-5) == 0
    assert prefault(1 << 20) == 0  # under one piece: nothing
    assert prefault(40 << 20) == 32 << 20
    assert PREFAULT_MAX == 1 << 30  # prefault(n) touches min(n, PREFAULT_MAX)


def test_prefault_leaves_most_free_memory_alone(monkeypatch):
    import kvcodec.runtime.allocator as al

    monkeypatch.setattr(al, "_available", lambda: 100 << 20)
    assert al.prefault(1 << 30) == 16 << 20  # a quarter of 100 MiB, in 16 MiB pieces
