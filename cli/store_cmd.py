"""``kvc store``: put, get, list, remove, inspect and clean store entries."""

from __future__ import annotations

from pathlib import Path

import click

from .options import emit_json, json_option

store_option = click.option("--store", "store_url", default=None, help="Store URL (default: the user cache store).")


def _open(url: str | None):
    from kvcodec.knowledge import default_store_url
    from kvcodec.store import Store

    return Store.open(url or default_store_url())


@click.group("store")
def store_group() -> None:
    """Manage a KV-cache store (directory, redis://..., or a comma-separated tier list)."""


@store_group.command("put")
@click.argument("kvc_file", type=click.Path(dir_okay=False))
@store_option
@click.option("--namespace", default="default", show_default=True)
@json_option
def put_command(kvc_file, store_url, namespace, as_json):
    """Verify KVC_FILE and store it under its content key."""
    from kvcodec.errors import KvcFormatError
    from kvcodec.format import KvcReader
    from kvcodec.knowledge import key_for_file

    data = Path(kvc_file).read_bytes() if Path(kvc_file).is_file() else None
    if data is None:
        raise click.BadParameter(f"no such file: {kvc_file}")
    reader = KvcReader(data)
    problems = reader.verify()
    if problems:
        raise KvcFormatError(f"{kvc_file} does not verify: {problems[0]}")
    key = key_for_file(reader, namespace)
    with _open(store_url) as st:
        res = st.put(key, data, {"source": Path(kvc_file).name, "preset": reader.header.codec, "tokens": reader.header.num_context_tokens})
    out = {"key": key.to_str(), "bytes": len(data), "stored_in": res.stored_in, "failed": res.failed}
    emit_json(out) if as_json else click.echo(f"{key.to_str()}  {len(data):,} bytes -> {', '.join(res.stored_in)}")
    if res.failed:
        click.echo(f"kvc: warning: not stored in {res.failed}", err=True)


@store_group.command("get")
@click.argument("key")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
@store_option
def get_command(key, output, store_url):
    """Write the entry KEY to OUTPUT (atomically)."""
    from kvcodec.errors import KvcStoreError
    from kvcodec.kvcache import atomic_write_bytes
    from kvcodec.store import StoreKey

    with _open(store_url) as st:
        data = st.get(StoreKey.from_str(key))
    if data is None:
        raise KvcStoreError(f"no entry {key} in the store")
    atomic_write_bytes(Path(output), data)
    click.echo(f"{output}: {len(data):,} bytes")


@store_group.command("ls")
@store_option
@json_option
def ls_command(store_url, as_json):
    """List entries."""
    with _open(store_url) as st:
        rows = st.ls(with_meta=True)
    if as_json:
        emit_json([r.to_dict() for r in rows])
        return
    for r in rows:
        click.echo(f"{r.key.to_str()}  {r.size:,} bytes  [{r.tier}]")


@store_group.command("rm")
@click.argument("key")
@store_option
def rm_command(key, store_url):
    """Remove the entry KEY from every tier."""
    from kvcodec.errors import KvcStoreError
    from kvcodec.store import StoreKey

    with _open(store_url) as st:
        if not st.rm(StoreKey.from_str(key)):
            raise KvcStoreError(f"no entry {key} in the store")
    click.echo(f"removed {key}")


@store_group.command("stats")
@store_option
@json_option
def stats_command(store_url, as_json):
    """Entries, bytes, hits and misses per tier."""
    with _open(store_url) as st:
        stats = st.stats()
    emit_json(stats) if as_json else click.echo("\n".join(f"{k}: {v}" for k, v in stats.items()))


@store_group.command("gc")
@store_option
@click.option("--grace", type=float, default=3600.0, show_default=True, help="Leave temp files younger than this (s).")
@json_option
def gc_command(store_url, grace, as_json):
    """Remove leftover temp files and corrupt entries."""
    with _open(store_url) as st:
        res = st.gc(grace_s=grace)
    emit_json(res) if as_json else click.echo("\n".join(f"{k}: {v}" for k, v in res.items()))


COMMANDS = [store_group]
