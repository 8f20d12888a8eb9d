"""2:4 sparsity and recovery by distillation on SmolLM2-135M: trtpipe beside nvidia-modelopt, in one run.

Same calibration samples (the `news` recipe: --samples x <= --seq-len tokens, seed 0), same held-out tokens (the
first --eval documents cut to 512, as `benchmarks/measure_calibration_quality.py` scores them):

- trtpipe `sparsify` (SparseGPT: mask and weight update), then `distill` for --minutes (KL on the logits);
- modelopt's `mts.sparsify(mode="sparsegpt")` on the Hugging Face model, then `modelopt.torch.distill`
  (LogitsDistillationLoss, AdamW 5e-5, batch 4 windows of --seq-len, masks kept) for the same minutes.

    .venv/bin/python benchmarks/bench_sparsity.py [--minutes 15] [--skip-modelopt] [--json-out F]

Prints perplexity, the change against float, wall seconds and peak RSS per row, and the ratios the goals are in.
Run it on an otherwise idle machine; it takes about 2 x (sparsify + --minutes) on 2 cores. The modelopt
installed beside trtpipe is 0.37 (the test oracle); the issue's modelopt column was measured with 0.47.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch

from pipeline.calibrate.data import load_texts, load_tokenizer, resolve_recipe, tokenize_samples
from pipeline.calibrate.stage import heldout_sequences
from pipeline.distill.stage import training_windows
from pipeline.runtime import perplexity

REPO = Path(__file__).resolve().parents[1]


def trtpipe(*args: str) -> dict:
    """A trtpipe command in its own process (its peak RSS is its own), --json result, wall seconds."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "pipeline.cli", *args, "--json", "--quiet"], check=True,
                         capture_output=True, text=True, cwd=REPO).stdout
    return {**json.loads(out[out.index("{"):]), "wall_s": time.monotonic() - started}


def hf_perplexity(model, heldout, desc: str) -> float:
    class HF:
        def forward(self, ids):
            return model(ids).logits

    with torch.no_grad():
        return perplexity(HF(), heldout, window=512, desc=desc).perplexity


def modelopt_rows(hf_dir: Path, samples, windows, heldout, minutes: float, batch: int) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import modelopt.torch.distill as mtd
        import modelopt.torch.sparsity as mts
        from modelopt.torch.distill.losses import LogitsDistillationLoss
        from transformers import AutoModelForCausalLM

        student = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        started = time.monotonic()
        student = mts.sparsify(student, "sparsegpt", config={
            "data_loader": [torch.tensor([ids]) for ids in samples], "collect_func": lambda x: x})
        rows = [{"method": "modelopt sparsegpt 2:4", "perplexity": hf_perplexity(student, heldout, "modelopt 2:4"),
                 "seconds": time.monotonic() - started}]
        if not minutes:
            return rows
        teacher = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        model = mtd.convert(student, mode=[("kd_loss", {"teacher_model": teacher,
                                                         "criterion": LogitsDistillationLoss()})])
        model.train()
        optimizer = torch.optim.AdamW([p for p in student.parameters() if p.requires_grad], lr=5e-5)
        started, steps, cursor = time.monotonic(), 0, 0
        while time.monotonic() - started < minutes * 60:
            ids = torch.tensor([windows[(cursor + k) % len(windows)] for k in range(batch)])
            cursor += batch
            model(ids)
            loss = model.compute_kd_loss()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
        model.eval()
        student = mtd.export(model)
        rows.append({"method": f"modelopt sparsegpt 2:4 + distill ({steps} steps, {steps * ids.numel()} tokens)",
                     "perplexity": hf_perplexity(student, heldout, "modelopt 2:4 + kd"),
                     "seconds": time.monotonic() - started})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--eval", type=int, default=40)
    ap.add_argument("--minutes", type=float, default=15.0, help="distillation budget of each side (0 skips it)")
    ap.add_argument("--lr", type=float, default=None, help="trtpipe distill's peak learning rate (its default)")
    ap.add_argument("--skip-modelopt", action="store_true")
    ap.add_argument("--json-out", type=Path, default=None)
    args = ap.parse_args()

    from pipeline.sources import resolve_model

    work = Path(tempfile.mkdtemp(prefix="bench-sparsity-"))
    ck, sparse, kd = work / "ck", work / "ck24", work / "ck24-kd"
    trtpipe("convert", "smollm2-135m", "-o", str(ck), "--precision", "fp32")
    data = ["--samples", str(args.samples), "--seq-len", str(args.seq_len)]
    pruned = trtpipe("sparsify", str(ck), "-o", str(sparse), *data, "--eval-samples", str(args.eval))
    dense = pruned["perplexity"]["dense"]
    rows = [{"method": "float (trtpipe convert)", "perplexity": dense, "seconds": 0.0},
            {"method": "trtpipe sparsify 2:4 (SparseGPT)", "perplexity": pruned["perplexity"]["sparse"],
             "seconds": pruned["wall_s"]}]
    if args.minutes:
        distilled = trtpipe("distill", str(sparse), "-o", str(kd), "--teacher", str(ck), "--minutes",
                            str(args.minutes), "--seq-len", str(args.seq_len), "--eval-samples", str(args.eval),
                            *(["--lr", str(args.lr)] if args.lr else []))
        rows.append({"method": f"trtpipe sparsify + distill ({distilled['steps']} steps, "
                               f"{distilled['tokens_seen']} tokens)", "perplexity": distilled["perplexity"]["after"],
                     "seconds": distilled["wall_s"], "peak_rss_gb": distilled["peak_rss_gb"]})
    if not args.skip_modelopt:
        tokenizer = load_tokenizer(ck)
        recipe = resolve_recipe(None, samples=args.samples, seq_len=args.seq_len)
        samples = tokenize_samples(load_texts(recipe), tokenizer, recipe)
        windows = training_windows(load_texts(recipe), tokenizer, replace(recipe, samples=0))
        heldout = heldout_sequences(tokenizer, args.eval)
        rows += modelopt_rows(resolve_model("smollm2-135m").hf_dir(), samples, windows, heldout, args.minutes, 4)
        rows[-1]["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20

    print(f"{'method':<72} {'perplexity':>10} {'vs float':>9} {'wall s':>7} {'peak GB':>8}")
    for r in rows:
        rss = f"{r['peak_rss_gb']:.2f}" if "peak_rss_gb" in r else ""
        print(f"{r['method']:<72} {r['perplexity']:>10.2f} {(r['perplexity'] / dense - 1) * 100:>+8.1f}% "
              f"{r['seconds']:>7.0f} {rss:>8}")
    by = {r["method"].split(" (")[0]: r for r in rows}
    ours, theirs = by.get("trtpipe sparsify 2:4"), by.get("modelopt sparsegpt 2:4")
    if ours and theirs:
        loss_ratio = (ours["perplexity"] / dense - 1) / (theirs["perplexity"] / dense - 1)
        print(f"2:4 loss, trtpipe / modelopt: {loss_ratio:.2f} (goal <= 0.6); wall, trtpipe / modelopt: "
              f"{ours['seconds'] / theirs['seconds']:.2f} (goal < 1)")
    kd_ours = next((r for r in rows if r["method"].startswith("trtpipe sparsify + distill")), None)
    if kd_ours and ours:
        recovered = (ours["perplexity"] - kd_ours["perplexity"]) / (ours["perplexity"] - dense)
        print(f"distill: {recovered:.0%} of trtpipe's own 2:4 loss recovered (goal >= 50%)")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
