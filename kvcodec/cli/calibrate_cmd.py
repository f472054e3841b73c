"""``kvc calibrate``: build a model's codec calibration once, with progress."""

from __future__ import annotations

import click

from kvcodec.cli.options import emit_json, json_option, model_option


@click.command("calibrate")
@model_option
@click.option("--force", is_flag=True, help="Rebuild even if the model already has a calibration (and refit its rate model).")
@click.option("--basis", type=click.Choice(["blocks", "full"]), default="blocks", show_default=True,
              help="blocks: a block-diagonal PCA for head_dim > 64 (64-channel blocks; decode ~2x faster at head_dim 256); "
                   "full: one PCA per whole head (files ~5-10 %% smaller there, decode at about half the speed).")
@click.option("--thorough", is_flag=True,
              help="Fit the thorough rate model (four texts at 1K-4K tokens and per-layer factors: fewer bits at the same "
                   "promises, ~4x the CPU of the quick one a first use fits: 885 vs 229 CPU-s on Gemma 3 270M); replaces a quick one.")
@json_option
def calibrate_command(model, force, basis, thorough, as_json) -> None:
    """Build MODEL's PCA bases and sensitivities, and fit its rate model (the lossy presets need both; encode builds
    them on first use, with the quick rate model)."""
    import time

    from kvcodec.models.load import load_model
    from kvcodec.codecs.blocks import channel_blocks
    from kvcodec.calibration.build import build_calibration
    from kvcodec.calibration.store import load_calibration, save_calibration
    from kvcodec.plan.presets import answer_targets, lossy_settings, preset_targets
    from kvcodec.onboard.ratefit import calibrate_rate_model

    lm = load_model(model)
    fid = lm.fingerprint.id
    cal = None if force else load_calibration(fid)
    timings: dict[str, float] = {}
    built = cal is None
    if cal is None:
        t0 = time.perf_counter()
        cal = build_calibration(lm, timings=timings, full_basis=basis == "full")
        save_calibration(cal, fid)
        timings.setdefault("total_s", time.perf_counter() - t0)
    t0 = time.perf_counter()
    rm, fitted = calibrate_rate_model(lm, cal, lossy_settings(), answer_targets(), preset_targets(), fresh=built,
                                      thorough=thorough)
    if fitted:
        timings["rate_model_s"] = round(time.perf_counter() - t0, 1)
    size = cal.path.stat().st_size if cal.path is not None else None  # what ships to a decoder of this model's files
    report = {"model": model, "fingerprint": fid, "path": str(cal.path), "built": built, "timings": timings,
              "version": cal.meta.get("version"), "bytes": size,
              "channel_blocks": cal.meta.get("channel_blocks"), "rate_model_fitted": fitted,
              # layers whose attention modules kvcodec cannot read, fitted by plain squared error (null: none)
              "even_weights": cal.meta.get("even_weights"),
              "rate_model": {k: v for k, v in rm.to_json().items() if k != "fit"},
              # ΔPPL per unit KL on real text (kvcodec.calibration.ratemodel.RateModel.dppl_ratio); rate control aims
              # at the tighter of the KL and ΔPPL promises with it
              "dppl_ratio": rm.dppl_ratio(),
              # per preset: measured / predicted KL on chat contexts (kvcodec.onboard.chatfactor), applied to them
              "chat_factor": {n: v["factor"] for n, v in rm.chat_factor.items()},
              # which fit measured the rate model: quick (a first use, this command) or thorough (--thorough, shipped)
              "rate_model_recipe": rm.recipe,
              # what onboarding's prefills ran in where not the model's own dtype (kvcodec.models.compute; null: its own)
              "compute_dtype": {"calibration": cal.meta.get("compute_dtype"), "rate_model": rm.prefill_dtype}}
    if as_json:
        emit_json(report)
    elif built:
        click.echo(f"calibrated {model} in {timings['total_s']:.0f} s -> {cal.path} ({size:,} bytes); {rm.recipe} rate model "
                   f"fitted in {timings.get('rate_model_s', 0):.0f} s (alpha {', '.join(f'{k} {v:.2f}' for k, v in rm.alpha.items())}; "
                   f"ΔPPL/KL {_ratio(rm.dppl_ratio())})")
    else:
        has = "full" if cal.meta.get("channel_blocks") is None else "blocks"
        note = "" if has == basis or len(channel_blocks(lm.fingerprint.head_dims[0])) == 1 else f"; it has the {has} basis"
        old = "" if cal.meta.get("version") != 2 else "; version 2: a rebuild stores it in about half the bytes"
        fit = f"; {rm.recipe} rate model fitted in {timings['rate_model_s']:.0f} s" if fitted else f"; {rm.recipe} rate model"
        click.echo(f"{model} already has a calibration: {cal.path} ({size:,} bytes){note}{old} (--force rebuilds it){fit}; "
                   f"ΔPPL/KL {_ratio(rm.dppl_ratio())}")


def _ratio(r: float | None) -> str:
    return "not measured" if r is None else f"{r:.2f}"


COMMANDS = [calibrate_command]
