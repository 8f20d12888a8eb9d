"""4-bit weight quantization of SmolLM2-135M (float32): trtpipe beside nvidia-modelopt and llm-compressor.

    .venv/bin/python benchmarks/measure_int4_quality.py [--samples 64] [--seq-len 256] [--eval 40] [--group-size 64]
        [--skip-peers] [--only ROW,ROW] [--json-out int4-quality.json]

Every row quantizes the same float model with the same calibration samples (`tokenize_samples` of the default
recipe: --samples texts of the offline news corpus, each cut to --seq-len tokens) and is scored on the same
held-out tokens (`heldout_sequences`: the first --eval held-out news documents, 512 tokens each, one window of
512):

  float               the float32 checkpoint, the reference;
  rtn                 round-to-nearest symmetric int4, one scale per group of --group-size inputs (group amax / 7),
                      of every linear of the decoder layers (not lm_head), no calibration;
  trtpipe-int4-awq    `calibrate_checkpoint` --precision int4-awq --group-size 64 (W4A16_AWQ);
  trtpipe-w4a8-awq    `calibrate_checkpoint` --precision w4a8-awq --group-size 64 (W4A8_AWQ);
  modelopt-int4-awq   nvidia-modelopt 0.47 INT4_AWQ_CFG (awq_lite) with block_sizes[-1] = 64;
  modelopt-w4a8-awq   nvidia-modelopt 0.47 W4A8_AWQ_BETA_CFG with the int4 weight quantizer's block_sizes[-1] = 64;
  llmc-gptq-w4a16     llm-compressor 0.14 GPTQModifier, int4 symmetric, group 64, lm_head ignored.

Each calibration runs in a process of its own, which reports the wall seconds of the calibration alone and its
peak RSS (ru_maxrss, read right after calibrating, before any scoring). trtpipe's calibration is
`calibrate_checkpoint` with eval_samples=0 (its own report would include two perplexity evaluations) and includes
reading the float checkpoint, which it streams layer by layer; the peers' seconds are `mtq.quantize` /
`oneshot` alone (the model load is reported apart, as load_seconds). trtpipe's checkpoints and the rtn one are
scored in this process by `pipeline.runtime.perplexity(LayerStream(path), heldout, window=512)`, the function the
float row uses. The peers run in their own virtual environments (--modelopt-python, --llmc-python; they never
import `pipeline`) and are scored on their own fake-quantized model as they report it: transformers' logits,
with `pipeline/runtime/perplexity.py`'s definition reimplemented (windows of 512 from position 0, mean NLL over
every token after the first of each window, exp of the mean over all of them). That reimplementation is checked
by scoring the float model in the modelopt environment (row modelopt-float, run with any modelopt row) and in
the llm-compressor child: both must equal the float row within 0.1%.

Prints a table (perplexity, change vs float, calibration seconds, peak RSS) and the ratios of trtpipe's
degradation to the peers', and writes everything as JSON (--json-out). The full default run takes a long while
on 2 cores (AWQ searches and GPTQ over 30 layers on the CPU).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pipeline.calibrate.data import load_texts, load_tokenizer, resolve_recipe, tokenize_samples
from pipeline.calibrate.stage import CalibrateOptions, calibrate_checkpoint, heldout_sequences
from pipeline.runtime import LayerStream, perplexity

EVAL_WINDOW = 512
TRTPIPE_ROWS = {"trtpipe-int4-awq": "int4-awq", "trtpipe-w4a8-awq": "w4a8-awq"}
MODELOPT_ROWS = {"modelopt-int4-awq": "INT4_AWQ_CFG", "modelopt-w4a8-awq": "W4A8_AWQ_BETA_CFG"}
LLMC_ROWS = ("llmc-gptq-w4a16",)
PEER_ROWS = ("modelopt-float", *MODELOPT_ROWS, *LLMC_ROWS)
ROWS = ("rtn", *TRTPIPE_ROWS, *PEER_ROWS)
RTN_LINEARS = ("attention.qkv", "attention.dense", "mlp.fc", "mlp.gate", "mlp.proj")
FLOAT_TOLERANCE = 1e-3   # a peer child's float perplexity vs the float row: the same definition, other kernels


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024   # Linux: KiB


# ---------------------------------------------------------------------------------------------------------------
# round to nearest


def rtn_int4(weight, group: int):
    """Symmetric int4 round-to-nearest with one scale (amax / 7) per `group` consecutive inputs of each row."""
    import torch

    rows, cols = weight.shape
    g = weight.float().reshape(rows, cols // group, group)
    scale = g.abs().amax(-1, keepdim=True) / 7
    codes = torch.clamp(torch.round(g / torch.where(scale > 0, scale, torch.ones_like(scale))), -8, 7)
    return (codes * scale).reshape(rows, cols).to(weight.dtype)


def rtn_checkpoint(src: Path, out: Path, group: int) -> int:
    """A copy of float checkpoint SRC at OUT whose decoder linears hold rtn_int4 weights; the number quantized."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, out)
    done = 0
    for shard in sorted(out.glob("rank*.safetensors")):
        tensors = load_file(str(shard))
        for name, value in tensors.items():
            if name.startswith("transformer.layers.") and name.endswith(".weight") and \
                    any(f".{lin}.weight" in name for lin in RTN_LINEARS):
                tensors[name] = rtn_int4(value, group).contiguous()
                done += 1
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return done


