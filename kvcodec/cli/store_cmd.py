"""``kvc store``: put, get, list, remove, inspect and clean the caller's store entries."""

from __future__ import annotations

import logging
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import click

from kvcodec.cli.options import emit_json, json_option

store_option = click.option("--store", "store_url", default=None, help="Store URL (default: the user cache store).")
key_option = click.option(
    "--key-file", type=click.Path(dir_okay=False), default=None,
    help="Tenant key file (default: $KVC_STORE_KEY, $KVC_STORE_KEY_FILE, else ~/.config/kvcodec/store.key). "
         "Only entries written with the same key are visible.")


def _open(url: str | None, key_file: str | None):
    from kvcodec.runtime.knowledge import default_store_url
    from kvcodec.store import Store, TenantKey

    key = TenantKey.load(key_file) if key_file else None
    return Store.open(url or default_store_url(), key=key)


@contextmanager
def _failures_in_the_error_line() -> Iterator[None]:
    """While a command that reports every tier failure in its one error line runs, the store's own
    warnings about the same failures stay quiet (one line per failure, not two)."""
    lg = logging.getLogger("kvcodec.store")
    old = lg.level
    lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        lg.setLevel(old)


def _nonneg_seconds(ctx: click.Context, param: click.Parameter, value: float) -> float:
    import math

    if not (math.isfinite(value) and value >= 0):
        raise click.BadParameter(f"must be a finite number of seconds >= 0, got {value}")
    return value


def _key(text: str):
    from kvcodec.store import StoreKey

    return StoreKey.from_str(text)


@click.group("store")
def store_group() -> None:
    """Manage a KV-cache store (directory, redis://..., or a comma-separated tier list).

    Every command acts for one tenant, the holder of a store key: it can
    name, read, list, delete and check only entries written with that key.
    """


@store_group.command("put")
@click.argument("kvc_file", type=click.Path(dir_okay=False))
@store_option
@key_option
@click.option("--namespace", default="default", show_default=True, help="Label within the tenant key.")
@json_option
def put_command(kvc_file, store_url, key_file, namespace, as_json):
    """Verify KVC_FILE and store it under its content key."""
    from kvcodec.errors import KvcFormatError
    from kvcodec.format import KvcReader
    from kvcodec.runtime.knowledge import key_for_file

    from kvcodec.atomic import check_input, io_error

    check_input(kvc_file)  # a name too long for a file escaped as OSError ENAMETOOLONG
    try:
        data = Path(kvc_file).read_bytes()
    except OSError as exc:
        raise io_error(exc, f"cannot read {kvc_file}") from None
    reader = KvcReader(data)
    problems = reader.verify()
    if problems:
        raise KvcFormatError(f"{kvc_file} does not verify: {problems[0]}")
    key = key_for_file(reader, namespace)
    with _open(store_url, key_file) as st, _failures_in_the_error_line():
        res = st.put(key, data, {"source": Path(kvc_file).name, "preset": reader.header.codec,
                                 "tokens": reader.header.num_context_tokens})
        kept = [t.name for t in st.tiers if t.persistent and t.name in res.stored_in]
        lost = "; ".join(f"{t.name}: {res.tiers.get(t.name, 'not tried')}" for t in st.tiers if t.persistent)
    if not kept:  # a store of read-only tiers (http://...) kept it only in this process's memory, and exited 0
        from kvcodec.errors import KvcStoreError

        raise KvcStoreError(f"{kvc_file} was stored in no persistent tier of the store"
                            + (f" ({lost})" if lost else " (it has none)"))
    out = {"key": key.to_str(), "bytes": len(data), "stored_in": res.stored_in, "failed": res.failed}
    emit_json(out) if as_json else click.echo(f"{key.to_str()}  {len(data):,} bytes -> {', '.join(res.stored_in)}")
    if res.failed:  # stored somewhere, but not everywhere asked: a failure all the same
        from kvcodec.errors import KvcStoreError

        raise KvcStoreError("not stored in " + "; ".join(f"{t}: {why}" for t, why in res.failed.items()))


@store_group.command("get")
@click.argument("key")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
@store_option
@key_option
@json_option
def get_command(key, output, store_url, key_file, as_json):
    """Write the entry KEY to OUTPUT (atomically)."""
    from kvcodec.atomic import check_output
    from kvcodec.errors import KvcStoreError
    from kvcodec.core.kvcache import atomic_write_bytes

    check_output(output)
    k = _key(key)
    with _open(store_url, key_file) as st, _failures_in_the_error_line():
        data = st.get(k)
        down = _read_failures(st) if data is None else []
    if data is None:  # a tier that could not be read may hold it: said in the one line (it was a warning line too)
        raise KvcStoreError(f"no entry {k} for this tenant key in the store"
                            + (f"; could not read {'; '.join(down)}" if down else ""))
    atomic_write_bytes(Path(output), data)
    emit_json({"key": k.to_str(), "output": output, "bytes": len(data)}) if as_json else \
        click.echo(f"{output}: {len(data):,} bytes")


