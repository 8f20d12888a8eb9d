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
from .errors import UserError
from .backends import BACKENDS as BACKEND_NAMES
from .backends.reference import RUNTIMES
from .precisions import PRECISIONS

#: The image the Dockerfile builds (`docker build -t trtpipe:VERSION .`), for `trtpipe k8s`.
DEFAULT_IMAGE = f"trtpipe:{__version__}"
MODEL_HELP = ("MODEL is a preset name (smollm2-135m, llama-3-8b, ...), a Hugging Face directory, a GGUF file "
              "or a hub id.")


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


def device_option(what: str):
    """--device of the stages that run the model a decoder layer at a time (one spelling for all)."""
    return click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
                        help=f"Where {what}, one decoder layer in memory at a time (auto: CUDA when torch sees a GPU).")


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
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="Checkpoint directory to write.")
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
@click.argument("model", required=False)
@click.option("--matrix", "matrix_path", type=click.Path(path_type=Path), default=None,
              help="Run the builds of this matrix (trtpipe.toml or pyproject.toml) instead of MODEL; -o is then "
                   "the directory above them (default: the matrix's `output`).")
@click.option("--only", multiple=True, metavar="NAME", help="With --matrix: only this build (repeatable).")
@click.option("--target", default="cpu", show_default=True, help="Target from `trtpipe targets` (cpu, rtx4090, ...).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp16", show_default=True)
@click.option("--kv-cache", type=click.Choice(["auto", "fp16", "fp8", "int8"]), default="auto", show_default=True)
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), default=None,
              help="Build directory (default: out/<model>-<target>-<precision>[-<backend>]).")
@click.option("--dry-run", is_flag=True, help="Do everything that needs no GPU; print the engine build command.")
@click.option("--url", default=None, help="Validate on this running Triton server instead of the embedded one.")
@click.option("--load-test", is_flag=True, help="Add the bounded load test to validation.")
@click.option("--samples", type=int, default=None, help="Calibration samples (default: the recipe's).")
@click.option("--model-dir", type=click.Path(path_type=Path), default=None, help="Directory holding downloaded models.")
@device_option("calibration and the golden reference run")
@click.option("--backend", type=click.Choice(sorted(BACKEND_NAMES)), default=None,
              help="What serves the model: engine (default on GPUs; compiled by trtllm-build) or pytorch "
                   "(TensorRT-LLM LLM API on the Hugging Face checkpoint, no compile); reference (default on cpu), "
                   "reference-llmapi or reference-onnx on the cpu target.")
@click.option("--k8s", "k8s_manifests", is_flag=True,
              help="Also write Kubernetes manifests, alerts and a dashboard to OUT/k8s (see `trtpipe k8s`).")
@click.option("--json", "as_json", is_flag=True, help="Print the build summary as JSON.")
def build(model, matrix_path, only, target, precision, kv_cache, out, dry_run, url, load_test, samples, model_dir,
          device, backend, k8s_manifests, as_json):
    """Run every stage: convert, calibrate, plan, compile, deploy, validate.

    \b
    Each stage is skipped when its manifest shows unchanged inputs. Exit 0 only when validation passed
    (or was not possible: a dry run, a GPU target without --url).
    Examples:
      trtpipe build smollm2-135m --target cpu --precision fp8 -o out/smollm2
      trtpipe build llama-3-8b --target rtx4090 --precision fp8 --dry-run
      trtpipe build llama-3-8b --target rtx4090 --precision fp8 --backend pytorch
      trtpipe build --matrix trtpipe.toml --only smollm2-cpu-fp8
    """
    from .build import BuildOptions, build as run_build

    if matrix_path is not None:
        if k8s_manifests:
            raise UserError("--k8s writes one build's manifests: run `trtpipe k8s BUILD` for each matrix build")
        if backend is not None:
            raise UserError("--backend chooses one build's backend; a matrix build takes its matrix's settings")
        return build_matrix(model, matrix_path, only, out, as_json, dry_run=dry_run, url=url, load_test=load_test,
                            model_dir=model_dir, device=device, progress=not as_json)
    if model is None:
        raise UserError("give MODEL (a preset, Hugging Face directory, GGUF file or hub id) or --matrix FILE")
    if only:
        raise UserError("--only selects builds of a matrix: give --matrix FILE with it")
    safe_name = Path(model).name.replace(".gguf", "")
    out = out or Path("out") / (f"{safe_name}-{target}-{precision}" + (f"-{backend}" if backend else ""))
    options = BuildOptions(model=model, target=target, precision=precision, kv_cache=kv_cache, out=out,
                           dry_run=dry_run, url=url, load_test=load_test, model_dir=model_dir,
                           calibration_samples=samples, device=device, progress=not as_json, backend=backend)
    summary = run_build(options, say=(lambda msg: click.echo(msg, err=True)) if as_json else click.echo)
    click.echo(json.dumps(summary.to_dict(), indent=2) if as_json else summary.render())
    if summary.passed is False:
        sys.exit(1)
    if k8s_manifests:
        from .k8s import K8sOptions, write_k8s

        written = write_k8s(out, out / "k8s", K8sOptions(image=DEFAULT_IMAGE, force=True))
        click.echo(written.summary(), err=as_json)


def build_matrix(model, matrix_path, only, out, as_json, **options):
    """`trtpipe build --matrix`: each selected build in turn; exit 1 when one failed validation."""
    from .matrix import load_matrix, run_matrix

    if model is not None:
        raise UserError(f"give MODEL or --matrix, not both (got {model!r} and --matrix {matrix_path})")
    say = (lambda msg: click.echo(msg, err=True)) if as_json else click.echo
    summaries = run_matrix(load_matrix(matrix_path), tuple(only), out, say, **options)
    if as_json:
        click.echo(json.dumps({name: s.to_dict() for name, s in summaries.items()}, indent=2))
    else:
        for name, summary in summaries.items():
            click.echo(f"== {name}\n{summary.render()}")
    if any(s.passed is False for s in summaries.values()):
        sys.exit(1)


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="Directory for the quantized checkpoint (with calibration/ report, plots and TensorRT cache).")
@click.option("--precision", type=click.Choice(["fp8", "int8-sq"]), required=True,
              help="fp8: FP8 E4M3 weights and activations; int8-sq: SmoothQuant W8A8 (per-channel weights).")
