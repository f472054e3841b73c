"""A worker process of the KDN service (:func:`main`, started by :mod:`kvcodec.service.workers`): the work whose cost grows with a
request -- verifying (decoding) a put entry, parsing a large JSON body, tokenizing a text lookup -- runs here,
never on the service's event loop, and a job that outlives its deadline is ended by killing the process
(:mod:`kvcodec.service.workers` is the parent's side).

Protocol on stdin / stdout, both ways: frames of ``<u32 header length><u64 payload length><header JSON>
<payload>``; no pickling.  Requests (header ``op``):

* ``check`` (payload: the ``.kvc``): the cheap checks (:func:`~kvcodec.service.checks.open_entry`), then
  ``{"declared": n}``; the parent answers ``{"go": true|false}`` after its quota check; then the decode
  (:func:`~kvcodec.service.checks.verify_entry`) and ``{"ok": true}``;
* ``lookup`` (payload: the JSON body): the prefix keys of the lookup, tokenizing ``text`` with the
  tokenizer of its model (given with ``--tokenizer FINGERPRINT=DIR``);
* ``contains`` (payload: the JSON body): the key strings;
* ``ping``.

Every failure is a reply ``{"error": "<one line>", "status": <http status>}``; nothing is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from typing import Any, BinaryIO

from kvcodec.service.checks import (
    HttpError,
    contains_keys,
    error_line,
    lookup_candidates,
    open_entry,
    parse_json,
    parse_lookup,
    verify_entry,
)

FRAME = struct.Struct("<IQ")
TEST_OPS_ENV = "KVCODEC_WORKER_TEST_OPS"  # "1" enables the ``spin`` and ``alloc`` ops (tests of deadlines, memory)
MAX_HEADER = 1 << 20
WORKER_NICE = 10  # CPU priority below the service process (Unix nice increment)


def read_frame(f: BinaryIO) -> tuple[dict[str, Any], bytes] | None:
    head = f.read(FRAME.size)
    if len(head) < FRAME.size:
        return None
    hl, pl = FRAME.unpack(head)
    if hl > MAX_HEADER:
        raise ValueError(f"frame header of {hl} bytes")
    header = json.loads(f.read(hl))
    payload = f.read(pl) if pl else b""
    if len(payload) != pl:
        return None
    return header, payload


def write_frame(f: BinaryIO, header: dict[str, Any], payload: bytes = b"") -> None:
    h = json.dumps(header, separators=(",", ":")).encode()
    f.write(FRAME.pack(len(h), len(payload)) + h)
    if payload:
        f.write(payload)
    f.flush()


class Worker:
    def __init__(self, tokenizers: dict[str, str], inp: BinaryIO, out: BinaryIO, memory: int = 0) -> None:
        self.memory = memory
        self._tok_dirs = tokenizers
        self._toks: dict[str, Any] = {}
        self.inp, self.out = inp, out

    def tokenizer(self, fingerprint: str) -> Any:
        tok = self._toks.get(fingerprint)
        if tok is None:
            d = self._tok_dirs.get(fingerprint)
            if d is None:
                raise HttpError(422, f"this service has no tokenizer for model {fingerprint[:80]} (start it with "
                                     "--model, or send token_ids)")
            from transformers import AutoTokenizer

            tok = self._toks[fingerprint] = AutoTokenizer.from_pretrained(d, local_files_only=True)
        return tok

    def reply(self, header: dict[str, Any]) -> None:
        write_frame(self.out, header)

    def serve(self) -> None:
        while True:
            frame = read_frame(self.inp)
            if frame is None:
                return
            req, payload = frame
            try:
                self.handle(req, payload)
            except HttpError as e:
                self.reply({"error": str(e), "status": e.status})
            except MemoryError:  # over this process's data limit (--worker-memory): refused, and this worker replaced
                what = "checking the entry" if req.get("op") == "check" else "the request"
                self.reply({"error": f"{what} needs more memory than a worker may use ({self.memory:,} bytes, "
                                     "--worker-memory)", "status": 422 if req.get("op") == "check" else 413,
                            "recycle": True})
            except Exception as e:  # a hostile input's failure mode, or our bug: one line either way
                status = 422 if req.get("op") == "check" else 400
                self.reply({"error": error_line(e), "status": status})

    def handle(self, req: dict[str, Any], payload: bytes) -> None:
        op = req.get("op")
        if op == "ping":
            self.reply({"ok": True, "pid": os.getpid()})
        elif op == "check":
            self.check(req, payload)
        elif op == "lookup":
            q = parse_lookup(parse_json(payload), list(req["namespaces"]), max_tokens=int(req["max_tokens"]),
                             max_text=int(req["max_text"]))
            if q.text is not None:
                from kvcodec.models.capture import tokenize

                ids: Any = tokenize(self.tokenizer(q.model), q.text)
            else:
                ids = q.token_ids
            keys = lookup_candidates(q, ids, int(req["max_tokens"]))
            self.reply({"ok": True, "tokens": len(ids), "namespace": q.namespace, "keys": [k.to_str() for k in keys]})
        elif op == "spin" and os.environ.get(TEST_OPS_ENV) == "1":  # tests: a job that outlives its deadline
            # "seconds": of wall time; "cpu_seconds": of this process's CPU time (what the CPU-share tests
            # charge: a niced worker on a busy box gets little CPU in a wall-time spin)
            clock = time.process_time if "cpu_seconds" in req else time.monotonic
            end = clock() + float(req.get("cpu_seconds", req.get("seconds", 1.0)))
            while clock() < end:
                pass
            self.reply({"ok": True})
        elif op == "alloc" and os.environ.get(TEST_OPS_ENV) == "1":  # tests: a job that needs `bytes` of memory
            buf = bytearray(int(req["bytes"]))
            self.reply({"ok": True, "bytes": len(buf)})
        elif op == "contains":
            self.reply({"ok": True, "keys": [k.to_str() for k in contains_keys(parse_json(payload))]})
        else:
            raise HttpError(400, f"unknown worker op {str(op)[:40]!r}")

    def check(self, req: dict[str, Any], data: bytes) -> None:
        from kvcodec.errors import KvcError
        from kvcodec.store.keys import StoreKey

        key = StoreKey.from_str(req["key"])
        want = req.get("crc")
        if want is not None:
            from kvcodec.store.tiers.base import crc32c

            if f"{crc32c(data):08x}" != want:
                raise HttpError(400, "body fails its X-Kvc-Crc32c checksum (damaged in transit)")
        try:
            r = open_entry(key, data, max_decoded_bytes=int(req["max_decoded_bytes"]),
                           max_decoded_ratio=float(req["max_decoded_ratio"]),
                           max_chunk_bytes=int(req["max_chunk_bytes"]))
        except KvcError as e:
            raise HttpError(422, f"entry refused: {error_line(e)}") from None
        if r is None:
            self.reply({"ok": True, "declared": 0})
            return
        with r:
            self.reply({"declared": int(r.declared_bytes)})
            frame = read_frame(self.inp)
            if frame is None:
                raise SystemExit(0)
            if not frame[0].get("go"):
                self.reply({"ok": False, "stopped": True})
                return
            if req.get("verify", True):
                try:
                    verify_entry(r)
                except KvcError as e:
                    raise HttpError(422, f"entry refused: {error_line(e)}") from None
        self.reply({"ok": True, "declared": int(r.declared_bytes)})


def main(argv: list[str] | None = None) -> None:
    """The worker's entry point (the pool runs ``python -c "from kvcodec.service.worker import main; main()"``)."""
    ap = argparse.ArgumentParser(prog="kvcodec.service.worker")
    ap.add_argument("--tokenizer", action="append", default=[], help="FINGERPRINT=DIR (repeatable)")
    ap.add_argument("--memory", type=int, default=0, help="bytes this process may allocate beyond its started "
                                                             "state (0: no limit)")
    args = ap.parse_args(argv)
    toks = dict(t.split("=", 1) for t in args.tokenizer)
    # the protocol owns stdout: anything a library prints goes to stderr instead
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    inp = os.fdopen(os.dup(sys.stdin.fileno()), "rb")
    # load the decoders now, so the first put does not pay for it (numba kernels come from their cache): the pool
    # hands this process work only after it answers its first ping, below
    import kvcodec.format  # noqa: F401
    from kvcodec.decode.registry import warm_cpu

    warm_cpu()
    if args.memory:
        limit_data(args.memory)
    try:  # below the event loop and the store threads: a tenant's legal decode must not starve their answers
        os.nice(WORKER_NICE)
    except OSError:  # pragma: no cover - not allowed here
        pass
    Worker(toks, inp, out, args.memory).serve()


def data_size() -> int:
    """This process's data segment in bytes (``VmData``: heap and private writable mappings)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmData in /proc/self/status")


def limit_data(extra: int) -> None:
    """Cap this process's data segment at its present size plus ``extra`` bytes (``RLIMIT_DATA``).

    Why the data segment: it counts what a job can make us allocate (numpy arrays, the body, the decoders'
    buffers: heap and private writable mappings), and not the shared libraries' mappings or reserved address
    space, which ``RLIMIT_AS`` would (numba and its LLVM map hundreds of MB they never touch).  Past the cap an
    allocation fails with ``MemoryError``, which becomes the request's one-line refusal, and the parent then
    replaces this worker.  On a system without ``/proc`` or the limit, the worker runs unlimited (logged).
    """
    import resource

    try:
        want = data_size() + extra
        _, hard = resource.getrlimit(resource.RLIMIT_DATA)
        if hard != resource.RLIM_INFINITY:
            want = min(want, hard)
        resource.setrlimit(resource.RLIMIT_DATA, (want, hard))
    except (OSError, ValueError) as e:  # pragma: no cover - not Linux
        print(f"kvcodec worker: cannot limit its memory: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
