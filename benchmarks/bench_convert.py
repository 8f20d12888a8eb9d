"""Convert a synthetic >= 2 GB Llama-shaped checkpoint and compare, in one run, with `cp` and with the
size of the largest output tensor.

    python benchmarks/bench_convert.py [--workdir DIR] [--layers N] [--repeats N]

Prints: conversion wall time / `cp -r` time of the same files, best of N each (goal <= 1.5), and the
conversion's peak RSS (largest over the runs) /
largest output tensor (goal: peak RSS <= 3 x largest tensor + 500 MB).

Beside them, the floor the conversion cannot go below: it copies every tensor in the kernel (copy_file_range,
as cp does: fusing q/k/v or gate/up at tp 1 concatenates whole rows, contiguous byte ranges of the source, so
no byte passes through user space), but TensorRT-LLM's format is one rank<N>.safetensors per rank, and writing
the same bytes into one file (`cat shards > one`) is slower on ext4 than cp's one output file per shard; and
the interpreter's start-up (`trtpipe convert --help`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

# TinyLlama-1.1B's shapes: 22 layers of 2048 hidden, 5632 intermediate, 32 heads / 4 KV heads.
DIMS = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=32,
            num_key_value_heads=4, max_position_embeddings=2048)


def write_synthetic_model(directory: Path, layers: int) -> int:
    """Random fp16 weights with real shapes, in ~500 MB shards with an index; returns total bytes."""
    h, i, v = DIMS["hidden_size"], DIMS["intermediate_size"], DIMS["vocab_size"]
    kv = h // DIMS["num_attention_heads"] * DIMS["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(layers):
        p = f"model.layers.{n}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    weight_map, shard, shard_bytes, total, index = {}, {}, 0, 0, 0
    gen = torch.Generator().manual_seed(0)

    def flush():
        nonlocal shard, shard_bytes, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, str(directory / name), metadata={"format": "pt"})
            weight_map.update({k: name for k in shard})
            shard, shard_bytes, index = {}, 0, index + 1

    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=gen) * 0.02).to(torch.float16)
        shard[name] = t
        shard_bytes += t.numel() * 2
        total += t.numel() * 2
        if shard_bytes > 500 << 20:
            flush()
    flush()
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                        "weight_map": weight_map}))
    config = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers, "hidden_act": "silu",
              "rms_norm_eps": 1e-5, "torch_dtype": "float16", "tie_word_embeddings": False, **DIMS}
    (directory / "config.json").write_text(json.dumps(config))
    return total


def timed(cmd: list[str]) -> tuple[float, int]:
    """Wall time and peak RSS (bytes) of one child process, from its own rusage (os.wait4)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} failed")
    return seconds, usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each (best is reported)")
    parser.add_argument("--generate-only", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.generate_only:
        print(write_synthetic_model(args.generate_only, args.layers))
        return
    work = Path(args.workdir or tempfile.mkdtemp(prefix="trtpipe-bench-"))
    src = work / "hf"
    src.mkdir(parents=True, exist_ok=True)
    # Generated in a child: a child forked from a large parent would inherit its RSS until exec,
    # which ru_maxrss of the later children would then report.
    total = int(subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--generate-only",
                                str(src)], check=True, capture_output=True, text=True).stdout)
    largest = DIMS["vocab_size"] * DIMS["hidden_size"] * 2
    print(f"synthetic model: {total / 1e9:.2f} GB, largest tensor {largest / 1e6:.0f} MB")

    # Warm the page cache the same way for both. Each timed run starts after `sync`, so neither pays for
    # the other's dirty pages being written back (the kernel throttles a writer while 2 GB of another
    # process's writes are pending); best of --repeats, alternating which goes first.
    subprocess.run(["cat", *map(str, src.glob("*.safetensors"))], stdout=subprocess.DEVNULL, check=True)
    shards = " ".join(str(p) for p in sorted(src.glob("*.safetensors")))
    commands = {
        "cp": (["cp", "-r", str(src), str(work / "copy")], work / "copy"),
        "one-file": (["sh", "-c", f"mkdir {work / 'one'} && cat {shards} > {work / 'one' / 'rank0'}"], work / "one"),
        "convert": ([sys.executable, "-m", "pipeline.cli", "convert", str(src), "-o", str(work / "ckpt"),
                     "--precision", "fp16"], work / "ckpt"),
    }
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name in commands}
    order = list(commands)
    for repeat in range(args.repeats):
        for name in order[repeat % len(order):] + order[:repeat % len(order)]:
            cmd, output = commands[name]
            shutil.rmtree(output, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            runs[name].append(timed(cmd))
    startup_s = min(timed([sys.executable, "-m", "pipeline.cli", "convert", "--help"])[0] for _ in range(3))
    cp_s, one_s = min(s for s, _ in runs["cp"]), min(s for s, _ in runs["one-file"])
    conv_s, conv_rss = min(s for s, _ in runs["convert"]), max(r for _, r in runs["convert"])
    print(f"cp -r:    {cp_s:6.2f} s")
    print(f"one file: {one_s:6.2f} s  (cat of the shards into one file, as a rank file is written)")
    print(f"start-up: {startup_s:6.2f} s  (trtpipe convert --help)")
    print(f"convert:  {conv_s:6.2f} s, peak RSS {conv_rss / 1e6:.0f} MB")
    print(f"time ratio convert / cp          = {conv_s / cp_s:.2f}   (goal <= 1.5)")
    print(f"time ratio convert / floor       = {conv_s / (one_s + startup_s):.2f}   "
          "(floor: one file + start-up)")
    print(f"peak RSS / largest output tensor = {conv_rss / largest:.2f}   "
          f"(goal: RSS <= 3 x tensor + 500 MB = {(3 * largest + (500 << 20)) / 1e6:.0f} MB: "
          f"{'met' if conv_rss <= 3 * largest + (500 << 20) else 'NOT met'})")
    if args.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