@click.option("--kv-cache", type=click.Choice(["fp8", "int8"]), default=None,
              help="Also quantize the KV cache (per-layer scales from the K and V values).")
@click.option("--method", type=click.Choice(["entropy", "percentile", "mse", "max"]), default=None,
              help="Activation amax method (default: max for both precisions, chosen by measurement; "
                   "see docs/calibrate.md).")
@click.option("--dataset", default=None,
              help="Recipe name (news, cnn_dailymail), local .txt/.jsonl/.json/.parquet/.csv file, or a "
                   "Hugging Face dataset name in the local cache (default: the offline news recipe).")
@click.option("--text-field", default=None, help="Field holding the text (default: the recipe's, else 'text').")
@click.option("--samples", type=int, default=None, help="Number of calibration samples (default: the recipe's).")
@click.option("--seq-len", type=int, default=None, help="Tokens per sample at most (default: the recipe's).")
@click.option("--seed", type=int, default=None, help="Seed of the sample order (default: the recipe's).")
@click.option("--alpha", type=float, default=None,
              help="SmoothQuant migration strength (int8-sq; default 0.8, chosen by measurement).")
@click.option("--percentile", type=float, default=99.99, show_default=True, help="Percentile for --method percentile.")
@click.option("--weight-rounding", type=click.Choice(["gptq", "nearest"]), default=None,
              help="gptq (default): round weights with error feedback through the calibration inputs (same "
                   "format, lower error); nearest: round each weight independently (as modelopt does).")
@click.option("--damp", type=float, default=None,
              help="GPTQ damping, as a fraction of the mean input second moment (default 0.3, chosen by "
                   "measurement).")
@click.option("--exclude", multiple=True, help="Keep matching modules unquantized (fnmatch on names such as "
              "transformer.layers.0.mlp.proj; repeatable). lm_head is always excluded.")
@click.option("--eval-samples", type=int, default=40, show_default=True,
              help="Held-out documents for the float vs quantized perplexity in the report (0 skips it).")
@device_option("the model runs")
@click.option("--format", "formats", type=click.Choice(["trtllm", "both"]), default="trtllm", show_default=True,
              help="both: also write OUT/hf, the same calibration as a Hugging Face FP8 checkpoint in modelopt's "
                   "layout (the PyTorch backend, vLLM and SGLang load it).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def calibrate(checkpoint, out, precision, kv_cache, method, dataset, text_field, samples, seq_len, seed, alpha,
              percentile, weight_rounding, damp, exclude, eval_samples, device, formats, force, quiet, as_json):
    """Calibrate the float CHECKPOINT into an FP8 or INT8-SmoothQuant TensorRT-LLM checkpoint.

    \b
    Examples:
      trtpipe calibrate out/ckpt -o out/ckpt-fp8 --precision fp8 --kv-cache fp8
      trtpipe calibrate out/ckpt -o out/ckpt-sq --precision int8-sq --alpha 0.8 --samples 64 --seq-len 256
      trtpipe calibrate out/ckpt -o out/ckpt-fp8 --precision fp8 --dataset notes.jsonl --text-field body
      trtpipe calibrate out/ckpt -o out/ckpt-fp8 --precision fp8 --kv-cache fp8 --format both   # + out/ckpt-fp8/hf
    """
    from .calibrate import CalibrateOptions, calibrate_checkpoint, resolve_recipe

    recipe = resolve_recipe(dataset, text_field=text_field, samples=samples, seq_len=seq_len, seed=seed)
    defaulted = {"alpha": alpha, "weight_rounding": weight_rounding, "damp": damp}   # None: CalibrateOptions'
    options = CalibrateOptions(precision=precision, recipe=recipe, kv_cache=kv_cache, method=method,
                               percentile=percentile, exclude=tuple(exclude), eval_samples=eval_samples,
                               device=device, hf_export=formats == "both", force=force,
                               progress=not quiet and not as_json,
                               **{k: v for k, v in defaulted.items() if v is not None})
    result = calibrate_checkpoint(checkpoint, out, options)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.summary())


@main.command(name="eval")
@click.argument("checkpoint")
@click.option("--dataset", default=None,
              help="Plain text file (one sample per line) or a dataset NAME[:CONFIG] in the local Hugging Face "
                   "cache (default: the held-out part of the offline news corpus).")
@click.option("--tokenizer", type=click.Path(path_type=Path), default=None,
              help="Tokenizer directory (default: CHECKPOINT/tokenizer, or the model's own).")
@click.option("--window", type=int, default=512, show_default=True, help="Tokens per scored window.")
@click.option("--max-samples", type=int, default=None, help="Score only the first N samples.")
@device_option("the model runs")
@click.option("--json", "as_json", is_flag=True, help='Print {"perplexity": ..., "tokens": ...}.')
def eval_(checkpoint, dataset, tokenizer, window, max_samples, device, as_json):
    """Perplexity of CHECKPOINT with the reference runtime, one decoder layer in memory at a time.

    \b
    CHECKPOINT is a TensorRT-LLM checkpoint directory or a Hugging Face FP8 checkpoint (modelopt's layout,
    `calibrate --format both` writes one to OUT/hf); a float Hugging Face directory, preset, GGUF file or
    hub id is evaluated with transformers instead, to compare a model before and after conversion.
    Examples:
      trtpipe eval out/ckpt
      trtpipe eval smollm2-135m --json
      trtpipe eval out/ckpt-fp8 --dataset notes.txt
      trtpipe eval out/ckpt-fp8/hf
    """
    from .evaluate import evaluate

    result = evaluate(checkpoint, dataset, tokenizer=tokenizer, window=window, max_samples=max_samples,
                      device=device, progress=not as_json)
    click.echo(json.dumps(result.to_dict()) if as_json else result.summary())


