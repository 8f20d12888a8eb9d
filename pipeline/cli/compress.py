"""The compression commands beyond post-training quantization: sparsify (2:4) and distill (recovery)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .base import calibration_data_options, choice, device_option, main


@main.command()
@click.argument("checkpoint", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="Directory for the 2:4 sparse float checkpoint.")
@click.option("--pattern", default="2:4", show_default=True,
              help="Structured sparsity pattern (2:4: at most 2 nonzeros in every 4 consecutive input weights).")
@click.option("--method", type=choice(["sparsegpt", "magnitude"]), default="sparsegpt", show_default=True,
              help="sparsegpt: mask and weight update from the calibration inputs; magnitude: the 2 largest of 4.")
@calibration_data_options
@click.option("--damp", type=float, default=None,
              help="SparseGPT damping, as a fraction of the mean input second moment (default 0.01).")
@click.option("--eval-samples", type=click.IntRange(min=0), default=40, show_default=True,
              help="Held-out documents for the dense vs 2:4 perplexity in the manifest (0 skips it).")
@device_option("the model runs")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def sparsify(checkpoint, out, pattern, method, dataset, text_field, samples, seq_len, seed, damp, eval_samples, device,
             force, quiet, as_json):
    """Prune every decoder linear of the float CHECKPOINT to 2:4 structured sparsity (embedding, lm_head dense).

    \b
    Examples:
      trtpipe sparsify out/ckpt -o out/ckpt-24
      trtpipe sparsify out/ckpt -o out/ckpt-24 --samples 128 --seq-len 512
      trtpipe calibrate out/ckpt-24 -o out/ckpt-24-fp8 --precision fp8     # keeps every zero a zero
    """
    from ..calibrate import resolve_recipe
    from ..sparsity.stage import SparsifyOptions, sparsify_checkpoint

    recipe = resolve_recipe(dataset, text_field=text_field, samples=samples, seq_len=seq_len, seed=seed)
    options = SparsifyOptions(recipe=recipe, pattern=pattern, method=method, eval_samples=eval_samples, device=device,
                              force=force, progress=not quiet and not as_json,
                              **({} if damp is None else {"damp": damp}))
    result = sparsify_checkpoint(checkpoint, out, options)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.summary())


@main.command()
@click.argument("student", type=click.Path(path_type=Path))
@click.option("-o", "--output", "out", type=click.Path(path_type=Path), required=True,
              help="Directory for the distilled checkpoint (same format as STUDENT; OUT/distill: report, loss curve).")
@click.option("--teacher", type=click.Path(path_type=Path), required=True,
              help="The float dense checkpoint STUDENT was compressed from (`trtpipe convert`'s output).")
@click.option("--tokens", type=int, default=None, help="Budget: training tokens to see.")
@click.option("--minutes", type=float, default=None, help="Budget: minutes of training.")
@calibration_data_options
@click.option("--lr", type=float, default=None,
              help="Peak AdamW learning rate (default: 3e-4 for a 2:4 student, 1e-4 for a dense quantized one; "
              "measured, docs/sparsity.md).")
@click.option("--batch", type=click.IntRange(min=1), default=None,
              help="Windows of --seq-len tokens per step (default 4).")
@click.option("--bf16/--fp32", default=True, show_default=True,
              help="Matmuls in bfloat16 (autocast; master weights, optimizer and loss stay float32) or float32.")
@click.option("--eval-samples", type=click.IntRange(min=0), default=40, show_default=True,
              help="Held-out documents for the teacher / before / after perplexity in the report (0 skips it).")
@click.option("--force", is_flag=True, help="Replace an existing output directory.")
@click.option("--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def distill(student, out, teacher, tokens, minutes, dataset, text_field, samples, seq_len, seed, lr, batch,
            bf16, eval_samples, force, quiet, as_json):
    """Recover what compression cost STUDENT (2:4 sparse, quantized, or both) by distillation from --teacher.

    \b
    KL on the logits, on the calibration recipe's text (never the held-out documents); 2:4 masks and
    quantization scales stay fixed (a quantized student trains through its quantizers). On the CPU.
    \b
    Examples:
      trtpipe distill out/ckpt-24 -o out/ckpt-24-kd --teacher out/ckpt --minutes 10
      trtpipe distill out/ckpt-fp8 -o out/ckpt-fp8-qat --teacher out/ckpt --tokens 100000
    """
    from ..calibrate import resolve_recipe
    from ..distill.stage import DistillOptions, distill_checkpoint

    recipe = resolve_recipe(dataset, text_field=text_field, samples=samples, seq_len=seq_len, seed=seed)
    if samples is None:              # every window of the recipe's text, unless --samples caps them
        from dataclasses import replace

        recipe = replace(recipe, samples=0)
    defaulted = {"lr": lr, "batch": batch}
    options = DistillOptions(teacher=teacher, recipe=recipe, tokens=tokens, minutes=minutes, eval_samples=eval_samples,
                             bf16=bf16, force=force, progress=not quiet and not as_json,
                             **{k: v for k, v in defaulted.items() if v is not None})
    result = distill_checkpoint(student, out, options)
    click.echo(json.dumps(result.to_dict(), indent=2) if as_json else result.summary())
