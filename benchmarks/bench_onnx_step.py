"""ONNX Runtime steps of the cpu target's SmolLM2 export, timed side by side in one run: what a decode step costs at
batch 1 and 8, what a prompt costs alone, and what it costs computed in the decode step of running rows (the
graph's prompt group, pipeline/onnx/graph.py), with the ratios the serving goals turn on.

    .venv/bin/python benchmarks/bench_onnx_step.py [--precision fp32 int8-sq int4-awq int4-awq-head] [--cached 87]
        [--prompt 64] [--threads 2] [--rounds 20] [--workdir DIR]

Each step runs over random cache contents of --cached tokens (timing does not depend on the values), once per
round, the steps in turn, after a warm-up round; the median per step is printed, wall time and the CPU time of the
process (every thread's, in core-ms). Rows:
- decode b1, decode b8: one token per row;
- prefill: the prompt alone (its last token's logits, as the server's prefill asks);
- mixed b1, mixed b8: the decode step with the prompt as its prompt group.
The saving is (prefill + decode) - mixed: the step a joining prompt no longer costs the running rows.
The decode steps are timed again with ONNX Runtime's threads not spinning between parallel regions: their CPU time
is then the work itself, which a served step shares the cores with (the client, Triton, the worker's Python);
with spinning the threads hold every core for the whole step.

Then the serving loop itself in process, without Triton (`serve_rows` on the export, the cpu target's worker
loop): --requests requests of --prompt random tokens and --output tokens each, kept --concurrency in flight, with
the prompt group (a joining prompt mixed into the decode step) and without (each prompt computed alone first),
alternating: output tokens/s and the gaps between a request's tokens (the ITL a client sees, less the server).
--torch serves the same checkpoint with the torch runtime the same way (ReferenceModel, 2 torch threads).
--in-place compares only the concat cache's export with the in-place one the cpu target serves (docs/onnx.md, "The
in-place KV cache"): their decode steps at 1 and 8 rows and the serving loop, side by side.
Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from pipeline.calibrate.data import resolve_recipe
from pipeline.calibrate.stage import CalibrateOptions, calibrate_checkpoint
from pipeline.convert import convert_model
from pipeline.onnx.export import SERVING_INT4_ACCURACY, ExportOptions, export_onnx, serving_options
from pipeline.onnx.inplace import InPlaceBatch
from pipeline.onnx.runner import Cache, OrtDecoder
from pipeline.runtime import ReferenceModel, SamplingConfig
from pipeline.runtime.model import CacheDecoder
from pipeline.runtime.scheduler import Scheduler, Sequence
from pipeline.sources import resolve_model


HEAD = "-head"


def checkpoint(work: Path, precision: str) -> Path:
    float_ckpt = work / "checkpoint-fp32"
    if not (float_ckpt / "config.json").is_file():
        convert_model(resolve_model("smollm2-135m"), float_ckpt, dtype="float32", progress=False)
    if precision == "fp32":
        return float_ckpt
    ckpt = work / f"checkpoint-{precision}"
    head = precision.endswith(HEAD)      # int4-awq-head: `calibrate --quantize-lm-head`
    calibrate_checkpoint(float_ckpt, ckpt, CalibrateOptions(precision.removesuffix(HEAD), resolve_recipe(None),
                                                            eval_samples=0, progress=False, quantize_lm_head=head))
    return ckpt


def random_cache(decoder: OrtDecoder, batch: int, length: int, rng: np.random.Generator) -> Cache:
    shape = (batch, decoder.kv_heads, length, decoder.head_size)
    return Cache({past: rng.standard_normal(shape).astype(np.float32) for past, _ in decoder.cache_names},
                 np.ones((batch, length), np.int64))


def measure(decoder: OrtDecoder, cached: int, prompt_length: int, rounds: int,
            only: tuple[str, ...] = ()) -> dict[str, tuple[float, float]]:
    """Median (wall ms, CPU core-ms) of each step (of `only`'s, when given) over `rounds` rounds that run every step
    once, in turn (after one warm-up round)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, decoder.vocab_size, prompt_length).tolist()
    steps = {"prefill": lambda: decoder.step(np.array([prompt]), decoder.empty_cache(1), last_only=True)}
    for batch in (1, 8):
        cache, tokens = random_cache(decoder, batch, cached, rng), rng.integers(0, decoder.vocab_size, (batch, 1))
        steps[f"decode b{batch}"] = lambda c=cache, t=tokens: decoder.step(t, c)
        steps[f"mixed b{batch}"] = lambda c=cache, t=tokens: decoder.step_with_prompt(t, c, prompt)
    steps = {name: step for name, step in steps.items() if not only or name in only}
    walls: dict[str, list[float]] = {name: [] for name in steps}
    cpus: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(rounds + 1):
        for name, step in steps.items():
            start, cpu = time.perf_counter(), time.process_time()
            step()
            if round_:
                walls[name].append(time.perf_counter() - start)
                cpus[name].append(time.process_time() - cpu)
    return {name: (statistics.median(walls[name]) * 1000, statistics.median(cpus[name]) * 1000) for name in steps}