@main.command(name="export-onnx")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="Output directory (model.onnx, genai_config.json).")
@click.option("--precision", type=click.Choice(["auto", "fp32", "fp16", "int8-sq", "fp8"]), default="auto",
              show_default=True, help="auto follows the checkpoint; int8-sq/fp8 need a calibrated checkpoint "
              "(Q/DQ nodes from its scales); fp16 stores float weights in half precision.")
@click.option("--opset", type=int, default=21, show_default=True, help="ONNX opset (19 or newer).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def export_onnx_(checkpoint, out, precision, opset, force, as_json):
    """Export CHECKPOINT as an ONNX decoder with KV cache for TensorRT (trtexec) and ONNX Runtime.

    \b
    Inputs input_ids, attention_mask, position_ids, past_key_values.N.key/value; outputs logits,
    present.N.key/value (the optimum / onnxruntime-genai names); dynamic batch and sequence axes.
    Examples:
      trtpipe export-onnx out/ckpt -o out/onnx
      trtpipe export-onnx out/ckpt-int8-sq -o out/onnx-int8 --precision int8-sq
    """
    from .onnx.export import ExportOptions, export_onnx

    result = export_onnx(checkpoint, out, ExportOptions(precision, opset, force))
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        state = "up to date" if result.skipped else "written"
        data = " (weights in model.onnx.data)" if result.external_data else ""
        click.echo(f"{result.path}/model.onnx {state}: {result.precision}, opset {result.opset}{data}")


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print the catalogue (with each figure's source) as JSON.")
def targets(as_json):
    """The target catalogue: GPUs trtpipe plans for, and the cpu target.

    \b
    Compute capability, memory, bandwidth, dense FP16/FP8/INT8 rates and peer-to-peer support, each
    figure with its source (pipeline/data/targets.json).
    Examples:
      trtpipe targets
      trtpipe targets --json
    """
    from rich.console import Console

    from .targets import catalogue, render_targets

    if as_json:
        click.echo(json.dumps([t.to_dict() for t in catalogue().values()], indent=2))
        return
    table = render_targets()
    console = Console()
    if not console.is_terminal:  # piped: no screen to fit, so the table's natural width and no cell cut
        natural = console.measure(table, options=console.options.update_width(sys.maxsize)).maximum
        console = Console(width=max(console.width, natural))
    console.print(table)


@main.command()
@click.argument("model")
@click.option("--target", required=True, help="A target from `trtpipe targets` (rtx4090, h100, cpu, ...).")
@click.option("--precision", type=click.Choice(PRECISIONS), required=True, help="Weight precision.")
@click.option("--kv-cache", type=click.Choice(["auto", "fp16", "bf16", "fp32", "fp8", "int8"]), default="auto",
              show_default=True, help="KV-cache precision; auto: fp8 for fp8 weights, int8 for int8-sq, else "
              "unquantized (a checkpoint's own KV quantization when MODEL is a checkpoint).")
@click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size (GPUs per engine).")
@click.option("--input-len", type=int, default=1024, show_default=True, help="Typical prompt length in tokens.")
@click.option("--output-len", type=int, default=256, show_default=True, help="Typical generated length in tokens.")
@click.option("--max-context", type=int, default=None,
              help="Longest prompt + output a request may have (max_seq_len); default min(model context, 8192).")
@click.option("--concurrency", type=int, default=None,
              help="Target number of concurrent requests; default: as many as the KV cache holds.")
@click.option("--p99-latency", type=float, default=None,
              help="Optional end-to-end latency budget per request, in seconds (bounds the batch).")
@click.option("--max-batch-size", type=int, default=None, help="Override the planned engine max_batch_size.")
@click.option("--max-num-tokens", type=int, default=None, help="Override the planned max_num_tokens.")
@click.option("--opt-num-tokens", type=int, default=None, help="Override opt_num_tokens (single profile only).")
@click.option("--multiple-profiles/--no-multiple-profiles", default=None, help="Override multiple_profiles.")
@click.option("--paged-context-fmha/--no-paged-context-fmha", default=None,
              help="Override use_paged_context_fmha (needed for KV reuse and chunked context).")
@click.option("--kv-cache-reuse/--no-kv-cache-reuse", default=None, help="Override enable_kv_cache_reuse.")
@click.option("--kv-cache-free-gpu-mem-fraction", type=float, default=None,
              help="Fraction of free GPU memory for the KV cache (default 0.9, must be < 1).")
@click.option("--model-dir", type=click.Path(path_type=Path), default=None, help="Directory holding downloaded models.")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), default=None, help="Also write plan.json here.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (the form other stages read).")
@click.option("--server", type=click.Choice(["vllm", "tgi"]), default=None,
              help="Print the launch line of that server with the plan's batch, context and KV-cache budget.")
@click.option("--backend", type=click.Choice(sorted(BACKEND_NAMES)), default=None,
              help="What serves the model: engine (default on GPUs) or pytorch (TensorRT-LLM LLM API, no engine); "
                   "reference (default on cpu) or reference-llmapi (the llmapi contract on the cpu target).")
@click.option("--instances", type=click.IntRange(1), default=1, show_default=True,
              help="Plan one of N instances sharing one GPU (memory / N each, each with its own CUDA context) "
                   "and print the largest N that fits for each precision.")
