"""``kvc serve``: run the KDN service (an authenticated HTTP front of a store) until interrupted."""

from __future__ import annotations

import math
import os
from typing import Any

import click


def _seconds(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and 0 < value <= 86400):
        raise click.BadParameter(f"must be in (0, 86400] seconds, got {value}")
    return value


def _count(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and not 1 <= value <= 4096:
        raise click.BadParameter(f"must be in [1, 4096], got {value}")
    return value


def _ratio(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not (math.isfinite(value) and value >= 0):
        raise click.BadParameter(f"must be a finite number >= 0 (0: no limit), got {value}")
    return value


_LIMITS = "Limits (defaults: spec/kdn-v1.md §5). "


@click.command("serve")
@click.option("--store", "store_url", default=None,
              help="Backing store URL: a directory, redis://, redis+cluster://, s3://, or a comma list "
                   "(default: the user cache store).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8470, show_default=True)
@click.option("--tokens", "tokens_file", type=click.Path(dir_okay=False), default=None,
              help="JSON token file mapping bearer tokens to tenants and namespaces (spec/kdn-v1.md). "
                   "Without it, $KVC_SERVE_TOKEN is one read-write token for --namespace.")
@click.option("--namespace", default="default", show_default=True,
              help="Namespace of the $KVC_SERVE_TOKEN token.")
@click.option("--model", "models", multiple=True,
              help="Load this model's tokenizer so lookups may send text instead of token ids (repeatable).")
@click.option("--no-verify-decode", is_flag=True,
              help="On put, check structure, CRCs, token ids and key only instead of decoding every chunk.")
@click.option("--max-body", default="1G", show_default=True, help="Largest accepted PUT body (bytes actually read).")
@click.option("--max-json-body", default="16M", show_default=True, help="Largest /v1/contains or /v1/lookup body.")
@click.option("--max-chunked-json", default="1M", show_default=True,
              help="Largest such body sent without Content-Length (chunked): it is refused only after it is read.")
@click.option("--max-decoded", "max_decoded", default="4G", show_default=True,
              help=_LIMITS + "Decoded K/V a put entry may declare.")
@click.option("--max-chunk-decoded", default="512M", show_default=True,
              help="Decoded size of one chunk of a put entry (a worker decodes one chunk at a time).")
@click.option("--max-decoded-ratio", type=float, default=256.0, show_default=True, callback=_ratio,
              help="A put entry may declare at most this many times its own size in decoded K/V (0: no limit).")
@click.option("--workers", type=int, default=2, show_default=True, callback=_count,
              help="Worker processes that check (decode) puts, parse large JSON bodies and tokenize text lookups.")
@click.option("--worker-memory", default="2G", show_default=True,
              help="Memory each worker process may allocate beyond its started state (enforced: RLIMIT_DATA); a "
                   "request that needs more is refused with one line and its worker replaced. Must exceed --max-body.")
@click.option("--peer-connections", type=click.IntRange(1, 1 << 20), default=256, show_default=True,
              help="Connections one client address may hold at once; more are answered 429 and closed at once.")
@click.option("--max-connections", type=click.IntRange(1, 1 << 20), default=4096, show_default=True,
              help="Connections at once, all client addresses together (at most what the descriptor limit leaves "
                   "room for); more are answered 503 and closed at once.")
@click.option("--tenant-workers", type=int, default=1, show_default=True, callback=_count,
              help="Worker processes one tenant may keep busy at once (the others are shared round-robin).")
@click.option("--tenant-queue", type=click.IntRange(0, 1 << 20), default=16, show_default=True,
              help="Requests one tenant may have waiting for a worker; more are answered 429.")
@click.option("--tenant-worker-cpu", type=float, default=0.5, show_default=True, callback=_ratio,
              help="Worker CPU-seconds per second one tenant's jobs (put checks, large lookups) may use on average, "
                   "its store-thread calls counted too (twice, plus 0.2 ms each), burst 2 s; past it its next jobs and "
                   "key-probe turns wait for the share to refill, or get 429 (0: no share).")
@click.option("--tenant-ingest-rate", default="64M", show_default=True,
              help="Body bytes per second one tenant's requests are read at, on average (burst: one second's; 0: no limit); "
                   "past it the service reads its bodies more slowly (TCP pushes back on the sender).")
@click.option("--tenant-decode-rate", default="256M", show_default=True,
              help="Decoded bytes per second one tenant's puts may cost (0: no quota); over it: 429.")
@click.option("--store-threads", type=int, default=16, show_default=True, callback=_count,
              help="Threads for store operations.")
@click.option("--tenant-store-threads", type=int, default=8, show_default=True, callback=_count,
              help="Store threads one tenant may keep busy at once.")
@click.option("--max-inflight-body", default="2G", show_default=True,
              help="Body bytes held at once (received, and entries being sent), all requests (more: 503).")
@click.option("--tenant-inflight-body", default="1G", show_default=True,
              help="Body bytes one tenant may hold at once (received, and entries being sent) (more: 429).")
@click.option("--header-timeout", type=float, default=10.0, show_default=True, callback=_seconds,
              help="Seconds a client has to send a request's head; idle keep-alive connections close after it too.")
@click.option("--body-timeout", type=float, default=120.0, show_default=True, callback=_seconds,
              help="Seconds to receive a whole body.")
@click.option("--body-idle-timeout", type=float, default=15.0, show_default=True, callback=_seconds,
              help="Longest silence while a body is being received (and stall while an answer is not read).")
@click.option("--op-timeout", type=float, default=30.0, show_default=True, callback=_seconds,
              help="Seconds for one store operation.")
@click.option("--verify-timeout", type=float, default=300.0, show_default=True, callback=_seconds,
              help="Seconds to check (decode) one put; its worker is killed after it.")
@click.option("--request-timeout", type=float, default=600.0, show_default=True, callback=_seconds,
              help="Deadline of any request: body, queue waits, checks and store operations together.")
@click.option("--queue-timeout", type=float, default=60.0, show_default=True, callback=_seconds,
              help="Longest wait for a worker process or a store thread (then 503).")
@click.option("--max-lookup-text", type=click.IntRange(1, 1 << 30), default=4 << 20, show_default=True,
              help="Characters of a text lookup (more: 413).")
@click.option("--tenant-refusal-rate", type=float, default=20.0, show_default=True, callback=_ratio,
              help="Refused (4xx) requests per second a tenant may cause, burst 5x; past it, its requests are 429 "
                   "before any body is read (0: no limit).")
@click.option("--peer-refusal-rate", type=float, default=20.0, show_default=True, callback=_ratio,
              help="Unauthenticated refusals (401, malformed HTTP) per second a client address may cause, burst 5x; "
                   "past it its 401s are held back up to 1 s, and far past it its connections are refused (0: no limit).")
@click.option("--log-rate", type=float, default=10.0, show_default=True, callback=_ratio,
              help="Bad-request log lines per second at most (one line per bad request; the rest are counted).")
def serve_command(store_url: str | None, host: str, port: int, tokens_file: str | None, namespace: str,
                  models: tuple[str, ...], no_verify_decode: bool, **limits: Any) -> None:
    """Serve a store to many engines over HTTP: put, lookup, ranged get, auth, /healthz, /metrics.

    Every request's work is bounded: puts are checked cheapest first and decoded by worker processes
    shared fairly between tenants, under per-tenant quotas and deadlines (spec/kdn-v1.md §5).
    """
    from kvcodec.errors import KvcInputError
    from kvcodec.service import ServiceConfig, TokenTable, serve
    from kvcodec.service.auth import SERVE_TOKEN_ENV
    from kvcodec.store import parse_size

    def size(name: str) -> int:
        v = parse_size(limits.pop(name))
        if v <= 0 and name not in ("tenant_decode_rate", "tenant_ingest_rate"):
            raise KvcInputError(f"--{name.replace('_', '-')} must be positive")
        return v

    cfg = ServiceConfig(max_body=size("max_body"), max_json_body=size("max_json_body"),
                        max_chunked_json=size("max_chunked_json"),
                        max_decoded_bytes=size("max_decoded"), max_chunk_decoded=size("max_chunk_decoded"),
                        tenant_decode_rate=float(size("tenant_decode_rate")),
                        tenant_ingest_rate=float(size("tenant_ingest_rate")),
                        max_inflight_body=size("max_inflight_body"), tenant_inflight_body=size("tenant_inflight_body"),
                        worker_memory=size("worker_memory"),
                        verify=not no_verify_decode, models=list(models), **limits)
    cfg.check()
    if tokens_file:
        tokens = TokenTable.from_file(tokens_file)
    elif os.environ.get(SERVE_TOKEN_ENV):
        tokens = TokenTable.single(os.environ[SERVE_TOKEN_ENV], namespace)
    else:
        raise KvcInputError(f"give --tokens FILE or set ${SERVE_TOKEN_ENV}: the service never runs without auth")
    if store_url is None:
        from kvcodec.runtime.knowledge import default_store_url  # imports torch: only when needed

        store_url = default_store_url()
    url = store_url

    def ready(base: str) -> None:
        click.echo(f"kvc: serving {url} at {base} ({len(tokens)} token(s)); clients use "
                   f"--store kvc+{base} with $KVC_TOKEN; Ctrl-C stops", err=True)

    serve(url, tokens, host=host, port=port, config=cfg, ready=ready)


COMMANDS = [serve_command]