def serve(model, mixed: bool, concurrency: int, requests: int, prompt_length: int, output: int) -> dict[str, float]:
    """`serve_rows` with `concurrency` requests kept in flight: output tokens/s, the p50/p90 token gaps (ms) and the
    cores the process kept busy."""
    rng = np.random.default_rng(1)
    scheduler, arrivals, sent, ended = Scheduler(), {}, [0], [0]

    def submit() -> None:
        key, sent[0] = sent[0], sent[0] + 1
        arrivals[key] = []
        prompt = rng.integers(0, model.vocab_size, prompt_length).tolist()
        scheduler.submit([Sequence(key, prompt, SamplingConfig(max_new_tokens=output, min_tokens=output))])

    def poll() -> None:
        while sent[0] < requests and sent[0] - ended[0] < concurrency:
            submit()

    def on_end(key) -> None:
        ended[0] += 1

    # the switch: the export's (an OrtDecoder's own), the torch runtime's (its in-flight decoder's)
    setattr(model if isinstance(model, OrtDecoder) else CacheDecoder, "mixes_prompts", mixed)
    start, cpu = time.perf_counter(), time.process_time()
    model.serve_rows(scheduler, poll, lambda key, result: arrivals[key].append(time.perf_counter()), on_end)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    gaps = [b - a for times in arrivals.values() for a, b in zip(times, times[1:])]
    tokens = sum(map(len, arrivals.values()))
    return {"tokens/s": tokens / wall, "gap p50": np.percentile(gaps, 50) * 1000,
            "gap p90": np.percentile(gaps, 90) * 1000, "cores": cpu / wall}


def in_place_step(batch: InPlaceBatch, rows: int) -> Callable[[], object]:
    """A decode step of an in-place batch's `rows` rows that leaves their lengths as they were (the next one writes the
    same positions again), so that every round times the same step."""
    keys, tokens = list(range(rows)), [1] * rows

    def step():
        batch.decode(keys, tokens)
        batch.lengths -= 1
    return step