# ---------------------------------------------------------------------------------------------------------------
# children of this script (trtpipe and rtn): one calibration each, for its time and peak RSS


def child_main(args) -> None:
    started = time.monotonic()
    if args._child == "rtn":
        quantized = rtn_checkpoint(args.ckpt, args.out, args.group_size)
        seconds = time.monotonic() - started
        result = {"seconds": seconds, "peak_rss_mb": peak_rss_mb(), "linears": quantized}
    else:
        recipe = resolve_recipe(None, samples=args.samples, seq_len=args.seq_len)
        opts = CalibrateOptions(TRTPIPE_ROWS[args._child], recipe, group_size=args.group_size, eval_samples=0,
                                progress=False)
        started = time.monotonic()
        calibrated = calibrate_checkpoint(args.ckpt, args.out, opts)
        seconds = time.monotonic() - started
        quantization = calibrated.config["quantization"]
        result = {"seconds": seconds, "peak_rss_mb": peak_rss_mb(), "calibration_samples": calibrated.samples,
                  "calibration_tokens": calibrated.tokens, "quant_algo": quantization["quant_algo"],
                  "group_size": quantization.get("group_size")}
    args.result.write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------
# the peers' child: run by a peer venv's python, never imports `pipeline`

PEER_CHILD = r'''
import copy, json, math, resource, sys, time, traceback, warnings

warnings.simplefilter("ignore")
mode, hf_dir, samples_path, heldout_path, group, result_path = sys.argv[1:7]
group = int(group)
WINDOW = 512


def peak_rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def perplexity(model, sequences, window=WINDOW):
    """pipeline/runtime/perplexity.py's definition: consecutive windows of `window` tokens, each scored from
    position 0; exp of the mean NLL of every token after the first of each window."""
    import torch
    import torch.nn.functional as F

    chunks = [list(seq[i:i + window]) for seq in sequences for i in range(0, len(seq), window)]
    chunks = [c for c in chunks if len(c) >= 2]
    total = sum(len(c) - 1 for c in chunks)
    nll_sum = 0.0
    with torch.inference_mode():
        for chunk in chunks:
            ids = torch.tensor([chunk])
            logits = model(ids).logits[0, :-1].float()
            nll_sum += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
    return math.exp(nll_sum / total), total


def load_float():
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()


def modelopt(mode, samples):
    import torch
    import modelopt
    import modelopt.torch.quantization as mtq

    name = {"modelopt-int4-awq": "INT4_AWQ_CFG", "modelopt-w4a8-awq": "W4A8_AWQ_BETA_CFG"}[mode]
    cfg = copy.deepcopy(getattr(mtq, name))
    quant_cfg = cfg["quant_cfg"]
    if isinstance(quant_cfg, dict):        # modelopt <= 0.3x: {pattern: cfg}
        weight = quant_cfg["*weight_quantizer"]
    else:                                  # modelopt 0.47: [{"quantizer_name": pattern, "cfg": cfg}, ...]
        weight = next(e for e in quant_cfg if e.get("quantizer_name") == "*weight_quantizer")["cfg"]
    int4 = weight[0] if isinstance(weight, list) else weight
    assert int4["num_bits"] == 4, int4
    int4["block_sizes"][-1] = group
    started = time.monotonic()
    model = load_float()
    load_seconds = time.monotonic() - started

    def loop(m):
        for ids in samples:
            m(torch.tensor([ids]))

    started = time.monotonic()
    with torch.no_grad():
        model = mtq.quantize(model, cfg, loop)
    seconds = time.monotonic() - started
    info = {"version": modelopt.__version__, "config": name, "algorithm": cfg.get("algorithm"),
            "weight_quantizer": weight}
    return model, seconds, load_seconds, info


def llmc(samples):
    import torch
    import llmcompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import GPTQModifier

    started = time.monotonic()
    model = load_float()
    load_seconds = time.monotonic() - started
    weights = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group)
    recipe = GPTQModifier(config_groups={"g": QuantizationScheme(targets=["Linear"], weights=weights)},
                          ignore=["lm_head"])
    dataset = Dataset.from_dict({"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]})
    started = time.monotonic()
    model = oneshot(model=model, dataset=dataset, recipe=recipe, num_calibration_samples=len(samples),
                    max_seq_length=max(len(s) for s in samples), batch_size=1, shuffle_calibration_samples=False)
    seconds = time.monotonic() - started
    info = {"version": llmcompressor.__version__, "actorder": str(recipe.actorder),
            "block_size": recipe.block_size, "dampening_frac": recipe.dampening_frac}
    return model, seconds, load_seconds, info


def main():
    samples = json.load(open(samples_path))
    heldout = json.load(open(heldout_path))
    if mode == "modelopt-float":
        import transformers

        started = time.monotonic()
        model = load_float()
        result = {"seconds": None, "load_seconds": time.monotonic() - started, "peak_rss_mb": peak_rss_mb(),
                  "transformers": transformers.__version__}
    else:
        model, seconds, load_seconds, info = (llmc(samples) if mode == "llmc-gptq-w4a16" else modelopt(mode, samples))
        import transformers

        result = {"seconds": seconds, "load_seconds": load_seconds, "peak_rss_mb": peak_rss_mb(),
                  "calibration_samples": len(samples), "calibration_tokens": sum(len(s) for s in samples),
                  "transformers": transformers.__version__, **info}
    result["perplexity"], result["tokens"] = perplexity(model, heldout)
    if mode == "llmc-gptq-w4a16":      # the float model in this venv: same definition, and really quantized?
        del model
        result["float_perplexity"], _ = perplexity(load_float(), heldout)
    json.dump(result, open(result_path, "w"), default=str)


try:
    main()
except BaseException as exc:
    json.dump({"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-4000:]},
              open(result_path, "w"))
    raise
'''