def plan(model, target, precision, kv_cache, tp, input_len, output_len, max_context, concurrency, p99_latency,
         max_batch_size, max_num_tokens, opt_num_tokens, multiple_profiles, paged_context_fmha, kv_cache_reuse,
         kv_cache_free_gpu_mem_fraction, model_dir, out, as_json, server, backend, instances):
    """Memory budget, build configuration and Triton parameters for MODEL on a target.

    \b
    MODEL is a preset name, a Hugging Face directory, a GGUF file, a hub id or a TensorRT-LLM checkpoint
    directory. Nothing is downloaded: presets carry their architecture numbers.
    Examples:
      trtpipe plan llama-3-8b --target rtx4090 --precision fp8
      trtpipe plan llama-3-8b --target rtx4090 --precision fp16 --input-len 2048 --output-len 512 --concurrency 16
      trtpipe plan out/ckpt-fp8 --target rtx4090 --precision fp8 --p99-latency 5 --json > plan.json
      trtpipe plan smollm2-135m --target cpu --precision fp16 -o out/plan.json
      trtpipe plan llama-3-8b --target rtx4090 --precision fp16 --server vllm
      trtpipe plan llama-3-8b --target rtx4090 --precision fp8 --instances 2
    """
    from rich.console import Console

    from .plan import Overrides, Workload, render_plan, resolve_model_info, save_plan
    from .plan.density import densities, plan_instances
    from .plan.servers import server_settings
    from .targets import get_target

    info, gpu = resolve_model_info(model, model_dir), get_target(target)
    result = plan_instances(
        info, gpu, precision, instances, kv_cache=kv_cache, tp=tp,
        workload=Workload(input_len=input_len, output_len=output_len, max_context=max_context,
                          concurrency=concurrency, p99_latency_s=p99_latency),
        overrides=Overrides(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens, opt_num_tokens=opt_num_tokens,
                            multiple_profiles=multiple_profiles, use_paged_context_fmha=paged_context_fmha,
                            enable_kv_cache_reuse=kv_cache_reuse,
                            kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction), backend=backend)
    equivalent = server_settings(result, server) if server else None
    if out is not None:
        save_plan(result, out)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    if equivalent is not None:
        from .presets import served_model_id

        click.echo(equivalent.launch_line(served_model_id(result.model)))
        for setting in equivalent.settings:
            click.echo(f"  {setting.flag} {setting.value}: {setting.arithmetic}")
        for note in equivalent.notes:
            click.echo(f"  note: {note}")
        return
    console = Console()
    for renderable in render_plan(result):
        console.print(renderable)
        console.print()
    if out is not None:
        console.print(f"plan written to {out}")
    if instances > 1:
        console.print(f"{instances} instances on one {gpu.name}: {result.memory.memory_bytes / 2**30:.2f} GiB each. "
                      "Largest number of instances that fits, per precision:")
        for d in densities(info, gpu, kv_cache=kv_cache, tp=tp, workload=result.workload, backend=backend):
            console.print(f"  {d.precision:<8} {d.max_instances:>3}" + (
                f"  ({d.memory_per_instance_bytes / 2**30:.2f} GiB, max_batch_size {d.max_batch_size} each)"
                if d.max_instances else f"  ({d.reason})"))




@main.command(name="compile")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("--plan", "plan_path", type=click.Path(path_type=Path), required=True,
              help="plan.json from `trtpipe plan`.")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="Engine directory to write.")
@click.option("--dry-run", is_flag=True, help="Only write the trtllm-build command and its --build_config JSON.")
@click.option("--workers", type=int, default=1, show_default=True,
              help="trtllm-build --workers (parallel rank builds).")
@click.option("--onnx", "onnx_dir", type=click.Path(path_type=Path), default=None,
              help="An `export-onnx` directory: also write ENGINE/trtexec.sh, TensorRT's build of that graph with "
                   "the plan's shapes (unverified: never run here).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def compile_(checkpoint, plan_path, out, dry_run, workers, onnx_dir, force, as_json):
    """Build a TensorRT-LLM 1.2.1 engine from CHECKPOINT as PLAN says (GPU and TensorRT-LLM required).

    \b
    Without a GPU and TensorRT-LLM 1.2.x (and with --dry-run) it writes the exact trtllm-build command
    (ENGINE/trtllm-build.sh) and the --build_config JSON (ENGINE/build_config.json) instead; the build
    itself runs inside the trtpipe container (see the Dockerfile). That real-build path (trtllm-build,
    engine config check, versions and GPU in the manifest) has not been run on trtpipe's GPU-less
    development machines: it is unverified.
    Examples:
      trtpipe compile out/ckpt-fp8 --plan plan.json -o out/engine --dry-run
      docker run --gpus all -v $PWD:/work -w /work trtpipe trtpipe compile out/ckpt-fp8 --plan plan.json -o out/engine
    """
    from .compile import compile_engine
    from .plan import load_plan

    result = compile_engine(checkpoint, load_plan(plan_path), out, dry_run=dry_run, workers=workers, force=force,
                            onnx=onnx_dir)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
        return
    click.echo(result.shell_command)
    state = "up to date" if result.skipped else "written"
    if result.dry_run:
        click.echo(f"dry run: {result.engine_dir}/trtllm-build.sh and build_config.json {state}", err=True)
    else:
        click.echo(f"engine {state}: {result.engine_dir}", err=True)


@main.command()
@click.option("--engine", type=click.Path(path_type=Path), default=None,
              help="Engine directory (the engine backend: GPU targets; where `trtpipe compile` writes, need not "
                   "exist yet).")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="TensorRT-LLM checkpoint (the reference backend, i.e. the cpu target, serves it; also the "
                   "default tokenizer source).")
@click.option("--plan", "plan_path", type=click.Path(path_type=Path), required=True,
              help="plan.json from `trtpipe plan`.")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="Repository to write.")
@click.option("--tokenizer", type=click.Path(path_type=Path), default=None,
              help="Directory with the tokenizer files (default: CHECKPOINT/tokenizer or ENGINE/tokenizer).")
