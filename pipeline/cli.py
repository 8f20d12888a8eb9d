"""The `trtpipe` command line: parses arguments and calls the stage functions.

Exit status: 0 success, 2 bad input or usage (one clear message), 1 anything else.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import click

from . import __version__
from .errors import NotImplementedStage, UserError

PRECISIONS = ("fp16", "bf16", "fp32", "fp8", "int8-sq")
MODEL_HELP = "MODEL is a preset name (smollm2-135m, llama-3-8b, ...), a Hugging Face directory, a GGUF file or a hub id."


class TrtpipeGroup(click.Group):
    """Turns user errors into one line on stderr and exit 2, other failures into exit 1."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as exc:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exc.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except Exception as exc:
            if os.environ.get("TRTPIPE_DEBUG"):
                raise
            click.echo(f"error: {type(exc).__name__}: {exc} (set TRTPIPE_DEBUG=1 for the traceback)", err=True)
            sys.exit(1)


@click.group(cls=TrtpipeGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="trtpipe")
def main():
    """trtpipe: a Hugging Face causal LM to a validated Triton deployment backed by TensorRT-LLM.

    \b
    Examples:
      trtpipe build smollm2-135m --target cpu --precision fp8 -o out/smollm2
      trtpipe build llama-3-8b --target rtx4090 --precision fp8 --dry-run
    """


@main.command()
def setup():
    """Fetch the offline assets (SmolLM2 GGUF check, calibration corpus) into the cache.

    \b
    Example:
      trtpipe setup
    """
    from .assets import calibration_corpus_path, smollm2_gguf_path

    click.echo(f"SmolLM2 GGUF:        {smollm2_gguf_path()}")
    click.echo(f"calibration corpus:  {calibration_corpus_path()}")


@main.command()
@click.argument("source")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="Checkpoint directory to write.")
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default=None,
              help="Weight dtype of the checkpoint (default: the model's own dtype).")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel size.")
@click.option("--model-dir", type=click.Path(path_type=Path), default=None, help="Directory holding downloaded models.")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def convert(source, out, dtype, tp, pp, model_dir, force, as_json):
    """Convert SOURCE to a TensorRT-LLM 1.2.x checkpoint (config.json + rank<N>.safetensors).

    \b
    SOURCE is a preset name, a Hugging Face directory, a GGUF file or a hub id.
    Examples:
      trtpipe convert smollm2-135m -o out/ckpt
      trtpipe convert ./Meta-Llama-3-8B -o out/ckpt-tp2 --dtype float16 --tp 2
    """
    from .convert import convert_model
    from .sources import resolve_model

    result = convert_model(resolve_model(source, model_dir), out, dtype=dtype, tp=tp, pp=pp, force=force)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(result.summary())


@main.command()
@click.argument("model")
@click.option("--target", default="cpu", show_default=True)
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp16", show_default=True)
@click.option("--kv-cache", type=click.Choice(["auto", "fp16", "fp8", "int8"]), default="auto", show_default=True)
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), default=None)
@click.option("--dry-run", is_flag=True)
def build(model, target, precision, kv_cache, out, dry_run):
    """Run every stage: convert, calibrate, plan, compile, deploy, validate."""
    raise NotImplementedStage("build")


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True)
@click.option("--precision", type=click.Choice(["fp8", "int8-sq"]), required=True)
@click.option("--kv-cache", type=click.Choice(["fp8", "int8"]), default=None)
@click.option("--method", type=click.Choice(["entropy", "percentile", "mse", "max"]), default=None)
@click.option("--dataset", default=None)
@click.option("--samples", type=int, default=None)
@click.option("--seq-len", type=int, default=None)
def calibrate(checkpoint, out, precision, kv_cache, method, dataset, samples, seq_len):
    """Calibrate CHECKPOINT into an FP8 or INT8-SmoothQuant checkpoint."""
    raise NotImplementedStage("calibrate")


@main.command(name="eval")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--dataset", default=None)
@click.option("--json", "as_json", is_flag=True)
def eval_(checkpoint, dataset, as_json):
    """Perplexity of CHECKPOINT with the reference runtime."""
    raise NotImplementedStage("eval")


@main.command()
@click.option("--json", "as_json", is_flag=True)
def targets(as_json):
    """The GPU target catalogue."""
    raise NotImplementedStage("targets")


@main.command()
@click.argument("model")
@click.option("--target", required=True)
@click.option("--precision", type=click.Choice(PRECISIONS), required=True)
@click.option("--json", "as_json", is_flag=True)
def plan(model, target, precision, as_json):
    """Memory budget, build configuration and Triton parameters for MODEL on a target."""
    raise NotImplementedStage("plan")


@main.command(name="compile")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--plan", "plan_path", type=click.Path(path_type=Path), required=True)
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True)
@click.option("--dry-run", is_flag=True)
def compile_(checkpoint, plan_path, out, dry_run):
    """Build a TensorRT-LLM 1.2.1 engine (GPU and TensorRT-LLM required)."""
    raise NotImplementedStage("compile")


@main.command()
@click.option("--engine", type=click.Path(path_type=Path), default=None)
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None)
@click.option("--plan", "plan_path", type=click.Path(path_type=Path), required=True)
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True)
def deploy(engine, checkpoint, plan_path, out):
    """Write a Triton model repository."""
    raise NotImplementedStage("deploy")


@main.command()
@click.argument("repo", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def check(repo, as_json):
    """Static checks of a Triton model repository."""
    raise NotImplementedStage("check")


@main.command()
@click.argument("repo", type=click.Path(path_type=Path))
@click.option("--url", default=None)
@click.option("--load-test", is_flag=True)
def validate(repo, url, load_test):
    """Serve REPO with Triton and verify it."""
    raise NotImplementedStage("validate")


@main.command()
@click.argument("repo", type=click.Path(path_type=Path))
@click.option("--port", type=int, default=8000)
def serve(repo, port):
    """The embedded Triton server, in the foreground."""
    raise NotImplementedStage("serve")


if __name__ == "__main__":
    main()