# ---------------------------------------------------------------------------------------------------------------
# the parent


def run_child(cmd: list[str], result: Path, log: Path) -> dict:
    """Run CMD (which writes its JSON to RESULT); its output goes to LOG. A failure is {"error": ...}."""
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.monotonic() - started
    data = json.loads(result.read_text()) if result.is_file() else {}
    if proc.returncode != 0 or not data or "error" in data:
        tail = log.read_text(errors="replace").strip().splitlines()[-15:]
        data.setdefault("error", f"exit {proc.returncode}: " + (tail[-1] if tail else "no output"))
        data["log_tail"] = "\n".join(tail)
    data["child_wall_seconds"] = wall
    return data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval", type=int, default=40, help="held-out documents (512 tokens each at most)")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--skip-peers", action="store_true", help="no modelopt or llm-compressor rows")
    ap.add_argument("--only", default=None, help=f"comma-separated rows besides float, of: {','.join(ROWS)}")
    ap.add_argument("--modelopt-python", default="/work/peers/modelopt047/bin/python")
    ap.add_argument("--llmc-python", default="/work/peers/llmc/bin/python")
    ap.add_argument("--json-out", type=Path, default=Path("int4-quality.json"))
    ap.add_argument("--_child", choices=["rtn", *TRTPIPE_ROWS], help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        return child_main(args)

    rows = list(ROWS) if args.only is None else [r.strip() for r in args.only.split(",") if r.strip()]
    unknown = sorted(set(rows) - set(ROWS) - {"float"})
    if unknown:
        ap.error(f"--only: unknown rows {', '.join(unknown)} (rows: {', '.join(ROWS)})")
    if args.skip_peers:
        rows = [r for r in rows if r not in PEER_ROWS]
    if any(r in MODELOPT_ROWS for r in rows) and "modelopt-float" not in rows:
        rows.append("modelopt-float")     # the check of the children's perplexity definition
    rows = [r for r in ROWS if r in rows]  # float, rtn, trtpipe, then modelopt-float before the other peers

    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    results: dict = {"samples": args.samples, "seq_len": args.seq_len, "eval_docs": args.eval,
                     "group_size": args.group_size, "rows": {}}

    def save():
        args.json_out.write_text(json.dumps(results, indent=2, default=str))

    def record(row: str, data: dict):
        base = results["rows"].get("float", {}).get("perplexity")
        ppl = data.get("perplexity")
        if base and ppl:
            data["delta_pct"] = 100 * (ppl / base - 1)
        results["rows"][row] = data
        save()
        if "error" in data:
            print(f"{row}: ERROR {data['error']}", flush=True)
        else:
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in data.items()
                     if k in ("perplexity", "delta_pct", "tokens", "seconds", "peak_rss_mb", "child_wall_seconds")}
            print(f"{row}: {shown}", flush=True)

    script = Path(__file__).resolve()
    failed_check = None
    with tempfile.TemporaryDirectory(prefix="int4-quality-") as tmp:
        work = Path(tmp)
        hf_dir = resolve_model("smollm2-135m").hf_dir()
        ck_path = convert_model(resolve_model(str(hf_dir)), work / "float", dtype="float32", progress=False).path
        tok = load_tokenizer(ck_path)
        recipe = resolve_recipe(None, samples=args.samples, seq_len=args.seq_len)
        samples = tokenize_samples(load_texts(recipe), tok, recipe)
        heldout = heldout_sequences(tok, args.eval)
        results["calibration_tokens"] = sum(len(s) for s in samples)
        results["calibration_samples"] = len(samples)
        print(f"calibration: {len(samples)} samples, {results['calibration_tokens']} tokens; held-out: "
              f"{len(heldout)} documents, {sum(len(s) for s in heldout)} tokens", flush=True)

        def score(path: Path, row: str) -> dict:
            started = time.monotonic()
            p = perplexity(LayerStream(path), heldout, window=EVAL_WINDOW, desc=row)
            return {"perplexity": p.perplexity, "tokens": p.tokens, "eval_seconds": time.monotonic() - started}

        record("float", {**score(ck_path, "float"), "seconds": None, "peak_rss_mb": None})

        def own_child(row: str) -> dict:
            out, result = work / row, work / f"{row}.json"
            data = run_child([sys.executable, str(script), "--_child", row, "--ckpt", str(ck_path), "--out", str(out),
                              "--result", str(result), "--samples", str(args.samples), "--seq-len",
                              str(args.seq_len), "--group-size", str(args.group_size)], result, work / f"{row}.log")
            if "error" not in data:
                data.update(score(out, row))
                seen = data.get("calibration_samples"), data.get("calibration_tokens")
                if row in TRTPIPE_ROWS and seen != (len(samples), results["calibration_tokens"]):
                    data["error"] = (f"calibrated on {seen[0]} samples / {seen[1]} tokens, not the "
                                     f"{len(samples)} / {results['calibration_tokens']} of the other rows")
            return data

        for row in ("rtn", *TRTPIPE_ROWS):
            if row in rows:
                record(row, own_child(row))

        peers = [r for r in rows if r in PEER_ROWS]
        if peers:
            (work / "samples.json").write_text(json.dumps(samples))
            (work / "heldout.json").write_text(json.dumps(heldout))
            (work / "peer_child.py").write_text(PEER_CHILD)
        base = results["rows"]["float"]["perplexity"]
        for row in peers:
            python = args.llmc_python if row in LLMC_ROWS else args.modelopt_python
            result = work / f"{row}.json"
            data = run_child([python, str(work / "peer_child.py"), row, str(hf_dir), str(work / "samples.json"),
                              str(work / "heldout.json"), str(args.group_size), str(result)], result,
                             work / f"{row}.log")
            checked = {"modelopt-float": data.get("perplexity"), "llmc-gptq-w4a16": data.get("float_perplexity")}
            if row in checked and "error" not in data:
                float_ppl = checked[row]
                print(f"float perplexity: trtpipe (LayerStream) {base:.4f}, {row} child (transformers "
                      f"{data.get('transformers')}) {float_ppl:.4f}", flush=True)
                if abs(float_ppl / base - 1) > FLOAT_TOLERANCE:
                    failed_check = (f"{row}: the child's float perplexity {float_ppl:.4f} differs from trtpipe's "
                                    f"{base:.4f} by more than {100 * FLOAT_TOLERANCE:.1f}%: the peers' numbers are "
                                    "not comparable")
                    data["error"] = failed_check
                if row == "llmc-gptq-w4a16" and abs(data["perplexity"] / float_ppl - 1) < 1e-6:
                    data["error"] = "the quantized model scores as the float one: the quantization is not applied"
            float_tokens = results["rows"]["float"]["tokens"]
            if "error" not in data and data.get("tokens") != float_tokens:
                data["error"] = f"scored {data.get('tokens')} tokens, the float row {float_tokens}"
            record(row, data)
            if failed_check:
                break

    print_table(results)
    save()
    print(f"wrote {args.json_out}")
    if failed_check:
        raise SystemExit(failed_check)