@click.option("--force", is_flag=True, help="Replace an existing repository made from other inputs.")
@click.option("--runtime", type=click.Choice(list(RUNTIMES)), default=None,
              help="cpu target: what the tensorrt_llm Python model computes with (default: the plan's backend; "
                   "onnxruntime exports the checkpoint to ONNX into the repository). Same repository contract.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def deploy(engine, checkpoint, plan_path, out, tokenizer, force, runtime, as_json):
    """Write a Triton model repository (NVIDIA's inflight_batcher_llm layout) from a plan.

    \b
    Models: ensemble, preprocessing, tensorrt_llm, postprocessing, tensorrt_llm_bls; the plan's backend
    (engine or reference) decides what tensorrt_llm runs.
    Examples:
      trtpipe deploy --checkpoint out/ckpt --plan out/plan.json -o out/model_repo          # cpu target
      trtpipe deploy --checkpoint out/ckpt --plan out/plan.json --runtime onnxruntime -o out/model_repo
      trtpipe deploy --engine out/engine --plan out/plan.json --tokenizer ./Llama-3-8B -o out/model_repo
    """
    from .deploy import deploy_repository
    from .plan import load_plan

    result = deploy_repository(load_plan(plan_path), out, engine=engine, checkpoint=checkpoint, tokenizer=tokenizer,
                               force=force, runtime=runtime)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.summary())


@main.command()
@click.argument("repo", type=click.Path(path_type=Path))
@click.option("--engine", type=click.Path(path_type=Path), default=None,
              help="Engine directory to check against (default: the tensorrt_llm model's gpt_model_path).")
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def check(repo, engine, as_json):
    """Static checks of a Triton LLM model repository (trtpipe's or one made with fill_template.py).

    \b
    Schema of every config.pbtxt, unfilled ${...} placeholders, ensemble wiring, batch sizes against
    the engine's config.json, streaming without decoupled mode, KV-cache reuse / chunked context
    without paged context FMHA, preferred batch sizes, the engine's TensorRT-LLM version.
    Exit status 1 when anything is wrong.
    Examples:
      trtpipe check out/model_repo
      trtpipe check triton_model_repo --engine /engines/llama3 --json
    """
    from .check import check_repository

    report_verification(check_repository(repo, engine=engine), as_json)


@main.command()
@click.argument("repo", type=click.Path(path_type=Path), required=False)
@click.option("--url", default=None, help="HTTP URL of a running Triton server serving REPO (default: start the "
              "embedded server on REPO), or with --api openai of an OpenAI-compatible server.")
@click.option("--api", type=click.Choice(["triton", "openai"]), default="triton", show_default=True,
              help="What --url speaks: Triton's (the repository's contract: engine ensemble or llmapi, told from "
              "deploy's record) or the OpenAI-compatible API of trtllm-serve / vLLM (/v1/completions, "
              "/v1/chat/completions, /v1/models, /health; REPO optional, for the golden reference).")
@click.option("--model", "served_model", default=None, metavar="NAME",
              help="With --api openai: the model name to request (default: the first /v1/models lists).")
@click.option("--grpc-url", default=None,
              help="host:port of that server's gRPC endpoint (default: the --url port + 1).")
@click.option("--metrics-url", default=None, help="That server's Prometheus metrics endpoint, http://HOST:PORT "
              "(default: the --url host, port 8002).")
@click.option("--skip-metrics", is_flag=True, help="Skip the metrics check (the server's request counters grow by "
              "the requests validate sent).")
@click.option("--golden", default=None, metavar="MODEL", help="Reference model for the golden outputs (default: the "
              "model deploy recorded in the repository's manifest). " + MODEL_HELP)
@click.option("--load-test", is_flag=True, help="Also run a bounded concurrency sweep (TTFT, ITL, latency, tokens/s).")
@click.option("--concurrency", default="1,2,4,8", show_default=True, help="Load-test concurrency levels.")
@click.option("--max-tokens", type=click.IntRange(2, 4096), default=16, show_default=True,
              help="Tokens generated per request.")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), default=None,
              help="Report directory (default: validation/ beside REPO).")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the server to be ready.")
@device_option("the golden reference runs")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def validate(repo, url, api, served_model, grpc_url, metrics_url, skip_metrics, golden, load_test, concurrency,
             max_tokens, out, timeout, device, as_json):
    """Serve REPO with Triton and verify it: readiness, configs, golden outputs, streaming, HTTP, bad requests,
    metrics.

    \b
    Exit status 0 only when every check passes; report.json (and load_test.png) go to the report directory.
    Examples:
      trtpipe validate out/smollm2/model_repo --golden smollm2-135m --load-test
      trtpipe validate model_repo --url http://gpu-box:8000
      trtpipe validate --url http://gpu-box:8000 --api openai --golden smollm2-135m
    """
    from .validate import ValidateOptions, reference_for, render_report, validate_repository
    from .validate.openai import validate_openai

    try:
        levels = tuple(int(c) for c in concurrency.split(","))
    except ValueError:
        raise UserError(f"--concurrency must be comma-separated integers, got {concurrency!r}") from None
    if metrics_url and not url:
        raise UserError("--metrics-url is for a server given by --url (the embedded server's metrics port is known)")
    if metrics_url and skip_metrics:
        raise UserError("--metrics-url and --skip-metrics contradict each other; pass one")
    if api == "openai":
        triton_only = [flag for flag, given in (("--grpc-url", grpc_url), ("--metrics-url", metrics_url),
                                                ("--load-test", load_test)) if given]
        if not url or triton_only:
            raise UserError("--api openai needs --url (the OpenAI-compatible server) and takes none of "
                            f"--grpc-url, --metrics-url, --load-test; got {'no --url' if not url else triton_only}")
    elif served_model:
        raise UserError("--model names the model of an OpenAI-compatible server: pass it with --api openai")
    if repo is None and url is None:
        raise UserError("give a model repository to serve, or --url of a running server")
    out = out or (Path(repo).absolute().parent if repo else Path.cwd()) / "validation"
    options = ValidateOptions(golden=reference_for(repo, golden, device), load_test=load_test, concurrencies=levels,
                              max_tokens=max_tokens, metrics=not skip_metrics)
    progress = lambda step: click.echo(f"... {step}", err=True)  # noqa: E731
    report = (validate_openai(url, out, options, model=served_model, progress=progress) if api == "openai" else
              validate_repository(repo, out, options, url=url, grpc_url=grpc_url, metrics_url=metrics_url,
                                  ready_timeout=timeout, progress=progress))
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else render_report(report, out))
    sys.exit(0 if report.passed else 1)


