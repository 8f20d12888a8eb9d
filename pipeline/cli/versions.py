"""`trtpipe versions list | add | serve | remove`: the click group (registered in pipeline/cli/shipping.py)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .base import repository_argument

REPO = repository_argument()
AS_JSON = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")


@click.group()
def versions():
    """Several builds as versions of one repository's tensorrt_llm, for a rollback inside one Triton.

    \b
    A second build of the same model (another precision, calibration or checkpoint; same tokenizer and the
    same config.pbtxt settings, which are per model) goes into REPO/tensorrt_llm/N; tensorrt_llm's
    version_policy names the one Triton serves. Reference (cpu) builds only: an engine is named in the
    model-level gpt_model_path, so engines roll out with `trtpipe k8s --canary-of` (docs/versions.md).
    Examples:
      trtpipe versions add out/fp16/model_repo out/fp8
      trtpipe versions serve out/fp16/model_repo 2 --url http://127.0.0.1:8000
      trtpipe versions serve out/fp16/model_repo previous
      trtpipe versions list out/fp16/model_repo
    """


@versions.command(name="list")
@REPO
@AS_JSON
def list_(repo, as_json):
    """The versions REPO holds, which build each came from, and the one served.

    \b
    Examples:
      trtpipe versions list out/fp16/model_repo --json
    """
    from ..versions.repository import read_repository

    r = read_repository(repo)
    rows = [{"version": v, "served": v in r.served, "previous": v == r.previous,
             **(r.records[v].to_dict() if v in r.records else {"source": None, "deployment": None, "added": None})}
            for v in r.on_disk]
    if as_json:
        click.echo(json.dumps({"repository": str(r.path), "served": list(r.served), "versions": rows}, indent=2))
        return
    for row in rows:
        mark = "* " if row["served"] else "  "
        what = r.records[row["version"]].describe() if row["version"] in r.records else \
            "not recorded (an interrupted add? `trtpipe versions remove` it)"
        click.echo(f"{mark}{row['version']}  {what}{'  (served before)' if row['previous'] else ''}")


@versions.command()
@REPO
@click.argument("source", type=click.Path(path_type=Path))
@click.option("--serve", "serve_it", is_flag=True, help="Also make the new version the one served.")
@AS_JSON
def add(repo, source, serve_it, as_json):
    """Add SOURCE (a `trtpipe build` directory or a deploy repository) as the next version of REPO's tensorrt_llm.

    \b
    REPO keeps serving the version it serves (its config is pinned to it) unless --serve. Refused (exit 2,
    REPO unchanged): an engine or llmapi build, another model or tokenizer, or any config.pbtxt setting that
    differs (named in the message).
    Examples:
      trtpipe versions add out/fp16/model_repo out/fp8
      trtpipe versions add model_repo other_repo --serve
    """
    from ..versions.edit import add_version

    result = add_version(repo, source, serve=serve_it)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.summary())


@versions.command()
@REPO
@click.argument("version", metavar="VERSION|previous")
@click.option("--url", default=None, help="Also switch this running Triton (started on REPO with "
              "--model-control-mode=explicit), before REPO is changed.")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="With --url: seconds to wait for the version to be ready.")
@AS_JSON
def serve(repo, version, url, timeout, as_json):
    """Serve VERSION of REPO's tensorrt_llm: roll forward, or back (`previous`: the one served before).

    \b
    Writes version_policy { specific { versions: [VERSION] } } into tensorrt_llm/config.pbtxt; a server
    started afterwards serves VERSION. With --url the running server loads VERSION first (model control) and
    unloads the other once its requests are done; a server without model control is refused, REPO unchanged.
    Examples:
      trtpipe versions serve out/fp16/model_repo 1
      trtpipe versions serve out/fp16/model_repo previous --url http://127.0.0.1:8000
    """
    from ..versions.edit import serve_version

    result = serve_version(repo, version, url=url, timeout=timeout)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.summary())


@versions.command()
@REPO
@click.argument("version")
@click.option("--json", "as_json", is_flag=True, help="Print what was removed as JSON.")
def remove(repo, version, as_json):
    """Delete VERSION (not the served one) from REPO.

    \b
    Examples:
      trtpipe versions remove out/fp16/model_repo 1
    """
    from ..versions.edit import remove_version

    path, removed = remove_version(repo, version)
    click.echo(json.dumps({"repository": str(path), "removed": removed}) if as_json
               else f"removed version {removed} of tensorrt_llm from {path}")
