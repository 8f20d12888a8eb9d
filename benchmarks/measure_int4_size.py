"""Bytes of SmolLM2-135M's 4-bit checkpoints: trtpipe's beside nvidia-modelopt 0.37's exports of the same settings.

    .venv/bin/python benchmarks/measure_int4_size.py [--group-size 64] [--work DIR]

Four checkpoints, float16, group --group-size, W4A16_AWQ and W4A8_AWQ: trtpipe's `calibrate` (TensorRT-LLM
checkpoint; and `--format hf`, modelopt's unified Hugging Face layout), and modelopt 0.37's
`export_tensorrt_llm_checkpoint` / `export_hf_checkpoint` of the same model after its own INT4_AWQ_CFG /
W4A8_AWQ_BETA_CFG with the block size set to the group. A checkpoint's size does not depend on how well it was
calibrated, so both sides calibrate on a few short samples (this is a size benchmark, not a quality one:
benchmarks/measure_int4_quality.py is). Sizes are the bytes of the weight files (safetensors headers included),
printed with the fp16 checkpoint's and the ratio trtpipe / modelopt, which the issue wants within 1%.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import warnings
from pathlib import Path

ALGOS = {"int4-awq": "INT4_AWQ_CFG", "w4a8-awq": "W4A8_AWQ_BETA_CFG"}


def weight_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in Path(directory).glob("*.safetensors"))


def trtpipe_checkpoints(ckpt: Path, work: Path, precision: str, group: int) -> dict[str, int]:
    from pipeline.calibrate import CalibrateOptions, calibrate_checkpoint, resolve_recipe

    recipe = resolve_recipe(None, samples=4, seq_len=64)
    sizes = {}
    for fmt in ("trtllm", "hf"):
        out = work / f"trtpipe-{precision}-{fmt}"
        calibrate_checkpoint(ckpt, out, CalibrateOptions(precision, recipe, group_size=group, eval_samples=0,
                                                         progress=False, weight_rounding="nearest", format=fmt))
        sizes[fmt] = weight_bytes(out)
    return sizes


def modelopt_checkpoints(hf_dir: Path, work: Path, precision: str, group: int) -> dict[str, int]:
    import modelopt.torch.quantization as mtq
    import torch
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    data = torch.randint(0, 49152, (2, 64), generator=torch.Generator().manual_seed(0))
    sizes = {}
    for fmt in ("trtllm", "hf"):
        cfg = copy.deepcopy(getattr(mtq, ALGOS[precision]))
        weight = cfg["quant_cfg"]["*weight_quantizer"]
        (weight[0] if isinstance(weight, list) else weight)["block_sizes"][-1] = group
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        out = work / f"modelopt-{precision}-{fmt}"
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = mtq.quantize(model, cfg, lambda m: [m(data[i:i + 1]) for i in range(len(data))])
            if fmt == "trtllm":
                export_tensorrt_llm_checkpoint(model, "llama", torch.float16, out, inference_tensor_parallel=1)
            else:
                export_hf_checkpoint(model.half(), dtype=torch.float16, export_dir=out)
        sizes[fmt] = weight_bytes(out)
    return sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--work", type=Path, default=None, help="where the checkpoints are written (default: a temp dir)")
    args = ap.parse_args()
    from pipeline.convert import convert_model
    from pipeline.sources import resolve_model

    work = args.work or Path(tempfile.mkdtemp(prefix="int4-size-"))
    source = resolve_model("smollm2-135m")
    ckpt = convert_model(source, work / "fp16", dtype="float16", progress=False).path
    rows = []
    for precision in ALGOS:
        ours = trtpipe_checkpoints(ckpt, work, precision, args.group_size)
        theirs = modelopt_checkpoints(source.hf_dir(), work, precision, args.group_size)
        for fmt in ("trtllm", "hf"):
            rows.append({"precision": precision, "format": fmt, "trtpipe_bytes": ours[fmt],
                         "modelopt_bytes": theirs[fmt], "ratio": ours[fmt] / theirs[fmt]})
    fp16 = weight_bytes(ckpt)
    print(f"SmolLM2-135M, group {args.group_size}; fp16 TensorRT-LLM checkpoint {fp16 / 1e6:.2f} MB")
    print("| precision | format | trtpipe MB | modelopt 0.37 MB | trtpipe / modelopt | of fp16 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['precision']} | {r['format']} | {r['trtpipe_bytes'] / 1e6:.2f} | {r['modelopt_bytes'] / 1e6:.2f} "
              f"| {r['ratio']:.4f} | {r['trtpipe_bytes'] / fp16:.3f} |")
    print(json.dumps({"fp16_bytes": fp16, "rows": rows}))


if __name__ == "__main__":
    main()
