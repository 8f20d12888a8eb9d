"""Speculative decoding on the cpu target: exactness and speedup of one deployment with and without it, one run.

Two workloads from the first --prompts held-out news documents of the offline corpus
(`pipeline.evaluate.corpus_split(seed=0)[1]`, what `trtpipe eval` holds out):

    grounded  the tokenizer's chat template over "<the document's first 200 tokens>\\n\\nRepeat the text above word for
              word." (the case prompt lookup exists for: the answer quotes its input)
    open      the document's first 128 tokens, continued (nothing says the output repeats the input)

Two repositories of the same SmolLM2-135M float32 checkpoint, planned alike (`--input-len 256 --output-len 96`,
--runtime, default ONNX Runtime) except that one is planned with `--speculative ngram --draft-len K`. They are served
one at a time by the embedded Triton server; every request goes to the ensemble's generate_stream, greedy (top_k 1),
exactly --output-tokens tokens (min_tokens = max_tokens), with return_perf_metrics (the drafts: NVIDIA's
total_draft_tokens / total_accepted_draft_tokens). Concurrency C keeps C requests in flight; output tokens/s is
every output token over the wall time of the workload.

Both servers run at once, idle but for the one being measured; each (workload, concurrency) cell is measured on one
and then the other, the order alternating by round (--rounds), since this machine's speed drifts by 10-25% over
minutes; before the rounds each server serves every cell once with a few prompts, unmeasured (`warm_up`). Printed:
per workload and concurrency, tokens/s without and with speculation (medians), the ratio of each
round and their median, the acceptance rate (accepted / drafted), output tokens per step, and the plan's predicted
ratio at that concurrency (with its default acceptance and drafts a step, and with the ones this run measured: D, the
drafts per decode step); and how many texts are identical with and without speculation. Raw numbers:
--workdir/bench_speculative.json. Run it on an otherwise idle machine: the servers and the client share its cores.

    .venv/bin/python benchmarks/bench_speculative.py [--draft-len K] [--prompts 40] [--c1-prompts 12]
        [--runtime onnxruntime|torch] [--workdir /tmp/trtpipe-bench-speculative]
        [--draft CHECKPOINT [--draft-rows N]]     # draft-target instead of prompt lookup
        [--control]     # A/A: the second server plain too; its ratios are this machine's noise between two servers
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from dataclasses import replace
from pathlib import Path

import requests
from bench_batching import smollm2_checkpoint

from pipeline.deploy import deploy_repository
from pipeline.evaluate import corpus_split
from pipeline.plan import Workload, resolve_model_info
from pipeline.plan.speculative import DEFAULT_DRAFT_LEN, NGRAM_DRAFT_LEN, SpeculativeRequest, plan_speculation
from pipeline.planner import make_plan
from pipeline.server import embedded_server
from pipeline.sources import resolve_model
from pipeline.targets import get_target
from pipeline.triton_names import TOTAL_ACCEPTED_DRAFT_TOKENS, TOTAL_DRAFT_TOKENS

GROUNDED_TOKENS, OPEN_TOKENS = 200, 128
INSTRUCTION = "\n\nRepeat the text above word for word."


def workloads(tokenizer, count: int) -> dict[str, list[str]]:
    docs = [t for t in corpus_split(seed=0)[1] if t.strip()][:count]

    def head(doc: str, n: int) -> str:
        return tokenizer.decode(tokenizer(doc)["input_ids"][:n])

    grounded = [tokenizer.apply_chat_template([{"role": "user", "content": head(d, GROUNDED_TOKENS) + INSTRUCTION}],
                                              tokenize=False, add_generation_prompt=True) for d in docs]
    return {"grounded": grounded, "open": [head(d, OPEN_TOKENS) for d in docs]}


def repository(name: str, speculative: SpeculativeRequest | None, args: argparse.Namespace):
    checkpoint = smollm2_checkpoint(args.workdir)
    plan = make_plan(resolve_model_info(str(checkpoint)), get_target("cpu"), "fp32",
                     workload=Workload(input_len=256, output_len=args.output_tokens), speculative=speculative)
    if speculative is not None and args.draft_rows is not None:     # drafting where the plan would not
        plan = replace(plan, speculative=replace(plan.speculative, max_rows=args.draft_rows))
    repo = deploy_repository(plan, args.workdir / f"repo-{name}", checkpoint=checkpoint,
                             tokenizer=resolve_model("smollm2-135m").hf_dir(), runtime=args.runtime, force=True).path
    return plan, repo


def one_request(url: str, prompt: str, tokens: int) -> dict:
    body = {"text_input": prompt, "max_tokens": tokens, "min_tokens": tokens, "top_k": 1, "stream": True,
            "return_perf_metrics": True}
    text, drafted, accepted = [], 0, 0
    with requests.post(f"{url}/v2/models/ensemble/generate_stream", json=body, stream=True, timeout=900) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:"):
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            text.append(chunk["text_output"])
            drafted = max(drafted, int(chunk.get(TOTAL_DRAFT_TOKENS, 0)))
            accepted = max(accepted, int(chunk.get(TOTAL_ACCEPTED_DRAFT_TOKENS, 0)))
    return {"text": "".join(text), "drafted": drafted, "accepted": accepted}


def run_load(url: str, prompts: list[str], concurrency: int, tokens: int) -> dict:
    results: list[dict | None] = [None] * len(prompts)
    cursor = iter(range(len(prompts)))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(cursor, None)
            if i is None:
                return
            results[i] = one_request(url, prompts[i], tokens)

    start = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    drafted, accepted = sum(r["drafted"] for r in results), sum(r["accepted"] for r in results)
    return {"tokens_per_s": len(prompts) * tokens / wall, "wall_s": wall, "drafted": drafted, "accepted": accepted,
            "texts": [r["text"] for r in results]}


def measure(loads: dict, plain_url: str, spec_url: str, args: argparse.Namespace) -> dict[str, list[dict]]:
    """Every (workload, concurrency) cell on both servers, the two taking turns (which goes first alternates by round):
    {cell: [{"plain": load, "speculative": load} per round]}."""
    cells: dict[str, list[dict]] = {}
    for n in range(args.rounds):
        for workload, prompts in loads.items():
            for c in args.concurrency:
                use = prompts if c > 1 else prompts[:args.c1_prompts]
                order = [("plain", plain_url), ("speculative", spec_url)]
                pair = {name: run_load(url, use, c, args.output_tokens) for name, url in order[::1 - 2 * (n % 2)]}
                cells.setdefault(f"{workload}@{c}", []).append(pair)
                print(f"  round {n + 1} {workload:<8} c={c}: plain {pair['plain']['tokens_per_s']:.1f}, speculative "
                      f"{pair['speculative']['tokens_per_s']:.1f} tokens/s (accepted {pair['speculative']['accepted']}"
                      f" of {pair['speculative']['drafted']} drafts)", flush=True)
    return cells


def warm_up(loads: dict, urls: tuple[str, ...], args: argparse.Namespace) -> None:
    """Each server serves every (workload, concurrency) cell once with a few of its prompts, not measured: ONNX
    Runtime sizes its buffers for the shapes it meets first and the gate times its first steps, as in a server that
    has been up a while. (It did not remove the low first rounds: grounded c=1 read 1.13x in a round 1 without it
    and 1.23x with it, against 1.36-1.58x in the later rounds of both runs.)"""
    for url in urls:
        for prompts in loads.values():
            for c in args.concurrency:
                run_load(url, prompts[:c], c, args.output_tokens)


def informed_prediction(plan, acceptance: float, drafts_per_step: float, args: argparse.Namespace) -> dict:
    """The plan's speedup per concurrency given the acceptance and drafts a step this run measured (what `trtpipe
    validate` tells a user to plan with)."""
    request = SpeculativeRequest(plan.speculative.method, plan.speculative.draft_checkpoint, args.draft_len,
                                 round(acceptance, 4), round(drafts_per_step, 4))
    spec = plan_speculation(replace(plan, speculative=None), request).speculative
    return served_speedups(spec)


def served_speedups(spec) -> dict[int, float]:
    """The plan's speedup at each number of rows as the server runs it: 1.0 above `max_rows`, where it does not
    draft (on the in-place ONNX export, above one row)."""
    return {rows: speedup if rows <= spec.max_rows else 1.0 for rows, speedup in zip(spec.rows, spec.speedup)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draft-len", type=int, default=None,
                        help="K (default: the plan's, 8 for prompt lookup, whose drafts shrink with the match, and 3 "
                             "for a draft model)")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--c1-prompts", type=int, default=12, help="requests of each workload at concurrency 1")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--acceptance", type=float, default=None,
                        help="the acceptance rate the plan's prediction assumes (default: the plan's default)")
    parser.add_argument("--runtime", choices=["onnxruntime", "torch"], default="onnxruntime")
    parser.add_argument("--draft", type=Path, default=None,
                        help="draft-target with this checkpoint (e.g. SmolLM2 calibrated to int4-awq) instead of "
                             "prompt lookup")
    parser.add_argument("--draft-rows", type=int, default=None,
                        help="draft while at most this many rows run, whatever the plan's break-even says (to "
                             "measure a method the plan turns off)")
    parser.add_argument("--control", action="store_true",
                        help="A/A: the second server is a second plain deployment (the ratios then measure how far "
                             "two identical servers taking turns differ on this machine)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/trtpipe-bench-speculative"))
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.draft_len is None:
        args.draft_len = DEFAULT_DRAFT_LEN if args.draft else NGRAM_DRAFT_LEN
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2-135m").hf_dir())
    loads = workloads(tokenizer, args.prompts)
    what = "control: both plain" if args.control else f"draft {args.draft}" if args.draft else "prompt lookup"
    print(f"SmolLM2-135M fp32, {args.runtime}, {what}"
          + ("" if args.draft_rows is None else f" drafting up to {args.draft_rows} rows (--draft-rows)")
          + f", {args.output_tokens} output tokens, greedy, K = {args.draft_len}, "
          f"{args.rounds} round(s)")
    _, plain_repo = repository("plain", None, args)
    method = ("draft", str(args.draft)) if args.draft else ("ngram", None)
    plan, spec_repo = repository("control" if args.control else "speculative",
                                 None if args.control else SpeculativeRequest(*method, args.draft_len,
                                                                              args.acceptance), args)
    with embedded_server(plain_repo, log_path=args.workdir / "tritonserver-plain.log") as plain, \
            embedded_server(spec_repo, log_path=args.workdir / "tritonserver-speculative.log") as spec:
        warm_up(loads, (plain.http_url, spec.http_url), args)
        cells = measure(loads, plain.http_url, spec.http_url, args)
    predicted = served_speedups(plan.speculative) if plan.speculative else {}
    print(f"\n{'workload':<9} {'c':>2} {'plain t/s':>9} {'spec t/s':>9} {'ratio (rounds)':<22} {'median':>6} "
          f"{'accept':>6} {'tok/step':>8} {'D':>5} {'plan':>5} {'plan(a,D)':>9}  identical")
    report = {}
    for key, pairs in cells.items():
        workload, c = key.split("@")
        ratios = [p["speculative"]["tokens_per_s"] / p["plain"]["tokens_per_s"] for p in pairs]
        drafted = sum(p["speculative"]["drafted"] for p in pairs)
        accepted = sum(p["speculative"]["accepted"] for p in pairs)
        rate = accepted / drafted if drafted else 0.0
        texts = [(a, b) for p in pairs for a, b in zip(p["plain"]["texts"], p["speculative"]["texts"])]
        same = sum(a == b for a, b in texts)
        produced = len(texts) * args.output_tokens
        guess = predicted.get(int(c))
        steps = produced - len(texts) - accepted          # a request's first token comes from its prompt's pass
        per_step = min(drafted / steps, args.draft_len) if steps else 0.0
        informed = informed_prediction(plan, rate, per_step, args).get(int(c)) if drafted else None
        print(f"{workload:<9} {c:>2} {statistics.median(p['plain']['tokens_per_s'] for p in pairs):>9.1f} "
              f"{statistics.median(p['speculative']['tokens_per_s'] for p in pairs):>9.1f} "
              f"{', '.join(f'{r:.2f}' for r in ratios):<22} {statistics.median(ratios):>6.2f} {rate:>6.2f} "
              f"{produced / (produced - accepted):>8.2f} {per_step:>5.2f} {guess if guess else float('nan'):>5.2f} "
              f"{informed if informed else float('nan'):>9.2f}  {same}/{len(texts)}")
        report[key] = {"ratios": ratios, "median_ratio": statistics.median(ratios), "acceptance": rate,
                       "drafts_per_step": per_step, "identical": same, "requests": len(texts), "predicted": guess,
                       "predicted_with_measured": informed,
                       "rounds": [{name: {k: v for k, v in load.items() if k != "texts"} for name, load in p.items()}
                                  for p in pairs]}
    if plan.speculative:
        print(f"plan: acceptance {plan.speculative.acceptance} ({plan.speculative.acceptance_basis}); "
              f"predicted {predicted}; drafts while at most {plan.speculative.max_rows} rows run")
    (args.workdir / "bench_speculative.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