@main.command()
@click.argument("repo", type=click.Path(path_type=Path))
@click.option("--port", type=click.IntRange(0, 65533), default=8000, show_default=True,
              help="HTTP port; gRPC uses PORT+1 and metrics PORT+2. 0 picks free ports.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0 for all).")
@click.option("--log", "log_path", type=click.Path(path_type=Path), default=None,
              help="Server log file (default: a temporary file, removed on exit).")
@click.option("--timeout", type=float, default=600.0, show_default=True,
              help="Seconds to wait for every model to be ready.")
def serve(repo, port, host, log_path, timeout):
    """The embedded Triton server on REPO, in the foreground until Ctrl-C.

    \b
    Examples:
      trtpipe serve out/smollm2/model_repo
      trtpipe serve model_repo --port 9000 --host 0.0.0.0 --log triton.log
    """
    from .server import serve_forever

    serve_forever(repo, http_port=port or None, host=host, log_path=log_path, ready_timeout=timeout, echo=click.echo)


def _percent(ctx, param, value):
    from .compare import parse_percent

    return None if value is None else parse_percent(value, f"--{param.name.replace('_', '-')}")


@main.command()
@click.argument("build_a", type=click.Path(path_type=Path))
@click.argument("build_b", type=click.Path(path_type=Path))
@click.option("--prompts", default=None, metavar="FILE|RECIPE",
              help="A text file (one prompt per line) or a recipe: heldout (default: the start of held-out news "
                   "documents) or validate (validate's four prompts).")
@click.option("--num-prompts", type=int, default=16, show_default=True, help="Prompts to use at most.")
@click.option("--max-tokens", type=click.IntRange(1), default=32, show_default=True, help="New tokens per prompt.")
@click.option("--ppl-samples", type=int, default=16, show_default=True,
              help="Held-out documents the perplexity of each checkpoint is computed over.")
@click.option("--load-test", is_flag=True, help="Also measure TTFT/ITL/latency and tokens/s under the same load.")
@click.option("--concurrency", type=click.IntRange(1), default=4, show_default=True,
              help="Concurrent clients of the load test (the same for both).")
@click.option("--requests-per-client", type=click.IntRange(1), default=4, show_default=True)
@click.option("--url-a", default=None, help="Use A's running Triton server instead of serving BUILD_A/model_repo.")
@click.option("--url-b", default=None, help="Use B's running Triton server instead of serving BUILD_B/model_repo.")
@click.option("--max-ppl-increase", callback=_percent, default=None, metavar="PCT",
              help="Fail when B's held-out perplexity is more than PCT above A's (e.g. 2%).")
@click.option("--min-token-agreement", type=float, default=None, help="Fail below this token agreement (0-1).")
@click.option("--min-rouge-l", type=float, default=None, help="Fail below this ROUGE-L F of B against A (0-1).")
@click.option("--min-bleu", type=float, default=None, help="Fail below this corpus BLEU of B against A (0-100).")
@click.option("--min-exact-match", type=float, default=None, help="Fail below this share of identical completions.")
@click.option("--min-throughput-speedup", type=float, default=None,
              help="With --load-test: fail when B's output tokens/s over A's is below this.")
@click.option("--max-p99-latency-increase", callback=_percent, default=None, metavar="PCT",
              help="With --load-test: fail when B's P99 request latency is more than PCT above A's.")
@click.option("--allow-different-tokenizer", is_flag=True,
              help="Compare builds of different models or tokenizers (refused otherwise: exit 2).")
@device_option("perplexity is computed")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), default=None,
              help="Report directory (default: compare-<A>-vs-<B>).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def compare(build_a, build_b, prompts, num_prompts, max_tokens, ppl_samples, load_test, concurrency,
            requests_per_client, url_a, url_b, allow_different_tokenizer, device, out, force, as_json, **limits):
    """Compare two builds of one model on the same prompts and load; exit 1 when B fails a threshold.

    Reports held-out perplexity, B's token agreement, ROUGE-L, BLEU and exact match against A's greedy
    completions, weights and planned memory per instance, and with --load-test TTFT/ITL/latency
    P50/P90/P99 and output tokens/s at one concurrency: report.json, report.md and report.png.

    \b
    Examples:
      trtpipe compare out/fp16 out/fp8 --max-ppl-increase 2% --min-rouge-l 0.85
      trtpipe compare out/fp16 out/fp8 --load-test --concurrency 8 -o ab-report
    """
    from .compare import CompareOptions, Thresholds, compare_builds
    from .compare.serving import ServeOptions

    out = out or Path(f"compare-{Path(build_a).name}-vs-{Path(build_b).name}")
    if out.exists() and any(out.iterdir()) and not force:
        raise UserError(f"{out} exists and is not empty; pass --force to replace it, or another -o")
    options = CompareOptions(
        build_a, build_b, out, thresholds=Thresholds(**limits),
        serve=ServeOptions(max_tokens=max_tokens, load_test=load_test, concurrency=concurrency,
                           requests_per_client=requests_per_client),
        prompts=prompts, num_prompts=num_prompts, ppl_samples=ppl_samples, url_a=url_a, url_b=url_b,
        allow_different_tokenizer=allow_different_tokenizer, device=device)
    report = compare_builds(options, say=lambda m: click.echo(m, err=True))
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        click.echo(report.markdown().split("\n## Completions")[0])
        click.echo(f"report: {out}/report.json, report.md, report.png")
    sys.exit(0 if report.passed else 1)


@main.command()
@click.argument("build_or_repo", metavar="BUILD_OR_REPO", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="Directory for the manifests (kustomization.yaml, ...), the alerts and the dashboard.")
@click.option("--image", default=DEFAULT_IMAGE, show_default=True,
              help="The trtpipe image (the Dockerfile's: Triton 25.12 with TensorRT-LLM 1.2.1), pushed where the "
                   "cluster pulls from.")
