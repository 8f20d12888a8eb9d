"""Draft-target on the cpu target: does SmolLM2-135M at 4 bits draft cheaply enough for SmolLM2-135M at float32?

In process, ONNX Runtime (what the cpu target serves), greedy, --output-tokens tokens a request, the workloads of
benchmarks/bench_speculative.py (input-grounded and open continuation of held-out news documents). The draft is the
target's own checkpoint calibrated to int4-awq (group 64, `trtpipe calibrate`'s default recipe; made once into
--workdir) and exported with MatMulNBits. Printed, side by side in one run:

- the cost of one decode step of one row: the draft's over the target's, and the target's K + 1 token verification
  step over its plain one (what drafting must pay for);
- per workload, concurrency 1 (one request after another) and concurrency 8 (batches of 8): output tokens/s of
  plain decoding, prompt lookup (ngram), the draft model with the server's gate (`Speculation`, adaptive: it stops
  drafting where drafting steps lose) and the draft model drafting every step, each over plain; the acceptance rate
  (accepted / drafted) and how many outputs are identical to plain decoding's.

    .venv/bin/python benchmarks/bench_draft_model.py [--prompts 12] [--draft-len 3] [--output-tokens 96]
        [--workdir /tmp/trtpipe-bench-draft-model] [--quantize-lm-head]

Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from bench_batching import smollm2_checkpoint
from bench_speculative import workloads

from pipeline.calibrate import CalibrateOptions, calibrate_checkpoint, resolve_recipe
from pipeline.onnx.export import SERVING_INT4_ACCURACY, ExportOptions, export_onnx
from pipeline.onnx.runner import OrtDecoder
from pipeline.runtime import SamplingConfig
from pipeline.runtime.draft_model import ModelDrafter
from pipeline.runtime.speculative import NgramDrafter, Speculation
from pipeline.sources import resolve_model

GROUP = 64      # SmolLM2's 576-wide layers take 4-bit group 64, not 128
STEPS = 40


def exported(checkpoint: Path, out: Path, spinning: bool = True) -> OrtDecoder:
    """The export's decoder; a draft's threads do not spin, as the served cpu model's (`load_runtime`)."""
    if not (out / "config.json").is_file():
        export_onnx(checkpoint, out, ExportOptions(int4_accuracy=SERVING_INT4_ACCURACY))
    return OrtDecoder(out, spinning=spinning)


def int4_checkpoint(float_checkpoint: Path, workdir: Path, quantize_lm_head: bool) -> Path:
    out = workdir / ("checkpoint-int4-awq" + ("-head" if quantize_lm_head else ""))
    if not (out / "config.json").is_file():
        options = CalibrateOptions("int4-awq", resolve_recipe(None), group_size=GROUP, eval_samples=0, progress=False,
                                   quantize_lm_head=quantize_lm_head)
        calibrate_checkpoint(float_checkpoint, out, options)
    return out


def step_seconds(runtime: OrtDecoder, prompt: list[int], tokens: int) -> float:
    """The median time of a step feeding one row `tokens` tokens after `prompt` (1: a plain decode step)."""
    batch = runtime.inflight_decoder()
    batch.add([0], [prompt], [SamplingConfig(max_new_tokens=STEPS * tokens + 1)])
    token = int(batch.prefill([0])[0].argmax())
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        logits = batch.decode([0], [token]) if tokens == 1 else batch.verify([0], [[token] * tokens])[0]
        times.append(time.perf_counter() - start)
        token = int(logits[-1].argmax())
    return statistics.median(times[5:])


def run(target: OrtDecoder, prompts: list[list[int]], concurrency: int, config: SamplingConfig, make) -> dict:
    """Every prompt, `concurrency` at a time (one generate_rows batch each), with the speculation `make()` gives."""
    start, outputs, drafted, accepted = time.perf_counter(), [], 0, 0
    for i in range(0, len(prompts), concurrency):
        for result in target.generate_rows(prompts[i:i + concurrency], config, speculation=make()):
            outputs.append(result.tokens)
            drafted += result.draft_tokens
            accepted += result.accepted_draft_tokens
    seconds = time.perf_counter() - start
    return {"tokens_per_s": sum(map(len, outputs)) / seconds, "outputs": outputs,
            "acceptance": accepted / drafted if drafted else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--draft-len", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-bench-draft-model"))
    parser.add_argument("--quantize-lm-head", action="store_true",
                        help="the draft's lm_head in 4 bits too (`calibrate --quantize-lm-head`)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    float_checkpoint = smollm2_checkpoint(args.workdir)
    target = exported(float_checkpoint, args.workdir / "onnx-fp32")
    suffix = "-head" if args.quantize_lm_head else ""
    draft = exported(int4_checkpoint(float_checkpoint, args.workdir, args.quantize_lm_head),
                     args.workdir / f"onnx-int4-awq{suffix}", spinning=False)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m").hf_dir())
    loads = {name: [tokenizer(p)["input_ids"] for p in prompts]
             for name, prompts in workloads(tokenizer, args.prompts).items()}
    k = args.draft_len
    probe = loads["open"][0]
    plain_step, verify_step, draft_step = (step_seconds(target, probe, 1), step_seconds(target, probe, k + 1),
                                           step_seconds(draft, probe, 1))
    print(f"SmolLM2-135M fp32 target, int4-awq (group {GROUP}{', lm_head 4-bit' if suffix else ''}) draft, "
          f"ONNX Runtime, K = {k}, "
          f"{args.output_tokens} tokens, greedy, {args.prompts} prompts a workload")
    print(f"one row's decode step: target {plain_step * 1e3:.1f} ms, draft {draft_step * 1e3:.1f} ms "
          f"(draft / target {draft_step / plain_step:.2f}); target's {k + 1}-token step {verify_step * 1e3:.1f} ms "
          f"({verify_step / plain_step:.2f} x plain); a drafting step costs "
          f"{(verify_step + k * draft_step) / plain_step:.2f} plain steps and outputs 1 + a x {k}: it pays above "
          f"a = {((verify_step + k * draft_step) / plain_step - 1) / k:.2f}")
    config = SamplingConfig(max_new_tokens=args.output_tokens)
    variants = {"plain": lambda: None, "ngram": lambda: Speculation(NgramDrafter(k)),
                "draft (gated)": lambda: Speculation(ModelDrafter(draft.inflight_decoder(), k)),
                "draft (always)": lambda: Speculation(ModelDrafter(draft.inflight_decoder(), k), adaptive=False)}
    print(f"\n{'workload':<9} {'c':>2} {'variant':<15} {'tokens/s':>8} {'x plain':>7} {'accept':>6}  identical")
    for workload, prompts in loads.items():
        for c in args.concurrency:
            base = None
            for name, make in variants.items():
                result = run(target, prompts, c, config, make)
                base = base or result
                same = sum(a == b for a, b in zip(result["outputs"], base["outputs"]))
                print(f"{workload:<9} {c:>2} {name:<15} {result['tokens_per_s']:>8.1f} "
                      f"{result['tokens_per_s'] / base['tokens_per_s']:>7.2f} {result['acceptance']:>6.2f}  "
                      f"{same}/{len(prompts)}", flush=True)


if __name__ == "__main__":
    main()