def compare_caches(ckpt: Path, precision: str, args) -> None:
    """The concat export beside the in-place one, side by side in one run: decode steps at 1 and 8 rows over
    --cached tokens (the concat one through `OrtDecoder.step` on a random cache, the in-place one through its batch
    over prefilled random prompts), then the serving loop, the two taking turns each round."""
    exports = {name: OrtDecoder(export_onnx(ckpt, args.workdir / f"onnx-{precision}{suffix}",
                                            replace(serving_options(ckpt), in_place_kv=in_place)).path,
                                threads=args.threads)
               for name, suffix, in_place in (("concat", "", False), ("in-place", "-in-place", True))}
    rng = np.random.default_rng(0)
    steps: dict[str, Callable[[], object]] = {}
    for batch in (1, 8):
        concat = exports["concat"]
        cache, tokens = random_cache(concat, batch, args.cached, rng), rng.integers(0, concat.vocab_size, (batch, 1))
        steps[f"concat b{batch}"] = lambda c=cache, t=tokens: concat.step(t, c)
        in_place = InPlaceBatch(exports["in-place"], [rng.integers(0, concat.vocab_size, args.cached).tolist()
                                                      for _ in range(batch)])
        in_place.prefill(list(range(batch)))
        steps[f"in-place b{batch}"] = in_place_step(in_place, batch)
    walls: dict[str, list[float]] = {name: [] for name in steps}
    for round_ in range(args.rounds + 1):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            if round_:
                walls[name].append(time.perf_counter() - start)
    t = {name: statistics.median(w) * 1000 for name, w in walls.items()}
    print(f"SmolLM2 {precision}, {args.threads} threads, {args.cached} cached tokens (medians of {args.rounds} "
          "rounds, ms)")
    for batch in (1, 8):
        print(f"  decode b{batch}: concat {t[f'concat b{batch}']:.2f}, in-place {t[f'in-place b{batch}']:.2f} "
              f"({t[f'concat b{batch}'] / t[f'in-place b{batch}']:.2f}x faster)")
    print(f"serve_rows in process, mixed: {args.requests} requests, {args.prompt} tokens in, {args.output} out, "
          f"{args.rounds} rounds taking turns (medians)")
    for concurrency in args.concurrency:
        results: dict[str, list[dict]] = {name: [] for name in exports}
        for _ in range(max(1, args.rounds // 4)):
            for name, decoder in exports.items():
                results[name].append(serve(decoder, True, concurrency, args.requests, args.prompt, args.output))
        med = {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in results.items()}
        for name, m in med.items():
            print(f"  c={concurrency} {name:<8}: {m['tokens/s']:6.1f} tokens/s, token gap p50 {m['gap p50']:5.1f} ms, "
                  f"p90 {m['gap p90']:5.1f} ms")
        print(f"  c={concurrency} in-place / concat tokens/s: "
              f"{med['in-place']['tokens/s'] / med['concat']['tokens/s']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", nargs="+", choices=["fp32", "int8-sq", "int4-awq", "int4-awq" + HEAD],
                        default=["fp32"], help="int4-awq-head: lm_head in 4 bits too")
    parser.add_argument("--cached", type=int, default=87, help="tokens in each row's cache")
    parser.add_argument("--prompt", type=int, default=64, help="tokens of the joining prompt")
    parser.add_argument("--threads", type=int, default=2, help="ONNX Runtime's intra-op threads")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--requests", type=int, default=24, help="requests of the in-process serving loop")
    parser.add_argument("--output", type=int, default=32, help="output tokens of each request")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--torch", action="store_true", help="serve with the torch runtime too")
    parser.add_argument("--in-place", action="store_true",
                        help="only compare the concat cache's export with the in-place one the cpu target serves")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-bench-onnx-step"))
    args = parser.parse_args()
    for precision in args.precision:
        if args.in_place:
            compare_caches(checkpoint(args.workdir, precision), precision, args)
            continue
        ckpt = checkpoint(args.workdir, precision)
        decoder_path = export_onnx(ckpt, args.workdir / f"onnx-{precision}",
                                   ExportOptions(int4_accuracy=SERVING_INT4_ACCURACY)).path
        decoder = OrtDecoder(decoder_path, threads=args.threads)
        timed = measure(decoder, args.cached, args.prompt, args.rounds)
        t = {name: wall for name, (wall, _) in timed.items()}
        print(f"SmolLM2 {precision}, {args.threads} threads, {args.cached} cached tokens, a {args.prompt}-token prompt"
              f" (medians of {args.rounds} rounds: wall ms, CPU core-ms)")
        for name, (wall, cpu) in timed.items():
            print(f"  {name:<10} {wall:7.1f} {cpu:7.1f}")
        for batch in (1, 8):
            apart = t["prefill"] + t[f"decode b{batch}"]
            print(f"  b{batch}: prefill + decode {apart:.1f} -> mixed {t[f'mixed b{batch}']:.1f} "
                  f"(saves {apart - t[f'mixed b{batch}']:.1f} ms, {t[f'mixed b{batch}'] / apart:.2f}x)")
        print(f"  decode b8 / b1: {t['decode b8'] / t['decode b1']:.2f}x")
        resting = OrtDecoder(decoder_path, threads=args.threads, spinning=False)
        work = measure(resting, args.cached, args.prompt, args.rounds, only=("decode b1", "decode b8"))
        print("  threads not spinning (wall ms, CPU core-ms): " + ", ".join(
            f"{name} {wall:.1f}, {cpu:.1f}" for name, (wall, cpu) in work.items()))
        print(f"  the work of decode b8 / b1 (CPU, not spinning): {work['decode b8'][1] / work['decode b1'][1]:.2f}x")
        served = {"onnxruntime": decoder}
        if args.torch:
            torch.set_num_threads(args.threads)
            served["torch"] = ReferenceModel.load(ckpt)
        for runtime, model in served.items():
            print(f"serve_rows in process, {runtime}: {args.requests} requests, {args.prompt} tokens in, "
                  f"{args.output} out")
            for concurrency in args.concurrency:
                for mixed in (True, False):
                    r = serve(model, mixed, concurrency, args.requests, args.prompt, args.output)
                    print(f"  c={concurrency} {'mixed' if mixed else 'apart'}: {r['tokens/s']:6.1f} tokens/s, token "
                          f"gap p50 {r['gap p50']:5.1f} ms, p90 {r['gap p90']:5.1f} ms, {r['cores']:.2f} cores")


if __name__ == "__main__":
    main()
