"""Generation throughput: trtpipe's reference runtime vs transformers `generate`, side by side.

Same SmolLM2-135M weights (float32, the offline preset), same prompts (held-out corpus lines cut to
different lengths), greedy decoding of exactly --new-tokens tokens, batch 1 and batch 8. Reports new
tokens per second (best of --repeats, the two run alternately, after one warm-up) and the runtime/transformers ratio.

    .venv/bin/python benchmarks/bench_runtime.py [--new-tokens 32] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch


def timed_pair(first, second, repeats: int) -> tuple[float, float]:
    """Best wall time of each of two functions, run alternately so load changes hit both alike."""
    first(), second()                      # warm-up
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, fn in enumerate((first, second)):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best[0], best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.convert import convert_model
    from pipeline.evaluate import corpus_split
    from pipeline.runtime import ReferenceModel, SamplingConfig
    from pipeline.sources import resolve_model

    hf_dir = resolve_model("smollm2-135m").hf_dir()
    tok = AutoTokenizer.from_pretrained(hf_dir)
    tok.padding_side = "left"
    tok.pad_token = tok.pad_token or tok.eos_token
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = convert_model(resolve_model(str(hf_dir)), Path(tmp) / "ckpt", dtype="float32", progress=False).path
        runtime = ReferenceModel.load(ckpt)
    lines = corpus_split()[1]
    prompts = [tok(line)["input_ids"][: 16 + 8 * (i % 4)] for i, line in enumerate(lines[: max(args.batches)])]
    n = args.new_tokens
    sampling = SamplingConfig(max_new_tokens=n)

    rows = []
    for batch in args.batches:
        chosen = prompts[:batch]
        enc = tok.pad({"input_ids": chosen}, return_tensors="pt")

        def run_hf():
            with torch.inference_mode():
                out = hf.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
            assert out.shape[1] == enc["input_ids"].shape[1] + n

        def run_runtime():
            outs = runtime.generate(chosen, sampling)
            assert all(len(o) == n for o in outs)

        t_hf, t_rt = timed_pair(run_hf, run_runtime, args.repeats)
        rows.append({"batch": batch, "new_tokens": batch * n, "transformers_tok_s": batch * n / t_hf,
                     "runtime_tok_s": batch * n / t_rt, "ratio": t_hf / t_rt})

    if args.json:
        print(json.dumps({"model": "smollm2-135m (float32)", "threads": torch.get_num_threads(), "rows": rows},
                         indent=2))
        return
    print(f"SmolLM2-135M float32, greedy, {n} new tokens per request, torch threads={torch.get_num_threads()}")
    print(f"{'batch':>5} {'transformers tok/s':>19} {'runtime tok/s':>14} {'runtime/transformers':>21}")
    for r in rows:
        print(f"{r['batch']:>5} {r['transformers_tok_s']:>19.1f} {r['runtime_tok_s']:>14.1f} {r['ratio']:>20.2f}x")


if __name__ == "__main__":
    main()
