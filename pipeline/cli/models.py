"""`trtpipe models`: the presets, what each model is, and which precisions fit an RTX 4090 and the cpu target."""

from __future__ import annotations

import json

import click

from .base import json_option, main


@main.command()
@json_option("the catalogue (a list: each preset's hub id, facts, and what fits where, with the planner's "
             "refusals)")
def models(as_json):
    """The presets: hub id, family, parameters, base or instruct, gated or not, and what fits where.

    The fit columns are the planner's verdict for one rtx4090 and the cpu target at the default workload
    (`trtpipe plan` with no workload options). Nothing is downloaded.

    \b
    Examples:
      trtpipe models
      trtpipe models --json
    """
    from ..catalogue import model_catalogue, render

    entries = model_catalogue()
    if as_json:
        click.echo(json.dumps([e.to_dict() for e in entries], indent=2))
    else:
        click.echo(render(entries))
