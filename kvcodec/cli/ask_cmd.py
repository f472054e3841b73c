"""``kvc ask``: answer a question about documents, from the store when possible."""

from __future__ import annotations

import click

from kvcodec.cli.options import emit_json, json_option, model_option
from kvcodec.plan.presets import DEFAULT_LOSSY


@click.command("ask")
@model_option
@click.option("--doc", "docs", multiple=True, required=True, help="Document (file or corpus name); repeat for a prefix chain.")
@click.option("--store", "store_url", default=None, help="Store URL: a directory, redis://..., or a comma list (default: the user cache).")
@click.option("--preset", default=None,
              help=f"Codec preset for new entries. Default: {DEFAULT_LOSSY}, which keeps answers (docs/guide/presets.md), "
                   "or lossless, with a warning, for a model whose window cannot hold a calibration.")
@click.option("--namespace", default="default", show_default=True, help="Tenant namespace: entries never cross namespaces.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=48, show_default=True)
@click.option("--no-store", is_flag=True, help="Answer without depositing new entries.")
@click.option("--blend", is_flag=True,
              help="Cache every --doc as its own position-independent chunk and blend the chunks (CacheBlend): "
                   "later asks with the documents in any order or subset load each one from the store.")
@click.option("--recompute-ratio", type=float, default=0.15, show_default=True,
              help="--blend: fraction of context tokens recomputed (0..1; 1 = a full prefill).")
@click.option("--ttft-budget", type=float, default=None,
              help="Stream the documents' multi-level entry (kvc encode --levels) within this many seconds to the first "
                   "token: each chunk at the highest level that fits, else from its text; --json reports every choice.")
@click.option("--check/--no-check", "check", default=None,
              help="Confirm each new entry's step with the model on the context's tail (kvc encode --check). Default: "
                   "on for a model whose calibration measured that the prediction alone can miss on chat contexts.")
@json_option
@click.argument("question")
def ask_command(model, docs, store_url, preset, namespace, max_new_tokens, no_store, blend, recompute_ratio, ttft_budget,
                check, as_json, question) -> None:
    """Answer QUESTION about the documents; the first call prefills and stores, later calls load."""
    from kvcodec.errors import KvcInputError
    from kvcodec.plan.presets import available_presets
    from kvcodec.runtime.knowledge import KnowledgeBase, read_docs
    from kvcodec.models.load import load_model, resolve_model_dir
    from kvcodec.runtime.warmup import context_bytes, prewarm

    if not blend and click.get_current_context().get_parameter_source("recompute_ratio") == click.core.ParameterSource.COMMANDLINE:
        raise KvcInputError("--recompute-ratio only applies with --blend")
    if blend and not 0.0 <= recompute_ratio <= 1.0:  # refused before loading the model
        raise KvcInputError(f"--recompute-ratio must lie in [0, 1], got {recompute_ratio:g}")
    if preset is not None and preset not in available_presets():
        raise KvcInputError(f"unknown preset {preset!r} (available: {', '.join(available_presets())})")
    if max_new_tokens < 1:
        raise KvcInputError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if not question.strip():
        raise KvcInputError("the question is empty")
    if ttft_budget is not None and (blend or no_store):
        raise KvcInputError("--ttft-budget streams a stored multi-level entry; it takes neither --blend nor --no-store")
    if ttft_budget is not None and not ttft_budget > 0:
        raise KvcInputError(f"--ttft-budget must be positive seconds, got {ttft_budget:g}")
    texts = read_docs(list(docs))
    # the codec's one-time costs and the context's first page faults (~4 characters a token), paid
    # while the model loads (kvcodec/runtime/warmup.py)
    prewarm(context_bytes(resolve_model_dir(model), sum(len(t) for t in texts) // 4))
    lm = load_model(model)
    lm.warm_up()  # a fresh process's first forward pays one-time set-up: pay it here, not in the first token
    kb = KnowledgeBase(lm, store_url, preset=preset, namespace=namespace, check=check)
    if ttft_budget is not None:
        ans, report = kb.ask_streamed(texts, question, ttft_budget, max_new_tokens=max_new_tokens)
        if as_json:
            emit_json(dict(ans.to_json(), stream=report))
            return
        click.echo(ans.answer)
        ok = "within" if report["within_budget"] else "OVER"
        click.echo(f"[stream: TTFT {ans.ttft_s * 1000:.0f} ms, {ok} the {ttft_budget * 1000:.0f} ms budget; "
                   f"chunks {report['level_counts']}; {100 * report['text_share']:.0f}% from text"
                   + (f"; link failed: {report['link_failed']}" if report["link_failed"] else "") + "]", err=True)
        for c in report["chunks"]:
            click.echo(f"[chunk {c['chunk']} [{c['start']}, {c['end']}): {c['choice']} - {c['reason']}]", err=True)
        return
    if blend:
        ans = kb.ask_blended(texts, question, max_new_tokens=max_new_tokens, recompute_ratio=recompute_ratio,
                             store_new=not no_store)
    else:
        ans = kb.ask(texts, question, max_new_tokens=max_new_tokens, store_new=not no_store)
    # A speed-up is only claimed against a prefill timed on this context's entry. An entry written without one (an
    # appended child: the parent's prefill timed other, shorter ids, issue 57; one put by `kvc store put`) says so.
    unmeasured = ans.source != "prefill" and not ans.prefill_ttft_s
    if as_json:
        emit_json(dict(ans.to_json(), speedup_vs_prefill=None) if unmeasured else ans.to_json())
        return
    click.echo(ans.answer)
    line = f"[{ans.source}: {ans.cached_tokens}/{ans.context_tokens} context tokens from the store; TTFT {ans.ttft_s * 1000:.0f} ms"
    if blend:
        line += f"; recompute ratio {recompute_ratio:g}"
    if ans.source != "prefill" and ans.prefill_ttft_s:
        line += f" vs {ans.prefill_ttft_s * 1000:.0f} ms by prefill ({ans.prefill_ttft_s / ans.ttft_s:.1f}x faster)"
    elif unmeasured:
        line += "; no prefill of this context was timed, so no speed-up is claimed"
    click.echo(line + "]", err=True)
    if ans.stored:
        s = ans.stored
        what = f"{len(s['chunks'])} chunk(s), " if "chunks" in s else ""
        click.echo(f"[stored {what}{s['bytes']:,} bytes ({s['bits_per_element']:.2f} bits/element) in {', '.join(s['stored_in'])}]", err=True)
        if s.get("checked"):
            click.echo(f"[its step was checked with the model on the context's tail{': ' + s['check_reason'] if s.get('check_reason') else ''}]",
                       err=True)
        if s["failed"]:
            click.echo(f"[warning: not stored in {s['failed']}]", err=True)


COMMANDS = [ask_command]
