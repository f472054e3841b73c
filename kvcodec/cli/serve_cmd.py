"""``kvc serve``: run the KDN service (an authenticated HTTP front of a store) until interrupted."""

from __future__ import annotations

import os

import click


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
@click.option("--max-body", default="1G", show_default=True, help="Largest accepted PUT body.")
@click.option("--body-timeout", type=float, default=120.0, show_default=True, help="Seconds to receive a body.")
@click.option("--op-timeout", type=float, default=30.0, show_default=True, help="Seconds for one store operation.")
@click.option("--model", "models", multiple=True,
              help="Load this model's tokenizer so lookups may send text instead of token ids (repeatable).")
@click.option("--no-verify-decode", is_flag=True,
              help="On put, check structure and CRCs only instead of decoding every chunk.")
def serve_command(store_url, host, port, tokens_file, namespace, max_body, body_timeout, op_timeout, models,
                  no_verify_decode) -> None:
    """Serve a store to many engines over HTTP: put, lookup, ranged get, auth, /healthz, /metrics."""
    from kvcodec.errors import KvcInputError
    from kvcodec.service import ServiceConfig, TokenTable, serve
    from kvcodec.service.auth import SERVE_TOKEN_ENV
    from kvcodec.store import parse_size

    if tokens_file:
        tokens = TokenTable.from_file(tokens_file)
    elif os.environ.get(SERVE_TOKEN_ENV):
        tokens = TokenTable.single(os.environ[SERVE_TOKEN_ENV], namespace)
    else:
        raise KvcInputError(f"give --tokens FILE or set ${SERVE_TOKEN_ENV}: the service never runs without auth")
    cfg = ServiceConfig(max_body=parse_size(max_body), body_timeout=body_timeout, op_timeout=op_timeout,
                        verify=not no_verify_decode, models=list(models))
    if store_url is None:
        from kvcodec.runtime.knowledge import default_store_url  # imports torch: only when needed

        store_url = default_store_url()
    url = store_url

    def ready(base: str) -> None:
        click.echo(f"kvc: serving {url} at {base} ({len(tokens)} token(s)); clients use "
                   f"--store kvc+{base} with $KVC_TOKEN; Ctrl-C stops", err=True)

    serve(url, tokens, host=host, port=port, config=cfg, ready=ready)


COMMANDS = [serve_command]