@click.option("--replicas", default="1:4", show_default=True, metavar="MIN:MAX", help="Autoscaling bounds.")
@click.option("--namespace", default="default", show_default=True, help="Namespace of every object.")
@click.option("--repo-source", default=None, metavar="pvc|pvc:CLAIM|artifact:URL",
              help="Where pods find the model repository: pvc (default) writes a new PersistentVolumeClaim to fill "
                   "with the loader pod; pvc:CLAIM uses an existing, already filled claim; artifact:URL has every "
                   "pod fetch a `trtpipe package` archive and `trtpipe unpack --target` it before Triton starts.")
@click.option("--scale-ratio", type=click.FloatRange(min=0, min_open=True), default=None,
              help="queue:compute ratio the autoscaler holds (default: from the plan's --p99-latency, else 1.0).")
@click.option("--name", default=None, help="Name of every object (default: <model>-<target>).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--canary-of", type=click.Path(path_type=Path), default=None, metavar="A",
              help="Write this build as the canary of A (deployed already with `trtpipe k8s`): a Gateway API "
                   "HTTPRoute splitting requests between the two Services, and CANARY.md with the commands. A is A's "
                   "manifests directory (the -o of `trtpipe k8s BUILD_A`, which names A's Service) or BUILD_A (its "
                   "k8s/ when present, else the default name).")
@click.option("--weight", type=int, default=10, show_default=True,
              help="With --canary-of: % of requests to this build.")
@click.option("--gateway", default="trtpipe", show_default=True, metavar="[NAMESPACE/]NAME",
              help="With --canary-of: the Gateway the HTTPRoute attaches to.")
def k8s(build_or_repo, out, image, replicas, namespace, repo_source, scale_ratio, name, force, canary_of, weight,
        gateway):
    """Kubernetes manifests for a built model repository: Triton, autoscaling, alerts, a Grafana dashboard.

    \b
    BUILD_OR_REPO is a `trtpipe build` directory or a `trtpipe deploy` repository; its plan sizes the pods
    (GPUs = tp x pp, memory, /dev/shm, startup and drain times). Writes kustomization.yaml with the
    Deployment, Service, HorizontalPodAutoscaler (on triton:queue_compute:ratio), PodDisruptionBudget,
    PodMonitor, PrometheusRule and the model-repository volume; model-repo-loader.yaml and
    grafana-dashboard.json beside them. Nothing is built in the cluster (docs/kubernetes.md).
    Examples:
      trtpipe k8s out/smollm2 -o out/smollm2/k8s
      trtpipe k8s out/llama3 -o k8s/llama3 --image registry.example.com/trtpipe:0.1.0 --replicas 2:8 --namespace llm
      kubectl apply -k out/smollm2/k8s
      trtpipe k8s out/fp8 -o k8s/fp8 --canary-of out/fp16 --weight 10 --name smollm2-135m-cpu-fp8
    """
    from .k8s import K8sOptions, write_k8s

    options = K8sOptions(image=image, replicas=replicas, namespace=namespace, repo_source=repo_source,
                         scale_ratio=scale_ratio, name=name, force=force, canary_of=canary_of, weight=weight,
                         gateway=gateway)
    click.echo(write_k8s(build_or_repo, out, options).summary())


@main.command()
@click.argument("build_or_repo", metavar="BUILD_OR_REPO", type=click.Path(path_type=Path))
@click.option("--slo", required=True, metavar="CLAUSES",
              help='Bounds every trial is judged by, e.g. "ttft_p99<=500ms,itl_p99<=50ms": ttft/itl/latency at '
                   "p50/p90/p99 (<=, with us/ms/s), output_tokens_per_s (>=).")
@click.option("--trials", type=click.IntRange(1), default=8, show_default=True,
              help="Trials to serve in the study (a resumed study runs up to this many in all).")
@click.option("--concurrency", default="1,4,8", show_default=True, help="The load's concurrency sweep.")
@click.option("--requests-per-client", type=click.IntRange(1), default=2, show_default=True)
@click.option("--max-tokens", type=click.IntRange(2, 4096), default=32, show_default=True,
              help="Tokens generated per request.")
@click.option("--prompts", default=None, metavar="FILE|RECIPE",
              help="heldout (default: held-out calibration-corpus documents), validate, or a file of prompts.")
@click.option("--num-prompts", type=click.IntRange(1), default=16, show_default=True)
@click.option("--load-generator", type=click.Choice(["builtin", "aiperf"]), default="builtin", show_default=True)
@click.option("--url", default=None, help="A running Triton with --model-control-mode=explicit serving the "
              "repository: each trial's configs are loaded into it (GPU targets need it).")
@click.option("--rebuild", is_flag=True, help="GPU: also search the build's max_batch_size, max_num_tokens and "
              "multiple_profiles, compiling each trial's engine.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the TPE sampler.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds to wait for each server.")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), default=None,
              help="Study directory (default: BUILD/tune, or tune/ beside REPO); study.db resumes there.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON.")
def tune(build_or_repo, out, as_json, trials, url, rebuild, seed, timeout, **load):
    """Search batching and serving parameters for the most output tokens/s within an SLO, by measurement.

    \b
    Each trial renders a candidate repository (the plan with the trial's values), serves it and runs the same
    load; Optuna's TPE (seeded, resumable in OUT/study.db) starts from the plan's configuration and the
    roofline's, never serves what the planner's memory model refuses, and prunes trials whose first load
    level already breaks the SLO. OUT/result/ gets trials.json/csv, tradeoff.png, importances.png and, when a
    trial meets the SLO, overlay.json, plan.json and model_repo/. Exit 1 when no trial meets the SLO.
    Examples:
      trtpipe tune out/smollm2 --slo "ttft_p99<=2s,itl_p99<=300ms" --trials 6
      trtpipe tune out/llama3 --slo "ttft_p99<=500ms,itl_p99<=50ms" --url http://gpu-box:8000
    """
    from .tune import tune as run_tune
    from .tune import tune_options
    from .tune.stage import result_json

    options = tune_options(trials=trials, url=url, rebuild=rebuild, out=out, seed=seed, ready_timeout=timeout,
                           progress=not as_json, **load)
    result = run_tune(build_or_repo, options, say=lambda message: click.echo(message, err=as_json))
    click.echo(result_json(result) if as_json else result.render())
    sys.exit(0 if result.met else 1)


