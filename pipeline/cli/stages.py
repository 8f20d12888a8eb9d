"""The stage commands: setup, convert, calibrate, eval, export-onnx, targets, plan, compile, deploy, and build
(all of them in one run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .. import NVIDIA_MODEL_FILES
from ..backends.names import NAMES, RUNTIMES
from ..backends.runtime_images import IMAGES
from ..engine_inspect import DEFAULT_PROFILING_VERBOSITY, PROFILING_VERBOSITIES
from ..errors import UserError
from ..triton_names import BATCH_SCHEDULER_POLICIES
from ..precisions import (AUTO, AUTO_PRECISIONS, CALIBRATION_FORMATS, CALIBRATION_QUANT_ALGO, FLOAT_DTYPES,
                          KV_CACHE_CHOICES, KV_CACHE_QUANT_ALGO, PRECISIONS)
from .base import (DEFAULT_IMAGE, calibration_data_options, choice, concurrency_option, device_option, main,
                   speculative_options, speculative_request)


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Print where the assets are as JSON.")
def setup(as_json):
    """Fetch the offline assets (SmolLM2 GGUF check, calibration corpus) into the cache.

    \b
    Example:
      trtpipe setup
    """
    from ..assets import calibration_corpus_path, smollm2_gguf_path

    assets = {"SmolLM2 GGUF": str(smollm2_gguf_path()), "calibration corpus": str(calibration_corpus_path())}
    if as_json:
        click.echo(json.dumps(assets))
        return
    for name, path in assets.items():
        click.echo(f"{name + ':':<20} {path}")


@main.command()
@click.argument("source")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="Checkpoint directory to write.")
@click.option("--precision", type=choice(FLOAT_DTYPES), default=None,
              help="Weight precision of the checkpoint, as in plan and build (default: the model's own dtype).")
@click.option("--tp", "--tensor-parallel-size", type=click.IntRange(1), default=1, show_default=True,
              help="Tensor-parallel size.")
@click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel size.")
@click.option("--model-dir", type=click.Path(path_type=Path), default=None, help="Directory holding downloaded models.")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def convert(source, out, precision, tp, pp, model_dir, force, as_json):
    """Convert SOURCE to a TensorRT-LLM 1.2.x checkpoint (config.json + rank<N>.safetensors).

    \b
    SOURCE is a preset name, a Hugging Face directory, a GGUF file or a hub id.
    Examples:
      trtpipe convert smollm2-135m -o out/ckpt
      trtpipe convert ./Meta-Llama-3-8B -o out/ckpt-tp2 --precision fp16 --tp 2
    """
    from ..convert import convert_model
    from ..sources import resolve_model

    dtype = FLOAT_DTYPES[precision] if precision else None
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
@click.option("--precision", type=choice([*PRECISIONS, AUTO]), default="fp16", show_default=True,
              help="Weight precision (`trtpipe targets` says which each target runs); auto: the highest-quality "
                   f"one whose plan fits ({' -> '.join(AUTO_PRECISIONS)}).")
@click.option("--kv-cache", type=choice(KV_CACHE_CHOICES), default="auto", show_default=True,
              help="KV-cache precision; auto: fp8 for fp8 weights, int8 for int8-sq, else unquantized.")
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), default=None,
              help="Build directory (default: out/<model>-<target>-<precision>[-<backend>]).")
@click.option("--dry-run", is_flag=True,
              help="GPU targets: say what the build would do, in seconds, from the model's config alone: the plan, "
                   "each stage's command (trtllm-build's too), the download and each stage's estimated time here; "
                   "nothing is downloaded, converted or written. cpu (or with --checkpoints-on-cpu): every stage but "
                   "compile's trtllm-build and validation.")
@click.option("--url", default=None, help="Validate on this running Triton server instead of the embedded one.")
@click.option("--load-test", is_flag=True, help="Add the bounded load test to validation.")
@click.option("--samples", type=click.IntRange(min=1), default=None,
              help="Calibration samples (default: the recipe's).")
@click.option("--model-dir", type=click.Path(path_type=Path), default=None, help="Directory holding downloaded models.")
@device_option("calibration and the golden reference run")
@click.option("--backend", type=choice(sorted(NAMES)), default=None,
              help="What serves the model: engine (default on GPUs; compiled by trtllm-build) or pytorch "
                   "(TensorRT-LLM LLM API on the Hugging Face checkpoint, no compile); reference (default on cpu), "
                   "reference-llmapi or reference-onnx on the cpu target.")
@click.option("--runtime-image", type=choice(list(IMAGES)), default=None, metavar="IMAGE",
              help=f"GPU targets: the runtime image the deployment runs in, one of {', '.join(IMAGES)} (its "
                   "TensorRT-LLM version decides what can run; docs/capabilities.md). Default: the newest Triton "
                   "image with TensorRT-LLM 1.2.1; trtllm-1.3.0rc27 serves --backend pytorch with trtllm-serve alone.")
@click.option("--k8s", "k8s_manifests", is_flag=True,
              help="Also write Kubernetes manifests, alerts and a dashboard to OUT/k8s (see `trtpipe k8s`).")
@click.option("--input-len", type=click.IntRange(1), default=None, help="Typical prompt length the plan is for "
              "(default 1024, as `trtpipe plan`).")
@click.option("--output-len", type=click.IntRange(1), default=None, help="Typical generated length (default 256).")
@click.option("--max-context", "--max-model-len", type=click.IntRange(2), default=None,
              help="Longest prompt + output a request may have (default: min(model context, 8192)).")
@click.option("--sparsity", type=choice(["2:4"]), default=None,
              help="Prune the converted checkpoint to 2:4 (SparseGPT) before calibration; on a GPU target the "
              "engine is built with --weight_sparsity (no speedup assumed: docs/sparsity.md).")
@click.option("--distill-tokens", type=int, default=None,
              help="With --sparsity: distill the sparse checkpoint from the dense one on this many tokens.")
@click.option("--checkpoints-on-cpu", is_flag=True,
              help="GPU targets: download, convert and calibrate here on this machine's CPU, without a GPU (hours for "
                   "an 8B model; the download and time are printed before it starts), then write the engine build "
                   "command. Without it, a GPU target's build needs the GPU machine.")
@click.option("--quantize-lm-head", is_flag=True,
              help="int4-awq: calibrate lm_head to 4 bits too (see `trtpipe calibrate --quantize-lm-head`): fewer "
                   "bytes a decode step, a little more perplexity (docs/int4.md).")
@speculative_options
@click.option("--json", "as_json", is_flag=True, help="Print the build summary as JSON.")
def build(model, matrix_path, only, target, precision, kv_cache, out, dry_run, url, load_test, samples, model_dir,
          device, backend, runtime_image, k8s_manifests, input_len, output_len, max_context, sparsity, distill_tokens,
          checkpoints_on_cpu, quantize_lm_head, speculative, draft_len, acceptance, drafts_per_step, as_json):
    """Run every stage: convert, [sparsify, distill,] calibrate, plan, compile, deploy, validate.

    \b
    Each stage is skipped when its manifest shows unchanged inputs. Exit 0 only when validation passed
    (or was not possible: a dry run, a GPU target without --url).
    Examples:
      trtpipe build smollm2-135m --target cpu --precision fp8 -o out/smollm2
      trtpipe build llama-3-8b --target rtx4090 --precision fp8 --dry-run
      trtpipe build llama-3-8b --target rtx4090 --precision fp8 --backend pytorch
      trtpipe build smollm2-135m --target cpu --precision fp8 --sparsity 2:4 --distill-tokens 100000
      trtpipe build --matrix trtpipe.toml --only smollm2-cpu-fp8
    """
    from ..build import BuildOptions, build as run_build
    from ..plan import Workload

    if matrix_path is not None:
        if k8s_manifests:
            raise UserError("--k8s writes one build's manifests: run `trtpipe k8s BUILD` for each matrix build")
        if backend is not None:
            raise UserError("--backend chooses one build's backend; a matrix build takes its matrix's settings")
        if (sparsity, distill_tokens) != (None, None) or quantize_lm_head:
            raise UserError("--sparsity, --distill-tokens and --quantize-lm-head make one build's checkpoint; a "
                            "matrix build takes its matrix's settings")
        if (speculative, draft_len, acceptance, drafts_per_step) != (None, None, None, None):
            raise UserError("--speculative plans one build; a matrix build takes its matrix's settings")
        if (input_len, output_len, max_context) != (None, None, None):
            raise UserError("--input-len, --output-len and --max-context plan one build; a matrix build takes its "
                            "matrix's settings")
        return build_matrix(model, matrix_path, only, out, as_json, dry_run=dry_run, url=url, load_test=load_test,
                            model_dir=model_dir, device=device, progress=not as_json,
                            checkpoints_on_cpu=checkpoints_on_cpu)
    if model is None:
        raise UserError("give MODEL (a preset, Hugging Face directory, GGUF file or hub id) or --matrix FILE")
    if only:
        raise UserError("--only selects builds of a matrix: give --matrix FILE with it")
    safe_name = Path(model).name.replace(".gguf", "")
    out = out or Path("out") / (f"{safe_name}-{target}-{precision}" + ("-head" if quantize_lm_head else "")
                                + (f"-{backend}" if backend else "") + ("-sparse" if sparsity else ""))
    lengths = {k: v for k, v in (("input_len", input_len), ("output_len", output_len), ("max_context", max_context))
               if v is not None}
    options = BuildOptions(model=model, target=target, precision=precision, kv_cache=kv_cache, out=out,
                           dry_run=dry_run, url=url, load_test=load_test, model_dir=model_dir,
                           calibration_samples=samples, device=device, progress=not as_json, backend=backend,
                           runtime_image=runtime_image,
                           workload=Workload(**lengths) if lengths else None, sparsity=sparsity,
                           distill_tokens=distill_tokens, checkpoints_on_cpu=checkpoints_on_cpu,
                           quantize_lm_head=quantize_lm_head,
                           speculative=speculative_request(speculative, draft_len, acceptance, drafts_per_step))
    summary = run_build(options, say=(lambda msg: click.echo(msg, err=True)) if as_json else click.echo)
    click.echo(json.dumps(summary.to_dict(), indent=2) if as_json else summary.render())
    if summary.passed is False:
        sys.exit(1)
    if k8s_manifests and summary.preview is not None:
        click.echo("--k8s: a dry run has no repository to write manifests for", err=True)
    elif k8s_manifests:
        from ..k8s import K8sOptions, write_k8s

        written = write_k8s(out, out / "k8s", K8sOptions(image=DEFAULT_IMAGE, force=True))
        click.echo(written.summary(), err=as_json)


def build_matrix(model, matrix_path, only, out, as_json, **options):
    """`trtpipe build --matrix`: each selected build in turn; exit 1 when one failed validation."""
    from ..matrix import load_matrix, run_matrix

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
@click.option("--precision", type=choice(CALIBRATION_QUANT_ALGO), required=True,
              help="fp8: FP8 E4M3 weights and activations; int8-sq: SmoothQuant W8A8 (per-channel weights); "
                   "int4-awq: 4-bit weights in groups, AWQ smoothing, float activations (W4A16); w4a8-awq: the same "
                   "weights with FP8 activations (sm_89 and newer).")
@click.option("--group-size", type=int, default=None,
              help="4-bit: inputs per weight scale (default 128 where every quantized input width is a multiple of "
                   "it, else 64, with a note).")
@click.option("--kv-cache", type=choice(sorted(KV_CACHE_QUANT_ALGO)), default=None,
              help="Also quantize the KV cache (per-layer scales from the K and V values).")
@click.option("--method", type=choice(["entropy", "percentile", "mse", "max"]), default=None,
              help="Activation amax method (default: max for every precision, chosen by measurement; "
                   "see docs/calibrate.md).")
@calibration_data_options
@click.option("--alpha", type=float, default=None,
              help="SmoothQuant migration strength (int8-sq; default 0.8, chosen by measurement).")
@click.option("--percentile", type=float, default=99.99, show_default=True, help="Percentile for --method percentile.")
@click.option("--weight-rounding", type=choice(["gptq", "nearest"]), default=None,
              help="gptq (default): round weights with error feedback through the calibration inputs (same "
                   "format, lower error); nearest: round each weight independently (as modelopt does).")
@click.option("--damp", type=float, default=None,
              help="GPTQ damping, as a fraction of the mean input second moment (default 0.3, chosen by "
                   "measurement).")
@click.option("--exclude", multiple=True, help="Keep matching modules unquantized (fnmatch on names such as "
              "transformer.layers.0.mlp.proj; repeatable). lm_head is excluded unless --quantize-lm-head.")
@click.option("--quantize-lm-head", is_flag=True,
              help="int4-awq: quantize lm_head to 4 bits as well (AWQ, group scales, GPTQ), written untied from the "
                   "embedding; NVIDIA's exporter keeps it 16-bit. It is most of a small model's bytes per decode "
                   "step (docs/int4.md).")
@click.option("--eval-samples", type=click.IntRange(min=0), default=40, show_default=True,
              help="Held-out documents for the float vs quantized perplexity in the report (0 skips it).")
@device_option("the model runs")
@click.option("--format", "formats", type=choice(CALIBRATION_FORMATS), default="trtllm", show_default=True,
              help="both: also write OUT/hf, the same calibration as a Hugging Face checkpoint in modelopt's "
                   "unified layout (fp8, int4-awq, w4a8-awq; TensorRT-LLM's PyTorch backend loads it, vLLM and "
                   "SGLang the FP8 one); hf: that Hugging Face checkpoint alone, as OUT (no TensorRT-LLM "
                   "checkpoint; its perplexity is the Hugging Face checkpoint's); vllm: int4-awq as AutoAWQ's "
                   "checkpoint alone, as OUT, the one vLLM reads (GPU and x86 CPU), every smoothing folded into the "
                   "tensors before it.")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def calibrate(checkpoint, out, precision, group_size, kv_cache, method, dataset, text_field, samples, seq_len, seed,
              alpha, percentile, weight_rounding, damp, exclude, quantize_lm_head, eval_samples, device, formats, force,
              quiet, as_json):
    """Calibrate the float CHECKPOINT into an FP8, INT8-SmoothQuant or 4-bit (AWQ) TensorRT-LLM checkpoint.

    \b
    Examples:
      trtpipe calibrate out/ckpt -o out/ckpt-fp8 --precision fp8 --kv-cache fp8
      trtpipe calibrate out/ckpt -o out/ckpt-sq --precision int8-sq --alpha 0.8 --samples 64 --seq-len 256
      trtpipe calibrate out/ckpt -o out/ckpt-int4 --precision int4-awq --group-size 64
      trtpipe calibrate out/ckpt -o out/ckpt-fp8 --precision fp8 --dataset notes.jsonl --text-field body
      trtpipe calibrate out/ckpt -o out/ckpt-fp8 --precision fp8 --kv-cache fp8 --format both   # + out/ckpt-fp8/hf
      trtpipe calibrate out/ckpt -o out/hf-fp8 --precision fp8 --kv-cache fp8 --format hf        # for vLLM only
      trtpipe calibrate out/ckpt -o out/hf-int4 --precision int4-awq --format hf   # for trtllm-serve only
      trtpipe calibrate out/ckpt -o out/awq-int4 --precision int4-awq --format vllm  # for vLLM only
    """
    from ..calibrate import CalibrateOptions, calibrate_checkpoint, resolve_recipe

    recipe = resolve_recipe(dataset, text_field=text_field, samples=samples, seq_len=seq_len, seed=seed)
    defaulted = {"alpha": alpha, "weight_rounding": weight_rounding, "damp": damp}   # None: CalibrateOptions'
    options = CalibrateOptions(precision=precision, recipe=recipe, kv_cache=kv_cache, method=method,
                               percentile=percentile, exclude=tuple(exclude), eval_samples=eval_samples,
                               device=device, format=formats, force=force,
                               group_size=group_size, quantize_lm_head=quantize_lm_head,
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
@click.option("--window", type=click.IntRange(min=2), default=512, show_default=True,
              help="Tokens per scored window.")
@click.option("--eval-samples", "max_samples", type=click.IntRange(min=1), default=None,
              help="Held-out documents scored: only the first N (default: all of them).")
@device_option("the model runs")
@click.option("--json", "as_json", is_flag=True, help='Print {"perplexity": ..., "tokens": ...}.')
def eval_(checkpoint, dataset, tokenizer, window, max_samples, device, as_json):
    """Perplexity of CHECKPOINT with the reference runtime, one decoder layer in memory at a time.

    \b
    CHECKPOINT is a TensorRT-LLM checkpoint directory or a Hugging Face FP8 checkpoint (modelopt's layout,
    `calibrate --format both` writes one to OUT/hf, `--format hf` to OUT); a float Hugging Face directory,
    preset, GGUF file or hub id is evaluated with transformers instead, to compare a model before and after conversion.
    Examples:
      trtpipe eval out/ckpt
      trtpipe eval smollm2-135m --json
      trtpipe eval out/ckpt-fp8 --dataset notes.txt
      trtpipe eval out/ckpt-fp8/hf
    """
    from ..evaluate import evaluate

    result = evaluate(checkpoint, dataset, tokenizer=tokenizer, window=window, max_samples=max_samples,
                      device=device, progress=not as_json)
    click.echo(json.dumps(result.to_dict()) if as_json else result.summary())


@main.command(name="export-onnx")
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="Output directory (model.onnx, genai_config.json).")
@click.option("--precision", type=choice(["auto", "fp32", "fp16", "int8-sq", "fp8", "int4-awq"]), default="auto",
              show_default=True, help="auto follows the checkpoint; int8-sq/fp8 need a calibrated checkpoint "
              "(Q/DQ nodes from its scales), int4-awq an int4-awq one (ONNX Runtime's 4-bit MatMulNBits on its "
              "codes and group scales); fp16 stores float weights in half precision.")
@click.option("--opset", type=int, default=21, show_default=True, help="ONNX opset (19 or newer).")
@click.option("--int4-accuracy", type=click.IntRange(0, 4), default=0, show_default=True,
              help="int4-awq: MatMulNBits' accuracy_level (0 computes in float32; 4 quantizes each input block to "
                   "int8 and computes in integers).")
@click.option("--in-place-kv", is_flag=True,
              help="ONNX Runtime only: each layer's attention is its GroupQueryAttention, which writes the KV cache "
                   "into a buffer bound as both past and present (rows right-padded) instead of returning past + new "
                   "(what the cpu target serves; TensorRT does not run it).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def export_onnx_(checkpoint, out, precision, opset, int4_accuracy, in_place_kv, force, as_json):
    """Export CHECKPOINT as an ONNX decoder with KV cache for TensorRT (trtexec) and ONNX Runtime.

    \b
    Inputs input_ids, attention_mask, position_ids, past_key_values.N.key/value; outputs logits,
    present.N.key/value (the optimum / onnxruntime-genai names); dynamic batch and sequence axes.
    Examples:
      trtpipe export-onnx out/ckpt -o out/onnx
      trtpipe export-onnx out/ckpt-int8-sq -o out/onnx-int8 --precision int8-sq
    """
    from ..onnx.export import ExportOptions, export_onnx

    result = export_onnx(checkpoint, out, ExportOptions(precision, opset, int4_accuracy=int4_accuracy,
                                                        in_place_kv=in_place_kv, force=force))
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

    from ..targets import catalogue, render_targets

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
@click.option("--target", default="cpu", show_default=True,
              help="A target from `trtpipe targets` (cpu, rtx4090, h100, ...); the same default as build.")
@click.option("--precision", type=choice([*PRECISIONS, AUTO]), default="fp16", show_default=True,
              help="Weight precision; the same default as build. auto: the highest-quality one whose plan fits "
                   f"the workload ({' -> '.join(AUTO_PRECISIONS)}); the plan says why each before it did not.")
@click.option("--kv-cache", type=choice(KV_CACHE_CHOICES), default="auto",
              show_default=True, help="KV-cache precision; auto: fp8 for fp8 weights, int8 for int8-sq, else "
              "unquantized (a checkpoint's own KV quantization when MODEL is a checkpoint; unquantized on the cpu "
              "target, whose reference runtime stores every KV cache in float32, as its build does).")
@click.option("--tp", "--tensor-parallel-size", type=click.IntRange(1), default=1, show_default=True,
              help="Tensor-parallel size (GPUs per engine).")
@click.option("--input-len", type=click.IntRange(1), default=1024, show_default=True,
              help="Typical prompt length in tokens.")
@click.option("--output-len", type=click.IntRange(1), default=256, show_default=True,
              help="Typical generated length in tokens.")
@click.option("--max-context", "--max-model-len", type=click.IntRange(2), default=None,
              help="Longest prompt + output a request may have (max_seq_len); default min(model context, 8192).")
@concurrency_option("Target number of concurrent requests; default: as many as the KV cache holds.")
@click.option("--p99-latency", type=float, default=None,
              help="Optional end-to-end latency budget per request, in seconds (bounds the batch).")
@click.option("--max-batch-size", type=int, default=None, help="Override the planned engine max_batch_size.")
@click.option("--max-num-tokens", type=int, default=None,
              help="Override the planned max_num_tokens (on cpu: the tokens of one scheduler step).")
@click.option("--batch-scheduler-policy", type=choice(BATCH_SCHEDULER_POLICIES), default=None,
              help="guaranteed_no_evict (default: a request starts only when its whole KV fits) or max_utilization "
                   "(start more, pause the latest when the KV cache runs out).")
@click.option("--priority-levels", type=click.IntRange(1), default=None,
              help="Triton priority levels for the tensorrt_llm model (1 is the highest); a request's `priority` "
                   "picks its level. cpu target only: NVIDIA's tensorrtllm backend schedules without priorities.")
@click.option("--default-priority-level", type=click.IntRange(1), default=None,
              help="The level of a request without a priority (default: the lowest).")
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
@click.option("--server", type=choice(["vllm", "tgi"]), default=None,
              help="Print the launch line of that server with the plan's batch, context and KV-cache budget.")
@click.option("--backend", type=choice(sorted(NAMES)), default=None,
              help="What serves the model: engine (default on GPUs) or pytorch (TensorRT-LLM LLM API, no engine); "
                   "reference (default on cpu) or reference-llmapi (the llmapi contract on the cpu target).")
@click.option("--runtime-image", type=choice(list(IMAGES)), default=None, metavar="IMAGE",
              help=f"GPU targets: the runtime image the deployment runs in, one of {', '.join(IMAGES)} (its "
                   "TensorRT-LLM version decides what can run; docs/capabilities.md). Default: the newest Triton "
                   "image with TensorRT-LLM 1.2.1; trtllm-1.3.0rc27 serves --backend pytorch with trtllm-serve alone.")
@click.option("--instances", type=click.IntRange(1), default=1, show_default=True,
              help="Plan one of N instances sharing one GPU (memory / N each, each with its own CUDA context) "
                   "and print the largest N that fits for each precision.")
@click.option("--measured", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Correct the performance model for this machine with a load test of the same deployment: "
                   "validate --load-test's load_test.json (or report.json), or tune's result/trials.json.")
@click.option("--details", is_flag=True,
              help="After the verdict, every section: the memory budget, build_config, plugin_config, profiles, "
                   "Triton parameters, performance, speed of light, energy.")
@speculative_options
def plan(model, target, precision, kv_cache, tp, input_len, output_len, max_context, concurrency, p99_latency,
         max_batch_size, max_num_tokens, opt_num_tokens, multiple_profiles, paged_context_fmha, kv_cache_reuse,
         kv_cache_free_gpu_mem_fraction, batch_scheduler_policy, priority_levels, default_priority_level, model_dir,
         out, as_json, server, backend, runtime_image, instances, measured, details, speculative, draft_len,
         acceptance, drafts_per_step):
    """Whether MODEL fits a target, its batch, KV cache and speed; its build configuration and Triton parameters.

    \b
    The first lines are the verdict: fits, batch, KV-cache tokens, TTFT, TPOT and output tokens/s with where each
    figure comes from (measured kernels, derived from another card, timed on this host, or a speed-of-light
    bound, shown as >= or <=). --details adds every section; --json prints plan.json.

    \b
    MODEL is a preset name, a Hugging Face directory, a GGUF file, a hub id or a TensorRT-LLM checkpoint
    directory. Nothing is downloaded: presets carry their architecture numbers.
    Examples:
      trtpipe plan llama-3-8b --target rtx4090 --precision fp8
      trtpipe plan llama-3-8b --target rtx4090 --precision fp8 --details
      trtpipe plan llama-3-8b --target rtx4090 --precision fp16 --input-len 2048 --output-len 512 --concurrency 16
      trtpipe plan out/ckpt-fp8 --target rtx4090 --precision fp8 --p99-latency 5 --json > plan.json
      trtpipe plan smollm2-135m --target cpu --precision fp16 -o out/plan.json
      trtpipe plan llama-3-8b --target rtx4090 --precision fp16 --server vllm
      trtpipe plan llama-3-8b --target rtx4090 --precision fp8 --instances 2
      trtpipe plan smollm2-135m --target cpu --precision fp8 --measured out/validate/load_test.json
      trtpipe plan smollm2-135m --target cpu --precision fp32 --speculative ngram --draft-len 8
    """
    from rich.console import Console

    from ..plan import Overrides, Workload, plan_document, resolve_model_info, save_plan
    from ..plan.policy import Refusal
    from .plan_render import other_warnings, performance_table, plan_command_line, render_plan, verdict
    from ..planner import densities, plan_instances
    from ..plan.servers import server_settings
    from ..targets import get_target

    spec = speculative_request(speculative, draft_len, acceptance, drafts_per_step)
    info, gpu = resolve_model_info(model, model_dir), get_target(target)
    try:
        result = plan_instances(
            info, gpu, precision, instances, advise=True, kv_cache=kv_cache, tp=tp,
            workload=Workload(input_len=input_len, output_len=output_len, max_context=max_context,
                              concurrency=concurrency, p99_latency_s=p99_latency),
            overrides=Overrides(max_batch_size=max_batch_size, max_num_tokens=max_num_tokens,
                                opt_num_tokens=opt_num_tokens, multiple_profiles=multiple_profiles,
                                use_paged_context_fmha=paged_context_fmha, enable_kv_cache_reuse=kv_cache_reuse,
                                kv_cache_free_gpu_mem_fraction=kv_cache_free_gpu_mem_fraction,
                                batch_scheduler_policy=batch_scheduler_policy, priority_levels=priority_levels,
                                default_priority_level=default_priority_level), backend=backend,
            image=runtime_image, speculative=spec)
    except Refusal as exc:   # each "instead" as the whole command, planned before it is named
        ctx = click.get_current_context()
        raise UserError(exc.explained(lambda flags: plan_command_line(ctx, flags))) from None
    if measured is not None:
        from ..plan.feedback import correct, read_measured

        result = correct(result, read_measured(measured))
    equivalent = server_settings(result, server) if server else None
    if out is not None:
        save_plan(result, out)
    if as_json:
        click.echo(json.dumps(plan_document(result), indent=2))
        return
    if equivalent is not None:
        from ..presets import served_model_id

        click.echo(equivalent.launch_line(served_model_id(result.model)))
        for setting in equivalent.settings:
            click.echo(f"  {setting.flag} {setting.value}: {setting.arithmetic}")
        for note in equivalent.notes:
            click.echo(f"  note: {note}")
        return
    for line in verdict(result):
        click.echo(line)
    for warning in other_warnings(result):
        click.echo(f"warning: {warning}")
    console = Console()
    if details:
        console.print()
        for renderable in render_plan(result):
            console.print(renderable)
            console.print()
    elif measured is not None and result.performance is not None:   # the correction asked for, and what it changed
        console.print()
        console.print(performance_table(result))
    if out is not None:
        console.print(f"plan written to {out}")
    if instances > 1:
        console.print(f"{instances} instances on one {gpu.name}: {result.memory.memory_bytes / 2**30:.2f} GiB each. "
                      "Largest number of instances that fits, per precision:")
        for d in densities(info, gpu, kv_cache=kv_cache, tp=tp, workload=result.workload, backend=backend,
                            image=runtime_image):
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
@click.option("--profiling-verbosity", type=choice(PROFILING_VERBOSITIES),
              default=DEFAULT_PROFILING_VERBOSITY, show_default=True,
              help="trtllm-build --profiling_verbosity: what the engine keeps about its layers. With detailed, a "
                   "real build also writes ENGINE/rankN.layers.json (TensorRT's engine inspector) and the layer "
                   "types and tactics into the manifest (unverified here: tested with a fake tensorrt module).")
@click.option("--draft", is_flag=True,
              help="CHECKPOINT is the draft of PLAN's draft-target: build the draft engine, with PLAN's precision and "
                   "limits (deploy it with --draft-engine).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def compile_(checkpoint, plan_path, out, dry_run, workers, onnx_dir, profiling_verbosity, draft, force, as_json):
    """Build a TensorRT-LLM 1.2.1 engine from CHECKPOINT as PLAN says (GPU and TensorRT-LLM required).

    \b
    Without a GPU and TensorRT-LLM 1.2.x (and with --dry-run) it writes the exact trtllm-build command
    (ENGINE/trtllm-build.sh) and the --build_config JSON (ENGINE/build_config.json) instead; the build
    itself runs inside the trtpipe container (see the Dockerfile). That real-build path (trtllm-build,
    engine config check, versions and GPU in the manifest) has not been run on trtpipe's GPU-less
    development machines: it is unverified.
    Examples:
      trtpipe compile out/ckpt-fp8 --plan plan.json -o out/engine --dry-run
      trtpipe compile out/draft-ckpt --plan plan.json --draft -o out/draft-engine --dry-run   # draft-target
      docker run --gpus all -v $PWD:/work -w /work trtpipe trtpipe compile out/ckpt-fp8 --plan plan.json -o out/engine
    """
    from ..compile import compile_engine
    from ..plan import load_plan
    from ..plan.speculative_gpu import draft_build_plan

    plan = load_plan(plan_path)
    plan = draft_build_plan(plan, checkpoint) if draft else plan
    result = compile_engine(checkpoint, plan, out, dry_run=dry_run, workers=workers, force=force,
                            onnx=onnx_dir, profiling_verbosity=profiling_verbosity)
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
@click.option("--runtime", type=choice(list(RUNTIMES)), default=None,
              help="cpu target: what the tensorrt_llm Python model computes with (default: the plan's backend; "
                   "onnxruntime exports the checkpoint to ONNX into the repository). Same repository contract.")
@click.option("--python-models", default="trtpipe", metavar="trtpipe|nvidia|DIR",
              help="Whose preprocessing, postprocessing and BLS model.py to ship with trtpipe's configs: trtpipe's "
                   f"(default), NVIDIA's from their container ('nvidia': {NVIDIA_MODEL_FILES}), or NVIDIA's "
                   "inflight_batcher_llm directory DIR.")
@click.option("--draft-engine", type=click.Path(path_type=Path), default=None,
              help="A draft-target plan's draft engine (the engine backend: NVIDIA's BLS calls it as a second "
                   "tensorrt_llm model, tensorrt_llm_draft; need not exist yet).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def deploy(engine, checkpoint, plan_path, out, tokenizer, force, runtime, python_models, draft_engine, as_json):
    """Write a Triton model repository (NVIDIA's inflight_batcher_llm layout) from a plan.

    \b
    Models: ensemble, preprocessing, tensorrt_llm, postprocessing, tensorrt_llm_bls (and tensorrt_llm_draft
    for a draft-target plan on the engine backend); the plan's backend (engine or reference) decides what
    tensorrt_llm runs.
    Examples:
      trtpipe deploy --checkpoint out/ckpt --plan out/plan.json -o out/model_repo          # cpu target
      trtpipe deploy --checkpoint out/ckpt --plan out/plan.json --runtime onnxruntime -o out/model_repo
      trtpipe deploy --engine out/engine --plan out/plan.json --tokenizer ./Llama-3-8B -o out/model_repo
      trtpipe deploy --engine out/engine --plan out/plan.json --python-models nvidia -o out/repo  # NVIDIA's image
      trtpipe deploy --engine out/engine --draft-engine out/draft-engine --plan out/plan.json -o out/repo
    """
    from ..deploy import deploy_repository
    from ..plan import load_plan

    models = {"trtpipe": None, "nvidia": Path(NVIDIA_MODEL_FILES)}.get(python_models, Path(python_models))
    result = deploy_repository(load_plan(plan_path), out, engine=engine, checkpoint=checkpoint, tokenizer=tokenizer,
                               force=force, runtime=runtime, python_models=models, draft_engine=draft_engine)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.summary())