@store_group.command("ls")
@store_option
@key_option
@click.option("--namespace", default=None, help="Only this namespace.")
@click.option("--model", "model_id", default=None, help="Only this model fingerprint id.")
@json_option
def ls_command(store_url, key_file, namespace, model_id, as_json):
    """List the caller's entries (other tenants' entries are never shown). Exits non-zero if a tier
    could not be listed (the listing printed is then partial)."""
    from kvcodec.errors import KvcStoreError

    failures: list[str] = []  # a filter no key can carry (--namespace a/b) is refused by Store.ls, in one line
    with _open(store_url, key_file) as st, _failures_in_the_error_line():
        rows = st.ls(with_meta=True, namespace=namespace, model=model_id, failures=failures)
        for tier in st.tiers:  # as stats does: a source that cannot list is no error, one that does not answer is
            why = _unreachable(tier) if not tier.supports_listing and tier.remote else None
            if why:
                failures.append(f"{tier.name}: {why}")
    if as_json:
        emit_json([r.to_dict() for r in rows])
    else:
        for r in rows:
            click.echo(f"{r.key.to_str()}  {r.size:,} bytes  [{r.tier}]")
    if failures:
        raise KvcStoreError("listing incomplete: cannot list " + "; ".join(failures))


@store_group.command("rm")
@click.argument("key")
@store_option
@key_option
@json_option
def rm_command(key, store_url, key_file, as_json):
    """Remove the caller's entry KEY from every tier."""
    from kvcodec.errors import KvcStoreError

    k = _key(key)
    with _open(store_url, key_file) as st, _failures_in_the_error_line():  # the failures are in the error line
        if not st.rm(k):
            raise KvcStoreError(f"no entry {k} for this tenant key in the store")
    emit_json({"removed": k.to_str()}) if as_json else click.echo(f"removed {k}")


@store_group.command("stats")
@store_option
@key_option
@json_option
def stats_command(store_url, key_file, as_json):
    """The caller's entries and bytes, hits and misses per tier (--json: every counter). Exits non-zero
    if a tier could not be counted."""
    from kvcodec.errors import KvcStoreError

    with _open(store_url, key_file) as st, _failures_in_the_error_line():
        stats = st.stats()
        for tier, t in zip(st.tiers, stats["tiers"]):
            if not t.get("error") and not tier.supports_listing and tier.remote:
                t["error"] = _unreachable(tier)
    errors = [f"{t['name']}: {t['error']}" for t in stats["tiers"] if t.get("error")]
    if as_json:
        emit_json(stats)
        if errors:
            raise KvcStoreError("cannot count " + "; ".join(errors))
        return
    click.echo(f"store {stats['url']}  tenant key {stats['tenant_key']} ({stats['key_source']})")
    click.echo(f"hits {stats['hits']}  misses {stats['misses']}  put failures {stats['put_failures']}  "
               f"refused (failed authentication) {stats['rejected']}")
    for t in stats["tiers"]:
        own = "?" if t.get("entries") is None else f"{t['entries']:,} entries, {t['bytes']:,} bytes"
        err = f"  error: {t['error']}" if t.get("error") else ""
        click.echo(f"  {t['name']:<12} {t['kind']:<10} {own:<32} hits {t['hits']}  misses {t['misses']}  "
                   f"corrupt {t['corrupt']}  evictions {t['evictions']}{err}")
    if errors:
        raise KvcStoreError("cannot count " + "; ".join(errors))


def _read_failures(st: Any) -> list[str]:
    """The tiers of ``st`` whose reads failed or whose copy was corrupt (either is a miss), each with why: the
    store's own warning lines about them are kept quiet, so the error line says it."""
    out = []
    for t in st.tiers:
        guard = getattr(t, "guard", None)
        if guard is not None and not guard.up:
            out.append(f"{t.name}: {guard.what} is unreachable ({guard.last_error})")
        elif t.counters.errors:
            out.append(f"{t.name}: " + (_unreachable(t) or "its read failed"))
        if t.counters.corrupt:
            out.append(f"{t.name}: its copy was corrupt (moved to quarantine)")
    return out


def _unreachable(tier: Any) -> str | None:
    """Why a remote tier that cannot list (a plain http source) did not answer one HEAD of its base URL, or
    None if it answered (any status): it has no entries to count, but an unreachable one is an error, not
    "?" with exit 0 (issue 55)."""
    base = getattr(tier, "base", None)
    if not isinstance(base, str):
        return None
    from kvcodec.errors import KvcStoreError
    from kvcodec.store.ranged import http_request

    try:
        limits = getattr(tier, "limits", None)
        if limits is None:
            http_request(base, method="HEAD")
        else:
            http_request(base, method="HEAD", limits=limits)
    except KvcStoreError as e:
        return f"{tier.name} {base} is unreachable ({e})"
    return None


@store_group.command("gc")
@store_option
@key_option
@click.option("--grace", type=float, default=3600.0, show_default=True, callback=_nonneg_seconds,
              help="Leave temp files younger than this (s).")
@json_option
def gc_command(store_url, key_file, grace, as_json):
    """Remove leftover temp files and unreadable files; verify the caller's entries, drop those that fail.
    Exits non-zero if a tier could not be collected."""
    from kvcodec.errors import KvcStoreError

    with _open(store_url, key_file) as st, _failures_in_the_error_line():
        res = st.gc(grace_s=grace)
    emit_json(res) if as_json else click.echo("\n".join(f"{k}: {v}" for k, v in res.items()))
    errors = [f"{k}: {v['error']}" for k, v in res.items() if isinstance(v, dict) and v.get("error")]
    if errors:
        raise KvcStoreError("gc incomplete: " + "; ".join(errors))


@store_group.command("keygen")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="New key file (mode 0600); an existing file is never replaced.")
@json_option
def keygen_command(output, as_json):
    """Create a new tenant key file: give it to every process that should share entries."""
    from kvcodec.atomic import check_file_name
    from kvcodec.store import TenantKey

    check_file_name(output)
    k = TenantKey.generate(output)
    emit_json({"key_file": output, "key_id": k.id}) if as_json else click.echo(f"{output}: new store key {k.id}")


COMMANDS = [store_group]