@main.command()
@click.option("--target", default="rtx4090", show_default=True, help="The GPU target this box should be "
              "(`trtpipe targets`).")
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
def doctor(target, as_json):
    """Check that this machine can build and serve TensorRT-LLM 1.2.1 engines for a GPU target.

    \b
    One line per check, PASS / FAIL / SKIP with what to do: nvidia-smi and the driver, the GPU's name,
    compute capability and memory against the target catalogue, TensorRT-LLM 1.2.1 importable,
    trtllm-build and tritonserver (with the tensorrtllm backend) on PATH, torch with CUDA.
    Exit status 0 when every check passes, 1 when one fails, 2 for an unknown or non-GPU target.
    Examples:
      trtpipe doctor
      trtpipe doctor --target l40s --json
    """
    from .doctor import run_doctor

    report = run_doctor(target)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.render())
    sys.exit(0 if report.ok else 1)


def _versions_group():
    from .versions.commands import versions

    return versions


main.add_command(_versions_group())   # trtpipe versions list|add|serve|remove (pipeline/versions/commands.py)


@main.command(name="matrix")
@click.argument("matrix_file", type=click.Path(path_type=Path), default="trtpipe.toml")
@click.option("--json", "as_json", is_flag=True, help='Print {"include": [build...]}, the shape of a CI matrix.')
def matrix_(matrix_file, as_json):
    """The builds of MATRIX_FILE (trtpipe.toml, or pyproject.toml's [tool.trtpipe]).

    \b
    Examples:
      trtpipe matrix
      trtpipe matrix pyproject.toml --json
    """
    from .matrix import entry_for_ci, load_matrix

    matrix = load_matrix(matrix_file)
    if as_json:
        click.echo(json.dumps(matrix.to_dict(), indent=2))
        return
    for row in map(entry_for_ci, matrix.entries):
        click.echo(f"{row['name']:<24} {row['model']} -> {row['target']} (sm {row['sm']}) {row['precision']}, "
                   f"kv {row['kv_cache']}, tp {row['tp']} pp {row['pp']}, "
                   f"calibration {row['calibration'] or 'default'}")


@main.group()
def ci():
    """CI workflows that build, validate, package and upload the build matrix."""


@ci.command()
@click.option("--matrix", "matrix_path", type=click.Path(path_type=Path), default=None,
              help="Build matrix (default: trtpipe.toml when it exists; without one, only the SmolLM2 job).")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path),
              default=Path(".github/workflows/trtpipe.yml"), show_default=True)
def github(matrix_path, out):
    """Write the GitHub Actions workflow: SmolLM2 end to end on a hosted runner, the matrix's builds.

    \b
    GPU builds run on self-hosted runners labelled [self-hosted, linux, x64, gpu, TARGET] inside NVIDIA's
    TensorRT-LLM Triton container; see docs/ci.md. Run it from the repository root.
    Examples:
      trtpipe ci github
      trtpipe ci github --matrix trtpipe.toml -o .github/workflows/trtpipe.yml
    """
    from .ci import github_workflow, workflow_matrix_path, write_workflow
    from .matrix import load_matrix

    if matrix_path is None and Path("trtpipe.toml").is_file():
        matrix_path = Path("trtpipe.toml")
    matrix = load_matrix(matrix_path) if matrix_path else None
    write_workflow(github_workflow(matrix, workflow_matrix_path(matrix_path) if matrix else None), out)
    jobs = 1 + (len(matrix.entries) if matrix else 0)
    click.echo(f"wrote {out}: {jobs} build(s) (SmolLM2 on the cpu target{' and the matrix' if matrix else ''})")


@main.command()
@click.argument("build_dir", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True, help="The .tar to write.")
def package(build_dir, out):
    """Pack BUILD_DIR (engine or checkpoint, model repository, build.json, validation report) into one
    archive with artifact.json: every file's sha256, the model's fingerprint, versions, target and SM.

    \b
    Examples:
      trtpipe package out/smollm2-cpu-fp8 -o smollm2-cpu-fp8.tar
    """
    from .artifact import package_build

    click.echo(package_build(build_dir, out).summary())


def report_verification(result, as_json: bool) -> None:
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.summary())
    if not result.ok:
        sys.exit(1)


@main.command()
@click.argument("archive", type=click.Path(path_type=Path))
@click.option("--target", default=None, help="Refuse an artifact built for another SM or TensorRT-LLM version "
              "than this target's.")
@click.option("--json", "as_json", is_flag=True, help="Print what was found as JSON.")
def verify(archive, target, as_json):
    """Check every file of ARCHIVE against its artifact.json (exit 1 when anything does not match).

    \b
    Examples:
      trtpipe verify smollm2-cpu-fp8.tar
      trtpipe verify llama-3-8b-rtx4090-fp8.tar --target rtx4090
    """
    from .artifact import verify_archive

    report_verification(verify_archive(archive, target), as_json)


@main.command()
@click.argument("archive", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="New directory to extract into.")
@click.option("--target", default=None, help="As for verify: refuse an artifact for another SM or version.")
@click.option("--json", "as_json", is_flag=True, help="Print what was found as JSON.")
def unpack(archive, out, target, as_json):
    """Verify ARCHIVE, then extract it into OUT (nothing is extracted from an archive that fails).

    \b
    Examples:
      trtpipe unpack smollm2-cpu-fp8.tar -o deploy/smollm2
    """
    from .artifact import unpack_archive

    result = unpack_archive(archive, out, target)
    report_verification(result, as_json)
    click.echo(f"extracted into {out}")


if __name__ == "__main__":
    main()