def print_table(results: dict) -> None:
    rows = results["rows"]

    def fmt(value, spec):
        width = int(spec.lstrip("+").split(".")[0])
        return "-".rjust(width) if value is None or (isinstance(value, float) and math.isnan(value)) \
            else format(value, spec)

    print(f"\nSmolLM2-135M float32, int4 group {results['group_size']}: {results['calibration_samples']} calibration "
          f"samples ({results['calibration_tokens']} tokens), held-out {rows['float']['tokens']} tokens "
          f"({results['eval_docs']} documents, window {EVAL_WINDOW})")
    print(f"  {'row':20s} {'perplexity':>10s} {'Δ vs float':>11s} {'calib s':>9s} {'peak RSS MB':>12s}")
    for row, data in rows.items():
        if "error" in data and data.get("perplexity") is None:
            print(f"  {row:20s} ERROR: {data['error'][:200]}")
            continue
        delta = data.get("delta_pct")
        delta = 0.0 if row == "float" else delta
        print(f"  {row:20s} {fmt(data.get('perplexity'), '10.3f')} {fmt(delta, '+10.2f')}% "
              f"{fmt(data.get('seconds'), '9.1f')} {fmt(data.get('peak_rss_mb'), '12.0f')}"
              + (f"  ({data['error'][:120]})" if "error" in data else ""))

    def delta(row):
        data = rows.get(row, {})
        return None if "error" in data else data.get("delta_pct")

    w4a16 = {r: delta(r) for r in ("modelopt-int4-awq", "llmc-gptq-w4a16") if delta(r) is not None}
    parts = []
    ours = delta("trtpipe-int4-awq")
    if ours is not None and w4a16:
        best = min(w4a16, key=w4a16.get)
        ratio = ours / w4a16[best] if w4a16[best] else float("inf")
        parts.append(f"trtpipe int4-awq Δ / best peer W4A16 Δ ({best}) = {ours:+.2f}% / {w4a16[best]:+.2f}% "
                     f"= {ratio:.2f}")
        results["ratio_int4_awq_vs_best_w4a16"] = {"peer": best, "ratio": ratio}
    ours, theirs = delta("trtpipe-w4a8-awq"), delta("modelopt-w4a8-awq")
    if ours is not None and theirs is not None:
        ratio = ours / theirs if theirs else float("inf")
        parts.append(f"trtpipe w4a8-awq Δ / modelopt W4A8 Δ = {ours:+.2f}% / {theirs:+.2f}% = {ratio:.2f}")
        results["ratio_w4a8_awq_vs_modelopt"] = ratio
    print("ratios: " + ("; ".join(parts) if parts else "n/a (rows missing)"))


if __name__ == "__main__":
    main()
